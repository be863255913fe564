"""What one program computes over one chunk of a row: the statistics that start the search (with the
precheck, the plain draw's best (value, index) there too), and C and M at a search pass's candidates.

Cost at B × V: 1 + passes(top-k) + passes(top-p) reads of each row by the search (the row is re-read
while it sits in L2 at moderate batch) plus one read by the draw; 2 launches per split pass, over
B × ceil(V / 8,192) programs. A search pass sorts each value three ways: at most lo (above no
candidate), above w (above every candidate: one count and one mass per lane), or in (lo, w] (compared
with the NC candidates); w = hi, or the top of the top-p bracket while a top-k search places candidates
in it. Each program keeps per-lane partials in registers (BLOCK_E lanes × NC counts and masses) and sums
its lanes once, at the end of its chunk: no cross-thread reduction per iteration. The NC-wide compare
and add run on every value (those outside (lo, w] as −inf); with `skip`, only in the iterations whose
BLOCK_E values hold one in (lo, w] (one block-wide max per iteration decides), which after the first
passes are few; with `unroll` 2, each iteration issues two blocks' loads before using either. The
placement's arithmetic (logarithms, the normal quantile, the grid test) runs once per row and pass, in
the per-row programs. Masses are float32 sums (each lane's in index order, then a fixed tree over the
lanes: fixed by chunk, block_e and NC, never by B), so a row whose top-p boundary lies within float32
rounding (~1e-6 relative) of p may keep one token more or fewer than an exact computation would, as the
full sampler's float32 cumsum may.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.sampling import allowed_by, thresholded_gumbel
from tinyvllm.kernels.top_p_sampling.row import scaled as _scaled


@triton.jit
def _draw_block(
    row_ptr, mask_row_ptr, V, inv_t, seed, start, g_val, g_idx, HAS_MASK: tl.constexpr, TILE: tl.constexpr,
    NR: tl.constexpr, NQ: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """The draw's per-lane running best (value, index) after the NR · NQ indices from `start`
    (a multiple of NR · NQ, which divides TILE; NQ = min(NR · NQ, TILE / 4)): the NR pieces of NQ lie in
    consecutive quarters of one of the sampler's tiles and take their noise from one Philox call per lane,
    as in the sampler (`sample_partial_kernel`, `noise_at`); each is folded in as `_best_of_quarter` folds
    a quarter under a threshold (`thresholded_gumbel`, strict >, indices in increasing order per lane). The values are
    loaded again (from L1: the statistics just read them) in the layout the noise has, so that no value
    moves between threads."""
    QUARTER: tl.constexpr = TILE // 4
    n0, n1, n2, n3 = tl.rand4x(seed, (start // TILE) * QUARTER + start % QUARTER + tl.arange(0, NQ))
    q0 = (start % TILE) // QUARTER
    for r in tl.static_range(NR):
        # one index per thread and lane, as the noise (and the sampler's loads): offsets known aligned
        # would vectorise the load and move the noise between threads in every iteration
        offs = tl.multiple_of(start + r * NQ + tl.arange(0, NQ), 1)
        valid = offs < V
        if HAS_MASK:
            valid = valid & allowed_by(mask_row_ptr, offs, valid)
        z = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        q = q0 + r
        u = tl.maximum(tl.where(q == 0, n0, tl.where(q == 1, n1, tl.where(q == 2, n2, n3))), 1e-20)
        g = tl.where(valid, thresholded_gumbel(z, inv_t, u, FAST_LOG), float("-inf"))
        better = g > g_val
        g_val = tl.where(better, g, g_val)
        g_idx = tl.where(better, offs, g_idx)
    return g_val, g_idx


@triton.jit
def chunk_stats(
    row_ptr, mask_row_ptr, V, inv_t, seed, c0, CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
    DRAW: tl.constexpr, TILE: tl.constexpr, NR: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """(max l, Σ exp(l − max l), smallest finite l, count of finite l, Σ l, Σ l², Σ l · exp(l − max l),
    Σ l² · exp(l − max l)) over the finite l in [c0, c0 + CHUNK) of a row (the moments place the first
    search pass, placement.py `candidates`), and with DRAW the plain sampler's best (value, index) there:
    the largest z · inv_t + g_i with each index's noise g_i and arithmetic (kernels/sampling.py), the lowest
    index among equal values (−inf, V when no value is finite). The per-lane running best (strict >, indices in
    increasing order per lane) and the final lowest-index-of-the-maximum are the sampler's own, so the
    combination over the chunks gives its id bit for bit."""
    NQ: tl.constexpr = BLOCK // NR
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK], tl.float32)
    lo_i = tl.full([BLOCK], float("inf"), tl.float32)
    n_i = tl.zeros([BLOCK], tl.int32)
    u1_i = tl.zeros([BLOCK], tl.float32)
    u2_i = tl.zeros([BLOCK], tl.float32)
    w1_i = tl.zeros([BLOCK], tl.float32)
    w2_i = tl.zeros([BLOCK], tl.float32)
    g_val = tl.full([NQ], float("-inf"), tl.float32)
    g_idx = tl.full([NQ], V, tl.int32)
    for start in range(c0, c0 + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < V
        if HAS_MASK:
            valid = valid & allowed_by(mask_row_ptr, offs, valid)
        z = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        sl = z * inv_t + 0.0  # `_scaled`
        finite = sl > float("-inf")
        m_new = tl.maximum(m_i, sl)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # lanes still at −inf keep a zero sum, no NaN
        rescale = tl.exp2((m_i - m_safe) * 1.4426950408889634)
        e = tl.exp2((sl - m_safe) * 1.4426950408889634)
        s_i = s_i * rescale + e
        lf = tl.where(finite, sl, 0.0)
        le = lf * e
        w1_i = w1_i * rescale + le
        w2_i = w2_i * rescale + lf * le
        u1_i += lf
        u2_i += lf * lf
        m_i = m_new
        lo_i = tl.minimum(lo_i, tl.where(finite, sl, float("inf")))
        n_i += finite.to(tl.int32)
        if DRAW:
            g_val, g_idx = _draw_block(
                row_ptr, mask_row_ptr, V, inv_t, seed, start, g_val, g_idx, HAS_MASK, TILE, NR, NQ, FAST_LOG
            )
    m = tl.max(m_i, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    rescale = tl.exp2((m_i - m_safe) * 1.4426950408889634)
    s = tl.sum(s_i * rescale, axis=0)
    w1 = tl.sum(w1_i * rescale, axis=0)
    w2 = tl.sum(w2_i * rescale, axis=0)
    g_top = tl.max(g_val, axis=0)
    g_arg = tl.min(tl.where(g_val == g_top, g_idx, V), axis=0)
    u1 = tl.sum(u1_i, axis=0)
    u2 = tl.sum(u2_i, axis=0)
    return m, s, tl.min(lo_i, axis=0), tl.sum(n_i, axis=0), g_top, g_arg, u1, u2, w1, w2


@triton.jit
def combine_stats(m, s, lmin, n, u1, u2, w1, w2, m_c, s_c, lmin_c, n_c, u1_c, u2_c, w1_c, w2_c):
    """The statistics of two consecutive spans of a row from each one's (`chunk_stats`)."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    r = tl.exp2((m - m_safe) * 1.4426950408889634)
    r_c = tl.exp2((m_c - m_safe) * 1.4426950408889634)
    s = s * r + s_c * r_c
    w1 = w1 * r + w1_c * r_c
    w2 = w2 * r + w2_c * r_c
    return m_new, s, tl.minimum(lmin, lmin_c), n + n_c, u1 + u1_c, u2 + u2_c, w1, w2


