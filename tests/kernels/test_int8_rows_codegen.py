"""The int8 copy's kernel (kernels/int8_rows.py) compiled for the H200 (sm_90) without a GPU, at the LM
heads of Llama-3.2-1B (K 2,048) and Llama-3.1-8B (K 4,096), bf16 and fp16: it compiles, spills nothing,
and divides and takes square roots in IEEE float64 (`div.rn.f64`, `sqrt.rn.f64`) as the reference does.
Fused multiply-adds appear where they change nothing or only tighten the bound: s·q is exact in float64
(24 by 8 significant bits), and the sums of squares may round once instead of twice.

Compiled in a subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped where this
Triton cannot compile for CUDA. Numerics: tests/kernels/test_int8_rows.py (interpreter).
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

PATTERNS = {"div_rn": "div.rn.f64", "sqrt_rn": "sqrt.rn.f64", "local": ".local"}
WIDTHS = {"1b": 2048, "8b": 4096}


def compile_kernels() -> dict:
    """{label: pattern counts and resources}, one compile per (dtype, width)."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90, resource_usage
    from tinyvllm.kernels.int8_rows import quantize_rows

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for size, K in WIDTHS.items():
            with compile_only_for_sm90() as launched:
                quantize_rows(torch.zeros(256, K, dtype=dtype))
            (_, kernel), *_ = launched
            ptx = kernel.asm["ptx"]
            out[f"{str(dtype).removeprefix('torch.')}/{size}"] = {
                **{k: ptx.count(p) for k, p in PATTERNS.items()},
                **resource_usage(kernel),
            }
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=600)["kernels"]


def test_compiles_without_spills_and_rounds_in_ieee_float64(facts):
    assert len(facts) == 2 * len(WIDTHS), sorted(facts)
    for label, found in facts.items():
        assert found["local"] == 0 and found["stack"] == 0, (label, found)
        assert found["div_rn"] > 0 and found["sqrt_rn"] == 2, (label, found)


if __name__ == "__main__":
    print(json.dumps(compiled_or_skip("kernels", compile_kernels)))
