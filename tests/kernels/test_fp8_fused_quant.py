"""RMSNorm and SwiGLU with the per-token FP8 quantization of their output fused in (rms_norm_fp8,
add_rms_norm_fp8, silu_and_mul_fp8) against the unfused kernels' composition, bit for bit: the codes
(compared as bytes) and the float32 scales of `quantize_per_token(rms_norm(x))` and
`quantize_per_token(silu_and_mul(x))`, and the same residual as add_rms_norm. Odd widths, strided
rows, an all-zero row, a row with an outlier (the rest of it in e4m3's subnormals), float16, bfloat16
and float32. The reference table's ops are the reference norm / activation then `quantize_rows`."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels import batch_invariant, get_ops, reference, triton_ops
from tinyvllm.kernels.activation import silu_and_mul_fp8
from tinyvllm.kernels.fp8_quant import quantize_per_token
from tinyvllm.kernels.rms_norm import add_rms_norm_fp8, rms_norm_fp8
from tinyvllm.quantization.fp8 import FP8_DTYPE, quantize_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
SHAPES = [(1, 64), (5, 50), (9, 200)]  # (rows, width): one row; K not a power of two; K > 128


def rows(T: int, K: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """[T, K] in `dtype`, a strided view of a wider tensor; row 1 all zero, row 2 one outlier (when there)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, K + 7, generator=gen) * 3
    if T > 1:
        wide[1] = 0.0
    if T > 2:
        wide[2, 5] = 3e3
    return wide.to(dtype=dtype, device=device)[:, 3 : K + 3]


def assert_same_codes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H", SHAPES)
def test_rms_norm_fp8_equals_norm_then_quantize(T, H, dtype, device):
    x = rows(T, H, dtype, device, seed=T * H)
    w = (1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(1))).to(dtype=dtype, device=device)
    got = rms_norm_fp8(x, w, 1e-5)
    assert_same_codes(got, quantize_per_token(triton_ops.rms_norm(x, w, 1e-5)))
    if T > 1:  # the zero row: scale 1, codes 0
        assert got[1][1] == 1.0 and not got[0][1].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H", SHAPES)
def test_add_rms_norm_fp8_equals_add_norm_then_quantize(T, H, dtype, device):
    x = rows(T, H, dtype, device, seed=T + H)
    r = rows(T, H, dtype, device, seed=T + H + 1) * 4
    if T > 1:
        x[1] = -r[1]  # x + r = 0: an all-zero normed row
    w = (1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(2))).to(dtype=dtype, device=device)
    x0, r0 = x.clone(), r.clone()
    q, s, new_r = add_rms_norm_fp8(x, r, w, 1e-6)
    y_ref, r_ref = triton_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, r_ref)
    assert_same_codes((q, s), quantize_per_token(y_ref))
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_rms_norm_fp8_rounds_to_the_promoted_dtype(device):
    """A float32 weight on bf16 rows: rms_norm stores y in float32 (torch's promotion), so the codes are
    those of the float32 y."""
    x = rows(4, 64, torch.bfloat16, device, seed=6)
    w = torch.randn(64, generator=torch.Generator().manual_seed(6)).to(device)
    y = triton_ops.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32
    assert_same_codes(rms_norm_fp8(x, w, 1e-5), quantize_per_token(y))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,F,block", [(1, 64, None), (5, 37, None), (9, 100, None), (5, 37, 16), (3, 100, 32)])
def test_silu_and_mul_fp8_equals_act_then_quantize(T, F, block, dtype, device):
    """block=None: the whole row in registers; a block below F: the two-pass loop (last chunk partial)."""
    x = rows(T, 2 * F, dtype, device, seed=T * F)
    if T > 2:
        x[2, F + 5] = 3e3  # the outlier on u, so it survives silu(g)·u
    got = silu_and_mul_fp8(x, block=block)
    assert_same_codes(got, quantize_per_token(triton_ops.silu_and_mul(x)))
    if T > 1:
        assert got[1][1] == 1.0 and not got[0][1].view(torch.uint8).any()


def test_empty_and_unsupported_inputs(device):
    x = torch.zeros(0, 16, device=device)
    w = torch.ones(16, device=device)
    q, s = rms_norm_fp8(x, w, 1e-5)
    assert q.shape == (0, 16) and s.shape == (0,)
    q, s, r = add_rms_norm_fp8(x, x, w, 1e-5)
    assert q.shape == r.shape == (0, 16) and s.shape == (0,)
    q, s = silu_and_mul_fp8(x)
    assert q.shape == (0, 8) and s.shape == (0,)
    x64 = torch.zeros(2, 16, dtype=torch.float64, device=device)
    with pytest.raises(TypeError):
        rms_norm_fp8(x64, w.double(), 1e-5)
    with pytest.raises(TypeError):
        silu_and_mul_fp8(x64)


@pytest.mark.parametrize("invariant", [False, True])
def test_ops_tables_quantize_what_the_unfused_ops_compute(invariant):
    """Every table has the fused ops; the torch tables' are their own norm / activation then quantize_rows."""
    x = rows(5, 48, torch.bfloat16, torch.device("cpu"), seed=3)
    r = rows(5, 48, torch.bfloat16, torch.device("cpu"), seed=4)
    w = torch.randn(48, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ops = get_ops("torch", batch_invariant=invariant)
    m = batch_invariant if ops.batch_invariant else reference
    assert_same_codes(ops.rms_norm_fp8(x, w, 1e-5), quantize_rows(m.rms_norm(x, w, 1e-5)))
    q, s, new_r = ops.add_rms_norm_fp8(x, r, w, 1e-5)
    y_ref, r_ref = m.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(new_r, r_ref)
    assert_same_codes((q, s), quantize_rows(y_ref))
    assert_same_codes(ops.silu_and_mul_fp8(x), quantize_rows(m.silu_and_mul(x)))
    triton_table = get_ops("triton", batch_invariant=invariant)
    assert triton_table.rms_norm_fp8 is rms_norm_fp8 and triton_table.silu_and_mul_fp8 is silu_and_mul_fp8
