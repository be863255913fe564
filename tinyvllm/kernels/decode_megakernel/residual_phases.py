"""Phases C and E of the decode megakernel: a product added to the residual stream.

    C  r = round(round(Wo o) + r)      o: phase B's attention output
    E  r = round(round(Wd a) + r)      a: phase D's SwiGLU output

`residual_phase` does either as a loop over units of R whole output rows. With `split_o` (the default)
phase C is `o_group_phase` instead: split along K by KV group, each unit merging its group's attention
partials itself and adding its product to the row sums by atomics; phase D adds the sums to the residual
(vectors.residual_at). The atomics arrive in an order that varies from launch to launch, so the sums are
kept in fixed point (int64, `O_SCALE` = 2³² units per 1.0), where addition is exact and so independent
of that order: every launch gives the same bits, with or without `split_o`.

Fixed point, exactly. A group's float32 partial y becomes trunc(y · 2³²) (exact for |y| ≥ 2⁻⁹, whose
float32 ulp is at least 2⁻³²; off by less than 2⁻³² below); the int64 sums are exact while |Σ| < 2³¹;
phase D converts the sum to float32 once, correctly rounded. So the sum phase D reads is the exact sum of
the groups' partials rounded once (float32 atomics round after every addition), to within 2⁻³² per group
for tiny partials. The cost is 8 bytes per row sum instead of 4, in the same atomics and barriers.

FP8W: W is float8_e4m3fn with one float32 scale per row (ws_ptr, stacked [L, N]); tiles are converted
exactly as they are multiplied and each row's float32 (partial) sum is multiplied by its scale: the
product is dequant(W) x, before any rounding, and the split phase C's partials are scaled before they
become fixed point (the scale distributes over the groups' sum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.attention_phase import group_attention
from tinyvllm.kernels.decode_megakernel.grid_sync import end_phase

O_SCALE = 2.0**32  # fixed-point units per 1.0 of phase C's row sums (int64: exact while |sum| < 2**31)


@triton.jit
def _rows_tile(w_ptr, layer, u, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Unit u's output rows u·R + [0, R) of W [N, K], as [R, BK] (a pipelined load; R divides N, so only
    the padding columns are masked)."""
    rows = u * R + tl.arange(0, R)[:, None]
    cols = tl.arange(0, BK)[None, :]
    base = w_ptr + tl.cast(layer, tl.int64) * (N * K)
    return tl.load(base + rows * K + cols, mask=cols < K, other=0.0)


