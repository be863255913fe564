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

Finding thr (`truncation_threshold_kernel`, one program per row), each pass a streaming read of the row:

1. m = max l, Z = Σ exp(l − m) (online), the smallest finite value and the count of finite values;
2. top-k, then top-p: a search over x keeping cond(lo) false and cond(hi) true, cond(x) = C(x) < k and
   M(x) < P (top-k: P = ∞; top-p: k = ∞, P = p · Z_k). A pass evaluates C and M at NC candidates in
   (lo, hi), half spread evenly over the values and half evenly over the float32 bit patterns read as
   ordered integers (so that each pass cuts the interval of representable floats by (NC/2 + 1)× at
   least, whatever the spread of the values), and the smallest and largest values in (lo, hi]; lo and hi
   move to the tightest candidates, then to the values themselves. The search ends when (lo, hi] holds
   one token or one representable float: then t* is the only value in it and thr = lo. Ties at t* are
   found when (lo, hi] shrinks to that one float: at most ⌈32 / log2(NC/2 + 1)⌉ passes.
3. min-p: thr ≥ the float just below max l + log(min_p).

Then the fused Gumbel-max pass (kernels/sampling.py, HAS_THR) draws argmax_{i ∈ K} (l_i + g_i) with
each index's seeded noise g_i: the same ids as the plain fused kernel when K holds every finite token,
and the same id for a row alone or anywhere in any batch.

Cost at B × V: 1 + passes(top-k) + passes(top-p) reads of each row by the search (the row is re-read
while it sits in L2 at moderate batch) plus one read by the draw; each search pass does O(NC) compares
and adds per logit. Masses are float32 sums, so a row whose top-p boundary lies within float32
rounding (~1e-6 relative) of p may keep one token more or fewer than an exact computation would, as
the full sampler's float32 cumsum may.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.sampling import allowed_by, sample_greedy_or_gumbel

_LOG2E = 1.4426950408889634


