"""The threshold search's kernels: the statistics, the precheck of the plain draw, the split search
passes with their per-row reductions and the per-row finish (launched as plan.py's docstring, "Launches",
describes); and a row's search state between them.

Finding thr, each pass a streaming read of the row:

1. m = max l, Z = Σ exp(l − m) (online), the smallest finite value, the count n of finite values, and
   the moments Σ l, Σ l², Σ l · exp(l − m), Σ l² · exp(l − m) (they place the first search pass);
2. top-k, then top-p: a search over x keeping cond(lo) false and cond(hi) true, cond(x) = C(x) < k and
   M(x) < P (top-k: P = ∞; top-p: k = ∞, P = p · Z_k). A pass evaluates C and M at NC candidates in
   [lo, hi) ("Where the candidates go", placement.py) and the smallest and largest values in (lo, hi]; lo and
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.top_p_sampling.bracket import advance as _advance
from tinyvllm.kernels.top_p_sampling.bracket import step as _step
from tinyvllm.kernels.top_p_sampling.chunks import chunk_eval as _chunk_eval
from tinyvllm.kernels.top_p_sampling.chunks import chunk_stats as _chunk_stats
from tinyvllm.kernels.top_p_sampling.chunks import combine_stats as _combine_stats
from tinyvllm.kernels.top_p_sampling.placement import candidates as _candidates
from tinyvllm.kernels.top_p_sampling.placement import qinv as _qinv
from tinyvllm.kernels.top_p_sampling.placement import store_candidates as _store_candidates
from tinyvllm.kernels.top_p_sampling.placement import window as _window
from tinyvllm.kernels.top_p_sampling.radix import radix_served as _radix_served
from tinyvllm.kernels.top_p_sampling.row import from_key as _from_key
from tinyvllm.kernels.top_p_sampling.row import key as _key
from tinyvllm.kernels.top_p_sampling.row import min_p_floor as _min_p_floor
from tinyvllm.kernels.top_p_sampling.row import params as _params
from tinyvllm.kernels.top_p_sampling.row import scaled as _scaled


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
    row's 1 / T (the values its tokens can take, bracket.py `_is_done`)."""
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
    """The top-p bracket a top-k search narrows for the top-p search after it (bracket.py `_update`):
    (lo_p, C, M), (hi_p, C, M)."""
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
