"""Phase D of the decode megakernel: h = RMSNorm(r; w2), g, u = round(Wg h), round(Wu h), a = round(silu(g) ⊙ u)
(SwiGLU, Shazeer 2020, "GLU Variants Improve Transformer", eq. 6).

A unit is RG gate rows and the matching up rows. Where the shape allows (`DOT`, launch.phase_d_chunks)
the unit's products run on the tensor cores: the unit is laid out as [rows × chunks, CW], multiplied by
the normed input cut into the same chunks, [chunks, CW], in one tl.dot, and each row's product is the
sum of its chunks' diagonal entries (`_gate_up_dot_unit`). This avoids reducing every tile across the
program's threads, which `_gate_up_unit`, the other scheme, does.

FP8W: Wgu is float8_e4m3fn with one float32 scale per row (ws_ptr, stacked [L, 2F]); it always takes
`_gate_up_unit` (launch.phase_d_chunks), which converts the tile exactly to float32 as it is used, and
each row's float32 sum is multiplied by its scale before the rounding:
g, u = round(dequant(Wg) h), round(dequant(Wu) h).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.grid_sync import end_phase
from tinyvllm.kernels.decode_megakernel.vectors import normed, normed_chunks
from tinyvllm.kernels.flash_tiles import dot_qk


@triton.jit
def _gate_up_tile(w_ptr, layer, u, H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr, BH: tl.constexpr):
    """Unit u's gate rows u·RG + [0, RG) and the matching up rows (+ F), as [RG, 2, BH]."""
    gate_rows = u * RG + tl.arange(0, RG)[:, None, None]
    rows = gate_rows + tl.arange(0, 2)[None, :, None] * F
    cols = tl.arange(0, BH)[None, None, :]
    base = w_ptr + tl.cast(layer, tl.int64) * (2 * F * H)
    return tl.load(base + rows * H + cols, mask=cols < H, other=0.0)


@triton.jit
def _gate_up_unit(w, a, u, act_ptr, ws_ptr, F: tl.constexpr, RG: tl.constexpr, FP8W: tl.constexpr):
    """Unit u: act[rows] = round(silu(g) ⊙ u) with g, u = round(W a) of its tile [RG, 2, BH]; FP8W: each
    row's sum times its scale (ws_ptr: this layer's [2F])."""
    hh = tl.arange(0, 2)[None, :]
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2)  # [RG, 2]
    if FP8W:
        y = y * tl.load(ws_ptr + u * RG + tl.arange(0, RG)[:, None] + hh * F)
    y = y.to(act_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.sum(tl.where(hh == 0, y, 0.0), axis=1)
    up = tl.sum(tl.where(hh == 1, y, 0.0), axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + u * RG + tl.arange(0, RG), act.to(act_ptr.dtype.element_ty))


@triton.jit
def _gate_up_dot_tile(
    w_ptr, layer, u, H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr, NC: tl.constexpr, CW: tl.constexpr
):
    """Unit u as [2·RG·NC, CW]: row n is chunk n mod NC (columns c·CW + [0, CW)) of weight row n // NC, the
    rows being RG gate rows u·RG + [0, RG) then the matching up rows (+ F)."""
    n = tl.arange(0, 2 * RG * NC)
    r = n // NC
    rows = u * RG + r % RG + (r // RG) * F
    base = w_ptr + tl.cast(layer, tl.int64) * (2 * F * H)
    cols = (n % NC)[:, None] * CW + tl.arange(0, CW)[None, :]
    return tl.load(base + rows[:, None] * H + cols, mask=cols < H, other=0.0)


@triton.jit
def _gate_up_dot_unit(
    w,
    a,
    u,
    act_ptr,
    F: tl.constexpr,
    RG: tl.constexpr,
    NC: tl.constexpr,
    M: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Unit u from `_gate_up_dot_tile` on the tensor cores: Y = A wᵀ with A the normed input as [M, CW]
    chunks (vectors.normed_chunks) gives every chunk of the input against every chunk of every row; row
    r's product is the sum of its chunks' own entries, Σ_c Y[c, r·NC + c]. Then as `_gate_up_unit`. Never
    for FP8 weights (launch.phase_d_chunks): they take `_gate_up_unit`."""
    y_all = dot_qk(a, w, UPCAST, IEEE)  # [M, 2·RG·NC]
    n = tl.arange(0, 2 * RG * NC)
    mine = tl.sum(tl.where(tl.arange(0, M)[:, None] == (n % NC)[None, :], y_all, 0.0), axis=0)
    y = tl.sum(tl.reshape(mine, [2 * RG, NC]), axis=1)  # [2·RG]: RG gate rows, then the matching up rows
    hh = tl.arange(0, 2 * RG)
    y = y.to(act_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.sum(tl.where(hh[None, :] == tl.arange(0, RG)[:, None], y[None, :], 0.0), axis=1)
    up = tl.sum(tl.where(hh[None, :] == tl.arange(0, RG)[:, None] + RG, y[None, :], 0.0), axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + u * RG + tl.arange(0, RG), act.to(act_ptr.dtype.element_ty))


@triton.jit
def gate_up_phase(
    layer,
    pid,
    P,
    r_ptr,
    o_ptr,
    n2_ptr,
    wgu_ptr,
    ws_ptr,
    act_ptr,
    eps,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    F: tl.constexpr,
    RG: tl.constexpr,
    BH: tl.constexpr,
    STAGES: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    DOT: tl.constexpr,
    CW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_O: tl.constexpr,
    FP8W: tl.constexpr,
):
    """Phase D of `layer`, starting with the wait of barrier b inside the first iteration of its
    STAGES-deep pipelined unit loop; with DOT on the tensor cores; with SPLIT_O its input is the residual
    plus phase C's sums o (vectors.residual_at); FP8W: ws_ptr the stacked row scales [L, 2F]."""
    NC: tl.constexpr = BH // CW
    M: tl.constexpr = 16 if NC <= 16 else NC
    n_units = F // RG
    layer_scales = ws_ptr + tl.cast(layer, tl.int64) * (2 * F)
    if DOT:
        a = tl.zeros([M, CW], r_ptr.dtype.element_ty)
    else:
        a = tl.zeros([1, 1, BH], r_ptr.dtype.element_ty)
    for u in tl.range(pid, n_units, P, num_stages=STAGES):
        if DOT:
            w = _gate_up_dot_tile(wgu_ptr, layer, u, H, F, RG, NC, CW)
        else:
            w = _gate_up_tile(wgu_ptr, layer, u, H, F, RG, BH)
        if u == pid:  # the pipeline's first tiles are in flight
            end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
            if DOT:
                a = normed_chunks(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, M, NC, CW, BH, SPLIT_O)
            else:
                a = normed(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, BH, SPLIT_O)[None, None, :]
        if DOT:
            _gate_up_dot_unit(w, a, u, act_ptr, F, RG, NC, M, UPCAST, IEEE)
        else:
            _gate_up_unit(w, a, u, act_ptr, layer_scales, F, RG, FP8W)
    if pid >= n_units:
        end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
