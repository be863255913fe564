"""SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
    x = [g, u] along the last dim (each F wide)  →  silu(g) ⊙ u = g·σ(g)·u
in float32 (float64 for float64 inputs), rounded to x's dtype. Elementwise and memory-bound: each
input element read once, each output written once. Grid: (rows, F / BLOCK).

`silu_and_mul_fp8` feeds an FP8 linear layer (down_proj) that quantizes its input per token: one
program per row computes the rounded activation y as above and writes, instead of y, its FP8 codes and
row scale (kernels/fp8_quant.py, bit for bit: s = max|y| / 448, q = e4m3(y / s)). A row that fits one
block (F ≤ 16384: every supported model's MLP width per rank) is read once and kept in registers; a
wider one is computed twice, once for its maximum and once for its codes (the second read hits L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.fp8_quant import empty_quantized, row_scale, store_e4m3
from tinyvllm.kernels.launch import FLOAT_DTYPES, cdiv, check_float, check_last_dim_contiguous, upcast_dot

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_ROW_BLOCK = 16384  # the widest row silu_and_mul_fp8 keeps in registers


@triton.jit
def _swiglu(row_ptr, F, cols, mask):
    """round(silu(g) ⊙ u) at `cols` of one row, g = row[cols], u = row[F + cols]; 0 where masked."""
    g = tl.load(row_ptr + cols, mask=mask, other=0.0)
    u = tl.load(row_ptr + F + cols, mask=mask, other=0.0)
    acc_ty = tl.float64 if g.dtype == tl.float64 else tl.float32
    gf, uf = g.to(acc_ty), u.to(acc_ty)
    return (gf / (1.0 + tl.exp(-gf)) * uf).to(g.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, F, stride_x, stride_y, BLOCK: tl.constexpr):
    """Program (row, column block): y[row, cols] = silu(g) ⊙ u with g = x[row, cols], u = x[row, F + cols]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    tl.store(y_ptr + row * stride_y + cols, _swiglu(x_ptr + row * stride_x, F, cols, mask), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    F,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
):
    """Program per row: y = round(silu(g) ⊙ u) as `_silu_and_mul_kernel` computes it, then s = max|y| / 448
    at s_ptr and e4m3(y / s) at q_ptr (module docstring); ONE_BLOCK (BLOCK ≥ F): y stays in registers."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = offs < F
        y = _swiglu(x_row, F, offs, mask).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), 0))
        tl.store(s_ptr + row, scale)
        store_e4m3(q_row + offs, y, scale, mask, EMULATE_FP8)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for f0 in range(0, F, BLOCK):
            y = _swiglu(x_row, F, f0 + offs, f0 + offs < F).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = row_scale(tl.max(amax, 0))
        tl.store(s_ptr + row, scale)
        for f0 in range(0, F, BLOCK):
            mask = f0 + offs < F
            y = _swiglu(x_row, F, f0 + offs, mask).to(tl.float32)
            store_e4m3(q_row + f0 + offs, y, scale, mask, EMULATE_FP8)


def _rows(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, int]:
    """Checks; x [..., 2F] as rows [R, 2F] (a view where possible) and F."""
    check_float("x", x, dtypes)
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    F = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * F) if x.dim() != 2 else x
    check_last_dim_contiguous("x", x2)
    return x2, F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2F] → [..., F]."""
    x2, F = _rows(x, _DTYPES)
    rows = x2.shape[0]
    y = torch.empty((rows, F), dtype=x.dtype, device=x.device)
    if rows and F:
        block = min(1024, triton.next_power_of_2(F))
        _silu_and_mul_kernel[(rows, cdiv(F, block))](x2, y, F, x2.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], F)


def silu_and_mul_fp8(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, 2F] (float16/bfloat16/float32) → silu_and_mul(x) quantized per token, without storing it:
    (q [R, F] float8_e4m3fn, s [R] float32), bit for bit `quantize_per_token(silu_and_mul(x))`. `block`:
    columns per chunk (a power of two; default the row, up to MAX_ROW_BLOCK)."""
    if x.dim() != 2:
        raise ValueError(f"x must have 2 dimensions, got shape {tuple(x.shape)}")
    x2, F = _rows(x, FLOAT_DTYPES)
    rows = x2.shape[0]
    q, s = empty_quantized(rows, F, x.device)
    if rows == 0:
        return q, s
    block = block or min(triton.next_power_of_2(max(F, 1)), MAX_ROW_BLOCK)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _silu_and_mul_fp8_kernel[(rows,)](
        x2,
        q,
        s,
        F,
        x2.stride(0),
        q.stride(0),
        BLOCK=block,
        ONE_BLOCK=block >= F,
        EMULATE_FP8=upcast_dot(x.device),
        num_warps=num_warps,
    )
    return q, s