@triton.jit
def _key(x):
    """The float32 x as an int64 that orders as the floats do (−0.0 and +0.0 apart; callers add 0.0 first)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _from_key(k):
    """The inverse of `_key`."""
    b = k.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(row_ptr, mask_row_ptr, offs, V, inv_t, HAS_MASK: tl.constexpr):
    """l = z · inv_t at `offs` (float32; −inf past V and where the bitmask disallows), −0.0 made +0.0."""
    valid = offs < V
    if HAS_MASK:
        valid = valid & allowed_by(mask_row_ptr, offs, valid)
    z = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return z * inv_t + 0.0


@triton.jit
def _row_stats(row_ptr, mask_row_ptr, V, inv_t, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """(max l, Σ exp(l − max l), smallest finite l, count of finite l) of one row, in one read (sl: l)."""
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK], tl.float32)
    lo_i = tl.full([BLOCK], float("inf"), tl.float32)
    n_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        sl = _scaled(row_ptr, mask_row_ptr, start + tl.arange(0, BLOCK), V, inv_t, HAS_MASK)
        finite = sl > float("-inf")
        m_new = tl.maximum(m_i, sl)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # lanes still at −inf keep a zero sum, no NaN
        s_i = s_i * tl.exp2((m_i - m_safe) * 1.4426950408889634) + tl.exp2((sl - m_safe) * 1.4426950408889634)
        m_i = m_new
        lo_i = tl.minimum(lo_i, tl.where(finite, sl, float("inf")))
        n_i += finite.to(tl.int32)
    m = tl.max(m_i, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    s = tl.sum(s_i * tl.exp2((m_i - m_safe) * 1.4426950408889634), axis=0)
    return m, s, tl.min(lo_i, axis=0), tl.sum(n_i, axis=0)


@triton.jit
def _candidates(lo, hi, a, NC: tl.constexpr):
    """NC candidate keys in [max(lo, a), hi) (mostly strictly inside (lo, hi)): the first half spread
    evenly over the values, the second evenly over the keys. `a`: a lower bound on t* that only places
    them (the invariants hold whatever it is)."""
    HALF: tl.constexpr = NC // 2
    klo = _key(lo)
    khi = _key(hi)
    start = tl.where(a > lo, tl.minimum(_key(a), khi - 1), klo)
    j = tl.arange(0, NC)
    by_key = start + (khi - start) * ((j % HALF) + 1) // (HALF + 1)
    x0 = _from_key(start)
    x0 = tl.where(x0 > float("-inf"), x0, hi)  # no value spread from −inf: the key half serves
    x_val = x0 + (hi - x0) * (((j % HALF) + 1).to(tl.float32) / (HALF + 1))
    ok = (x_val > x0) & (x_val < hi)  # not NaN, not ±inf, strictly inside
    by_val = tl.where(ok, _key(x_val + 0.0), by_key)
    return tl.where(j < HALF, by_val, by_key)


@triton.jit
def _search(
    row_ptr,
    mask_row_ptr,
    V,
    inv_t,
    m,
    lo,
    c_lo,
    s_lo,
    hi,
    c_hi,
    a,
    k,
    P,
    passes,
    BLOCK: tl.constexpr,
    NC: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """The threshold thr with {l > thr} = {l ≥ t*} for cond(x) = C(x) < k and M(x) < P (module
    docstring), given cond(lo) false and cond(hi) true, with c_lo = C(lo), s_lo = M(lo), c_hi = C(hi).
    Returns (thr, C(thr), M(thr), passes + the passes it made)."""
    done = (c_lo - c_hi <= 1) | (_key(hi) - _key(lo) <= 1)
    while not done:
        keys = _candidates(lo, hi, a, NC)
        x = _from_key(keys)
        cnt = tl.zeros([NC], tl.int32)
        mass = tl.zeros([NC], tl.float32)
        vmin = tl.full([BLOCK], float("inf"), tl.float32)
        vmax = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            sl = _scaled(row_ptr, mask_row_ptr, start + tl.arange(0, BLOCK), V, inv_t, HAS_MASK)
            e = tl.exp2((sl - m) * 1.4426950408889634)
            gt = sl[:, None] > x[None, :]
            cnt += tl.sum(gt.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(gt, e[:, None], 0.0), axis=0)
            inside = (sl > lo) & (sl <= hi)
            vmin = tl.minimum(vmin, tl.where(inside, sl, float("inf")))
            vmax = tl.maximum(vmax, tl.where(inside, sl, float("-inf")))
        vmin_r = tl.min(vmin, axis=0)
        vmax_r = tl.max(vmax, axis=0)
        cond = (cnt < k) & (mass < P)
        # lo: the largest candidate where cond is false (cond is monotone in x); hi: the smallest true one
        klo = tl.maximum(tl.max(tl.where(cond, -(1 << 40), keys), axis=0), _key(lo))
        khi = tl.minimum(tl.min(tl.where(cond, keys, 1 << 40), axis=0), _key(hi))
        new_lo = klo > _key(lo)
        new_hi = khi < _key(hi)
        c_lo = tl.where(new_lo, tl.min(tl.where(keys == klo, cnt, 1 << 30), axis=0), c_lo)
        s_lo = tl.where(new_lo, tl.min(tl.where(keys == klo, mass, float("inf")), axis=0), s_lo)
        c_hi = tl.where(new_hi, tl.min(tl.where(keys == khi, cnt, 1 << 30), axis=0), c_hi)
        # No value lies in (old lo, vmin) nor in (vmax, old hi]: move lo up to just below vmin and hi
        # down to vmax when they are tighter; C and M do not change across a gap without values.
        kmin = _key(vmin_r) - 1
        kmax = _key(vmax_r)
        klo = tl.maximum(klo, kmin)
        khi = tl.minimum(khi, kmax)
        lo = _from_key(klo)
        hi = _from_key(khi)
        passes += 1
        a = tl.full([], float("-inf"), tl.float32)  # the bound places the first pass only: a wrong one costs one pass
        done = (c_lo - c_hi <= 1) | (khi - klo <= 1)
    return lo, c_lo, s_lo, passes


@triton.jit
def truncation_threshold_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    mask_ptr,
    stride_mask,
    thr_ptr,
    passes_ptr,
    V,
    BLOCK: tl.constexpr,
    NC: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Program b: thr[b] with kept set {i : l_i > thr[b]} (module docstring), and the passes over the
    row it took. Greedy rows (T = 0), rows without a filter (k = 0, p ≥ 1, min_p = 0: nothing read) and
    rows without a finite logit get −inf."""
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)  # 0: off
    p = tl.load(top_p_ptr + row)  # ≥ 1: off
    min_p = tl.load(min_p_ptr + row)  # 0: off
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
    # tensors, not constants: the branches and the search's loop carry them
    thr = tl.full([], float("-inf"), tl.float32)
    passes = tl.zeros([], tl.int32)
    filtered = (k > 0) | (p < 1.0) | (min_p > 0.0)
    if (temperature != 0.0) & filtered:
        m, z, lmin, n = _row_stats(row_ptr, mask_row_ptr, V, inv_t, BLOCK, HAS_MASK)
        passes += 1
        none_above_m = tl.zeros([], tl.int32)
        if n > 0:
            # thr = just below the smallest finite value keeps every finite token: C = n, M = Z
            lo = _from_key(_key(lmin) - 1)
            c_lo = n
            s_lo = z
            if (k > 0) & (k < n):
                lo, c_lo, s_lo, passes = _search(
                    row_ptr, mask_row_ptr, V, inv_t, m, lo, c_lo, s_lo, m, none_above_m, lo, k, float("inf"), passes,
                    BLOCK, NC, HAS_MASK,
                )  # fmt: skip
            if (p < 1.0) & (c_lo > 1):
                # tokens below a hold at most c_lo · exp(a − m) = (1 − p) · s_lo / e: t* lies above a
                a = m + tl.log(s_lo * (1.0 - p) / c_lo.to(tl.float32)) - 1.0
                lo, c_lo, s_lo, passes = _search(
                    row_ptr, mask_row_ptr, V, inv_t, m, lo, c_lo, s_lo, m, none_above_m, a, 1 << 30, p * s_lo, passes,
                    BLOCK, NC, HAS_MASK,
                )  # fmt: skip
            thr = lo
            if min_p > 0.0:
                thr = tl.maximum(thr, _from_key(_key(m + tl.log(min_p) + 0.0) - 1))
    tl.store(thr_ptr + row, thr)
    tl.store(passes_ptr + row, passes)


