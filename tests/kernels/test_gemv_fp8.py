"""fused_gemv (kernels/gemv.py) reading FP8 weights with their row scales (`weight_scale`), against the
float64 product of the same activations with the dequantized weights, x · (q_W · s)ᵀ: the kernel
converts each FP8 tile exactly and multiplies every row's float32 sum by its scale once, so the only
errors are those of a product in the activations' dtype (kernel_helpers.TOL, as tests/kernels/test_gemv.py
uses: 1.5× where the input transform rounds too). Every input transform and epilogue, the FMA and the
tl.dot paths, with and without split-K, odd N and K (masked tiles).

A scale applied to the wrong rows (or not at all: the rows' scales here span a factor of 100) gives a
relative error of order 1, far above every bound.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close

from tinyvllm.kernels import reference
from tinyvllm.kernels.gemv import GemvConfig, default_config, fused_gemv_fwd
from tinyvllm.quantization.fp8 import FP8_DTYPE, quantize_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
CONFIGS = [
    ("default", None),
    ("fma_split3", GemvConfig(block_n=16, block_k=32, split_k=3, num_warps=4, num_stages=2, use_dot=False)),
    ("dot_split2", GemvConfig(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=2, use_dot=True)),
]
VARIANTS = {
    "plain": {},
    "norm": {"norm": True},
    "silu_residual": {"silu": True, "res": True},
    "bias": {"bias": True},
}


def fp8_weight(N: int, K: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [N, K] weight whose rows' magnitudes span 100×, quantized per row: (q, s)."""
    w = torch.randn(N, K, generator=gen, device=device) / K**0.5
    w = w * torch.logspace(-1, 1, N, device=device)[:, None]
    return quantize_rows(w)


def make_inputs(M, N, K, dtype, device, variant, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    flags = VARIANTS[variant]
    width = 2 * K if flags.get("silu") else K
    x = (torch.randn(M, width + 3, generator=gen, device=device) * 2).to(dtype)[:, 1 : width + 1]
    q, s = fp8_weight(N, K, device, gen)
    kw = {}
    if flags.get("norm"):
        kw["norm_weight"] = (1 + 0.3 * torch.randn(K, generator=gen, device=device)).to(dtype)
        kw["eps"] = 1e-5
    if flags.get("silu"):
        kw["silu_mul"] = True
    if flags.get("res"):
        kw["residual"] = (torch.randn(M, N, generator=gen, device=device) * 3).to(dtype)
    if flags.get("bias"):
        kw["bias"] = torch.randn(N, generator=gen, device=device).to(dtype)
    return x, q, s, kw


def ref64(x, q, s, kw):
    """The float64 reference on the dequantized weight (the bias added before the one rounding)."""
    w = q.double() * s.double()[:, None]
    kw = dict(kw)
    bias = kw.pop("bias", None)
    out = reference.fused_gemv(x.double(), w, **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fp8_gemv_vs_float64_of_dequantized_weight(dtype, M, variant, device):
    N, K = 50, 77
    x, q, s, kw = make_inputs(M, N, K, dtype, device, variant, seed=M * 17 + len(variant))
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    ref = ref64(x, q, s, kw)
    for name, cfg in CONFIGS:
        out = fused_gemv_fwd(x, q, weight_scale=s, config=cfg, **kw)
        assert out.shape == (M, N) and out.dtype == dtype, name
        assert_close(out, ref, dtype, factor=1.5)


def test_fp8_gemv_real_tile_sizes_split_k(device):
    """[96, 2048] under the FP8 heuristic (block_k 1024 on the FMA path), split in 2 along K and not."""
    N, K = 96, 2048
    x, q, s, kw = make_inputs(1, N, K, torch.bfloat16, device, "silu_residual", seed=5)
    ref = ref64(x, q, s, kw)
    base = default_config(1, N, K, 132, fp8=True)
    assert base.block_k == 1024 and not base.use_dot
    for split in (1, 2):
        out = fused_gemv_fwd(x, q, weight_scale=s, config=base._replace(split_k=split), **kw)
        assert_close(out, ref, torch.bfloat16, factor=1.5)


def test_fp8_gemv_argument_errors(device):
    x = torch.randn(1, 8, device=device, dtype=torch.bfloat16)
    q, s = quantize_rows(torch.randn(4, 8, device=device))
    with pytest.raises(TypeError, match="weight_scale"):
        fused_gemv_fwd(x, q)
    with pytest.raises(ValueError, match=r"weight_scale must be \[4\]"):
        fused_gemv_fwd(x, q, weight_scale=s[:3])
    with pytest.raises(ValueError, match="float32"):
        fused_gemv_fwd(x, q, weight_scale=s.to(torch.bfloat16))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fused_gemv_fwd(x, q.to(torch.bfloat16), weight_scale=s)
