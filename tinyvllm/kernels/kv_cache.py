"""Store each token's K and V into the paged cache.

Token t goes to slot `slot_mapping[t]` = block · block_size + offset, i.e. cache[block, :, offset, :];
a negative slot (a padded row) writes nothing. k, v: [T, Hk, D] (any strides, e.g. views of the fused
qkv output); caches: [num_blocks, Hk, block_size, D]. One program per token moves its Hk·D values of
K and of V (pure data movement: 2·T·Hk·D elements read and written). Offsets are int64: a layer's
cache can hold more than 2³¹ elements.

An FP8 cache (float8_e4m3fn, FP8 a constexpr) stores e4m3(clamp(K / k_scale, ±448)) and the same of V:
the division in float32 as the reference does it, then kernels/fp8_convert.py's saturating
round-to-nearest-even conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.fp8_convert import to_e4m3
from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.launch import (
    check_dim,
    check_int,
    check_same_device,
    is_power_of_2,
    next_power_of_2,
    upcast_dot,
)
from tinyvllm.kernels.pdl import options as pdl_options


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    Hk,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    block_size,
    k_scale,
    v_scale,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program t: token t's K and V rows [Hk, D] into cache slot slot_mapping[t] (none where negative).
    PDL: launched as a dependent (kernels/pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous(PDL)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, D)
        mask = heads[:, None] < Hk
        block = slot // block_size
        offset = slot % block_size
        dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
        k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        if FP8:
            k = to_e4m3(k.to(tl.float32) / k_scale, EMULATE_FP8)
            v = to_e4m3(v.to(tl.float32) / v_scale, EMULATE_FP8)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> bool:
    """Raise ValueError / TypeError unless k, v [T, Hk, D] fit the caches [num_blocks, Hk, block_size, D]
    and slot_mapping [T]; returns whether the cache is FP8 (e4m3)."""
    for name, t in (("k", k), ("v", v)):
        check_dim(name, t, 3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dim(name, t, 4)
    check_int("slot_mapping", slot_mapping)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    T, Hk, D = k.shape
    if v.shape != k.shape or slot_mapping.shape != (T,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} disagree")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.shape[1] != Hk or k_cache.shape[3] != D:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit k [T, {Hk}, {D}]")
    if not is_power_of_2(D):
        raise ValueError(f"head dim must be a power of two, got {D}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"FP8 cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
    return fp8


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """cache[slot // bs, :, slot % bs] = k[t] (and v) for every t with slot_mapping[t] >= 0; an FP8 cache
    stores k[t] / k_scale and v[t] / v_scale (module docstring)."""
    fp8 = check_kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    T, Hk, D = k.shape
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        Hk,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[2],
        float(k_scale),
        float(v_scale),
        BLOCK_H=next_power_of_2(Hk),
        D=D,
        FP8=fp8,
        EMULATE_FP8=upcast_dot(k.device),  # the CPU interpreter: fp8_convert.py
        num_warps=4,
        **pdl_options(k.device),
    )