@triton.jit
def _eval_block(sl, m, lo, hi, w, x, cnt2, mass2, c_w, s_w, vmin, vmax, SKIP: tl.constexpr):
    """`chunk_eval`'s per-lane partials after one more value per lane (sl: [BLOCK_E])."""
    e = tl.exp2((sl - m) * 1.4426950408889634)
    above = sl > w
    c_w += above.to(tl.int32)
    s_w += tl.where(above, e, 0.0)
    over_lo = sl > lo
    inside = over_lo & (sl <= hi)
    vmin = tl.minimum(vmin, tl.where(inside, sl, float("inf")))
    vmax = tl.maximum(vmax, tl.where(inside, sl, float("-inf")))
    s_in = tl.where(over_lo & (~above), sl, float("-inf"))  # above no candidate unless in (lo, w]
    if SKIP:
        if tl.max(s_in, axis=0) > lo:
            gt = s_in[None, :] > x[:, None]
            cnt2 += gt.to(tl.int32)
            mass2 += tl.where(gt, e[None, :], 0.0)
    else:
        gt = s_in[None, :] > x[:, None]
        cnt2 += gt.to(tl.int32)
        mass2 += tl.where(gt, e[None, :], 0.0)
    return cnt2, mass2, c_w, s_w, vmin, vmax


