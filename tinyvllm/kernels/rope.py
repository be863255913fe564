"""Rotary position embedding (Su et al. 2021, "RoFormer", §3.4.2) in the rotate-half (GPT-NeoX) layout
that Hugging Face Llama uses, applied in place to q and k in one launch.

For each head vector x = [x1, x2] (halves of D/2) at position p, with c = cos_sin[p, :D/2] and
s = cos_sin[p, D/2:] (Llama 3's scaled frequencies are already in the table):
    x ← [x1·c − x2·s, x2·c + x1·s]           (float32 arithmetic, rounded to x's dtype)

q: [T, Hq, D] and k: [T, Hk, D] may be strided views (the model passes slices of the fused qkv
output); one program per token rotates all its query and key heads, reading its table row once.

`rope_write_kv` also stores the token's rotated K and its V into the paged cache (kernels/kv_cache.py's
write, same values and FP8 conversion) in the same program: one launch a layer instead of two, and the
rotated K goes to the cache from registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.fp8_convert import cache_value
from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.kv_cache import check_kv_write
from tinyvllm.kernels.launch import (
    check_dim,
    check_float,
    check_int,
    check_same_device,
    is_power_of_2,
    next_power_of_2,
    upcast_dot,
)
from tinyvllm.kernels.pdl import options as pdl_options

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _rotate_heads(x_ptr, stride_h, stride_d, num_heads, c, s, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Rotate the [num_heads, D] rows at x_ptr (one token) in place; c, s: [HALF] float32. Returns the
    rotated halves [BLOCK_H, HALF] as stored (rows past num_heads: zeros)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    p1 = x_ptr + heads[:, None] * stride_h + dims[None, :] * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p2, mask=mask, other=0.0)
    acc_ty = c.dtype
    x1f, x2f = x1.to(acc_ty), x2.to(acc_ty)
    r1 = (x1f * c[None, :] - x2f * s[None, :]).to(x1.dtype)
    r2 = (x2f * c[None, :] + x1f * s[None, :]).to(x1.dtype)
    tl.store(p1, r1, mask=mask)
    tl.store(p2, r2, mask=mask)
    return r1, r2


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


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    Hq,
    Hk,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cb,
    stride_ch,
    stride_cslot,
    block_size,
    k_scale,
    v_scale,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    FP64: tl.constexpr,
    FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program t: `_rope_kernel`'s rotation of token t's query and key heads (in place), then, unless
    slot_mapping[t] < 0, its rotated K and its V into cache slot slot_mapping[t] (`_write_kv_kernel`'s
    values: the rotated K as rounded to k's dtype, each divided by its scale into an FP8 cache). k and v
    are contiguous in their last dimension. PDL: launched as a dependent (kernels/pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    acc_ty = tl.float64 if FP64 else tl.float32
    c = tl.load(cos_sin_ptr + pos * stride_cs + dims).to(acc_ty)
    s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims).to(acc_ty)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, stride_qd, Hq, c, s, BLOCK_HQ, HALF)
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, 1, Hk, c, s, BLOCK_HK, HALF)
    heads = tl.arange(0, BLOCK_HK)
    mask = heads[:, None] < Hk
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cslot
        dst += heads[:, None] * stride_ch + dims[None, :]
        pv = v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :]
        v1 = tl.load(pv, mask=mask)
        v2 = tl.load(pv + HALF, mask=mask)
        ty = k_cache_ptr.dtype.element_ty
        # an FP8 cache: the division in float32 (a 16-bit value over the float32 scale promotes), as the write's
        tl.store(k_cache_ptr + dst, cache_value(k1, k_scale, ty, FP8, EMULATE_FP8), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, cache_value(k2, k_scale, ty, FP8, EMULATE_FP8), mask=mask)
        tl.store(v_cache_ptr + dst, cache_value(v1, v_scale, ty, FP8, EMULATE_FP8), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, cache_value(v2, v_scale, ty, FP8, EMULATE_FP8), mask=mask)


def check_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Raise ValueError / TypeError unless q [T, Hq, D], k [T, Hk, D], positions [T] and cos_sin
    [max_pos, D] fit together; returns cos_sin with a unit last stride (the kernels' layout)."""
    check_dim("q", q, 3)
    check_dim("k", k, 3)
    check_float("q", q, _DTYPES)
    check_float("k", k, _DTYPES)
    check_int("positions", positions)
    check_same_device(q=q, k=k, positions=positions, cos_sin=cos_sin)
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != D:
        raise ValueError(f"cos_sin must be [max_pos, {D}], got {tuple(cos_sin.shape)}")
    if not is_power_of_2(D) or D < 2:
        raise ValueError(f"head dim must be a power of two, got {D}")
    return cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()


def _warps(block_hq: int, D: int) -> int:
    return 4 if block_hq * D <= 4096 else 8


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hk, D] (any strides); positions [T] int; cos_sin [max_pos, D]."""
    cos_sin = check_rope(q, k, positions, cos_sin)
    T, Hq, D = q.shape
    if T == 0:
        return q, k
    Hk = k.shape[1]
    block_hq, block_hk = next_power_of_2(Hq), next_power_of_2(Hk)
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
        num_warps=_warps(block_hq, D),
        **pdl_options(q.device),
    )
    return q, k


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope(q, k, positions, cos_sin)` then `write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale,
    v_scale)` (kernels/kv_cache.py) in one launch (module docstring); returns (q, k), rotated in place."""
    cos_sin = check_rope(q, k, positions, cos_sin)
    fp8 = check_kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, Hq, D = q.shape
    if T == 0:
        return q, k
    Hk = k.shape[1]
    block_hq = next_power_of_2(Hq)
    _rope_write_kv_kernel[(T,)](
        q,
        k,
        v,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        Hq,
        Hk,
        *q.stride(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[2],
        float(k_scale),
        float(v_scale),
        BLOCK_HQ=block_hq,
        BLOCK_HK=next_power_of_2(Hk),
        HALF=D // 2,
        FP64=q.dtype == torch.float64,
        FP8=fp8,
        EMULATE_FP8=upcast_dot(q.device),  # the CPU interpreter: fp8_convert.py
        num_warps=_warps(block_hq, D),
        **pdl_options(q.device),
    )
    return q, k
