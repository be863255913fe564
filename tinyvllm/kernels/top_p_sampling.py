"""Top-k / top-p / min-p sampling on the device without a sort: a per-row threshold, then the fused draw.

Row b samples from softmax(l) restricted to a kept set K_b, where l_i = z_i · (1 / T_b) (the fused
kernel's arithmetic, kernels/sampling.py) and, as in the full sampler (sampling/sampler.py), with
C(x) = #{j : l_j > x} and M(x) = Σ_{l_j > x} exp(l_j − max l):

* top-k keeps l_i ≥ t_k, the k-th largest value (every token tied with it is kept): the tokens with
  C(l_i) < k;
* top-p, after top-k, keeps the smallest set of largest values whose mass reaches p (ties with the
  smallest kept value are kept): the top-k tokens with M(l_i) < p · Z_k, Z_k = M over the top-k set;
  equivalently, the sorted-ascending cumulative mass of the tokens up to l_i exceeds (1 − p) · Z_k,
  which is the full sampler's rule (drop the ascending prefix whose mass is ≤ 1 − p, never the top);
* min-p keeps l_i ≥ max l + log(min_p).

Each rule keeps {l_i ≥ t*} for the smallest value t* it accepts: C and M only change at the row's own
values, so the accepted values form an upper set. The kept set is written as one strict threshold
per row, K = {i : l_i > thr}, with thr any value in [the largest value below t*, t*).

Finding thr, each pass a streaming read of the row:

1. m = max l, Z = Σ exp(l − m) (online), the smallest finite value, the count n of finite values, and
   the moments Σ l, Σ l², Σ l · exp(l − m), Σ l² · exp(l − m) (they place the first search pass);
2. top-k, then top-p: a search over x keeping cond(lo) false and cond(hi) true, cond(x) = C(x) < k and
   M(x) < P (top-k: P = ∞; top-p: k = ∞, P = p · Z_k). A pass evaluates C and M at NC candidates in
   [lo, hi) ("Where the candidates go", below) and the smallest and largest values in (lo, hi]; lo and
   hi move to the tightest candidates, then to the values themselves. The search ends when (lo, hi]
   holds one token, one representable float or one value a token can take: then t* is the only value in
   it and thr = lo. Ties at t* are found when (lo, hi] shrinks to that one value. (A token's l is
   z · (1/T) for a z of the logits' dtype: bf16 logits take every 2^16-th float32 only, fp16 every
   2^13-th, and l is monotone in z, so a test of the neighbouring z's tells whether (lo, hi] holds one
   such value.) While top-k searches with top-p to follow, the same passes also narrow a top-p bracket
   (lo_p, hi_p]: Z_k lies between M(hi) and M(lo) of the top-k bracket, so a candidate with
   M ≥ p · M(lo) has M ≥ P and one with M < p · M(hi) has M < P; the top-p search starts from that
   bracket (each end checked against P once Z_k is known).
3. min-p: thr ≥ the float just below max l + log(min_p).

Where the candidates go. A pass costs a read of the row whatever it finds, so the candidates go where t*
most likely lies, estimated from what the row state knows; only the number of passes depends on it, not
the kept set (any candidates in [lo, w) keep the invariants, `_chunk_eval`). With u_i = ±0.5, ±1.5, ±3, ±6, ... (dense
at the estimate, doubling outwards, so that an estimate that is off still brackets t* closely), and each
of these candidates moved to just below the nearest value a token can take (bf16, fp16: consecutive
candidates at consecutive such values end the search):

* the first pass of a top-k search, and of a top-p search over the whole row: all NC candidates from
  the statistics; top-k at μ + σ · Q⁻¹(c_i / n), the counts c_i = k + √k · u_i under a normal model of
  the values (μ, σ their mean and deviation, Q the normal tail; √k the deviation of the count above a
  fixed value); top-p at μ_w + σ_w · (Φ⁻¹(1 − p) + u_i / 5), the normal quantile of the mass-weighted
  values (mean μ_w, deviation σ_w) where the mass below is (1 − p) · Z;
* every other pass, NC / 2 candidates from the bracket: C taken log-linear between (lo, C(lo)) and
  (hi, C(hi) + 1) (a token density ∝ exp(−β x), so a mass density ∝ exp((1 − β) x)); the estimate is the
  count c* where cond changes (top-k: k; top-p: where the model's M crosses P, from M(lo) and M(hi)), and
  the candidates lie where the model puts the counts c* + σ · u_i, σ = √(j_hi · j_lo / (j_hi + j_lo))
  with j_hi = c* − C(hi), j_lo = C(lo) − c*: the deviation, in tokens, of the c*-th value among the
  bracket's tokens. While top-k searches with top-p to follow, NC / 4 of these go to the top-p
  bracket instead, around where its M crosses p · (M(lo) + M(hi)) / 2;
* and the other NC / 2 (the guards) spread evenly over the float32 bit patterns read as ordered
  integers (keys) of [max(lo, a), hi), a a lower bound on t* (top-p after top-k: t* lies above
  max l + log(Z_k (1 − p) / C(lo)) − 1, where the tokens below hold at most (1 − p) · Z_k / e).

The bound: a bracket of L keys holds at most ⌈L / (NC/2 + 1)⌉ keys between consecutive guards (or a
guard and an end), and the next bracket lies between two consecutive candidates, so every pass after a
search's first (whose guards start at a or are absent) cuts L by (NC/2 + 1)× at least, whatever the
row and the estimates; L < 2^32 at the start and the search is over at L = 1, so a search makes at
most 1 + ⌈32 / log2(NC/2 + 1)⌉ passes and a row 1 + 2 · (1 + ⌈32 / log2(NC/2 + 1)⌉) reads (one more
with the precheck's check).

Launches (`truncation_thresholds`), a fixed sequence whatever the data, so that a CUDA graph captures
it: each row is cut into chunks of a fixed length (8,192 logits: never a function of the batch, so a
row's sums are its own). The statistics run over rows × chunks, then one program per row combines them
in chunk order and starts the row's search (a row state in a small device buffer: phase, m, lo, C(lo),
M(lo), hi, C(hi), ..., and the candidates of the row's next pass, placed once by the per-row program).
Each of a fixed number of split passes runs over rows × chunks (C and M at the row's candidates over one
chunk each), then one program per row sums the chunks' counts and masses in chunk order, moves lo and
hi and places the next pass's candidates; a row whose search is over skips both. Last, one program per
row makes the passes its search still needs (usually none) itself, summing chunk by chunk the same way,
and writes thr. A row that does not truncate (greedy, no filter) reads nothing.

Then the fused Gumbel-max pass (kernels/sampling.py, HAS_THR) draws argmax_{i ∈ K} (l_i + g_i) with
each index's seeded noise g_i: the same ids as the plain fused kernel when K holds every finite token,
and the same id for a row alone or anywhere in any batch.

The plain draw first (`truncation_plan(precheck=True)`, `sample_top_k_top_p`'s default). Let x1 be the
draw's id over every token, argmax of l_i + g_i with the same noise. If x1 ∈ K, the draw over K is x1
(x1 maximises l + g over everything), so a row whose x1 is provably kept needs neither the search nor
the draw. The statistics pass also finds x1 (each chunk's best (value, index) with the sampler's noise,
the thresholded draw's arithmetic (`thresholded_gumbel`: the plain sampler's rounds its product
separately, which at a tie within one ulp could pick another id than the draw over K) and the
lowest-index rule, combined in chunk order: the draw's id bit for bit) and one check pass
over rows × chunks sums, in the search passes' way, C_gt = C(l_x1), M_gt = M(l_x1) and S = Σ_{l ≥ l_x1}
exp(l − m). x1 is kept when:

* min-p: l_x1 ≥ max l + log(min_p) (the float32 value above): decided by the statistics alone, and a
  row that fails it is searched without the check;
* top-k: C_gt < k (its tie group is kept whole);
* top-p alone: M_gt < p · Z;
* top-k and top-p: C_gt < k and M_gt < p · S. Every token ≥ l_x1 then has at most C_gt values above it,
  so lies in the top-k set: S ≤ Z_k, and the test is sufficient, not necessary.

A kept x1 is the row's id (thr just below l_x1, so {l > thr} ⊆ K holds x1; the draw skips the row). A
row whose x1 fails cond itself (C_gt ≥ k, or M_gt ≥ p · Z for top-p alone) searches from lo = l_x1 (every
kept token lies above it); one whose x1 passes top-k but not the sufficient top-p test searches top-k
from hi = l_x1, and its top-p test stays open until that search ends: then Z_k = M(lo) is known and the
exact rule decides. x1 is kept iff M_gt < p · Z_k (with its tie group): the row ends there, without the
top-p search and the draw; else every token top-p keeps has M < p · Z_k ≤ M_gt, so lies strictly above
l_x1, and the top-p search starts from lo = l_x1 (C(lo) = C_gt, M(lo) = M_gt; P = p · Z_k). Reads of a
row decided by the check: 2 (1 for min-p alone) against 2 + P; of one decided when its top-k search
ends: 2 + P(top-k). The check's sums round differently from the search's, so a row whose boundary lies
within float32 rounding of x1 may be decided differently from the search's own kept set, as the
search's rounding itself may.

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

Radix select: the top-k rows first (`truncation_plan(radix=True)`; `RADIX`, on by default: faster than
the search end to end, docs/perf.md §5). Isolating the k-th
value among 128k by counts takes the search several passes; a radix select finds it in two, then reads
the row once more for the few values it keeps:

* Buckets. Each finite l (after the bitmask: disallowed and −inf tokens never count) is placed by its
  logit z in one of 2^16 buckets: the top 16 bits of z's float32 order key (its bits as an unsigned
  integer, the sign bit flipped for z ≥ 0 and every bit for z < 0; −0.0 counts as +0.0). z ↦ bucket is
  monotone, and so is z ↦ l = z · (1 / T) for T > 0, so the bucket of the k-th largest z holds the k-th
  largest l. A bf16 value is alone in its bucket (its float32 bits end in 16 zeros), fp16 values share
  one by up to 8, float32 values by up to 2^16: float32 logits take the same passes, their buckets only
  hold more values, which the gather below resolves (only the bucket-only threshold needs bf16).
* R1, over rows × chunks: a 256-bin histogram (`tl.histogram`, the excluded values masked off) of the
  buckets' high bytes; one program per row sums its chunks' and finds the bin of the k'-th
  largest, k' = min(k, n) (n finite values: k ≥ n keeps them all), and its rank in the bin. R2: the same
  over the low bytes of the values in that bin, which gives the bucket B of the k'-th largest value and
  C_ge, the count of the values in B and above.
* G, over rows × chunks, when C_ge ≤ CAP (256): every l ≥ t_e = l of B's smallest float (an upper set of
  l that holds the top-k set, with any value whose l ties with t_e from a lower bucket) is appended to the
  row's buffer of CAP candidates, as (l, index) sort keys at positions from a per-row atomic counter.
  One program per row sorts them by (l descending, index ascending), so the result never depends on the
  order of the writes, and applies the rules exactly: t_k the k'-th largest l (its ties kept), Z_k =
  Σ exp(l − m) over the top-k set summed in sorted order, top-p keeps the sorted positions whose mass
  before them is < p · Z_k with their tie groups, min-p by the row max; thr just below the smallest kept
  value. Every token with l > thr is a candidate, so that program also draws the row's id, the
  thresholded draw's Gumbel-max over the kept candidates with its per-index noise, arithmetic and
  lowest-index rule (`best_thresholded`): the id the draw would give, and the draw skips the row.
* bf16 logits with top-p off and C_ge > CAP (a large k, a large tie group): B holds the k'-th value
  itself, so thr lies just below its l (min-p by the row max R1 found) and the draw draws.

Reads of a row served by the radix select: 3 (R1, R2, G), the draw's read skipped, for top-k alone, with
top-p, with min-p or both; 2 and the draw's for a bf16 row served by its bucket. A row the radix select
leaves (top_k = 0: top-p or min-p alone; k > CAP with top-p, or fp16 / float32 logits with k > CAP; C_ge >
CAP otherwise; after R1 and R2, or after G when more values than R2 counted tie with t_e in l) goes on to
the precheck and the search, as without it; their programs return at once for a served row. Launches:
six more before the statistics (R1, its per-row program, R2, its per-row program, G, the per-row
finish), a fixed sequence whatever the data; a row's histograms are integer sums and its candidates are
sorted, so its thr and id are its own whatever the batch. Per value, R1 costs a 256-bin histogram (with
Triton 3.9 on the GPU a shared-memory atomic add per value, serialised where a warp's values share a bin,
as logits' high bytes mostly do), R2 the same for its bin's values only, G a compare. The mask of
`tl.histogram` came with Triton 3.4: with an older one the radix select is off. The top-p masses are
float32 sums in sorted order, not the search's, so a row whose top-p boundary lies within float32 rounding
of p may keep one token more or fewer than the search would, as the search's own rounding may against an
exact computation.
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.sampling import (
    allowed_by,
    best_thresholded,
    sample_greedy_or_gumbel,
    sampling_tile,
    thresholded_gumbel,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _key(x):
    """The float32 x as an int64 that orders as the floats compare: consecutive keys are consecutive
    floats, and −0.0 has +0.0's key 0 (so the key just below 0.0 is the largest negative float, which
    compares below 0.0: −0.0 does not)."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b, (b ^ 0x7FFFFFFF) + 1)


