"""FP8 numerics against a float64 hand reference: per-row and per-tensor quantization (e4m3 rounding,
saturation at ±448, zero rows), the Triton per-token activation kernel (bit for bit, under the
interpreter or on CUDA), and Fp8Linear's product against the float64 product of the dequantized operands."""

from __future__ import annotations

import os

import pytest
import torch

from tests.quantization.fp8_reference import round_e4m3
from tinyvllm.quantization.fp8 import FP8_DTYPE, dequantize, quantize_rows, quantize_tensor
from tinyvllm.quantization.linear import Fp8Linear


def hand_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: s = amax / 448 (1 for a zero row) in float32 as the format stores it, q = round(x / s)."""
    amax = x.double().abs().amax(-1)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float()  # the stored float32 scale
    q = round_e4m3(x.float().double() / s.double()[:, None])
    return q, s


def odd_matrix() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 37, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[2] = 0.0  # a zero row
    x[3, 5] = 1e4  # one outlier: the rest of its row lands in subnormals or zero
    return x


def test_quantize_rows_matches_hand_reference():
    x = odd_matrix()
    q, s = quantize_rows(x)
    q_ref, s_ref = hand_quantize_rows(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    # float32 division x / s vs the float64 one: they round to the same e4m3 value except at an exact tie
    # of the float32 quotient, which the seeded inputs do not hit.
    assert torch.equal(q.double(), q_ref)
    assert torch.equal(q[2].double(), torch.zeros(37, dtype=torch.float64)) and s[2] == 1.0
    assert q.double().abs().amax(-1)[[0, 1, 3, 4, 5, 6]].eq(448).all()  # each row's largest maps to 448
    # dequantized rows are within half an e4m3 step (2⁻⁴ relative) of x where x is normal in e4m3
    err = (dequantize(q, s[:, None]).double() - x.double()).abs()
    normal = x.abs() / s[:, None] >= 2**-6
    assert (err[normal] <= x.double().abs()[normal] * 2**-4 + 1e-30).all()


def test_quantize_tensor_saturates_and_rounds():
    x = odd_matrix()
    q, s = quantize_tensor(x)
    assert s.dim() == 0 and float(s) == pytest.approx(1e4 / 448, rel=1e-7)
    assert torch.equal(q.double(), round_e4m3(x.double() / float(s)))


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the interpreter"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_kernel_bit_exact(dtype):
    from tinyvllm.kernels.fp8_quant import quantize_per_token

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = odd_matrix().to(dtype)
    wide = torch.zeros(7, 50, dtype=dtype)
    wide[:, 3:40] = x
    view = wide[:, 3:40].to(device)  # a strided row view
    q, s = quantize_per_token(view, block_k=16)  # three chunks per row, the last one partial
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("strategy,dynamic", [("token", True), ("tensor", True), ("tensor", False)])
def test_fp8_linear_product(strategy, dynamic):
    """y = (s_x s_W) (q_x q_Wᵀ) + b: against the float64 product of the hand-quantized operands."""
    gen = torch.Generator().manual_seed(1)
    K, N = 48, 24
    layer = Fp8Linear(K, N, bias=True, dtype=torch.float32, activation_strategy=strategy, activation_dynamic=dynamic)
    w = torch.randn(N, K, generator=gen) * 0.1
    q_w, s_w = quantize_rows(w)
    layer.weight.data.copy_(q_w)
    layer.weight_scale.data.copy_(s_w)
    layer.bias.data.copy_(torch.randn(N, generator=gen))
    if not dynamic:
        layer.input_scale.data.fill_(0.02)
    x = torch.randn(2, 5, K, generator=gen)
    y = layer(x)
    x2 = x.reshape(-1, K)
    if strategy == "token":
        qx, sx = hand_quantize_rows(x2)
        xd = qx * sx.double()[:, None]
    else:
        s = x2.abs().max() / 448 if dynamic else torch.tensor(0.02)
        xd = round_e4m3(x2.double() / s.double()) * s.double()
    wd = round_e4m3(w.double() / s_w.double()[:, None]) * s_w.double()[:, None]
    ref = (xd @ wd.T + layer.bias.double()).reshape(2, 5, N)
    assert y.shape == (2, 5, N) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # and FP8 is an approximation of the float product, not a different function
    exact = x.double() @ w.double().T + layer.bias.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.05


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="_scaled_mm needs sm_89+"
)
def test_scaled_mm_path_matches_reference():
    """On the GPU the product is torch._scaled_mm with row-wise scales: the reference's result, rounded to bf16."""
    from tinyvllm.quantization.linear import fp8_matmul, scaled_mm_supported

    gen = torch.Generator().manual_seed(2)
    K, N = 256, 384
    layer = Fp8Linear(K, N, bias=False, dtype=torch.bfloat16)
    q_w, s_w = quantize_rows(torch.randn(N, K, generator=gen) * 0.05)
    layer.weight.data.copy_(q_w)
    layer.weight_scale.data.copy_(s_w)
    x = torch.randn(33, K, generator=gen).to(torch.bfloat16)
    q_x, s_x = quantize_rows(x)
    ref = fp8_matmul(q_x, s_x, q_w, s_w, None, torch.float32)  # the CPU reference, float32
    layer = layer.cuda()
    assert scaled_mm_supported(q_x.cuda(), layer.weight, torch.bfloat16)
    y = layer(x.cuda())
    assert y.dtype == torch.bfloat16
    assert (y.float().cpu() - ref).norm() / ref.norm() < 4e-3  # bf16 output rounding: RMS 2⁻⁹ relative
