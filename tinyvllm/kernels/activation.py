"""SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
    x = [g, u] along the last dim (each F wide)  →  silu(g) ⊙ u = g·σ(g)·u
in float32 (float64 for float64 inputs), rounded to x's dtype. Elementwise and memory-bound: each
input element read once, each output written once. Grid: (rows, F / BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import cdiv, check_float, check_last_dim_contiguous

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, F, stride_x, stride_y, BLOCK: tl.constexpr):
    """Program (row, column block): y[row, cols] = silu(g) ⊙ u with g = x[row, cols], u = x[row, F + cols]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0)
    acc_ty = tl.float64 if g.dtype == tl.float64 else tl.float32
    gf, uf = g.to(acc_ty), u.to(acc_ty)
    y = gf / (1.0 + tl.exp(-gf)) * uf
    tl.store(y_ptr + row * stride_y + cols, y.to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2F] → [..., F]."""
    check_float("x", x, _DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    F = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], F)
    x2 = x.reshape(-1, 2 * F) if x.dim() != 2 else x
    check_last_dim_contiguous("x", x2)
    rows = x2.shape[0]
    y = torch.empty((rows, F), dtype=x.dtype, device=x.device)
    if rows and F:
        block = min(1024, triton.next_power_of_2(F))
        _silu_and_mul_kernel[(rows, cdiv(F, block))](x2, y, F, x2.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y.reshape(out_shape)