@triton.jit
def _from_key(k):
    """The inverse of `_key` (+0.0 for key 0)."""
    b = tl.where(k >= 0, k, (k - 1) ^ 0x7FFFFFFF)
    return b.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _loaded(row_ptr, mask_row_ptr, offs, V, HAS_MASK: tl.constexpr):
    """(z, valid) at `offs`: the logits as float32, −inf past V and where the bitmask disallows."""
    valid = offs < V
    if HAS_MASK:
        valid = valid & allowed_by(mask_row_ptr, offs, valid)
    return tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32), valid


@triton.jit
def _scaled(row_ptr, mask_row_ptr, offs, V, inv_t, HAS_MASK: tl.constexpr):
    """l = z · inv_t at `offs` (float32; −inf past V and where the bitmask disallows), −0.0 made +0.0."""
    z, _ = _loaded(row_ptr, mask_row_ptr, offs, V, HAS_MASK)
    return z * inv_t + 0.0


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
def _chunk_stats(
    row_ptr, mask_row_ptr, V, inv_t, seed, c0, CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
    DRAW: tl.constexpr, TILE: tl.constexpr, NR: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """(max l, Σ exp(l − max l), smallest finite l, count of finite l, Σ l, Σ l², Σ l · exp(l − max l),
    Σ l² · exp(l − max l)) over the finite l in [c0, c0 + CHUNK) of a row (the moments place the first
    search pass, `_candidates`), and with DRAW the plain sampler's best (value, index) there: the largest
    z · inv_t + g_i with each index's noise g_i and arithmetic (kernels/sampling.py), the lowest index among
    equal values (−inf, V when no value is finite). The per-lane running best (strict >, indices in
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
def _combine_stats(m, s, lmin, n, u1, u2, w1, w2, m_c, s_c, lmin_c, n_c, u1_c, u2_c, w1_c, w2_c):
    """The statistics of two consecutive spans of a row from each one's (`_chunk_stats`)."""
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
    """`_chunk_eval`'s per-lane partials after one more value per lane (sl: [BLOCK_E])."""
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
def _chunk_eval(
    row_ptr, mask_row_ptr, V, inv_t, m, lo, hi, w, x, c0,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, NC: tl.constexpr, HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    """Over [c0, c0 + CHUNK) of a row: C and M at the NC candidates x (counts and masses of the values
    above each), and the smallest and largest value in (lo, hi].

    Every candidate lies in [lo, w) (`_candidates`; w ≥ hi), so a value ≤ lo lies above none and a value
    > w above all: those add once to per-lane "above w" sums; only values in (lo, w] are compared with
    the NC candidates, into per-lane [NC, BLOCK_E] partials. Lane i takes the values at i + j · BLOCK_E,
    j = 0, 1, ..., in that order; the lanes are summed once at the end (a fixed tree: the order depends
    on the chunk, BLOCK_E and NC alone). SKIP: a block of BLOCK_E values none of which lies in (lo, w]
    skips the NC-wide compares (one block-wide max decides; the sums are the same, only zeros are left
    out). UNROLL (1 or 2): blocks loaded per iteration, both loads issued before either is used (more
    bytes in flight; each lane's order, so each sum, is the same)."""
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


@triton.jit
def _at_key(keys, vals, k, empty):
    """The value of `vals` at the lane whose key is k (the smallest such; `empty` when none)."""
    return tl.min(tl.where(keys == k, vals, empty), axis=0)


@triton.jit
def _update(
    keys, cnt, mass, vmin, vmax, lo, c_lo, s_lo, hi, c_hi, s_hi, kk, P, p, conc,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p,
):  # fmt: skip
    """One search pass's step from C and M at the candidates `keys` over the whole row (module
    docstring): lo and hi move to the tightest candidates where cond(x) = C(x) < kk and M(x) < P is
    false and true, then past the gaps without values to just below vmin and to vmax.

    conc (a top-k search with top-p to follow): the top-p bracket (lo_p, hi_p] moves too. Top-p's P =
    p · Z_k is not known yet, but Z_k = M(t_k) lies in [M(hi), M(lo)] of the top-k bracket, so a candidate
    with M ≥ p · M(lo) has M ≥ P (top-p's cond false: lo_p) and one with M < p · M(hi) has M < P (true:
    hi_p). `_advance` checks both ends against P once it is known."""
    cond = (cnt < kk) & (mass < P)
    # lo: the largest candidate where cond is false (cond is monotone in x); hi: the smallest true one
    klo = tl.maximum(tl.max(tl.where(cond, -(1 << 40), keys), axis=0), _key(lo))
    khi = tl.minimum(tl.min(tl.where(cond, keys, 1 << 40), axis=0), _key(hi))
    new_lo = klo > _key(lo)
    new_hi = khi < _key(hi)
    c_lo = tl.where(new_lo, _at_key(keys, cnt, klo, 1 << 30), c_lo)
    s_lo = tl.where(new_lo, _at_key(keys, mass, klo, float("inf")), s_lo)
    c_hi = tl.where(new_hi, _at_key(keys, cnt, khi, 1 << 30), c_hi)
    s_hi = tl.where(new_hi, _at_key(keys, mass, khi, float("inf")), s_hi)
    # No value lies in (old lo, vmin) nor in (vmax, old hi]: C and M do not change across a gap without
    # values, so lo moves up to just below vmin and hi down to vmax when they are tighter.
    klo = tl.maximum(klo, _key(vmin) - 1)
    khi = tl.minimum(khi, _key(vmax))
    kl = tl.max(tl.where(mass >= p * s_lo, keys, -(1 << 40)), axis=0)
    kh = tl.min(tl.where(mass < p * s_hi, keys, 1 << 40), axis=0)
    up = conc & (kl > _key(lo_p))
    down = conc & (kh < _key(hi_p))
    lo_p = tl.where(up, _from_key(kl), lo_p)
    c_lo_p = tl.where(up, _at_key(keys, cnt, kl, 1 << 30), c_lo_p)
    s_lo_p = tl.where(up, _at_key(keys, mass, kl, float("inf")), s_lo_p)
    hi_p = tl.where(down, _from_key(kh), hi_p)
    c_hi_p = tl.where(down, _at_key(keys, cnt, kh, 1 << 30), c_hi_p)
    s_hi_p = tl.where(down, _at_key(keys, mass, kh, float("inf")), s_hi_p)
    return _from_key(klo), c_lo, s_lo, _from_key(khi), c_hi, s_hi, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p


@triton.jit
def _l_at(g, inv_t):
    """l = z · inv_t (`_scaled`'s arithmetic) of the float32 z whose key is g."""
    return _from_key(g) * inv_t + 0.0


@triton.jit
def _is_done(lo, c_lo, hi, c_hi, inv_t, GB: tl.constexpr):
    """Whether t* is the only value in (lo, hi]: the bracket holds one token, or one float, or (GB > 0: the
    logits' dtype has 23 − GB mantissa bits, so the keys of its values read as float32 are multiples of
    2^GB) one value that a token can take. l = z · inv_t is monotone in z, so with g the smallest such key
    whose l lies above lo (found from lo / inv_t, then checked), (lo, hi] holds only l(g) when
    l(g + 2^GB) > hi."""
    done = (c_lo - c_hi <= 1) | (_key(hi) - _key(lo) <= 1)
    if GB > 0:
        GRID: tl.constexpr = 1 << GB
        g = (_key(lo / inv_t) >> GB) << GB
        for _ in tl.static_range(2):
            g = tl.where(_l_at(g, inv_t) > lo, g, g + GRID)
        for _ in tl.static_range(2):
            g = tl.where(_l_at(g - GRID, inv_t) > lo, g - GRID, g)
        first = (_l_at(g, inv_t) > lo) & (_l_at(g - GRID, inv_t) <= lo)  # NaN beyond ±inf: not done
        done = done | (first & (_l_at(g + GRID, inv_t) > hi))
    return done


@triton.jit
def _advance(
    phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_x1,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB: tl.constexpr,
):  # fmt: skip
    """Leave the finished searches: phase 0 (top-k) ends when (lo, hi] holds one token or one value a
    token can take (`_is_done`), or when exactly kk tokens lie above lo; then phase 1 (top-p over what
    top-k kept) starts when p < 1 and more than one token is left, else phase 2 (done, thr = lo). Phase 1
    ends the same way.

    Phase 1 starts from (lo, m] narrowed to the top-p bracket the top-k search kept (`_update`): to lo_p
    when M(lo_p) ≥ P and to hi_p when M(hi_p) < P, now that P is known (cond's own test on the sums).

    c_x1 ≥ 0 (a precheck row whose plain draw x1 lies in the top-k set, its top-p test left open; C, M at
    l_x1: c_x1, s_x1): when the top-k search ends, Z_k = M(lo) is known and top-p keeps x1 iff
    M(l_x1) < p · Z_k (its tie group with it): then the row is decided (phase 5); else every token top-p
    keeps has M < p · Z_k ≤ M(l_x1), so lies strictly above l_x1, and the top-p search starts from
    lo = l_x1 (C(lo) = c_x1, M(lo) = s_x1; P and the placement bound a from the top-k set)."""
    done = _is_done(lo, c_lo, hi, c_hi, inv_t, GB)
    if (phase == 0) & (done | (c_lo <= kk)):
        if (p < 1.0) & (c_lo > 1):
            phase = tl.full([], 1, tl.int32)
            hi = m
            c_hi = tl.zeros([], tl.int32)
            s_hi = tl.zeros([], tl.float32)
            kk = tl.full([], 1 << 30, tl.int32)
            P = p * s_lo
            fresh = tl.zeros([], tl.int32)
            # tokens below a hold at most c_lo · exp(a − m) = (1 − p) · s_lo / e: t* lies above a
            a = m + tl.log(s_lo * (1.0 - p) / c_lo.to(tl.float32)) - 1.0
            if c_x1 >= 0:
                keep = s_x1 < P
                phase = tl.where(keep, 5, phase)
                lo = tl.where(keep, lo, l_x1)
                c_lo = tl.where(keep, c_lo, c_x1)
                s_lo = tl.where(keep, s_lo, s_x1)
            up = (lo_p > lo) & (s_lo_p >= P)
            lo = tl.where(up, lo_p, lo)
            c_lo = tl.where(up, c_lo_p, c_lo)
            s_lo = tl.where(up, s_lo_p, s_lo)
            down = (hi_p < hi) & (hi_p > lo) & (s_hi_p < P)
            hi = tl.where(down, hi_p, hi)
            c_hi = tl.where(down, c_hi_p, c_hi)
            s_hi = tl.where(down, s_hi_p, s_hi)
            done = _is_done(lo, c_lo, hi, c_hi, inv_t, GB)
        else:
            phase = tl.full([], 2, tl.int32)
    if (phase == 1) & done:
        phase = tl.full([], 2, tl.int32)
    return phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh


# A row's state: 16 float32 and 16 int32 words in stf[row] and sti[row].
@triton.jit
def _load_state(stf_ptr, sti_ptr, row):
    f = stf_ptr + row * 16
    i = sti_ptr + row * 16
    return (
        tl.load(i), tl.load(f), tl.load(f + 1), tl.load(i + 1), tl.load(f + 2), tl.load(f + 3), tl.load(i + 2),
        tl.load(f + 8), tl.load(f + 4), tl.load(i + 3), tl.load(f + 5), tl.load(i + 4),
    )  # fmt: skip


@triton.jit
def _store_state(stf_ptr, sti_ptr, row, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes):
    """A row's search state: phase (0: top-k search, 1: top-p search, 2: done, 3: no truncation, thr
    −inf; with the precheck, 4: the plain draw x1 to check, 5: done, x1 kept and drawn; 6: served by the
    radix select, its thr and id written there), the row max m,
    (lo, C(lo), M(lo)), (hi, C(hi), M(hi)), the placement bound a, cond's kk and P, and the reads of the
    row so far (`_store_x1`, `_store_open`: the precheck's words; `_store_model`, `_store_pb`: the
    placement's)."""
    f = stf_ptr + row * 16
    i = sti_ptr + row * 16
    tl.store(i, phase)
    tl.store(f, m)
    tl.store(f + 1, lo)
    tl.store(i + 1, c_lo)
    tl.store(f + 2, s_lo)
    tl.store(f + 3, hi)
    tl.store(i + 2, c_hi)
    tl.store(f + 8, s_hi)
    tl.store(f + 4, a)
    tl.store(i + 3, kk)
    tl.store(f + 5, P)
    tl.store(i + 4, passes)


@triton.jit
def _store_model(stf_ptr, sti_ptr, row, fresh, n, g_mu, g_sd, inv_t):
    """What places a search's first pass (`_candidates`): fresh (1: a top-k search's first pass, 2: a
    top-p search's over the whole row, 0: any other pass), the count n of finite values, and the model's
    (g_mu, g_sd): the values' mean and deviation for 1, the top-p estimate and its spread for 2; and the
    row's 1 / T (the values its tokens can take, `_is_done`)."""
    tl.store(sti_ptr + row * 16 + 8, fresh)
    tl.store(sti_ptr + row * 16 + 9, n)
    tl.store(stf_ptr + row * 16 + 9, g_mu)
    tl.store(stf_ptr + row * 16 + 10, g_sd)
    tl.store(stf_ptr + row * 16 + 15, inv_t)


@triton.jit
def _load_model(stf_ptr, sti_ptr, row):
    f = stf_ptr + row * 16
    i = sti_ptr + row * 16
    return tl.load(i + 8), tl.load(i + 9), tl.load(f + 9), tl.load(f + 10), tl.load(f + 15)


@triton.jit
def _store_pb(stf_ptr, sti_ptr, row, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p):
    """The top-p bracket a top-k search narrows for the top-p search after it (`_update`): (lo_p, C, M),
    (hi_p, C, M)."""
    f = stf_ptr + row * 16
    i = sti_ptr + row * 16
    tl.store(f + 11, lo_p)
    tl.store(i + 10, c_lo_p)
    tl.store(f + 12, s_lo_p)
    tl.store(f + 13, hi_p)
    tl.store(i + 11, c_hi_p)
    tl.store(f + 14, s_hi_p)


@triton.jit
def _load_pb(stf_ptr, sti_ptr, row):
    f = stf_ptr + row * 16
    i = sti_ptr + row * 16
    return tl.load(f + 11), tl.load(i + 10), tl.load(f + 12), tl.load(f + 13), tl.load(i + 11), tl.load(f + 14)


@triton.jit
def _store_x1(stf_ptr, sti_ptr, row, x1, l_x1, saved):
    """The precheck's part of a row's state: the plain draw x1, its l, and the search phase a row in
    phase 4 resumes if x1 is not provably kept."""
    tl.store(stf_ptr + row * 16 + 6, l_x1)
    tl.store(sti_ptr + row * 16 + 5, x1)
    tl.store(sti_ptr + row * 16 + 6, saved)


@triton.jit
def _load_x1(stf_ptr, sti_ptr, row):
    return tl.load(sti_ptr + row * 16 + 5), tl.load(stf_ptr + row * 16 + 6), tl.load(sti_ptr + row * 16 + 6)


@triton.jit
def _store_open(stf_ptr, sti_ptr, row, c_x1, s_x1):
    """A row's open top-p test of x1 (`_advance`): C(l_x1) (−1: none, every row but those whose x1
    passed top-k and not the check's top-p test) and M(l_x1)."""
    tl.store(sti_ptr + row * 16 + 7, c_x1)
    tl.store(stf_ptr + row * 16 + 7, s_x1)


@triton.jit
def _load_open(stf_ptr, sti_ptr, row):
    """(C(l_x1), l_x1, M(l_x1)) of a row's open test (`_store_open`; C = −1: none)."""
    return tl.load(sti_ptr + row * 16 + 7), tl.load(stf_ptr + row * 16 + 6), tl.load(stf_ptr + row * 16 + 7)


@triton.jit
def _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row):
    """(1 / T (1 for greedy rows), whether the row truncates, k, p, min_p) of a row."""
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)  # 0: off
    p = tl.load(top_p_ptr + row)  # ≥ 1: off
    min_p = tl.load(min_p_ptr + row)  # 0: off
    active = (temperature != 0.0) & ((k > 0) | (p < 1.0) | (min_p > 0.0))
    inv_t = 1.0 / tl.where(temperature == 0.0, 1.0, temperature)
    return inv_t, active, k, p, min_p


