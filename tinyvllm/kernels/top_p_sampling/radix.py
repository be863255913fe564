"""The radix select: a top-k row's threshold, and its id, in three reads of the row, ahead of the search.

Radix select: the top-k rows first (`truncation_plan(radix=True)`; plan.py `RADIX`, on by default:
faster than the search end to end, docs/perf.md §5). Isolating the k-th value among 128k by counts takes
the search several passes; a radix select finds it in two, then reads the row once more for the few
values it keeps:

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

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.sampling import best_thresholded, sampling_tile
from tinyvllm.kernels.top_p_sampling.row import from_key as _from_key
from tinyvllm.kernels.top_p_sampling.row import key as _key
from tinyvllm.kernels.top_p_sampling.row import loaded as _loaded
from tinyvllm.kernels.top_p_sampling.row import min_p_floor as _min_p_floor
from tinyvllm.kernels.top_p_sampling.row import params as _params
from tinyvllm.kernels.top_p_sampling.row import scaled as _scaled

# The radix select for top-k rows (module docstring). A row's radix state is 8 int32 words in rsi[row]
# and 2 float32 in rsf[row]: rsi[0] the mode (0: the search serves the row, from the start or
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
def radix_served(rsi_ptr, row, RADIX: tl.constexpr):
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
    """The radix select's six launches (module docstring), `truncation_plan`'s first: R1 and R2 over
    rows × chunks, each followed by one program per row, the gather over rows × chunks, and one program
    per row that writes thr[b], passes[b] (and with `seeds` ids[b]: the row's id, or −1) for each row it
    serves. Returns the rows' radix state (rsi), whose mode tells the search's kernels which
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
