"""Fused greedy / temperature sampling on the device: one pass over each row of logits.

Row b with temperature T_b:
  * T_b == 0: the greedy token argmax_i z_i;
  * T_b > 0: the Gumbel-max trick, argmax_i (z_i / T_b + g_i) with g_i = −log(−log u_i) and u_i uniform
    from Philox keyed by (seed_b, i). This draws exactly from softmax(z / T_b) (Gumbel 1954; Maddison et
    al. 2014), without normalising, sorting or writing probabilities.
Ties resolve to the lowest index. Reads B·V logits once and writes B ids. With per-row thresholds
(HAS_THR, from kernels/top_p_sampling/) the argmax runs over the tokens whose scaled logit exceeds the
row's threshold: top-k / top-p / min-p sampling with the same noise. The torch sampler handles the rows
that need penalties, logit_bias or logprobs.

With a token bitmask (structured outputs: xgrammar's packed int32 rows, [B, ceil(V / 32)], token i
allowed iff bit i % 32 of word i // 32 is set) a disallowed token's value is −inf before the argmax, so
the draw is from softmax(z / T) restricted to the allowed tokens. The bitmask is a compiled variant
(HAS_MASK): a launch without one runs the kernel it ran before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tinyvllm.kernels.launch import num_sms


@triton.jit
def log2(x, FAST: tl.constexpr):
    """log2(x); on the GPU the SFU's lg2.approx (relative error ~2^-22, ample for sampling noise),
    accurate log2 under the interpreter, which has no libdevice."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def allowed_by(mask_row_ptr, offs, valid):
    """Whether the packed bitmask row at `mask_row_ptr` allows each token index of `offs` (where `valid`)."""
    words = tl.load(mask_row_ptr + (offs >> 5), mask=valid, other=0)
    return ((words >> (offs & 31)) & 1) != 0


@triton.jit
def thresholded_gumbel(z, inv_t, u, FAST_LOG: tl.constexpr):
    """The value the thresholded draw (HAS_THR) maximises for a logit z and its uniform u: z · inv_t −
    ln 2 · log2(−log2 u) (Gumbel noise up to a constant), the product z · inv_t rounded first (the
    threshold test compares it) and the noise's product fused into the subtraction, written as one
    explicit fma so that every kernel computing it gets the same bits, whatever its compiler would
    contract (top_p_sampling/ draws rows with it outside this kernel)."""
    return tl.fma(log2(-log2(u, FAST_LOG), FAST_LOG), -0.6931471805599453, z * inv_t)


@triton.jit
def best_thresholded(z, offs, valid, inv_t, seed, V, TILE: tl.constexpr, FAST_LOG: tl.constexpr):
    """(value, index) the thresholded draw (HAS_THR) finds among the logits z [BLOCK] (float32) at indices
    `offs` where `valid` (tokens above the row's threshold), for a row of 1 / T = inv_t > 0 and `seed`: the
    same noise (`noise_at`) and arithmetic (`thresholded_gumbel`), the lowest index among equal values,
    (−inf, V) when none is valid."""
    u = tl.maximum(noise_at(seed, offs, TILE), 1e-20)
    g = tl.where(valid, thresholded_gumbel(z, inv_t, u, FAST_LOG), float("-inf"))
    top = tl.max(g, axis=0)
    return top, tl.min(tl.where(g == top, offs, V), axis=0)


