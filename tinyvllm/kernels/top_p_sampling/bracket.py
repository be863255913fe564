"""A search pass's end: C and M at its candidates move the bracket (lo, hi] (`_update`), and a search
that has isolated t* ends and starts the next (`advance`); `step` is both (search.py's docstring,
"Finding thr", item 2; the open top-p test of the plain draw x1, "The plain draw first").
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.top_p_sampling.row import from_key as _from_key
from tinyvllm.kernels.top_p_sampling.row import key as _key
from tinyvllm.kernels.top_p_sampling.row import l_at as _l_at


@triton.jit
def _at_key(keys, vals, k, empty):
    """The value of `vals` at the lane whose key is k (the smallest such; `empty` when none)."""
    return tl.min(tl.where(keys == k, vals, empty), axis=0)


@triton.jit
def _update(
    keys, cnt, mass, vmin, vmax, lo, c_lo, s_lo, hi, c_hi, s_hi, kk, P, p, conc,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p,
):  # fmt: skip
    """One search pass's step from C and M at the candidates `keys` over the whole row (search.py's
    docstring, "Finding thr"): lo and hi move to the tightest candidates where cond(x) = C(x) < kk and
    M(x) < P is false and true, then past the gaps without values to just below vmin and to vmax.

    conc (a top-k search with top-p to follow): the top-p bracket (lo_p, hi_p] moves too. Top-p's P =
    p · Z_k is not known yet, but Z_k = M(t_k) lies in [M(hi), M(lo)] of the top-k bracket, so a candidate
    with M ≥ p · M(lo) has M ≥ P (top-p's cond false: lo_p) and one with M < p · M(hi) has M < P (true:
    hi_p). `advance` checks both ends against P once it is known."""
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
def advance(
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


@triton.jit
def step(
    keys, cnt, mass, vmin, vmax, phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_x1,
    lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB: tl.constexpr,
):  # fmt: skip
    """A search pass's end from C and M at its candidates over the whole row: `_update`, then `advance`
    (the bound a and the first pass's model place one pass only)."""
    conc = (phase == 0) & (p < 1.0)
    lo, c_lo, s_lo, hi, c_hi, s_hi, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p = _update(
        keys, cnt, mass, vmin, vmax, lo, c_lo, s_lo, hi, c_hi, s_hi, kk, P, p, conc,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p,
    )  # fmt: skip
    a = tl.full([], float("-inf"), tl.float32)
    fresh = tl.zeros([], tl.int32)
    phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh = advance(
        phase, m, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, p, c_x1, l_x1, s_x1,
        lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p, inv_t, GB,
    )  # fmt: skip
    return phase, lo, c_lo, s_lo, hi, c_hi, s_hi, a, kk, P, fresh, lo_p, c_lo_p, s_lo_p, hi_p, c_hi_p, s_hi_p
