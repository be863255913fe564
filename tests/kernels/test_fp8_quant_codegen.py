"""The per-token FP8 quantization kernels compiled for the H200 (sm_90) without a GPU: the standalone one
(kernels/fp8_quant.py, still o_proj's) and RMSNorm / SwiGLU with the quantization fused in
(rms_norm_fp8, add_rms_norm_fp8, silu_and_mul_fp8), beside the unfused RMSNorm and SwiGLU kernels that
share their code, at the `llama-3.2-1b` and `llama-3.1-8b` widths (H 2048 / 4096, F 8192 / 14336) and
in the two-pass form of a row wider than one block. Each must compile, keep its row in registers (no
local-memory spills), and the FP8 ones convert by the hardware's saturating e4m3 conversion after an
IEEE division (`div.rn.f32`: the bits of torch's division, which the interpreter tests compare against).

Compiled in a subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped where this
Triton cannot compile for CUDA. Numerics: tests/kernels/test_fp8_fused_quant.py (interpreter).
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import compiled_or_skip, facts_from_subprocess

PATTERNS = {
    "cvt_e4m3": "cvt.rn.satfinite.e4m3x2.f32",
    "div_rn": "div.rn.f32",
    "local": ".local",
}
WIDTHS = {"1b": (2048, 8192), "8b": (4096, 14336)}  # (hidden, intermediate)
FP8_KERNELS = ("_quantize_rows_kernel", "_rms_norm_kernel/fp8", "_silu_and_mul_fp8_kernel")


def launches(dtype, H: int, F: int) -> dict:
    """{label: (function, args, kwargs)}: every kernel launch compiled, at hidden size H and MLP width F."""
    import torch

    import tinyvllm.kernels.activation as act
    import tinyvllm.kernels.fp8_quant as fq
    import tinyvllm.kernels.rms_norm as rn

    T = 64
    x, w = torch.zeros(T, H, dtype=dtype), torch.ones(H, dtype=dtype)
    gate_up = torch.zeros(T, 2 * F, dtype=dtype)
    return {
        "rms_norm": (rn.rms_norm, (x, w, 1e-5), {}),
        "add_rms_norm": (rn.add_rms_norm, (x, x, w, 1e-5), {}),
        "rms_norm_fp8": (rn.rms_norm_fp8, (x, w, 1e-5), {}),
        "add_rms_norm_fp8": (rn.add_rms_norm_fp8, (x, x, w, 1e-5), {}),
        "silu_and_mul": (act.silu_and_mul, (gate_up,), {}),
        "silu_and_mul_fp8": (act.silu_and_mul_fp8, (gate_up,), {}),
        "silu_and_mul_fp8_two_pass": (act.silu_and_mul_fp8, (gate_up,), {"block": 4096}),
        "quantize_per_token": (fq.quantize_per_token, (gate_up[:, :F],), {}),
    }


def compile_kernels() -> dict:
    """{launch label: {"kernel": its name, pattern: count in its PTX}}."""
    import torch

    import tinyvllm.kernels.activation as act
    import tinyvllm.kernels.fp8_quant as fq
    import tinyvllm.kernels.rms_norm as rn
    from tests.kernels.sm90_compile import compile_only_for_sm90, resource_usage

    act.upcast_dot = fq.upcast_dot = rn.upcast_dot = lambda device: False  # what a CUDA device gets
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for size, (H, F) in WIDTHS.items():
            for label, (fn, args, kwargs) in launches(dtype, H, F).items():
                with compile_only_for_sm90() as launched:
                    fn(*args, **kwargs)
                (name, kernel), *_ = launched
                if label.startswith(("rms_norm_fp8", "add_rms_norm_fp8")):
                    name += "/fp8"
                ptx = kernel.asm["ptx"]
                key = f"{label}/{str(dtype).removeprefix('torch.')}/{size}"
                counts = {k: ptx.count(pattern) for k, pattern in PATTERNS.items()}
                out[key] = {"kernel": name, **counts, **resource_usage(kernel)}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=600)["kernels"]


def test_every_variant_compiles_without_spills(facts):
    assert len(facts) == 2 * len(WIDTHS) * 8, sorted(facts)
    for label, found in facts.items():
        assert found["local"] == 0 and found["stack"] == 0, (label, found)


def test_fp8_kernels_divide_exactly_and_convert_in_hardware(facts):
    fp8 = {label: found for label, found in facts.items() if found["kernel"] in FP8_KERNELS}
    assert len(fp8) == 2 * len(WIDTHS) * 5, sorted(fp8)
    for label, found in fp8.items():
        assert found["cvt_e4m3"] > 0 and found["div_rn"] > 0, (label, found)


if __name__ == "__main__":
    print(json.dumps(compiled_or_skip("kernels", compile_kernels)))
