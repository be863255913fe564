"""Rotary position embedding (Su et al. 2021, "RoFormer", §3.4.2) in the rotate-half (GPT-NeoX) layout
that Hugging Face Llama uses, applied in place to q and k in one launch.

For each head vector x = [x1, x2] (halves of D/2) at position p, with c = cos_sin[p, :D/2] and
s = cos_sin[p, D/2:] (Llama 3's scaled frequencies are already in the table):
    x ← [x1·c − x2·s, x2·c + x1·s]           (float32 arithmetic, rounded to x's dtype)

q: [T, Hq, D] and k: [T, Hk, D] may be strided views (the model passes slices of the fused qkv
output); one program per token rotates all its query and key heads, reading its table row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.launch import (
    check_dim,
    check_float,
    check_int,
    check_same_device,
    is_power_of_2,
    next_power_of_2,
)
from tinyvllm.kernels.pdl import options as pdl_options

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _rotate_heads(x_ptr, stride_h, stride_d, num_heads, c, s, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate the [num_heads, D] rows at x_ptr (one token) in place; c, s: [HALF] float32."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    p1 = x_ptr + heads[:, None] * stride_h + dims[None, :] * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    acc_ty = c.dtype
    x1f, x2f = x1.to(acc_ty), x2.to(acc_ty)
    tl.store(p1, (x1f * c[None, :] - x2f * s[None, :]).to(x1.dtype), mask=mask)
    tl.store(p2, (x2f * c[None, :] + x1f * s[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_sin_ptr,
    Hq,
    Hk,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cs,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    FP64: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program t: rotate token t's Hq query and Hk key heads in place by its position's cos/sin row.
    PDL: launched as a dependent (kernels/pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    c = tl.load(cos_sin_ptr + pos * stride_cs + dims)
    s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims)
    acc_ty = tl.float64 if FP64 else tl.float32
    c, s = c.to(acc_ty), s.to(acc_ty)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, stride_qd, Hq, c, s, BLOCK_HQ, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, stride_kd, Hk, c, s, BLOCK_HK, HALF)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hk, D] (any strides); positions [T] int; cos_sin [max_pos, D]."""
    check_dim("q", q, 3)
    check_dim("k", k, 3)
    check_float("q", q, _DTYPES)
    check_float("k", k, _DTYPES)
    check_int("positions", positions)
    check_same_device(q=q, k=k, positions=positions, cos_sin=cos_sin)
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != D:
        raise ValueError(f"cos_sin must be [max_pos, {D}], got {tuple(cos_sin.shape)}")
    if not is_power_of_2(D) or D < 2:
        raise ValueError(f"head dim must be a power of two, got {D}")
    if T == 0:
        return q, k
    cos_sin = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    Hk = k.shape[1]
    block_hq, block_hk = next_power_of_2(Hq), next_power_of_2(Hk)
    num_warps = 4 if block_hq * D <= 4096 else 8
    _rope_kernel[(T,)](
        q,
        k,
        positions,
        cos_sin,
        Hq,
        Hk,
        *q.stride(),
        *k.stride(),
        cos_sin.stride(0),
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        HALF=D // 2,
        FP64=q.dtype == torch.float64,
        num_warps=num_warps,
        **pdl_options(q.device),
    )
    return q, k
