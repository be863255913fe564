"""Where a search pass's candidates go (`candidates`), and the bound on a search's passes that follows.

Where the candidates go. A pass costs a read of the row whatever it finds, so the candidates go where t*
most likely lies, estimated from what the row state knows; only the number of passes depends on it, not
the kept set (any candidates in [lo, w) keep the invariants, chunks.py `chunk_eval`). With u_i = ±0.5,
±1.5, ±3, ±6, ... (dense at the estimate, doubling outwards, so that an estimate that is off still
brackets t* closely), and each of these candidates moved to just below the nearest value a token can take
(bf16, fp16: consecutive candidates at consecutive such values end the search):

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.top_p_sampling.row import from_key as _from_key
from tinyvllm.kernels.top_p_sampling.row import key as _key
from tinyvllm.kernels.top_p_sampling.row import l_at as _l_at


@triton.jit
def qinv(q):
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
def window(phase, p, hi, hi_p):
    """The top of the values a pass compares with its candidates: hi, and hi_p while a top-k search
    places candidates in the top-p bracket above it (`candidates`)."""
    return tl.where((phase == 0) & (p < 1.0), tl.maximum(hi, hi_p), hi)


@triton.jit
def _snap(x, inv_t, GB: tl.constexpr):
    """The key of a candidate near x: x's own, or (GB > 0, bracket.py `_is_done`) the key just below the
    value l(g) a token can take nearest x, so that consecutive candidates at consecutive such values end
    the search with the value between them."""
    if GB > 0:
        g = ((_key(x / inv_t) + (1 << (GB - 1))) >> GB) << GB
        k = _key(_l_at(g, inv_t)) - 1
    else:
        k = _key(x)
    return k


@triton.jit
def candidates(
    phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """NC candidate keys in [lo, w) (`window`), where C and M are evaluated next (module docstring): a
    cluster around an estimate of t*, and NC / 2 guards spread evenly over the keys of [max(lo, a), hi)
    except in a search's first pass. `a`: a lower bound on t* that only
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
        x = g_mu + g_sd * qinv(tl.minimum(tl.maximum(kkf + tl.sqrt(kkf) * u, 0.5), nf - 0.5) / nf)
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
        k_p = tl.minimum(k_p, _key(window(phase, p, hi, hi_p)) - 1)
    # the guards: whatever the estimates, consecutive candidates lie at most ⌈L / (G + 1)⌉ keys apart
    start = tl.where(a > lo, tl.minimum(_key(a), khi - 1), klo)
    by_key = start + (khi - start) * (j + 1) // (G + 1)
    return tl.where(j < g, by_key, tl.where(j < NC - kp, k_main, k_p))


@triton.jit
def store_candidates(
    cand_ptr, row, phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """cand[row] = the values of the row's next pass's candidates (`candidates`), found once per row by
    its per-row program: the pass's programs over the row's chunks read them."""
    keys = candidates(
        phase, fresh, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, p, n, g_mu, g_sd,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, NC, GB,
    )  # fmt: skip
    tl.store(cand_ptr + row * NC + tl.arange(0, NC), _from_key(keys))
