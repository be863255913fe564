"""Attention over an FP8 (e4m3) KV cache compiles, for the H200 (sm_90), to what makes the cache's half
bytes pay: the codes come in as whole words and are widened two at a time by `cvt.rn.f16x2.e4m3x2` in the
load's layout (kernels/flash_tiles.load_e4m3_as_f16), with no byte-wide shared-memory reads (what a
float8 tile converted as a dot operand compiles to), and the products run on float16 tensor cores.

Compiled without a GPU in a subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped
where this Triton cannot compile for CUDA. Numerics: tests/kernels/test_fp8_kv_cache.py (interpreter).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

PATTERNS = {
    "cvt_e4m3x2": r"cvt\.rn\.f16x2\.e4m3x2",
    "ld_shared_b8": r"ld\.shared\.b8",
    "mma_f16": r"mma[\w.]*\.f32\.f16\.f16",  # mma.sync or wgmma, float16 operands
}


def compile_kernels() -> dict:
    """{kernel name: {pattern: count in its PTX}} for decode (split and merge) and prefill attention over an
    FP8 cache with bf16 queries."""
    import torch

    import tinyvllm.kernels.decode_attention as da
    import tinyvllm.kernels.prefill_attention as pa
    from tests.kernels.sm90_compile import compile_only_for_sm90

    da.upcast_dot = pa.upcast_dot = lambda device: False  # what a CUDA device gets
    B, HQ, HK, D, BS, ctx = 4, 32, 8, 64, 16, 512
    nb = ctx // BS
    e4m3 = torch.float8_e4m3fn
    cache = torch.zeros(B * nb, HK, BS, D, dtype=e4m3)
    tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    out = {}
    with compile_only_for_sm90() as launched:
        q = torch.zeros(B, HQ, D, dtype=torch.bfloat16)
        da.decode_attention_fwd(q, cache, cache, lens, tables, 0.125, ctx, k_scale=0.5, v_scale=0.5)
        qp = torch.zeros(B * 64, HQ, D, dtype=torch.bfloat16)
        cu = torch.arange(0, B * 64 + 1, 64, dtype=torch.int32)
        pa.prefill_attention_fwd(qp, cache, cache, cu, lens, tables, 0.125, 64, k_scale=0.5, v_scale=0.5)
    for name, kernel in launched:
        ptx = kernel.asm["ptx"]
        out[name] = {key: len(re.findall(pattern, ptx)) for key, pattern in PATTERNS.items()}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=600)


def test_fp8_cache_is_widened_by_word_on_float16_tensor_cores(facts):
    kernels = facts["kernels"]
    attention = {name: f for name, f in kernels.items() if "merge" not in name}
    assert len(attention) >= 2, kernels  # decode's split kernel and prefill's
    for name, found in attention.items():
        assert found["cvt_e4m3x2"] > 0, (name, found)
        assert found["ld_shared_b8"] == 0, (name, found)
        assert found["mma_f16"] > 0, (name, found)


if __name__ == "__main__":
    print(json.dumps(compiled_or_skip("kernels", compile_kernels)))
