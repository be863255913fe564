"""Phase A of the decode megakernel: h = RMSNorm(r; w1), qkv = round(Wqkv h (+ bqkv)), RoPE on q and k,
the new token's k and v into the paged cache.

A unit is RQ rows of one head's first half together with their RoPE partners in its second half, so the
rotation happens in registers: y₁, y₂ → (y₁c − y₂s, y₂c + y₁s) with c, s the cos/sin of the rows'
frequencies at the token's position (Su et al. 2021, "RoFormer", §3.4.2, rotate-half layout). q goes
to a scratch vector, k and v straight into the cache.

With QK_NORM (Qwen3) RoPE follows an RMSNorm over each head's D features, which a unit does not hold
whole: phase A then stores q and k unrotated (rounded) into the scratch vector, [q heads | k heads], and
phase B normalises and rotates them (attention_phase.normed_rotated). v goes to the cache either way.
With HAS_BIAS (Qwen2) the bias is added to the float32 sums before their one rounding, as nn.Linear.

FP8W: Wqkv is float8_e4m3fn with one float32 scale per row (ws_ptr, stacked [L, NQKV]); the tile is
converted exactly as it is multiplied, and each row's float32 sum is multiplied by its scale before the
bias and the rounding: y = round(s ⊙ (q_W h) (+ b)) = round(dequant(W) h (+ b)). FP8KV: the cache stores
e4m3(k / k_scale) and e4m3(v / v_scale) of the rounded k and v, as the KV-write kernel does
(kernels/kv_cache.py; EMULATE: the interpreter's rounding, kernels/fp8_convert.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.grid_sync import end_phase
from tinyvllm.kernels.decode_megakernel.vectors import normed
from tinyvllm.kernels.fp8_convert import cache_value


@triton.jit
def _qkv_tile(
    w_ptr, layer, u, H: tl.constexpr, NQKV: tl.constexpr, D: tl.constexpr, RQ: tl.constexpr, BH: tl.constexpr
):
    """Unit u's weight rows head·D + j0 + [0, RQ) and their partners + D/2, as [RQ, 2, BH]. A load that
    Triton's pipeliner turns into cp.async copies; only the padding columns are masked (every caller
    loops over valid units, and RQ divides D/2)."""
    UPH: tl.constexpr = D // 2 // RQ
    head = u // UPH
    j0 = (u % UPH) * RQ
    jj = tl.arange(0, RQ)[:, None, None]
    hh = tl.arange(0, 2)[None, :, None]
    cols = tl.arange(0, BH)[None, None, :]
    rows = head * D + j0 + hh * (D // 2) + jj
    base = w_ptr + tl.cast(layer, tl.int64) * (NQKV * H)
    return tl.load(base + rows * H + cols, mask=cols < H, other=0.0)


@triton.jit
def _qkv_unit(
    w,
    a,
    c,
    s,
    u,
    slot,
    kv_off,
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    ws_ptr,
    stride_head,
    k_scale,
    v_scale,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    RQ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8W: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Unit u from its tile w [RQ, 2, BH] (`_qkv_tile`), the normed input a [1, 1, BH] and the RoPE
    factors c, s [RQ] of its rows: y = round(W a (+ b)), q and k rotated; q into the scratch vector, k
    and v into the cache row at kv_off (slot −1: nowhere). QK_NORM: q and k unrotated into the scratch
    vector instead (module docstring). bias_ptr: this layer's bias [NQKV] (HAS_BIAS only); ws_ptr: this
    layer's row scales [NQKV] (FP8W only); k_scale, v_scale: the cache's (FP8KV only)."""
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    jj = tl.arange(0, RQ)
    hh = tl.arange(0, 2)
    in_head = hh[None, :] * HALF + jj[:, None]  # [RQ, 2]: offset of each output within its head
    sign = tl.where(hh[None, :] == 0, -1.0, 1.0)
    other_half = (hh[None, :, None] != hh[None, None, :]).to(tl.float32)  # [1, 2, 2]
    head = u // UPH
    offs = (u % UPH) * RQ + in_head
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2)  # [RQ, 2]
    if FP8W:
        y = y * tl.load(ws_ptr + head * D + offs)
    if HAS_BIAS:
        y += tl.load(bias_ptr + head * D + offs).to(tl.float32)
    y = y.to(q_ptr.dtype.element_ty).to(tl.float32)
    partner = tl.sum(y[:, None, :] * other_half, axis=2)  # y of the other half, exactly
    roped = (y * c[:, None] + sign * partner * s[:, None]).to(q_ptr.dtype.element_ty)  # unused with QK_NORM
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    if head >= HQ + HK:
        if slot >= 0:
            v = cache_value(y, v_scale, dtype, FP8KV, EMULATE)
            tl.store(v_ptr + kv_off + (head - HQ - HK) * stride_head + offs, v)
    elif QK_NORM:  # q and k heads unrotated, [q heads | k heads]
        tl.store(q_ptr + head * D + offs, y.to(q_ptr.dtype.element_ty))
    elif head < HQ:
        tl.store(q_ptr + head * D + offs, roped)
    else:
        if slot >= 0:
            k = cache_value(roped.to(tl.float32), k_scale, dtype, FP8KV, EMULATE)
            tl.store(k_ptr + kv_off + (head - HQ) * stride_head + offs, k)


@triton.jit
def qkv_phase(
    layer,
    pid,
    P,
    r_ptr,
    n1_ptr,
    wqkv_ptr,
    cos_sin_ptr,
    pos,
    slot,
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    ws_ptr,
    stride_blk,
    stride_head,
    k_scale,
    v_scale,
    eps,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    RQ: tl.constexpr,
    BH: tl.constexpr,
    PIPE: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8W: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Phase A of `layer`, starting with the wait of barrier b inside the first iteration of its unit
    loop: the loop is software-pipelined PIPE deep, so its first tiles are in flight before the wait.
    bias_ptr: the stacked biases [L, NQKV] (HAS_BIAS only); ws_ptr: the stacked row scales [L, NQKV]
    (FP8W only); k_scale, v_scale: this layer's cache scales (FP8KV only)."""
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    n_units = (HQ + 2 * HK) * UPH
    jj = tl.arange(0, RQ)
    kv_off = (slot // BS) * stride_blk + (slot % BS) * D
    cs_row = cos_sin_ptr + pos * D
    a = tl.zeros([1, 1, BH], r_ptr.dtype.element_ty)
    layer_bias = bias_ptr + tl.cast(layer, tl.int64) * NQKV
    layer_scales = ws_ptr + tl.cast(layer, tl.int64) * NQKV
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _qkv_tile(wqkv_ptr, layer, u, H, NQKV, D, RQ, BH)
        c = tl.load(cs_row + (u % UPH) * RQ + jj)
        s = tl.load(cs_row + HALF + (u % UPH) * RQ + jj)
        if u == pid:  # the pipeline's first tiles are in flight
            end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
            a = normed(r_ptr, r_ptr, n1_ptr + layer * H, H, eps, BH, False)[None, None, :]
        _qkv_unit(
            w,
            a,
            c,
            s,
            u,
            slot,
            kv_off,
            q_ptr,
            k_ptr,
            v_ptr,
            layer_bias,
            layer_scales,
            stride_head,
            k_scale,
            v_scale,
            HQ,
            HK,
            D,
            RQ,
            HAS_BIAS,
            QK_NORM,
            FP8W,
            FP8KV,
            EMULATE,
        )
    if pid >= n_units:
        end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