@triton.jit
def _best_of_quarter(
    row_ptr,
    q_start,
    end,
    noise,
    inv_t,
    greedy,
    best_val,
    best_idx,
    mask_row_ptr,
    thr,
    QUARTER: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_THR: tl.constexpr,
):
    """Fold indices [q_start, q_start + QUARTER) into the running per-lane best (strict >: a lane
    keeps its earliest index on ties, and quarters arrive in index order). With HAS_MASK, only the
    indices the bitmask row allows; with HAS_THR, only those whose scaled logit z · inv_t exceeds `thr`
    (the truncation threshold of top_p_sampling/, computed there with the same arithmetic)."""
    offs = q_start + tl.arange(0, QUARTER)
    mask = offs < end
    if HAS_MASK:
        mask = mask & allowed_by(mask_row_ptr, offs, mask)
    z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_THR:
        mask = mask & (z * inv_t > thr)
    if not greedy:
        u = tl.maximum(noise, 1e-20)  # rand is in [0, 1): keep the logarithms finite
        if HAS_THR:
            z = thresholded_gumbel(z, inv_t, u, FAST_LOG)
        else:
            # Gumbel noise −ln(−ln u) = −ln 2 · log2(−log2 u) − ln(ln 2); the constant never moves an argmax.
            z = z * inv_t - 0.6931471805599453 * log2(-log2(u, FAST_LOG), FAST_LOG)
    z = tl.where(mask, z, float("-inf"))
    better = z > best_val
    return tl.where(better, z, best_val), tl.where(better, offs, best_idx)


