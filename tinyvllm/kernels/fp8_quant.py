"""Dynamic per-token FP8 quantization of activations: x [M, K] → (q [M, K] float8_e4m3fn, s [M] float32).

Row m: s_m = max_k |x[m, k]| / 448 (1 for an all-zero row), q[m, :] = e4m3(x[m, :] / s_m), the division
in float32, rounded to nearest even (kernels/fp8_convert.py); `quantization.fp8.quantize_rows` is the
reference. One program per row reads it twice in BLOCK_K chunks (the max, then the quantization): for
decode-sized M the second read hits L2. The GEMM that follows (torch._scaled_mm) takes s as its row
scales.

`row_scale` and `store_e4m3` are the two steps as @triton.jit helpers, so that the kernels that produce
a linear layer's input (RMSNorm: kernels/rms_norm.py, SwiGLU: kernels/activation.py) quantize their own
output with the same bits; this kernel remains for inputs no such kernel produces (the attention output
before o_proj, docs/fp8.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.fp8_convert import FP8_MAX, to_e4m3
from tinyvllm.kernels.launch import check_dim, check_float, next_power_of_2, upcast_dot


@triton.jit
def row_scale(row_max):
    """s = row_max / 448, IEEE-rounded as torch's division (1 where row_max is 0: an all-zero row)."""
    return tl.where(row_max > 0, tl.math.div_rn(row_max, FP8_MAX), 1.0)


@triton.jit
def store_e4m3(ptrs, x, scale, mask, EMULATE_FP8: tl.constexpr):
    """Store e4m3(x / scale) (float32 x, IEEE division, round to nearest even, saturating) at ptrs."""
    tl.store(ptrs, to_e4m3(tl.math.div_rn(x, scale), EMULATE_FP8), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, EMULATE_FP8: tl.constexpr
):
    """Program m: row m's scale s_m and its FP8 values."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, 0))
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        store_e4m3(q_ptr + m * stride_qm + k0 + offs, x, scale, mask, EMULATE_FP8)


def empty_quantized(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q [rows, cols] float8_e4m3fn, s [rows] float32) for a kernel to fill."""
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device)
    return q, torch.empty((rows,), dtype=torch.float32, device=device)


def quantize_per_token(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32/bf16/fp16, unit stride along K) → (q [M, K] float8_e4m3fn, scales [M] float32)."""
    check_dim("x", x, 2)
    check_float("x", x)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    M, K = x.shape
    q, s = empty_quantized(M, K, x.device)
    if M == 0:
        return q, s
    block_k = block_k or min(next_power_of_2(K), 4096)
    _quantize_rows_kernel[(M,)](
        x, q, s, K, x.stride(0), q.stride(0), BLOCK_K=block_k, EMULATE_FP8=upcast_dot(x.device), num_warps=4
    )
    return q, s
