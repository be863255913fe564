"""The fused decode path's kernels under programmatic dependent launch (kernels/pdl.py), compiled for the
H200 (sm_90) without a GPU: a decode step of 8 rows of a one-layer model of Llama-3.2-1B's shape runs
through `fused_forward(pdl=True)` and the LM head's fused product inside `programmatic_launches`, and
every launch compiles instead of running (tests/kernels/sm90_compile.py).

What must hold for PDL to be safe and useful, read from each kernel's PTX:
  * every kernel of the path is launched with `launch_pdl` and waits (`griddepcontrol.wait`);
  * nothing touches global memory before that wait (a load could read what the previous kernel has
    not yet written, a store could race its loads);
  * each kernel releases its dependents (`griddepcontrol.launch_dependents`) only after its wait;
  * outside the context the same launches compile without either.
The compiler runs in a subprocess; skipped where this Triton cannot compile for CUDA. On a GPU,
tests/gpu/test_pdl_gpu.py checks that the launches give the same bits with PDL as without.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

# An instruction that reads or writes global memory.
GLOBAL_ACCESS = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|atom\.|red\.|cp\.async|ld\.volatile\.global)", re.M)


def ptx_facts(ptx: str) -> dict:
    """Where the wait, the release and the first global access sit in the PTX."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    release = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), None)
    access = next((i for i, line in enumerate(lines) if GLOBAL_ACCESS.match(line)), None)
    return {"wait": wait, "release": release, "first_access": access}


def compile_path(pdl: bool) -> dict[str, list[dict]]:
    """{kernel name: [facts of each launch]} of one decode step, inside `programmatic_launches(pdl)`."""
    import torch

    import tinyvllm.kernels.pdl as pdl_module
    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.config import ModelConfig
    from tinyvllm.engine.paths.fused import fused_forward
    from tinyvllm.engine.paths.lm_head import LMHead
    from tinyvllm.kernels import get_ops
    from tinyvllm.kernels.attention_metadata import AttnMetadata
    from tinyvllm.models.checkpoint import make_config
    from tinyvllm.models.decoder import CausalLM

    pdl_module.supported = lambda device: True  # the compile-only driver stands for an sm_90 device
    config = ModelConfig.from_dict(make_config("llama-3.2-1b", num_hidden_layers=1, vocab_size=4096))
    with torch.device("meta"):
        model = CausalLM(config, get_ops("triton"), 256, torch.bfloat16)
    model.to_empty(device="cpu")
    model.init_rope_table()
    B, bs, i32 = 8, 16, torch.int32
    cache = torch.zeros(64, config.num_key_value_heads, bs, config.head_dim, dtype=torch.bfloat16)
    tables = torch.arange(B * 4, dtype=i32).reshape(B, 4)
    meta = AttnMetadata(
        slot_mapping=torch.arange(B, dtype=torch.int64),
        num_decode_tokens=B,
        decode_seq_lens=torch.full((B,), 60, dtype=i32),
        decode_block_tables=tables,
        max_decode_seq_len=60,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32),
        prefill_seq_lens=torch.zeros(0, dtype=i32),
        prefill_block_tables=tables[:0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    ids = torch.zeros(B, dtype=torch.int64)
    positions = torch.full((B,), 59, dtype=torch.int64)
    head = LMHead(model.lm_head_weight, model.ops, fused_max_rows=16, pdl=pdl)
    with torch.no_grad(), compile_only_for_sm90() as launched, pdl_module.programmatic_launches(pdl):
        hidden = fused_forward(model, ids, positions, meta, [(cache, cache)], pdl=pdl)
        head.logits(hidden, dtype=None)
    out: dict[str, list[dict]] = {}
    for name, k in launched:
        out.setdefault(name, []).append({**ptx_facts(k.asm["ptx"]), "launch_pdl": bool(k.metadata.launch_pdl)})
    return out


def summarise() -> dict:
    return compiled_or_skip("paths", lambda: {"pdl": compile_path(True), "plain": compile_path(False)})


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)["paths"]


def test_every_kernel_of_the_path_is_a_dependent(facts):
    kernels = facts["pdl"]
    assert {"_rms_norm_kernel", "gemv_kernel", "_rope_write_kv_kernel", "_decode_kernel"} <= set(kernels)
    for name, launches in kernels.items():
        for f in launches:
            assert f["launch_pdl"], name
            assert f["wait"] is not None, f"{name} launched with PDL but never waits"


def test_nothing_touches_memory_before_the_wait(facts):
    for name, launches in facts["pdl"].items():
        for f in launches:
            assert f["first_access"] is None or f["first_access"] > f["wait"], (name, f)
            assert f["release"] is not None and f["release"] > f["wait"], (name, f)


def test_every_product_is_ours(facts):
    assert len(facts["pdl"]["gemv_kernel"]) == 5  # qkv, o, gate/up, down and the LM head
    assert len(facts["plain"]["gemv_kernel"]) == 4  # gate/up by cuBLAS


def test_without_the_context_nothing_changes(facts):
    assert set(facts["plain"]) == set(facts["pdl"])
    for name, launches in facts["plain"].items():
        for f in launches:
            assert not f["launch_pdl"] and f["wait"] is None and f["release"] is None, name


if __name__ == "__main__":
    print(json.dumps(summarise()))