@triton.jit
def noise_at(seed, offs, TILE: tl.constexpr):
    """The uniform draw of logits index `offs` [BLOCK] for `seed`, the one `sample_partial_kernel` (tiles of
    TILE = its BLOCK) gives it: quarter q of rand4x(seed, tile start / 4 + lane) for the index at
    tile start + q·TILE/4 + lane. For kernels that meet the logits in other blocks (the LM head's, gemv.py)."""
    QUARTER: tl.constexpr = TILE // 4
    start = (offs // TILE) * TILE
    r = offs - start
    n0, n1, n2, n3 = tl.rand4x(seed, start // 4 + r % QUARTER)
    q = r // QUARTER
    return tl.where(q == 0, n0, tl.where(q == 1, n1, tl.where(q == 2, n2, n3)))


@triton.jit
def best_of_block(z, offs, valid, temperature, seed, V, TILE: tl.constexpr, FAST_LOG: tl.constexpr):
    """(value, index) that the sampler's partial kernel would find among the logits z [BLOCK] (float32)
    at indices `offs` (where `valid`) for a row of `temperature` and `seed`: the same noise and
    arithmetic, the lowest index among equal values, (−inf, V) when none is valid."""
    if temperature != 0.0:
        u = tl.maximum(noise_at(seed, offs, TILE), 1e-20)
        z = z * (1.0 / temperature) - 0.6931471805599453 * log2(-log2(u, FAST_LOG), FAST_LOG)
    z = tl.where(valid, z, float("-inf"))
    top = tl.max(z, axis=0)
    return top, tl.min(tl.where(z == top, offs, V), axis=0)


@triton.jit(do_not_specialize=["CHUNK", "NUM_SPLITS"])  # one compile whatever the batch
def sample_partial_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    seed_ptr,
    val_ptr,
    idx_ptr,
    mask_ptr,
    stride_mask,
    thr_ptr,
    V,
    CHUNK,
    NUM_SPLITS,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_THR: tl.constexpr = False,
    ids_ptr=None,
    HAS_IDS: tl.constexpr = False,
):
    """Program (row, split): the best (value, index) among indices [split·CHUNK, (split+1)·CHUNK).

    A tile of BLOCK indices takes its noise from one Philox call per lane: `rand4x` keyed by
    (seed, tile start / 4 + lane) gives four uniforms, one for each quarter of the tile. Tiles start
    at multiples of BLOCK whatever the split count, so every index always gets the same noise.
    HAS_IDS: a row whose ids[row] ≥ 0 reads nothing; its split 0 offers (+inf, ids[row]) and the others
    (−inf, V), so the reduce picks that id."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    mask_row_ptr = mask_ptr + row.to(tl.int64) * stride_mask
    thr = float("-inf")
    if HAS_THR:
        thr = tl.load(thr_ptr + row)
    best_val = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.full([QUARTER], 0, tl.int32)
    begin = split * CHUNK
    end = tl.minimum(begin + CHUNK, V)
    if HAS_IDS:
        decided = tl.load(ids_ptr + row)
        end = tl.where(decided >= 0, begin, end)  # a decided row's loop runs no iteration
    for start in range(begin, end, BLOCK):
        if greedy:
            n0 = tl.zeros([QUARTER], tl.float32)
            n1 = n0
            n2 = n0
            n3 = n0
        else:
            n0, n1, n2, n3 = tl.rand4x(seed, start // 4 + tl.arange(0, QUARTER))
        best_val, best_idx = _best_of_quarter(
            row_ptr,
            start,
            end,
            n0,
            inv_t,
            greedy,
            best_val,
            best_idx,
            mask_row_ptr,
            thr,
            QUARTER,
            FAST_LOG,
            HAS_MASK,
            HAS_THR,
        )
        best_val, best_idx = _best_of_quarter(
            row_ptr,
            start + QUARTER,
            end,
            n1,
            inv_t,
            greedy,
            best_val,
            best_idx,
            mask_row_ptr,
            thr,
            QUARTER,
            FAST_LOG,
            HAS_MASK,
            HAS_THR,
        )
        best_val, best_idx = _best_of_quarter(
            row_ptr,
            start + 2 * QUARTER,
            end,
            n2,
            inv_t,
            greedy,
            best_val,
            best_idx,
            mask_row_ptr,
            thr,
            QUARTER,
            FAST_LOG,
            HAS_MASK,
            HAS_THR,
        )
        best_val, best_idx = _best_of_quarter(
            row_ptr,
            start + 3 * QUARTER,
            end,
            n3,
            inv_t,
            greedy,
            best_val,
            best_idx,
            mask_row_ptr,
            thr,
            QUARTER,
            FAST_LOG,
            HAS_MASK,
            HAS_THR,
        )
    top = tl.max(best_val, axis=0)
    # Lowest index among the lanes holding the maximum (an empty split offers −inf at index V).
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    if HAS_IDS:
        top = tl.where(decided >= 0, tl.where(split == 0, float("inf"), float("-inf")), top)
        idx = tl.where(decided >= 0, tl.where(split == 0, decided, V), idx)
    tl.store(val_ptr + row * NUM_SPLITS + split, top)
    tl.store(idx_ptr + row * NUM_SPLITS + split, idx)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def sample_reduce_kernel(
    val_ptr, idx_ptr, out_ptr, host_ptr, V, NUM_SPLITS, MAX_SPLITS: tl.constexpr, HOST_OUT: tl.constexpr
):
    """Row b: the split holding the largest value; the lowest index among equal values. With HOST_OUT
    the id is also written to `host_ptr` (pinned host memory, through its mapped address)."""
    row = tl.program_id(0)
    k = tl.arange(0, MAX_SPLITS)
    mask = k < NUM_SPLITS
    val = tl.load(val_ptr + row * NUM_SPLITS + k, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_SPLITS + k, mask=mask, other=V)
    top = tl.max(val, axis=0)
    best = tl.min(tl.where(val == top, idx, V), axis=0)
    best = tl.where(best == V, 0, best)  # a row of −inf logits only: index 0, as an argmax gives
    tl.store(out_ptr + row, best.to(tl.int64))
    if HOST_OUT:
        tl.store(host_ptr + row, best.to(tl.int64))


_BLOCK = 2048


def sampling_tile() -> int:
    """The tile by which the sampler lays out its noise (see `noise_at`): kernels that fuse the sampler
    elsewhere pass it to `best_of_block` to draw the same tokens."""
    return _BLOCK


_MAX_SPLITS = 64  # a power of two; the split count is a runtime value below it, so one compile serves all


def num_splits(batch: int, vocab: int, device: torch.device) -> int:
    """Splits per row so that batch × splits programs fill the device about four times over (a row is
    long: 63 tiles of 2,048 for a 128k vocabulary), at least one tile per split."""
    return max(1, min(triton.cdiv(4 * num_sms(device), max(batch, 1)), triton.cdiv(vocab, _BLOCK), _MAX_SPLITS))


def sample_greedy_or_gumbel(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    host_out: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    thresholds: torch.Tensor | None = None,
    decided: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's greedy or Gumbel-max token (module docstring); the same (logits, T, seed) gives the same
    token whatever the batch or `splits`.

    Each row is cut into `splits` chunks: one kernel finds every chunk's best (value, index), a second
    picks each row's best chunk.

    Args:
        logits: [B, V], any float dtype (made row-contiguous if needed).
        temperature: [B] float32 (0: greedy); seeds: [B] int64.
        out: [B] int64 to write the ids into (default: a new tensor).
        splits: chunks per row (default: enough programs to fill the device).
        host_out: [B] int64 in pinned host memory (on CUDA): the ids are written there too, by the same
            kernel (readable once an event recorded after this call has completed), so that a decode
            graph needs no copy after its sampler (engine/cuda_graphs.py).
        bitmask: [B, ceil(V / 32)] int32 on the logits' device: each row samples among the tokens its
            row allows (module docstring); a row that allows nothing gives index 0. None: no constraint.
        thresholds: [B] float32 on the logits' device: row b samples only among the tokens whose scaled
            logit z · (1 / T_b) exceeds thresholds[b] (top_p_sampling/; −inf: every finite one), with
            the same noise, so a row whose threshold removes nothing draws the id it draws without.
        decided: [B] int32 on the logits' device: a row with decided[b] ≥ 0 takes that id without reading
            its logits (top_p_sampling/'s rows whose draw is already known); −1: the row is drawn.

    Returns:
        The sampled ids [B] int64 (`out`).
    """
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if host_out is not None:
        if host_out.dtype != torch.int64 or host_out.shape != (B,) or not host_out.is_contiguous():
            raise ValueError(f"host_out must be [{B}] contiguous int64, got {tuple(host_out.shape)} {host_out.dtype}")
        if host_out.is_cuda or (logits.is_cuda and not host_out.is_pinned()):
            raise ValueError("host_out must be pinned host memory")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape != (B, (V + 31) // 32)):
        raise ValueError(f"bitmask must be [{B}, {(V + 31) // 32}] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask is not None and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    if B:
        S = min(splits or num_splits(B, V, logits.device), _MAX_SPLITS)
        chunk = triton.cdiv(triton.cdiv(V, S), _BLOCK) * _BLOCK
        S = triton.cdiv(V, chunk)
        vals = torch.empty(B, S, dtype=torch.float32, device=logits.device)
        idxs = torch.empty(B, S, dtype=torch.int32, device=logits.device)
        sample_partial_kernel[(B, S)](
            logits,
            logits.stride(0),
            temperature,
            seeds,
            vals,
            idxs,
            seeds if bitmask is None else bitmask,  # never read without HAS_MASK
            0 if bitmask is None else bitmask.stride(0),
            seeds if thresholds is None else thresholds,  # never read without HAS_THR
            V,
            chunk,
            S,
            BLOCK=_BLOCK,
            FAST_LOG=logits.is_cuda,
            HAS_MASK=bitmask is not None,
            HAS_THR=thresholds is not None,
            ids_ptr=seeds if decided is None else decided,  # never read without HAS_IDS
            HAS_IDS=decided is not None,
            num_warps=8,
        )
        reduce_partials(vals, idxs, V, out, host_out)
    return out


def reduce_partials(
    vals: torch.Tensor, idxs: torch.Tensor, V: int, out: torch.Tensor, host_out: torch.Tensor | None = None
) -> None:
    """out[b] (and host_out[b]) ← the index of row b's best partial: vals [B, S] float32 and idxs [B, S]
    int32 are each split's (value, index), from the partial kernel or a kernel that fuses it (gemv.py)."""
    B, S = vals.shape
    max_splits = max(_MAX_SPLITS, triton.next_power_of_2(S))  # one compile for every split count below 64
    sample_reduce_kernel[(B,)](
        vals,
        idxs,
        out,
        out if host_out is None else host_out,
        V,
        S,
        MAX_SPLITS=max_splits,
        HOST_OUT=host_out is not None,
        num_warps=1 if max_splits <= _MAX_SPLITS else 4,
    )