@triton.jit
def _min_p_floor(thr, m, min_p):
    """thr raised to just below max l + log(min_p) (min_p > 0), min-p's strict threshold: every kernel
    that writes a threshold uses this expression, so that min-p cuts where the search's does."""
    if min_p > 0.0:
        thr = tl.maximum(thr, _from_key(_key(m + tl.log(min_p) + 0.0) - 1))
    return thr


@triton.jit
def _qinv(q):
    """z with P(N(0, 1) > z) = q, q in (0, 1) (Abramowitz & Stegun 26.2.23: |error| < 4.5e-4)."""
    r = tl.minimum(tl.maximum(tl.where(q < 0.5, q, 1.0 - q), 1e-30), 0.5)
    t = tl.sqrt(-2.0 * tl.log(r))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(q < 0.5, z, -z)


@triton.jit
def _offsets(i, K):
    """The cluster's offsets u_i, i in [0, K) ascending: 0 for K = 1, else ±0.5, ±1.5, ±3, ±6, ... (K / 2
    each side: dense at the estimate, doubling outwards)."""
    h = K // 2
    r = tl.where(i < h, h - 1 - i, i - h)
    mag = tl.where(r == 0, 0.5, 1.5 * tl.exp2((r - 1).to(tl.float32)))
    return tl.where(K == 1, 0.0, tl.where(i < h, -mag, mag))


@triton.jit
def _mass_center(lo, hi, c_lo, c_hi, s_lo, s_hi, P):
    """The count c* at which M crosses P in (lo, hi], by the bracket's model: C log-linear between
    (lo, C(lo)) and (hi, C(hi) + 1), i.e. a token density ∝ exp(−β x), so a mass density ∝ exp((1 − β) x);
    the mass in (x, hi] is then M(lo) − M(hi) times (e^γ − e^(γ t)) / (e^γ − 1), t = (x − lo) / (hi − lo),
    γ = (1 − β)(hi − lo), set equal to P − M(hi)."""
    l0 = tl.log(c_lo.to(tl.float32))
    l1 = tl.log(c_hi.to(tl.float32) + 1.0)
    gam = tl.minimum(tl.maximum((hi - lo) - (l0 - l1), -60.0), 60.0)
    q = tl.minimum(tl.maximum((P - s_hi) / tl.maximum(s_lo - s_hi, 1e-30), 0.0), 1.0)
    flat = tl.abs(gam) < 1e-3  # a uniform mass density: t = 1 − q
    t = tl.where(flat, 1.0 - q, tl.log(q + (1.0 - q) * tl.exp(gam)) / tl.where(flat, 1.0, gam))
    t = tl.minimum(tl.maximum(t, 0.0), 1.0)
    return tl.exp(l0 + (l1 - l0) * t)


@triton.jit
def _at_counts(lo, hi, c_lo, c_hi, c_star, u):
    """Values in (lo, hi] where C takes the counts c* + σ · u by the bracket's log-linear model of C
    (`_mass_center`), σ = √(j_hi · j_lo / (j_hi + j_lo)), j_hi = c* − C(hi), j_lo = C(lo) − c*: the
    deviation of the c*-th order statistic of the bracket's tokens, in tokens."""
    clo = c_lo.to(tl.float32)
    chi = c_hi.to(tl.float32) + 1.0
    j_hi = tl.maximum(c_star - c_hi.to(tl.float32), 0.5)
    j_lo = tl.maximum(clo - c_star, 0.5)
    c = tl.minimum(tl.maximum(c_star + tl.sqrt(j_hi * j_lo / (j_hi + j_lo)) * u, chi), clo)
    l0 = tl.log(clo)
    return lo + (hi - lo) * ((l0 - tl.log(c)) / tl.maximum(l0 - tl.log(chi), 1e-30))


