"""The paged prefill (`prefill_attention_fwd`) compiled for the H200 (sm_90) without a GPU, at head dims 64
and 128 in bf16: with DEFAULT_CONFIGS' tiles as it is by default, and with its Hopper options
(`PrefillConfig.tma`: Q, K and V through tensor descriptors; `ws`: one warp-specialised key loop), at
page size 16 (several page loads per key tile) and 256 (one load per tile), causal and windowed. The PTX
is searched for `wgmma.mma_async`, `cp.async.bulk.tensor` (TMA) and `setmaxnreg` (the register split of
a warp-specialised kernel). An FP8 cache asked for tma keeps the pointer loads. The interpreter tests
(test_prefill_attention.py, test_window_attention.py) check what the options compute. Runs in a
subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped where this Triton cannot
compile for CUDA.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.kernels.sm90_compile import compile_each, facts_from_subprocess

# name: (head dim, page size, window, FP8 cache, PrefillConfig fields replaced in DEFAULT_CONFIGS' entry)
VARIANTS = {
    "d64": (64, 16, None, False, {}),
    "d128": (128, 16, None, False, {}),
    "tma-d64-bs16": (64, 16, None, False, dict(tma=True)),
    "tma-d128-bs16": (128, 16, None, False, dict(tma=True)),
    "tma-d64-bs256": (64, 256, None, False, dict(tma=True)),
    "tma-d128-bs256": (128, 256, None, False, dict(tma=True)),
    "tma-d64-window": (64, 16, 100, False, dict(tma=True)),
    "tma-ws-w4-d64": (64, 16, None, False, dict(tma=True, ws=True, num_warps=4)),
    "tma-ws-w4-d128": (128, 256, None, False, dict(tma=True, ws=True, block_m=64, num_warps=4, num_stages=2)),
    "tma-ws-w4-d64-window": (64, 16, 100, False, dict(tma=True, ws=True, num_warps=4)),
    "tma-ws-w8-d128": (128, 16, None, False, dict(tma=True, ws=True, num_warps=8)),
    "tma-fp8-d64": (64, 16, None, True, dict(tma=True)),
}


def compile_variant(d: int, block_size: int, window: int | None, fp8: bool, knobs: dict) -> dict:
    """The prefill kernel of this variant compiled for sm_90: counts of the instructions above in its PTX."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels import prefill_attention
    from tinyvllm.kernels.prefill_attention import DEFAULT_CONFIGS, prefill_attention_fwd

    prefill_attention.upcast_dot = lambda device: False  # as on the GPU: bf16 operands into the tensor cores
    cfg = DEFAULT_CONFIGS[d]._replace(**knobs)
    hq, hk, lens = 4, 2, [300, 420]
    q = torch.zeros(sum(lens), hq, d, dtype=torch.bfloat16)
    blocks = sum(-(-n // block_size) for n in lens)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache, v_cache = (torch.zeros(blocks, hk, block_size, d, dtype=cache_dtype) for _ in range(2))
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tables = torch.arange(blocks, dtype=torch.int32).view(1, -1).repeat(2, 1)
    with compile_only_for_sm90() as launched:
        prefill_attention_fwd(q, k_cache, v_cache, cu, seq_lens, tables, d**-0.5, max(lens), window=window, config=cfg)
    [(name, kernel)] = launched
    ptx = kernel.asm["ptx"]
    return {
        "name": name,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": ptx.count("setmaxnreg"),
    }


def summarise() -> dict:
    facts = compile_each({n: functools.partial(compile_variant, *v) for n, v in VARIANTS.items()})
    return facts if "skip" in facts else {"variants": facts}


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)["variants"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_compiles_for_sm90(facts, name):
    """Every variant compiles and multiplies by wgmma; TMA copies exactly where tma applies (not over an
    FP8 cache); the single warp-specialised loop with 4 warps is split into producer and consumer warps
    (setmaxnreg), and nothing else is."""
    _, _, _, fp8, knobs = VARIANTS[name]
    got = facts[name]
    assert "error" not in got, got.get("error")
    assert got["name"] == "_prefill_kernel"
    assert got["wgmma"] > 0
    assert (got["tma"] > 0) == (bool(knobs.get("tma")) and not fp8)
    if knobs.get("ws") and knobs.get("num_warps") == 4:
        assert got["setmaxnreg"] > 0
    if not knobs.get("ws"):
        assert got["setmaxnreg"] == 0


if __name__ == "__main__":
    print(json.dumps(summarise()))