_BLOCK = 1024
_NC = 8


def truncation_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    candidates: int = _NC,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's strict threshold on l = z · (1 / T): the kept set is {i : l_i > thr} (module docstring).

    Args:
        logits: [B, V], any float dtype; row-contiguous.
        temperature: [B] float32 (0: greedy, no truncation); top_k: [B] int32 (0: off);
        top_p: [B] float32 in (0, 1] (1: off); min_p: [B] float32 in [0, 1] (0: off).
        bitmask: [B, ceil(V / 32)] int32 or None, as in `sample_greedy_or_gumbel`.
        candidates: thresholds tried per search pass (NC: an even power of two); more cut the passes and
            cost more compares per logit.

    Returns:
        thr [B] float32, and passes [B] int32: the reads of each row the search made (for benchmarks).
    """
    B, V = logits.shape
    if candidates < 2 or candidates & (candidates - 1):
        raise ValueError(f"candidates must be a power of two ≥ 2, got {candidates}")
    thr = torch.empty(B, dtype=torch.float32, device=logits.device)
    passes = torch.empty(B, dtype=torch.int32, device=logits.device)
    if B:
        truncation_threshold_kernel[(B,)](
            logits,
            logits.stride(0),
            temperature,
            top_k,
            top_p,
            min_p,
            temperature if bitmask is None else bitmask,  # never read without HAS_MASK
            0 if bitmask is None else bitmask.stride(0),
            thr,
            passes,
            V,
            BLOCK=min(_BLOCK, triton.next_power_of_2(V)),
            NC=candidates,
            HAS_MASK=bitmask is not None,
            num_warps=8,
        )
    return thr, passes


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
) -> torch.Tensor:
    """One id per row from softmax(z / T) truncated by top-k, top-p and min-p (module docstring),
    with the fused kernel's seeded Gumbel-max noise: the same (logits, parameters, seed) gives the same
    id whatever the batch. No host synchronisation: graph-capturable like `sample_greedy_or_gumbel`.

    Args:
        logits: [B, V], any float dtype (made row-contiguous if needed).
        temperature, top_k, top_p, min_p, bitmask: as in `truncation_thresholds`; seeds: [B] int64.
        out, host_out, splits: as in `sample_greedy_or_gumbel`.

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
    thr, _ = truncation_thresholds(logits, temperature, top_k, top_p, min_p, bitmask)
    return sample_greedy_or_gumbel(
        logits, temperature, seeds, out=out, splits=splits, host_out=host_out, bitmask=bitmask, thresholds=thr
    )