@triton.jit
def chunk_eval(
    row_ptr, mask_row_ptr, V, inv_t, m, lo, hi, w, x, c0,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, NC: tl.constexpr, HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    """Over [c0, c0 + CHUNK) of a row: C and M at the NC candidates x (counts and masses of the values
    above each), and the smallest and largest value in (lo, hi].

    Every candidate lies in [lo, w) (placement.py `candidates`; w ≥ hi), so a value ≤ lo lies above none
    and a value > w above all: those add once to per-lane "above w" sums; only values in (lo, w] are
    compared with the NC candidates, into per-lane [NC, BLOCK_E] partials. Lane i takes the values at
    i + j · BLOCK_E, j = 0, 1, ..., in that order; the lanes are summed once at the end (a fixed tree: the
    order depends on the chunk, BLOCK_E and NC alone). SKIP: a block of BLOCK_E values none of which lies
    in (lo, w] skips the NC-wide compares (one block-wide max decides; the sums are the same, only zeros
    are left out). UNROLL (1 or 2): blocks loaded per iteration, both loads issued before either is used
    (more bytes in flight; each lane's order, so each sum, is the same)."""
    # [NC, BLOCK_E], lanes last: each thread holds all NC partials of its lanes, so a loaded value
    # reaches the compares where it was loaded (no layout exchange through shared memory)
    cnt2 = tl.zeros([NC, BLOCK_E], tl.int32)
    mass2 = tl.zeros([NC, BLOCK_E], tl.float32)
    c_w = tl.zeros([BLOCK_E], tl.int32)
    s_w = tl.zeros([BLOCK_E], tl.float32)
    vmin = tl.full([BLOCK_E], float("inf"), tl.float32)
    vmax = tl.full([BLOCK_E], float("-inf"), tl.float32)
    for start in range(c0, c0 + CHUNK, BLOCK_E * UNROLL):
        sl = _scaled(row_ptr, mask_row_ptr, start + tl.arange(0, BLOCK_E), V, inv_t, HAS_MASK)
        if UNROLL == 2:
            sl2 = _scaled(row_ptr, mask_row_ptr, start + BLOCK_E + tl.arange(0, BLOCK_E), V, inv_t, HAS_MASK)
        cnt2, mass2, c_w, s_w, vmin, vmax = _eval_block(sl, m, lo, hi, w, x, cnt2, mass2, c_w, s_w, vmin, vmax, SKIP)
        if UNROLL == 2:
            cnt2, mass2, c_w, s_w, vmin, vmax = _eval_block(
                sl2, m, lo, hi, w, x, cnt2, mass2, c_w, s_w, vmin, vmax, SKIP
            )
    cnt = tl.sum(cnt2, axis=1) + tl.sum(c_w, axis=0)
    mass = tl.sum(mass2, axis=1) + tl.sum(s_w, axis=0)
    return cnt, mass, tl.min(vmin, axis=0), tl.max(vmax, axis=0)