@triton.jit
def _window(phase, p, hi, hi_p):
    """The top of the values a pass compares with its candidates: hi, and hi_p while a top-k search
    places candidates in the top-p bracket above it (`_candidates`)."""
    return tl.where((phase == 0) & (p < 1.0), tl.maximum(hi, hi_p), hi)


@triton.jit
def _snap(x, inv_t, GB: tl.constexpr):
    """The key of a candidate near x: x's own, or (GB > 0, `_is_done`) the key just below the value
    l(g) a token can take nearest x, so that consecutive candidates at consecutive such values end the
    search with the value between them."""
    if GB > 0:
        g = ((_key(x / inv_t) + (1 << (GB - 1))) >> GB) << GB
        k = _key(_l_at(g, inv_t)) - 1
    else:
        k = _key(x)
    return k


@triton.jit
def _candidates(
    phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """NC candidate keys in [lo, w) (`_window`), where C and M are evaluated next (module docstring,
    "Where the candidates go"): a cluster around an estimate of t*, and NC / 2 guards spread evenly over
    the keys of [max(lo, a), hi) except in a search's first pass. `a`: a lower bound on t* that only
    places them (the invariants hold whatever the candidates are)."""
    G: tl.constexpr = NC // 2
    KP: tl.constexpr = NC // 4
    j = tl.arange(0, NC)
    klo = _key(lo)
    khi = _key(hi)
    g = tl.where(fresh == 0, G, 0)
    kp = tl.where((fresh == 0) & (phase == 0) & (p < 1.0), KP, 0)
    k_main = NC - g - kp
    u = _offsets(j - g, k_main)
    # the search's cluster: counts around c* (top-k: kk; top-p: where M crosses P), by the bracket's model;
    # a first pass by the row's moments instead (`threshold_begin_kernel`)
    kkf = kk.to(tl.float32)
    if fresh == 1:
        nf = n.to(tl.float32)
        x = g_mu + g_sd * _qinv(tl.minimum(tl.maximum(kkf + tl.sqrt(kkf) * u, 0.5), nf - 0.5) / nf)
    elif fresh == 2:
        x = g_mu + g_sd * u
    else:
        c_star = kkf
        if phase == 1:
            c_star = _mass_center(lo, hi, c_lo, c_hi, s_lo, s_hi, P)
        x = _at_counts(lo, hi, c_lo, c_hi, c_star, u)
    k_main = tl.minimum(tl.maximum(tl.maximum(_snap(x, inv_t, GB), _key(a)), klo), khi - 1)
    # the top-p bracket's cluster while top-k searches: around where M crosses p · (M(lo) + M(hi)) / 2
    k_p = k_main
    if kp > 0:
        c_p = _mass_center(lo_p, hi_p, c_lo_p, c_hi_p, s_lo_p, s_hi_p, p * 0.5 * (s_lo + s_hi))
        x_p = _at_counts(lo_p, hi_p, c_lo_p, c_hi_p, c_p, _offsets(j - (NC - kp), kp))
        k_p = tl.maximum(tl.maximum(_snap(x_p, inv_t, GB), _key(lo_p)), klo)
        k_p = tl.minimum(k_p, _key(_window(phase, p, hi, hi_p)) - 1)
    # the guards: whatever the estimates, consecutive candidates lie at most ⌈L / (G + 1)⌉ keys apart
    start = tl.where(a > lo, tl.minimum(_key(a), khi - 1), klo)
    by_key = start + (khi - start) * (j + 1) // (G + 1)
    return tl.where(j < g, by_key, tl.where(j < NC - kp, k_main, k_p))


@triton.jit
def _store_candidates(
    cand_ptr, row, phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """cand[row] = the values of the row's next pass's candidates (`_candidates`), found once per row by
    its per-row program: the pass's programs over the row's chunks read them."""
    keys = _candidates(
        phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC, GB,
    )  # fmt: skip
    tl.store(cand_ptr + row * NC + tl.arange(0, NC), _from_key(keys))


@triton.jit
def _step(
    keys, cnt, mass, vmin, vmax, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_x1,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB: tl.constexpr,
):  # fmt: skip
    """A search pass's end from C and M at its candidates over the whole row: `_update`, then `_advance`
    (the bound a and the first pass's model place one pass only)."""
    conc = (phase == 0) & (p < 1.0)
    lo, c_lo, s_lo, hi, c_hi, s_hi, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _update(
        keys, cnt, mass, vmin, vmax, lo, c_lo, s_lo, hi, c_hi, s_hi, kk, P, p, conc,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p,
    )  # fmt: skip
    a = tl.full([], float("-inf"), tl.float32)
    fresh = tl.zeros([], tl.int32)
    phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh = _advance(
        phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_x1,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB,
    )  # fmt: skip
    return phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p


@triton.jit
def threshold_stats_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, mask_ptr, stride_mask, part_ptr, V,
    NUM_CHUNKS, seed_ptr, rsi_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
    PRECHECK: tl.constexpr = False, TILE: tl.constexpr = 2048, NR: tl.constexpr = 1, FAST_LOG: tl.constexpr = False,
    RADIX: tl.constexpr = False,
):  # fmt: skip
    """Program (b, c): `_chunk_stats` of chunk c of row b into part[b, c, 0:4] and [6:10] and, with
    PRECHECK, the plain sampler's best (value, index) over the chunk into part[b, c, 4:6] (rows that do
    not truncate, and with RADIX rows the radix select served, read nothing)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    inv_t, active, _k, _p, _min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    served, _reads = _radix_served(rsi_ptr, row, RADIX)
    if active & (~served):
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        seed = 0
        if PRECHECK:
            seed = tl.load(seed_ptr + row)
        m, s, lmin, n, g_top, g_arg, u1, u2, w1, w2 = _chunk_stats(
            row_ptr, mask_row_ptr, V, inv_t, seed, c * CHUNK, CHUNK, BLOCK, HAS_MASK, PRECHECK, TILE, NR, FAST_LOG
        )
        out = part_ptr + (row * NUM_CHUNKS + c) * 10
        tl.store(out, m)
        tl.store(out + 1, s)
        tl.store(out + 2, lmin)
        tl.store(out + 3, n.to(tl.float32))  # exact: at most CHUNK ≤ 2^24
        if PRECHECK:
            tl.store(out + 4, g_top)
            tl.store(out + 5, g_arg.to(tl.float32))  # exact: an index below V ≤ 2^24
        tl.store(out + 6, u1)
        tl.store(out + 7, u2)
        tl.store(out + 8, w1)
        tl.store(out + 9, w2)


@triton.jit
def threshold_begin_kernel(
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr, stf_ptr, sti_ptr, cand_ptr, NUM_CHUNKS,
    logits_ptr, stride_row, mask_ptr, stride_mask, V, rsi_ptr, NC: tl.constexpr, GB: tl.constexpr,
    HAS_MASK: tl.constexpr, PRECHECK: tl.constexpr = False, RADIX: tl.constexpr = False,
):  # fmt: skip
    """Program b: row b's statistics from its chunks' (in chunk order), and its search state: every
    finite token kept (lo just below the smallest finite value: C(lo) = n, M(lo) = Z), the first search
    to run, or phase 3 for a row that does not truncate (greedy, no filter, no finite logit), and the
    model its first pass is placed by (`_store_model`): for top-k the values' mean and deviation; for
    top-p over the whole row the mass-weighted values' mean μ_w and deviation σ_w, whose normal quantile
    μ_w + σ_w · Φ⁻¹(1 − p) estimates t* (the mass below t* is (1 − p) · Z), spread by σ_w / 5.

    PRECHECK: also the plain draw x1 (the chunks' best (value, index), the lowest index among equal
    values, combined in chunk order) and l_x1. A row whose kept set is decided here (no top-k or top-p
    search to run: only min-p cuts) takes phase 5 (x1 kept: its id) when l_x1 passes min-p; a row with a
    search to run and x1 within min-p takes phase 4 (`threshold_check_kernel` decides), the search's
    phase saved for it; a row whose x1 fails min-p searches as without the precheck (x1 is not kept).

    RADIX: a row the radix select served takes phase 6 (nothing left to do: the later kernels leave it);
    the reads of a row it left to the search count its own."""
    row = tl.program_id(0)
    inv_t, active, k, p, min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    served, radix_reads = _radix_served(rsi_ptr, row, RADIX)
    active = active & (~served)
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.zeros([], tl.float32)
    lmin = tl.full([], float("inf"), tl.float32)
    n = tl.zeros([], tl.int32)
    u1 = tl.zeros([], tl.float32)
    u2 = tl.zeros([], tl.float32)
    w1 = tl.zeros([], tl.float32)
    w2 = tl.zeros([], tl.float32)
    g_top = tl.full([], float("-inf"), tl.float32)
    x1 = V
    if active:
        for c in range(0, NUM_CHUNKS):
            part = part_ptr + (row * NUM_CHUNKS + c) * 10
            m, z, lmin, n, u1, u2, w1, w2 = _combine_stats(
                m, z, lmin, n, u1, u2, w1, w2, tl.load(part), tl.load(part + 1), tl.load(part + 2),
                tl.load(part + 3).to(tl.int32), tl.load(part + 6), tl.load(part + 7), tl.load(part + 8),
                tl.load(part + 9),
            )  # fmt: skip
            if PRECHECK:
                g_c = tl.load(part + 4)
                better = g_c > g_top  # strict: an earlier chunk (lower indices) keeps a tie
                x1 = tl.where(better, tl.load(part + 5).to(tl.int32), x1)
                g_top = tl.maximum(g_top, g_c)
    lo = _from_key(_key(lmin) - 1)
    kk = tl.where((k > 0) & (k < n), k, n)  # top-k off: its search is over at once (C(lo) = n ≤ kk)
    phase = tl.zeros([], tl.int32)
    hi = m
    c_hi = tl.zeros([], tl.int32)
    s_hi = tl.zeros([], tl.float32)
    a = lo
    P = tl.full([], float("inf"), tl.float32)
    fresh = tl.zeros([], tl.int32)
    none = tl.full([], -1, tl.int32)
    phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh = _advance(
        phase, m, lo, n, z, hi, c_hi, s_hi, a, kk, P, fresh, p, none, lo, z, lo, n, z, m, c_hi, s_hi, inv_t, GB
    )
    phase = tl.where(active & (n > 0), phase, 3)
    nf = tl.maximum(n, 1).to(tl.float32)
    mu = u1 / nf
    zs = tl.where(z > 0.0, z, 1.0)
    mu_w = w1 / zs
    sd_w = tl.sqrt(tl.maximum(w2 / zs - mu_w * mu_w, 0.0))
    fresh = tl.where(phase == 0, 1, tl.where(phase == 1, 2, 0))
    g_mu = tl.where(phase == 0, mu, mu_w + sd_w * _qinv(p))
    g_sd = tl.where(phase == 0, tl.sqrt(tl.maximum(u2 / nf - mu * mu, 0.0)), 0.2 * sd_w)
    zero_c = tl.zeros([], tl.int32)
    zero_s = tl.zeros([], tl.float32)
    _store_model(stf_ptr, sti_ptr, row, fresh, n, g_mu, g_sd, inv_t)
    _store_pb(stf_ptr, sti_ptr, row, lo, c_lo, s_lo, m, zero_c, zero_s)
    if phase < 2:
        _store_candidates(
            cand_ptr, row, phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
            lo, c_lo, s_lo, m, zero_c, zero_s, inv_t, NC, GB,
        )  # fmt: skip
    if PRECHECK:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        # l of x1 with `_scaled`'s arithmetic (the bits the check pass compares with); −inf when x1 = V
        l_x1 = _scaled(row_ptr, mask_row_ptr, x1, V, inv_t, HAS_MASK)
        # min-p keeps l > this (`threshold_finish_kernel`'s own expression)
        log_min_p = tl.log(tl.where(min_p > 0.0, min_p, 1.0))
        minp_ok = (min_p <= 0.0) | (l_x1 > _from_key(_key(m + log_min_p + 0.0) - 1))
        saved = phase
        phase = tl.where((phase == 2) & minp_ok, 5, tl.where((phase < 2) & minp_ok, 4, phase))
        _store_x1(stf_ptr, sti_ptr, row, x1, l_x1, saved)
    _store_open(stf_ptr, sti_ptr, row, none, z)
    phase = tl.where(served, 6, phase)
    _store_state(stf_ptr, sti_ptr, row, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, 1 + radix_reads)


@triton.jit
def threshold_check_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, mask_ptr, stride_mask,
    stf_ptr, sti_ptr, chk_cnt_ptr, chk_mass_ptr, V, NUM_CHUNKS,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, HAS_MASK: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """Program (b, c), for a row in phase 4 (its plain draw x1 to check): over chunk c, C and M at the
    float just below l_x1 and at l_x1, i.e. the count and mass of the values ≥ l_x1 and > l_x1, into
    chk_cnt[b, c, 0:2] and chk_mass[b, c, 0:2] (`_chunk_eval` with the two candidates and (lo, hi] =
    (−inf, max l]: the search passes' sums; other rows do nothing)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    phase, m, _lo, _c_lo, _s_lo, _hi, _c_hi, _s_hi, _a, _kk, _P, _passes = _load_state(stf_ptr, sti_ptr, row)
    if phase == 4:
        _x1, l_x1, _saved = _load_x1(stf_ptr, sti_ptr, row)
        inv_t, _active, _k, _p, _min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        j = tl.arange(0, 2)
        x = tl.where(j == 0, _from_key(_key(l_x1) - 1), l_x1)
        lo = tl.full([], float("-inf"), tl.float32)
        cnt, mass, _vmin, _vmax = _chunk_eval(
            row_ptr, mask_row_ptr, V, inv_t, m, lo, m, m, x, c * CHUNK, CHUNK, BLOCK_E, 2, HAS_MASK, False, UNROLL
        )
        at = (row * NUM_CHUNKS + c) * 2
        tl.store(chk_cnt_ptr + at + j, cnt)
        tl.store(chk_mass_ptr + at + j, mass)


@triton.jit
def threshold_check_reduce_kernel(
    top_p_ptr, stf_ptr, sti_ptr, cand_ptr, chk_cnt_ptr, chk_mass_ptr, NUM_CHUNKS, NC: tl.constexpr,
    GB: tl.constexpr,
):  # fmt: skip
    """Program b, for a row in phase 4: its check from the chunks' sums (in chunk order), C_ge = #{l ≥
    l_x1}, C_gt = C(l_x1), S = M_ge = Σ_{l ≥ l_x1} exp(l − m), M_gt = M(l_x1), and the decision whether the
    plain draw x1 is kept (then the thresholded draw, argmax over the kept set of the same l + g, is x1):

    * top-k search pending (saved phase 0: kk = k < n): x1 passes top-k iff C_gt < kk (its tie group is
      kept whole). Then with top-p off it is kept; with top-p it is kept when M_gt < p · S: every token
      ≥ l_x1 has at most C_gt values above it, so lies in the top-k set, and S ≤ Z_k (a sufficient test;
      its failure decides nothing about top-p).
    * top-p search pending (saved phase 1: top-k cuts nothing, P = p · Z): x1 is kept iff M_gt < P.

    A kept x1 ends the row (phase 5). Otherwise the search runs from its saved phase with its bracket
    narrowed where the check proves it: when cond(l_x1) = C_gt < kk and M_gt < P is false (x1 fails
    top-k, or fails top-p alone), every kept token lies above l_x1: lo = l_x1 (C(lo) = C_gt, M(lo) =
    M_gt); when x1 passes top-k but the top-p test is not met, cond(l_x1) is true in the top-k search:
    hi = l_x1 (C(hi) = C_gt, M(hi) = M_gt), and x1's top-p test stays open (`_store_open`) until the top-k
    search ends and `_advance` decides it with Z_k. A row still searching gets its next candidates
    (`_store_candidates`)."""
    row = tl.program_id(0)
    phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes = _load_state(stf_ptr, sti_ptr, row)
    if phase == 4:
        _x1, l_x1, saved = _load_x1(stf_ptr, sti_ptr, row)
        fresh, n, g_mu, g_sd, inv_t = _load_model(stf_ptr, sti_ptr, row)
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _load_pb(stf_ptr, sti_ptr, row)
        j = tl.arange(0, 2)
        cnt = tl.zeros([2], tl.int32)
        mass = tl.zeros([2], tl.float32)
        for c in range(0, NUM_CHUNKS):
            at = (row * NUM_CHUNKS + c) * 2
            cnt += tl.load(chk_cnt_ptr + at + j)
            mass += tl.load(chk_mass_ptr + at + j)
        c_gt = tl.sum(tl.where(j == 1, cnt, 0), axis=0)
        s_ge = tl.sum(tl.where(j == 0, mass, 0.0), axis=0)
        s_gt = tl.sum(tl.where(j == 1, mass, 0.0), axis=0)
        p = tl.load(top_p_ptr + row)
        topk_ok = c_gt < kk  # phase 1: kk = 2^30, always
        bound = tl.where(saved == 0, p * s_ge, P)
        keep = topk_ok & ((p >= 1.0) | (s_gt < bound))
        definite = (~topk_ok) | (saved == 1)  # x1 fails cond itself, not only the sufficient test
        up = (~keep) & definite
        lo = tl.where(up, l_x1, lo)
        c_lo = tl.where(up, c_gt, c_lo)
        s_lo = tl.where(up, s_gt, s_lo)
        down = (~keep) & (~definite)
        hi = tl.where(down, l_x1, hi)
        c_hi = tl.where(down, c_gt, c_hi)
        s_hi = tl.where(down, s_gt, s_hi)
        phase = tl.where(keep, 5, saved)
        # x1 in the top-k set, its top-p test open until Z_k is known (`_advance`)
        c_x1 = tl.where(down, c_gt, -1)
        phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh = _advance(
            phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_gt,
            lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB,
        )  # fmt: skip
        _store_open(stf_ptr, sti_ptr, row, c_x1, s_gt)
        _store_model(stf_ptr, sti_ptr, row, fresh, n, g_mu, g_sd, inv_t)
        _store_state(stf_ptr, sti_ptr, row, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes + 1)
        if phase < 2:
            _store_candidates(
                cand_ptr, row, phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
                lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC, GB,
            )  # fmt: skip


@triton.jit
def threshold_pass_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, mask_ptr, stride_mask,
    stf_ptr, sti_ptr, cand_ptr, cnt_ptr, mass_ptr, vmm_ptr, V, NUM_CHUNKS,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, NC: tl.constexpr, HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    """Program (b, c): C and M at row b's NC candidates (cand[b], `_store_candidates`) over chunk c, and
    the smallest and largest value in (lo, hi] there, into cnt[b, c], mass[b, c], vmm[b, c] (rows whose
    search is over do nothing)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    phase, m, lo, _c_lo, _s_lo, hi, _c_hi, _s_hi, _a, _kk, _P, _passes = _load_state(stf_ptr, sti_ptr, row)
    if phase < 2:
        inv_t, _active, _k, p, _min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
        hi_p = tl.load(stf_ptr + row * 16 + 13)  # `_store_pb`
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        x = tl.load(cand_ptr + row * NC + tl.arange(0, NC))
        w = _window(phase, p, hi, hi_p)
        cnt, mass, vmin, vmax = _chunk_eval(
            row_ptr, mask_row_ptr, V, inv_t, m, lo, hi, w, x, c * CHUNK, CHUNK, BLOCK_E, NC, HAS_MASK, SKIP, UNROLL
        )
        j = tl.arange(0, NC)
        at = (row * NUM_CHUNKS + c) * NC
        tl.store(cnt_ptr + at + j, cnt)
        tl.store(mass_ptr + at + j, mass)
        tl.store(vmm_ptr + (row * NUM_CHUNKS + c) * 2, vmin)
        tl.store(vmm_ptr + (row * NUM_CHUNKS + c) * 2 + 1, vmax)


@triton.jit
def threshold_reduce_kernel(
    top_p_ptr, stf_ptr, sti_ptr, cand_ptr, cnt_ptr, mass_ptr, vmm_ptr, NUM_CHUNKS, NC: tl.constexpr,
    GB: tl.constexpr,
):  # fmt: skip
    """Program b: row b's pass from its chunks' partials, summed in chunk order, then `_step`, and the
    candidates of the row's next pass (`_store_candidates`)."""
    row = tl.program_id(0)
    phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes = _load_state(stf_ptr, sti_ptr, row)
    if phase < 2:
        p = tl.load(top_p_ptr + row)
        fresh, n, g_mu, g_sd, inv_t = _load_model(stf_ptr, sti_ptr, row)
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _load_pb(stf_ptr, sti_ptr, row)
        j = tl.arange(0, NC)
        keys = _key(tl.load(cand_ptr + row * NC + j))
        cnt = tl.zeros([NC], tl.int32)
        mass = tl.zeros([NC], tl.float32)
        vmin = tl.full([], float("inf"), tl.float32)
        vmax = tl.full([], float("-inf"), tl.float32)
        for c in range(0, NUM_CHUNKS):
            at = row * NUM_CHUNKS + c
            cnt += tl.load(cnt_ptr + at * NC + j)
            mass += tl.load(mass_ptr + at * NC + j)
            vmin = tl.minimum(vmin, tl.load(vmm_ptr + at * 2))
            vmax = tl.maximum(vmax, tl.load(vmm_ptr + at * 2 + 1))
        c_x1, l_x1, s_x1 = _load_open(stf_ptr, sti_ptr, row)
        phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _step(
            keys, cnt, mass, vmin, vmax, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1,
            s_x1, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB,
        )  # fmt: skip
        _store_model(stf_ptr, sti_ptr, row, fresh, n, g_mu, g_sd, inv_t)
        _store_pb(stf_ptr, sti_ptr, row, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p)
        _store_state(stf_ptr, sti_ptr, row, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes + 1)
        if phase < 2:
            _store_candidates(
                cand_ptr, row, phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
                lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC, GB,
            )  # fmt: skip


@triton.jit
def threshold_finish_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, mask_ptr, stride_mask,
    stf_ptr, sti_ptr, thr_ptr, passes_ptr, V, NUM_CHUNKS, ids_ptr,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, NC: tl.constexpr, HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
    UNROLL: tl.constexpr, GB: tl.constexpr, PRECHECK: tl.constexpr = False,
):  # fmt: skip
    """Program b: the passes row b's search still needs, each over the whole row by this one program
    (the same sums, chunk by chunk in chunk order, as the split passes make), then thr[b] (min-p applied)
    and the reads of the row it took. PRECHECK: ids[b] = x1 for a row whose plain draw is kept (phase 5;
    thr[b] then lies just below l_x1: {l > thr} = {l ≥ l_x1} is a subset of the kept set that holds x1, so
    a draw over it is x1 too), −1 for the others."""
    row = tl.program_id(0)
    phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, passes = _load_state(stf_ptr, sti_ptr, row)
    inv_t, _active, _k, p, min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    fresh, n, g_mu, g_sd, _inv_t = _load_model(stf_ptr, sti_ptr, row)
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _load_pb(stf_ptr, sti_ptr, row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
    c_x1, l_x1, s_x1 = _load_open(stf_ptr, sti_ptr, row)
    while phase < 2:
        keys = _candidates(
            phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
            lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC, GB,
        )  # fmt: skip
        x = _from_key(keys)
        w = _window(phase, p, hi, hi_p)
        cnt = tl.zeros([NC], tl.int32)
        mass = tl.zeros([NC], tl.float32)
        vmin = tl.full([], float("inf"), tl.float32)
        vmax = tl.full([], float("-inf"), tl.float32)
        for c in range(0, NUM_CHUNKS):
            cnt_c, mass_c, vmin_c, vmax_c = _chunk_eval(
                row_ptr, mask_row_ptr, V, inv_t, m, lo, hi, w, x, c * CHUNK, CHUNK, BLOCK_E, NC, HAS_MASK, SKIP,
                UNROLL,
            )  # fmt: skip
            cnt += cnt_c
            mass += mass_c
            vmin = tl.minimum(vmin, vmin_c)
            vmax = tl.maximum(vmax, vmax_c)
        phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _step(
            keys, cnt, mass, vmin, vmax, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1,
            s_x1, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB,
        )  # fmt: skip
        passes += 1
    if phase != 6:  # a row the radix select served has its thr, id and reads
        thr = lo
        if PRECHECK:
            x1, l_x1, _saved = _load_x1(stf_ptr, sti_ptr, row)
            thr = tl.where(phase == 5, _from_key(_key(l_x1) - 1), thr)
            tl.store(ids_ptr + row, tl.where(phase == 5, x1, -1))
        thr = _min_p_floor(thr, m, min_p)
        thr = tl.where(phase == 3, float("-inf"), thr)
        tl.store(thr_ptr + row, thr)
        tl.store(passes_ptr + row, tl.where(phase == 3, 0, passes))


# The radix select for top-k rows (module docstring, "Radix select"). A row's radix state is 8 int32 words
# in rsi[row] and 2 float32 in rsf[row]: rsi[0] the mode (0: the search serves the row, from the start or
# as a fallback; 1: select, R2 to run; 2: gather, G to run; 3: exact, thr from the bucket; 4: served, thr
# and id written; 5: no finite value), [1] the rank of the k-th largest within R1's bin, [2] that bin,
# [3] the count above the bin (then above the bucket), [4] the bucket, [5] G's write position, [6] the
# reads of the row; rsf[0] max l, rsf[1] the gather edge t_e.


@triton.jit
def _radix_digits(z):
    """The high and low bytes of the bucket of float32 z (never −0.0): the top 16 bits of its order key
    u, the bits read as an unsigned integer that orders as the floats compare (the sign bit flipped for
    z ≥ 0, every bit for z < 0). z ↦ bucket is monotone; a bf16 value is alone in its bucket (its float32
    bits end in 16 zeros), fp16 values share one by up to 8, float32 values by up to 2^16."""
    b = z.to(tl.int32, bitcast=True)
    u = tl.where(b >= 0, b ^ -2147483648, ~b)
    return (u >> 24) & 255, (u >> 16) & 255


@triton.jit
def _bucket_float(bucket, low):
    """The float32 whose order key (`_radix_digits`) is bucket · 2^16 + low: low = 0 gives the bucket's
    smallest float; the bucket of a bf16 value v gives v back with low = 0 (v ≥ 0) or 2^16 − 1 (v < 0)."""
    u = (bucket << 16) | low
    b = tl.where(u < 0, u ^ -2147483648, ~u)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _exact_only(p, EXACT: tl.constexpr):
    """Whether a top-k row's threshold may be the k-th value itself, read off its bucket: bf16 logits
    (EXACT: a bucket holds one value) and top-p off (no mass to sum over the top-k set)."""
    if EXACT:
        return p >= 1.0
    else:
        return p > float("inf")


@triton.jit
def _radix_serves(active, k, p, CAP: tl.constexpr, EXACT: tl.constexpr):
    """Whether a row takes the radix select: it truncates with top-k, and k ≤ CAP (its top-k set may fit
    the candidate buffer) or its threshold is the k-th value itself (`_exact_only`)."""
    return active & (k > 0) & ((k <= CAP) | _exact_only(p, EXACT))


@triton.jit
def _radix_served(rsi_ptr, row, RADIX: tl.constexpr):
    """Whether the radix select served the row (its thr, id and reads written: the search leaves it),
    and the reads of the row it made (0 without RADIX)."""
    if RADIX:
        return tl.load(rsi_ptr + row * 8) == 4, tl.load(rsi_ptr + row * 8 + 6)
    else:
        return row < 0, tl.zeros([], tl.int32)


@triton.jit
def radix_hist_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, mask_ptr, stride_mask, rsi_ptr,
    hist_ptr, cmax_ptr, V, NUM_CHUNKS, CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
    CAP: tl.constexpr, EXACT: tl.constexpr, FIRST: tl.constexpr,
):  # fmt: skip
    """Program (b, c): a histogram over 256 bins of chunk c of row b into hist[b, c]. FIRST (R1, rows
    `_radix_serves` takes): the high byte of each finite l's bucket (`_radix_digits`, of the logit z:
    l = z · (1 / T) is monotone in z), and the chunk's largest l into cmax[b, c]; else (R2, rows in mode
    1): the low byte of those whose high byte is the row's bin. The values left out (past V, disallowed
    by the bitmask, l = −inf, another bin) are masked off the histogram (on the GPU they skip its
    shared-memory atomic add, so R2 adds only the values of the row's bin)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    inv_t, active, k, p, _min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    if FIRST:
        go = _radix_serves(active, k, p, CAP, EXACT)
        b_sel = tl.zeros([], tl.int32)
    else:
        go = tl.load(rsi_ptr + row * 8) == 1
        b_sel = tl.load(rsi_ptr + row * 8 + 2)
    if go:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        hist = tl.zeros([256], tl.int32)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            z, valid = _loaded(row_ptr, mask_row_ptr, start + tl.arange(0, BLOCK), V, HAS_MASK)
            sl = z * inv_t + 0.0  # `_scaled`
            valid = valid & (sl > float("-inf"))
            hi, lo = _radix_digits(z + 0.0)
            if FIRST:
                digit = hi
                top = tl.maximum(top, sl)
            else:
                valid = valid & (hi == b_sel)
                digit = lo
            hist += tl.histogram(digit, 256, mask=valid)
        tl.store(hist_ptr + (row * NUM_CHUNKS + c) * 256 + tl.arange(0, 256), hist)
        if FIRST:
            tl.store(cmax_ptr + row * NUM_CHUNKS + c, tl.max(top, axis=0))


@triton.jit
def _row_hist(hist_ptr, row, NUM_CHUNKS):
    """A row's histogram: its chunks' summed (integers: any order gives the same)."""
    bins = tl.arange(0, 256)
    h = tl.zeros([256], tl.int32)
    for c in range(0, NUM_CHUNKS):
        h += tl.load(hist_ptr + (row * NUM_CHUNKS + c) * 256 + bins)
    return h


@triton.jit
def _digit_of_rank(h, rank):
    """The digit d whose bin holds the rank-th largest value (rank ≥ 1) by the histogram h of the
    digits: the largest d with #{digits ≥ d} ≥ rank; and the counts above d and at d."""
    bins = tl.arange(0, 256)
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    d = tl.max(tl.where(at_or_above >= rank, bins, -1), axis=0)
    return d, tl.sum(tl.where(bins > d, h, 0), axis=0), tl.sum(tl.where(bins == d, h, 0), axis=0)


@triton.jit
def radix_select_kernel(
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, rsi_ptr, rsf_ptr, hist_ptr, cmax_ptr, NUM_CHUNKS,
    CAP: tl.constexpr, EXACT: tl.constexpr, FIRST: tl.constexpr,
):  # fmt: skip
    """Program b, after R1 (FIRST) or R2 over its chunks. FIRST: every row's radix state: a row the radix
    select takes gets n (its finite values), k' = min(k, n), the bin of the k'-th largest value, its rank
    within the bin and the count above it (mode 1, one read), or mode 5 when n = 0; the others mode 0.
    Else, for a row in mode 1: the bucket of the k'-th largest value and the count C_ge of the values in
    it and above; the row is gathered (mode 2: C_ge ≤ CAP, the buffer holds them; its counter zeroed and
    its gather edge t_e = l of the bucket's smallest float), or served by its bucket (mode 3,
    `_exact_only`), or left to the search (mode 0)."""
    row = tl.program_id(0)
    inv_t, active, k, p, _min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    st = rsi_ptr + row * 8
    if FIRST:
        mode = tl.zeros([], tl.int32)
        if _radix_serves(active, k, p, CAP, EXACT):
            h = _row_hist(hist_ptr, row, NUM_CHUNKS)
            m = tl.full([], float("-inf"), tl.float32)
            for c in range(0, NUM_CHUNKS):
                m = tl.maximum(m, tl.load(cmax_ptr + row * NUM_CHUNKS + c))
            n = tl.sum(h, axis=0)
            kk = tl.minimum(k, n)
            b, above, _in_b = _digit_of_rank(h, kk)
            mode = tl.where(n > 0, 1, 5)
            tl.store(st + 1, kk - above)
            tl.store(st + 2, b)
            tl.store(st + 3, above)
            tl.store(rsf_ptr + row * 2, m)
        tl.store(st, mode)
        tl.store(st + 6, tl.where(mode > 0, 1, 0))
    else:
        if tl.load(st) == 1:
            h = _row_hist(hist_ptr, row, NUM_CHUNKS)
            d, above, in_d = _digit_of_rank(h, tl.load(st + 1))
            above += tl.load(st + 3)
            bucket = tl.load(st + 2) * 256 + d
            mode = tl.where(above + in_d <= CAP, 2, tl.where(_exact_only(p, EXACT), 3, 0))
            tl.store(st, mode)
            tl.store(st + 3, above)
            tl.store(st + 4, bucket)
            tl.store(st + 5, 0)
            tl.store(st + 6, 2)
            tl.store(rsf_ptr + row * 2 + 1, _bucket_float(bucket, 0) * inv_t + 0.0)


@triton.jit
def _cand_key(sl, idx):
    """A candidate's sort key, an int64 > 0: l's order key above 30 bits of reversed index, so that the
    keys in descending order are l descending, then the index ascending (indices below 2^30)."""
    return ((_key(sl) + 2147483648) << 30) | (1073741823 - idx)


@triton.jit
def _cand_unkey(key):
    """(l, index) of a sort key (`_cand_key`)."""
    return _from_key((key >> 30) - 2147483648), (1073741823 - (key & 1073741823)).to(tl.int32)


@triton.jit
def radix_gather_kernel(
    logits_ptr, stride_row, temperature_ptr, mask_ptr, stride_mask, rsi_ptr, rsf_ptr, buf_ptr, V,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    """Program (b, c), for a row in mode 2: every l ≥ t_e of chunk c (the values of the buckets from the
    k-th largest's up, and any value whose l ties with t_e: an upper set of l) appended to buf[b] as sort
    keys (`_cand_key`) at positions from the row's counter, one atomic add per block that holds some; past
    CAP they are counted, not written. The order of the writes varies from run to run; the sort that
    reads them does not."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(rsi_ptr + row * 8) == 2:
        inv_t = 1.0 / tl.load(temperature_ptr + row)  # `_params`' (T > 0 here)
        t_e = tl.load(rsf_ptr + row * 2 + 1)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            sl = _scaled(row_ptr, mask_row_ptr, offs, V, inv_t, HAS_MASK)
            take = ((sl >= t_e) & (sl > float("-inf"))).to(tl.int32)
            n_take = tl.sum(take, axis=0)
            if n_take > 0:
                at = tl.atomic_add(rsi_ptr + row * 8 + 5, n_take) + tl.cumsum(take, axis=0) - 1
                tl.store(buf_ptr + row * CAP + at, _cand_key(sl, offs), mask=(take > 0) & (at < CAP))


@triton.jit
def _radix_pick(buf_ptr, row, n_c, k, p, min_p, CAP: tl.constexpr):
    """The threshold from a row's n_c ≤ CAP candidates (every value with l ≥ t_e: an upper set of the
    row's values holding its top-k set), sorted by (l descending, index ascending): t_k the min(k, n_c)-th
    largest l, Z_k = Σ exp(l − m) over the top-k set summed in that order, top-p keeps the sorted
    positions j whose mass before j is < p · Z_k (a prefix: positions up to the first whose inclusive
    mass is ≥ p · Z_k) with their tie groups, min-p by `_min_p_floor`. Returns thr (just below the
    smallest kept value, so {l > thr} is the kept set), the candidates' indices and which are kept."""
    j = tl.arange(0, CAP)
    key = tl.sort(tl.load(buf_ptr + row * CAP + j, mask=j < n_c, other=-1), descending=True)
    sl, idx = _cand_unkey(key)
    valid = j < n_c
    m = tl.max(tl.where(valid, sl, float("-inf")), axis=0)
    t_k = tl.min(tl.where(j < tl.minimum(k, n_c), sl, float("inf")), axis=0)
    top = valid & (sl >= t_k)
    e = tl.where(top, tl.exp2((sl - m) * 1.4426950408889634), 0.0)
    mass = tl.cumsum(e, axis=0)  # inclusive, in sorted order
    last = tl.sum((top & (mass < p * tl.max(mass, axis=0))).to(tl.int32), axis=0)  # the last kept position
    t_p = tl.min(tl.where(top & (j <= last), sl, float("inf")), axis=0)
    thr = _from_key(_key(tl.where(p < 1.0, t_p, t_k)) - 1)
    thr = _min_p_floor(thr, m, min_p)
    return thr, idx, valid & (sl > thr)


@triton.jit
def radix_finish_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, rsi_ptr, rsf_ptr,
    buf_ptr, thr_ptr, ids_ptr, passes_ptr, V, CAP: tl.constexpr, EXACT: tl.constexpr, DRAW: tl.constexpr,
    TILE: tl.constexpr = 2048, FAST_LOG: tl.constexpr = False,
):  # fmt: skip
    """Program b: row b's threshold when the radix select serves it, then mode 4 (served) and thr[b],
    passes[b] (its reads: R1, R2, and G when gathered). Gathered (mode 2) with at most CAP candidates:
    `_radix_pick`, and with DRAW the row's id drawn from its kept candidates, the thresholded draw's
    Gumbel-max with its noise, arithmetic and lowest-index rule (`best_thresholded`): every token with
    l > thr is a candidate, so it is the id that draw gives (ids[b]; the draw skips the row). More than
    CAP (ties in l with t_e beyond what R2 counted): served by the bucket if `_exact_only`, else left to
    the search (mode 0). By the bucket (mode 3): thr just below l of the bucket's one value, min-p by m;
    the draw draws. No finite value (mode 5): thr = −inf, as the search gives. With DRAW ids[b] = −1 for
    every row not drawn here."""
    row = tl.program_id(0)
    inv_t, _active, k, p, min_p = _params(temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row)
    st = rsi_ptr + row * 8
    mode = tl.load(st)
    reads = tl.load(st + 6)
    m = tl.load(rsf_ptr + row * 2)
    thr = tl.full([], float("-inf"), tl.float32)
    drawn = tl.full([], -1, tl.int32)
    if mode == 2:
        reads += 1
        n_c = tl.load(st + 5)
        if n_c <= CAP:
            thr, idx, kept = _radix_pick(buf_ptr, row, n_c, k, p, min_p, CAP)
            if DRAW:
                row_ptr = logits_ptr + row.to(tl.int64) * stride_row
                z = tl.load(row_ptr + idx, mask=kept, other=float("-inf")).to(tl.float32)
                _g, drawn = best_thresholded(z, idx, kept, inv_t, tl.load(seed_ptr + row), V, TILE, FAST_LOG)
            mode = tl.full([], 4, tl.int32)
        else:
            mode = tl.where(_exact_only(p, EXACT), 3, 0)
    if mode == 3:
        bucket = tl.load(st + 4)
        z_k = _bucket_float(bucket, tl.where(bucket >= 32768, 0, 65535))
        thr = _min_p_floor(_from_key(_key(z_k * inv_t + 0.0) - 1), m, min_p)
        mode = tl.full([], 4, tl.int32)
    if mode == 5:
        mode = tl.full([], 4, tl.int32)
    if mode == 4:
        tl.store(thr_ptr + row, thr)
        tl.store(passes_ptr + row, reads)
    if DRAW:
        tl.store(ids_ptr + row, drawn)
    tl.store(st, mode)
    tl.store(st + 6, reads)


_BLOCK = 1024  # logits per iteration of the statistics
_BLOCK_E = 128  # logits per iteration of a search pass (its partials: BLOCK_E × NC counts and masses)
_CHUNK = 8192  # a row's chunk per program of the split passes: fixed, so that a row's sums never depend on B
_NC = 4  # candidates per search pass: fastest on the H200 at batch 256 (perf.md §5, `--sweep`)
_SKIP = False
_UNROLL = 1
_SPLIT_PASSES = 10
_CAP = 256  # candidates a row's radix gather holds (a power of two: the per-row sort's length)
RADIX = True  # the radix select's default (False: the bisection search)
# the radix select's histograms leave values out by a mask (Triton 3.4 on); without it the search serves every row
_HISTOGRAM_MASK = "mask" in inspect.signature(tl.histogram).parameters
# the search-pass layouts `bench_top_p_sampling.py --sweep` times (and the sm_90 compile test builds):
# candidates × lanes × skip, and two blocks per iteration for the larger candidate counts
SEARCH_LAYOUTS = [
    dict(candidates=nc, block_e=be, skip=skip, unroll=1) for nc in (4, 8, 16) for be in (128, 256) for skip in (0, 1)
] + [dict(candidates=nc, block_e=be, skip=1, unroll=2) for nc in (8, 16) for be in (128, 256)]


def truncation_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    candidates: int = _NC,
    split_passes: int = _SPLIT_PASSES,
    chunk: int = _CHUNK,
    block_e: int = _BLOCK_E,
    skip: bool = _SKIP,
    unroll: int = _UNROLL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's strict threshold on l = z · (1 / T): the kept set is {i : l_i > thr} (module docstring).

    A fixed sequence of launches whatever the data (graph-capturable, no host synchronisation): the
    statistics over rows × chunks and their reduction, `split_passes` search passes over rows × chunks
    (each a launch over the chunks and a reduction per row; rows already done return at once), then
    one program per row for the passes its search still needs (usually none) and the threshold.

    Args:
        logits: [B, V], any float dtype; row-contiguous.
        temperature: [B] float32 (0: greedy, no truncation); top_k: [B] int32 (0: off);
        top_p: [B] float32 in (0, 1] (1: off); min_p: [B] float32 in [0, 1] (0: off).
        bitmask: [B, ceil(V / 32)] int32 or None, as in `sample_greedy_or_gumbel`.
        candidates: thresholds tried per search pass (NC: an even power of two); more cut the passes and
            cost more compares per logit.
        split_passes: search passes spread over rows × chunks before the per-row programs take over.
        chunk: logits per program of the split launches (a multiple of 1,024 or a power of two); the
            sums a row's search compares depend on it, never on the batch.
        block_e: logits per iteration of a search pass (a power of two; capped at the chunk): the lanes
            whose partial sums the pass keeps, BLOCK_E × NC of each per program. The masses' rounding
            depends on it (as on chunk and candidates), never on the batch.
        skip: a search pass skips the candidate compares of an iteration without values in (lo, hi]
            (the same sums either way).
        unroll: 1 or 2 blocks of block_e logits loaded per iteration of a search pass (the same sums
            either way; capped so that the chunk holds a whole number of iterations).

    Returns:
        thr [B] float32, and passes [B] int32: the reads of each row the search made (0: none, the row
        does not truncate).
    """
    thr, passes, _ids = truncation_plan(
        logits, temperature, None, top_k, top_p, min_p, bitmask, precheck=False, candidates=candidates,
        split_passes=split_passes, chunk=chunk, block_e=block_e, skip=skip, unroll=unroll, radix=False,
    )  # fmt: skip
    return thr, passes


def truncation_plan(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor | None,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    precheck: bool = True,
    candidates: int = _NC,
    split_passes: int = _SPLIT_PASSES,
    chunk: int = _CHUNK,
    block_e: int = _BLOCK_E,
    skip: bool = _SKIP,
    unroll: int = _UNROLL,
    radix: bool | None = None,
    cap: int = _CAP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What `sample_top_k_top_p` draws from: each row's threshold, and with `precheck` the rows whose id
    is already known (module docstring, "The plain draw first").

    precheck (needs `seeds`, [B] int64, the draw's): the statistics also find the plain sampler's id x1
    (its Gumbel-max over every token with the same noise); one check pass over rows × chunks then counts
    the values and the mass ≥ and > l_x1, and a row whose x1 is provably kept ends there: the draw over
    the kept set is x1. The other rows search as without the precheck, from a bracket the check narrowed
    where it proves it; a top-k + top-p row whose x1 passes top-k is decided when its top-k search ends
    (x1 kept, or the top-p search from l_x1). Launches: statistics, begin, check, check reduce, the split
    passes, finish, whatever the data. Without `precheck` and `radix` the launches and results are
    `truncation_thresholds`'.

    radix: the top-k rows go to the radix select first (module docstring, "Radix select"; None: the
        module's RADIX, read at the call, so a timing run can set it): two histogram
    passes and a gather over rows × chunks, each followed by one program per row; a row it serves has
    its exact threshold, and with `seeds` its id drawn from the gathered candidates (the thresholded
    draw's id), and the search's launches leave it; the others (top_k 0, k > cap with top-p, a tie group
    beyond `cap`) go on to the precheck and the search as without it. Six launches more, whatever the data.
    cap: the candidates a row's gather holds (a power of two ≥ 16). The radix select needs
    `tl.histogram`'s mask (Triton 3.4 on): with an older Triton it is off.

    Returns:
        thr [B] float32: the kept set is {i : l_i > thr}, except for a row decided by the precheck, whose
        thr lies just below l_x1 (a subset of its kept set that holds x1: a draw over it gives x1 too);
        passes [B] int32: the reads of each row (radix passes, statistics, check, search passes; 0: none);
        ids [B] int32 with precheck, or radix with seeds, else None: the id of a row decided (by the
        precheck, or drawn by the radix select), −1 for a row still to draw.
    """
    B, V = logits.shape
    if candidates < 2 or candidates & (candidates - 1):
        raise ValueError(f"candidates must be a power of two ≥ 2, got {candidates}")
    if block_e < 16 or block_e & (block_e - 1):
        raise ValueError(f"block_e must be a power of two ≥ 16, got {block_e}")
    block = min(_BLOCK, triton.next_power_of_2(chunk))
    if chunk % block:
        raise ValueError(f"chunk must be a multiple of {block}, got {chunk}")
    block_e = min(block_e, block)  # a power of two dividing block, so the chunk too
    if unroll not in (1, 2):
        raise ValueError(f"unroll must be 1 or 2, got {unroll}")
    if precheck and seeds is None:
        raise ValueError("precheck needs the draw's seeds")
    if cap < 16 or cap & (cap - 1):
        raise ValueError(f"cap must be a power of two ≥ 16, got {cap}")
    unroll = min(unroll, chunk // block_e)
    radix = (RADIX if radix is None else radix) and _HISTOGRAM_MASK
    dev = logits.device
    thr = torch.empty(B, dtype=torch.float32, device=dev)
    passes = torch.empty(B, dtype=torch.int32, device=dev)
    ids = torch.empty(B, dtype=torch.int32, device=dev) if precheck or (radix and seeds is not None) else None
    if not B:
        return thr, passes, ids
    S = triton.cdiv(V, chunk)
    stf = torch.empty(B, 16, dtype=torch.float32, device=dev)  # the row states (`_store_state`)
    sti = torch.empty(B, 16, dtype=torch.int32, device=dev)
    part = torch.empty(B, S, 10, dtype=torch.float32, device=dev)
    cand = torch.empty(B, candidates, dtype=torch.float32, device=dev)  # each row's next candidates
    mask = temperature if bitmask is None else bitmask  # never read without HAS_MASK
    stride_mask = 0 if bitmask is None else bitmask.stride(0)
    params = (temperature, top_k, top_p, min_p)
    consts = dict(CHUNK=chunk, HAS_MASK=bitmask is not None)
    # one lane per thread in a search pass (the split passes and the per-row programs alike: the same sums)
    search = dict(NC=candidates, BLOCK_E=block_e, SKIP=skip, UNROLL=unroll, **consts)
    # the logits' dtype: its values read as float32 have keys that are multiples of 2^gb (`_is_done`)
    gb = max(0, 23 + round(math.log2(torch.finfo(logits.dtype).eps)))
    search["num_warps"] = min(8, max(1, block_e // 32))
    # the plain draw in the statistics: a block of `block` logits spans NR quarters of the sampler's tile
    # (one Philox call per lane serves them, as in the sampler)
    tile = sampling_tile()
    rsi = passes  # the radix state (`radix_select_kernel`); never read without RADIX
    if radix:
        rsi = radix_select(logits, params, seeds, mask, stride_mask, thr, passes, ids, S, block, cap, consts)
    draw = dict(PRECHECK=precheck, TILE=tile, NR=max(1, block // (tile // 4)), FAST_LOG=logits.is_cuda)
    threshold_stats_kernel[(B, S)](
        logits, logits.stride(0), *params, mask, stride_mask, part, V, S, seeds if precheck else part, rsi,
        BLOCK=block, RADIX=radix, **consts, **draw, num_warps=8,
    )  # fmt: skip
    threshold_begin_kernel[(B,)](
        *params, part, stf, sti, cand, S, logits, logits.stride(0), mask, stride_mask, V, rsi, NC=candidates, GB=gb,
        HAS_MASK=bitmask is not None, PRECHECK=precheck, RADIX=radix, num_warps=1,
    )  # fmt: skip
    if precheck:
        chk_cnt = torch.empty(B, S, 2, dtype=torch.int32, device=dev)
        chk_mass = torch.empty(B, S, 2, dtype=torch.float32, device=dev)
        threshold_check_kernel[(B, S)](
            logits, logits.stride(0), *params, mask, stride_mask, stf, sti, chk_cnt, chk_mass, V, S,
            BLOCK_E=block_e, UNROLL=unroll, **consts, num_warps=search["num_warps"],
        )  # fmt: skip
        threshold_check_reduce_kernel[(B,)](
            top_p, stf, sti, cand, chk_cnt, chk_mass, S, NC=candidates, GB=gb, num_warps=1
        )
    if split_passes:
        cnt = torch.empty(B, S, candidates, dtype=torch.int32, device=dev)
        mass = torch.empty(B, S, candidates, dtype=torch.float32, device=dev)
        vmm = torch.empty(B, S, 2, dtype=torch.float32, device=dev)
        for _ in range(split_passes):
            threshold_pass_kernel[(B, S)](
                logits, logits.stride(0), *params, mask, stride_mask, stf, sti, cand, cnt, mass, vmm, V, S,
                **search,
            )  # fmt: skip
            threshold_reduce_kernel[(B,)](top_p, stf, sti, cand, cnt, mass, vmm, S, NC=candidates, GB=gb, num_warps=1)
    threshold_finish_kernel[(B,)](
        logits, logits.stride(0), *params, mask, stride_mask, stf, sti, thr, passes, V, S,
        passes if ids is None else ids, GB=gb, PRECHECK=precheck, **search,
    )  # fmt: skip
    return thr, passes, ids


def radix_select(
    logits: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    seeds: torch.Tensor | None,
    mask: torch.Tensor,
    stride_mask: int,
    thr: torch.Tensor,
    passes: torch.Tensor,
    ids: torch.Tensor | None,
    num_chunks: int,
    block: int,
    cap: int,
    consts: dict,
) -> torch.Tensor:
    """The radix select's six launches (module docstring, "Radix select"), `truncation_plan`'s first: R1
    and R2 over rows × chunks, each followed by one program per row, the gather over rows × chunks, and
    one program per row that writes thr[b], passes[b] (and with `seeds` ids[b]: the row's id, or −1) for
    each row it serves. Returns the rows' radix state (rsi), whose mode tells the search's kernels which
    rows are left to them."""
    B, V = logits.shape
    dev = logits.device
    rsi = torch.empty(B, 8, dtype=torch.int32, device=dev)
    rsf = torch.empty(B, 2, dtype=torch.float32, device=dev)
    hist = torch.empty(B, num_chunks, 256, dtype=torch.int32, device=dev)
    cmax = torch.empty(B, num_chunks, dtype=torch.float32, device=dev)
    buf = torch.empty(B, cap, dtype=torch.int64, device=dev)
    exact = logits.dtype == torch.bfloat16  # a bucket holds one value (`_exact_only`)
    rows = dict(CAP=cap, EXACT=exact)
    chunks = dict(BLOCK=block, **consts)
    for first in (True, False):
        radix_hist_kernel[(B, num_chunks)](
            logits, logits.stride(0), *params, mask, stride_mask, rsi, hist, cmax, V, num_chunks, FIRST=first,
            **rows, **chunks, num_warps=4,
        )  # fmt: skip
        radix_select_kernel[(B,)](*params, rsi, rsf, hist, cmax, num_chunks, FIRST=first, **rows, num_warps=2)
    radix_gather_kernel[(B, num_chunks)](
        logits, logits.stride(0), params[0], mask, stride_mask, rsi, rsf, buf, V, CAP=cap, **chunks, num_warps=4
    )
    draw = seeds is not None
    radix_finish_kernel[(B,)](
        logits, logits.stride(0), *params, seeds if draw else rsi, rsi, rsf, buf, thr, ids if draw else rsi,
        passes, V, DRAW=draw, TILE=sampling_tile(), FAST_LOG=logits.is_cuda, **rows, num_warps=4,
    )  # fmt: skip
    return rsi


def sample_top_k_top_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    out: torch.Tensor | None = None,
    host_out: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    splits: int | None = None,
    precheck: bool = True,
    radix: bool | None = None,
) -> torch.Tensor:
    """One id per row from softmax(z / T) truncated by top-k, top-p and min-p (module docstring),
    with the fused kernel's seeded Gumbel-max noise: the same (logits, parameters, seed) gives the same
    id whatever the batch. No host synchronisation: graph-capturable like `sample_greedy_or_gumbel`.

    Args:
        logits: [B, V], any float dtype (made row-contiguous if needed).
        temperature, top_k, top_p, min_p, bitmask: as in `truncation_thresholds`; seeds: [B] int64.
        out, host_out, splits: as in `sample_greedy_or_gumbel`.
        precheck: draw the plain id first and keep it where it is provably kept (`truncation_plan`; the
            same ids, the search and the draw's read skipped for those rows); False: search every row.
        radix: the top-k rows the radix select serves take it (`truncation_plan`: the same ids, in three
            reads of the row); False: the precheck and the search for every row; None: the module's RADIX.

    Returns:
        The sampled ids [B] int64 (`out`).
    """
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
    ):
        if t.dtype != dtype or t.shape != (B,):
            raise ValueError(f"{name} must be [{B}] {dtype}, got {tuple(t.shape)} {t.dtype}")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape != (B, (V + 31) // 32)):
        raise ValueError(f"bitmask must be [{B}, {(V + 31) // 32}] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask is not None and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    thr, _, ids = truncation_plan(
        logits, temperature, seeds, top_k, top_p, min_p, bitmask, precheck=precheck, radix=radix
    )
    return sample_greedy_or_gumbel(
        logits, temperature, seeds, out=out, splits=splits, host_out=host_out, bitmask=bitmask, thresholds=thr,
        decided=ids,
    )  # fmt: skip