@triton.jit
def _residual_unit(w, a, res, u, out_ptr, ws_ptr, N: tl.constexpr, R: tl.constexpr, FP8W: tl.constexpr):
    """Unit u: out[rows] = round(round(W x)[rows] + res) from its tile w [R, BK] (rows u·R + [0, R)),
    x as a [1, BK] and the rows' residual res [R]; FP8W: W = w · ws_ptr[rows] (this layer's scales)."""
    rows = u * R + tl.arange(0, R)
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)
    if FP8W:
        y = y * tl.load(ws_ptr + rows)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def residual_phase(
    layer,
    pid,
    P,
    x_ptr,
    w_ptr,
    ws_ptr,
    r_ptr,
    out_ptr,
    bar_ptr,
    b,
    trace_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    MAXU: tl.constexpr,
    PIPE: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    FP8W: tl.constexpr,
):
    """out ← round(round(W x) + r) over the units of W [N, K] (out may be r; FP8W: W = q · ws_ptr's row
    scales, stacked [L, N]), starting with the wait of
    barrier b inside the first iteration of the PIPE-deep pipelined unit loop. The residual rows of all of
    this program's units (at most MAXU) are read once after the wait, not by the loop: the pipeline's
    loads are issued ahead of the wait and may be cached in L1, which does not see other SMs' stores."""
    n_units = N // R
    layer_scales = ws_ptr + tl.cast(layer, tl.int64) * N
    rr = tl.arange(0, R)
    cols = tl.arange(0, BK)
    it = tl.arange(0, MAXU)
    my_rows = (pid + it * P)[:, None] * R + rr[None, :]  # [MAXU, R]: row i holds this program's i-th unit
    a = tl.zeros([1, BK], x_ptr.dtype.element_ty)
    res_all = tl.zeros([MAXU, R], r_ptr.dtype.element_ty)
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _rows_tile(w_ptr, layer, u, N, K, R, BK)
        if u == pid:  # the pipeline's first tiles are in flight
            end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
            a = tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")[None, :]
            res_all = tl.load(r_ptr + my_rows, mask=my_rows < N, other=0.0, cache_modifier=".cg")
        res = tl.sum(tl.where(it[:, None] == (u - pid) // P, res_all.to(tl.float32), 0.0), axis=0)
        _residual_unit(w, a, res, u, out_ptr, layer_scales, N, R, FP8W)
    if pid >= n_units:
        end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)


@triton.jit
def o_group_phase(
    layer,
    pid,
    P,
    part_ptr,
    num_splits,
    wo_ptr,
    ws_ptr,
    o_ptr,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    GP: tl.constexpr,
    RO: tl.constexpr,
    SM: tl.constexpr,
    PIPE: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    DTYPE: tl.constexpr,
    FP8W: tl.constexpr,
):
    """Phase C split along K by KV group, starting with the wait of barrier b: unit (group g, rows
    c·RO + [0, RO)) adds W_o[rows, g's G·D columns] · o_g to the int64 fixed-point sums o[rows] (units of
    1 / O_SCALE, zero before the phase) by atomics, exact and so in no order that matters, o_g being the
    attention output of g's query heads, merged from phase B's partials
    by this program itself and rounded to the model's dtype as the layer-by-layer path stores it. A
    program takes a contiguous run of units, so that it merges once per group its run touches. A group of
    G query heads that is not a power of two is padded to GP heads, masked (their weights read as 0).
    DTYPE: the model's dtype (the merged output's); FP8W: W_o = q · ws_ptr's row scales, stacked [L, H]."""
    G: tl.constexpr = HQ // HK
    GD: tl.constexpr = G * D
    QD: tl.constexpr = HQ * D
    CPG: tl.constexpr = H // RO  # units per group
    n_units = HK * CPG
    per = tl.cdiv(n_units, P)
    first = pid * per
    last = tl.minimum(first + per, n_units)
    rr = tl.arange(0, RO)[:, None, None]
    heads = tl.arange(0, GP)[None, :, None]
    cols = heads * D + tl.arange(0, D)[None, None, :]  # [1, GP, D]: g's columns
    base = wo_ptr + tl.cast(layer, tl.int64) * (H * QD)
    layer_scales = ws_ptr + tl.cast(layer, tl.int64) * H
    a = tl.zeros([1, GP, D], DTYPE)
    g_have = -1
    for u in tl.range(first, last, 1, num_stages=PIPE):
        g = u // CPG
        row0 = (u % CPG) * RO
        if GP == G:
            w = tl.load(base + (row0 + rr) * QD + g * GD + cols)  # [RO, G, D]
        else:
            w = tl.load(base + (row0 + rr) * QD + g * GD + cols, mask=heads < G, other=0.0)  # [RO, GP, D]
        # The first merge sits in the wait's own block: Triton's pipeliner may move an independent block
        # of the loop body ahead of another, and the merge must read the partials after the barrier.
        if u == first:  # the pipeline's first tiles are in flight
            end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
            a = group_attention(part_ptr, g, num_splits, DTYPE, HK, G, GP, D, SM)[None, :, :]
            g_have = g
        if g != g_have:
            a = group_attention(part_ptr, g, num_splits, DTYPE, HK, G, GP, D, SM)[None, :, :]
            g_have = g
        y = tl.sum(tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2), axis=1)  # [RO]
        if FP8W:
            y = y * tl.load(layer_scales + row0 + tl.arange(0, RO))
        fixed = (y * 4294967296.0).to(tl.int64)  # O_SCALE units, truncated toward zero
        tl.atomic_add(o_ptr + row0 + tl.arange(0, RO), fixed, sem="relaxed", scope="gpu")
    if first >= last:
        end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
