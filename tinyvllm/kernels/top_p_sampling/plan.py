"""The truncating sampler's launches: `truncation_plan` (the radix select, the precheck and the search,
a fixed sequence) and `truncation_thresholds` (the search alone), and their defaults.

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
"""

from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.sampling import sampling_tile
from tinyvllm.kernels.top_p_sampling.radix import radix_select
from tinyvllm.kernels.top_p_sampling.search import (
    threshold_begin_kernel,
    threshold_check_kernel,
    threshold_check_reduce_kernel,
    threshold_finish_kernel,
    threshold_pass_kernel,
    threshold_reduce_kernel,
    threshold_stats_kernel,
)

_BLOCK = 1024  # logits per iteration of the statistics
_BLOCK_E = 128  # logits per iteration of a search pass (its partials: BLOCK_E × NC counts and masses)
_CHUNK = 8192  # a row's chunk per program of the split passes: fixed, so that a row's sums never depend on B
_NC = 4  # candidates per search pass: fastest on the H200 at batch 256 (perf.md §5, `--sweep`)
_SKIP = False
_UNROLL = 1
_SPLIT_PASSES = 10
_CAP = 256  # candidates a row's radix gather holds (a power of two: the per-row sort's length)
# the radix select's default (False: the bisection search), read by `truncation_plan` at each call: set it here
RADIX = True
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
    """Each row's strict threshold on l = z · (1 / T): the kept set is {i : l_i > thr}
    (the package's docstring).

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
    is already known (search.py's docstring, "The plain draw first").

    precheck (needs `seeds`, [B] int64, the draw's): the statistics also find the plain sampler's id x1
    (its Gumbel-max over every token with the same noise); one check pass over rows × chunks then counts
    the values and the mass ≥ and > l_x1, and a row whose x1 is provably kept ends there: the draw over
    the kept set is x1. The other rows search as without the precheck, from a bracket the check narrowed
    where it proves it; a top-k + top-p row whose x1 passes top-k is decided when its top-k search ends
    (x1 kept, or the top-p search from l_x1). Launches: statistics, begin, check, check reduce, the split
    passes, finish, whatever the data. Without `precheck` and `radix` the launches and results are
    `truncation_thresholds`'.

    radix: the top-k rows go to the radix select first (radix.py's docstring; None: this module's RADIX,
        read at the call, so a timing run can set it): two histogram
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
    stf = torch.empty(B, 16, dtype=torch.float32, device=dev)  # the row states (search.py `_store_state`)
    sti = torch.empty(B, 16, dtype=torch.int32, device=dev)
    part = torch.empty(B, S, 10, dtype=torch.float32, device=dev)
    cand = torch.empty(B, candidates, dtype=torch.float32, device=dev)  # each row's next candidates
    mask = temperature if bitmask is None else bitmask  # never read without HAS_MASK
    stride_mask = 0 if bitmask is None else bitmask.stride(0)
    params = (temperature, top_k, top_p, min_p)
    consts = dict(CHUNK=chunk, HAS_MASK=bitmask is not None)
    # one lane per thread in a search pass (the split passes and the per-row programs alike: the same sums)
    search = dict(NC=candidates, BLOCK_E=block_e, SKIP=skip, UNROLL=unroll, **consts)
    # the logits' dtype: its values read as float32 have keys that are multiples of 2^gb (bracket.py `_is_done`)
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
