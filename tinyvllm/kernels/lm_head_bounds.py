"""Sampling one row of an LM head while reading its weight at about one byte per element, with the same ids.

The fused sampler (sampling.py; gemv.py `sampling=`) draws argmax_i S_i, the lowest index among ties, where
    S_i = f(z_i),  z_i = round(y_i),  y_i = w_i · h  (the fp32 sum of the LM head's product, gemv.py),
    f(z) = z (greedy) or z / T + g_i (g_i: the Gumbel noise of index i for the row's seed).
Rounding to the logits' dtype and f are non-decreasing in y, so bounds L_i ≤ y_i ≤ U_i give
S_i ∈ [f(round(L_i)), f(round(U_i))] (f evaluated as the sampler evaluates it, then widened by a few
ulps, for the compiler's freedom to contract it differently in two kernels).

The bounds come from an int8 copy of the weight, ŵ_i = s_i q_i (per-row absmax scale s_i, q_i in
[−127, 127]): with a_i = s_i (q_i · h),
    |y_i − a_i| ≤ |(w_i − ŵ_i) · h| + (rounding of both fp32 sums) ≤ (‖w_i − ŵ_i‖₂ + 2⁻¹⁰ ‖w_i‖₂) ‖h‖₂
by Cauchy–Schwarz; the 2⁻¹⁰ term covers the sums' rounding with orders of magnitude to spare (an fp32
sum of 2,048 products errs by at most ~2⁻¹³ ‖w_i‖₂ ‖h‖₂ in the worst case, ~2⁻²⁰ typically).
`slack_i` = ‖w_i − ŵ_i‖₂ + 2⁻¹⁰ ‖w_i‖₂ is computed once, in float64, when the copy is made
(kernels/int8_rows.py: the copy, its layout and its kernel).

`sample_pruned` runs two passes and the sampler's reduce:
1. `score_bounds` (V·K bytes): every row's upper bound hi_i, and each block's largest lower and upper
   bound. The int8 copy is stored as bytes u = q + 128 packed four to an int32 word, word c of a row
   holding columns c, c + K/4, c + K/2, c + 3K/4, and turned into floats without a conversion
   instruction: the word's byte b, or'ed into the bits of 2²³, is the float 2²³ + u, and subtracting
   2²³ + 128 leaves q exactly (integer and float ops only: int8 → float conversions run at a quarter of
   their rate, which would make the pass compute-bound).
2. `_pruned_product_kernel`: over only the blocks whose largest hi_i reaches t = max_i lo_i, the LM head's
   own product for the rows with hi_i ≥ t, with gemv.py's tiles and arithmetic for one row, then the
   sampler's (value, index) per program. The sampled row j* has S_j* ≥ t, so it is kept, and so is
   every row that ties with it; a dropped row scores strictly less than j*. Each kept row's logit is
   computed as the full product computes it (the same tile shapes and sums: a row's sum does not depend
   on the other rows of its tile), so the id is the unpruned one, bit for bit, whatever the weights;
   only the number of kept rows (pass 2's bytes) depends on them.
For Llama-3.2-1B's LM head (128,256 × 2,048) the passes read 263 MB plus the kept rows, against the
525 MB of the bf16 weight.

With a token bitmask (structured outputs; xgrammar's packed [1, ceil(N / 32)] int32 row, the fused
sampler's HAS_MASK variant) the draw is argmax over the allowed rows only. Both passes then treat a
disallowed row as absent: its bounds are −inf, so it neither raises t nor keeps its block, and pass 2
never takes it as a candidate. The argument above holds over the allowed rows, so the id is the masked
sampler's. A compiled variant (HAS_MASK): a launch without a mask runs the kernels it ran before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.gemv import GemvConfig, GemvSampling, check_sampling, default_config
from tinyvllm.kernels.int8_rows import QuantizedRows
from tinyvllm.kernels.launch import cdiv, is_power_of_2, num_sms, upcast_dot
from tinyvllm.kernels.sampling import allowed_by, best_of_block, log2, noise_at, reduce_partials, sampling_tile


def check_bitmask(bitmask: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    """Raise ValueError unless `bitmask` is None or one contiguous packed row [1, ceil(n / 32)] int32 on
    x's device."""
    if bitmask is None:
        return
    width = (n + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.shape != (1, width) or bitmask.device != x.device:
        raise ValueError(
            f"bitmask must be [1, {width}] int32 on {x.device}, got {tuple(bitmask.shape)} {bitmask.dtype} "
            f"on {bitmask.device}"
        )
    if not bitmask.is_contiguous():
        raise ValueError("bitmask must be contiguous")


class ScoreBounds(NamedTuple):
    """Pass 1's output for one row: hi [N] (each row's score at most), lo_max and hi_max [N / block_n]
    (each block's largest lower and upper bound; some row scores at least max(lo_max)), block_n."""

    hi: torch.Tensor
    lo_max: torch.Tensor
    hi_max: torch.Tensor
    block_n: int


class BoundsConfig(NamedTuple):
    block_n: int  # rows per pass-1 program (a power of two): the blocks pass 2 keeps or drops
    block_c: int  # packed words per row per tile (4 bytes each; a power of two)
    num_warps: int
    num_stages: int  # pass 1's pipeline depth (1: loads straight into registers)
    programs: int  # pass 2's programs (each takes every programs-th kept block)


def default_bounds_config(device: torch.device) -> BoundsConfig:
    if device.type == "cuda":
        return BoundsConfig(64, 64, 4, 1, 128)  # the best of a sweep on the H200
    return BoundsConfig(16, 16, 4, 1, 3)


@triton.jit
def _score_bounds_kernel(
    x_ptr,
    p_ptr,
    scale_ptr,
    slack_ptr,
    temp_ptr,
    seed_ptr,
    hi_ptr,
    lo_max_ptr,
    hi_max_ptr,
    mask_ptr,
    N,
    K4,
    stride_pn,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr,
    TILE: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Pass 1, program p: rows [p·BLOCK_N, (p+1)·BLOCK_N) of the packed int8 weight [N, K4] (4 columns a
    word) against x [4·K4] → each row's upper bound hi, and lo_max[p], hi_max[p] (module docstring).
    HAS_MASK: the rows the bitmask row at `mask_ptr` disallows get −inf bounds."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    p_rows = p_ptr + offs_n[:, None].to(tl.int64) * stride_pn

    ss = tl.zeros([BLOCK_C], dtype=tl.float32)  # ‖h‖² (h: 2·K bytes from L2, read once more)
    for k0 in range(0, 4 * K4, BLOCK_C):
        k = k0 + tl.arange(0, BLOCK_C)
        xk = tl.load(x_ptr + k, mask=k < 4 * K4, other=0.0).to(tl.float32)
        ss += xk * xk

    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    # STAGES > 1: software-pipelined through shared memory (cp.async; Triton pipelines a loop whose loads
    # feed no tl.dot only when the loop asks for it). The default, STAGES = 1, loads straight into
    # registers, which is faster: two or three programs per SM keep enough loads in flight.
    for c0 in tl.range(0, K4, BLOCK_C, num_stages=STAGES):
        c = c0 + tl.arange(0, BLOCK_C)
        mask_c = c < K4
        words = tl.load(p_rows + c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0)
        # h's columns c + j·K/4 loaded as [BLOCK_N, BLOCK_C] tiles of identical rows (L1 hits): the words'
        # own register layout, no shared-memory shuffle
        cols = c[None, :] + offs_n[:, None] * 0
        full = mask_c[None, :] & (offs_n[:, None] >= 0)
        for j in tl.static_range(4):
            h = tl.load(x_ptr + j * K4 + cols, mask=full, other=0.0).to(tl.float32)
            q = (((words >> (8 * j)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
            acc += q * h
    y = tl.sum(acc, axis=1)

    h_norm = tl.sqrt(tl.sum(ss, axis=0)) * (1.0 + 2.0**-12)  # its own rounding, generously
    a_row = y * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    d = tl.load(slack_ptr + offs_n, mask=mask_n, other=0.0) * h_norm
    z_hi = (a_row + d).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounding is monotone
    z_lo = (a_row - d).to(x_ptr.dtype.element_ty).to(tl.float32)
    temperature = tl.load(temp_ptr)
    if temperature != 0.0:  # the sampler's f (sampling.best_of_block), then a few ulps wider
        u = tl.maximum(noise_at(tl.load(seed_ptr), offs_n, TILE), 1e-20)
        g = -0.6931471805599453 * log2(-log2(u, FAST_LOG), FAST_LOG)
        inv_t = 1.0 / temperature
        s_hi = z_hi * inv_t + g
        s_lo = z_lo * inv_t + g
        ulps = (tl.abs(z_hi * inv_t) + tl.abs(z_lo * inv_t) + tl.abs(g)) * (2.0**-16)
        s_hi = s_hi + ulps
        s_lo = s_lo - ulps
    else:
        s_hi = z_hi
        s_lo = z_lo
    present = mask_n
    if HAS_MASK:
        present = present & allowed_by(mask_ptr, offs_n, mask_n)
    s_hi = tl.where(present, s_hi, float("-inf"))
    tl.store(hi_ptr + offs_n, s_hi, mask=mask_n)
    tl.store(lo_max_ptr + pid, tl.max(tl.where(present, s_lo, float("-inf")), axis=0))
    tl.store(hi_max_ptr + pid, tl.max(s_hi, axis=0))


@triton.jit
def _pruned_product_kernel(
    x_ptr,
    w_ptr,
    hi_ptr,
    lo_max_ptr,
    hi_max_ptr,
    num_blocks,
    temp_ptr,
    seed_ptr,
    part_val_ptr,
    part_idx_ptr,
    mask_ptr,
    N,
    K,
    stride_wn,
    BOUND_N: tl.constexpr,
    SUBS: tl.constexpr,
    NB_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TILE: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Program p: the kept blocks of rank p, p + P, ... (module docstring, pass 2), each as gemv.py's
    one-row plain product over [BLOCK_N, BLOCK_K] tiles (SUBS = max(1, BOUND_N / BLOCK_N) of them per
    block, rows outside the block masked), then the best (value, index) of the program's rows into the
    partials [P]. HAS_MASK: only the rows the bitmask row at `mask_ptr` allows are candidates."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    j = tl.arange(0, NB_POW2)
    valid = j < num_blocks
    threshold = tl.max(tl.load(lo_max_ptr + j, mask=valid, other=float("-inf")), axis=0)
    kept = valid & ~(tl.load(hi_max_ptr + j, mask=valid, other=float("-inf")) < threshold)  # NaN: kept
    rank = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    mine = kept & (rank % P == pid)
    count = tl.sum(mine.to(tl.int32), axis=0)
    temperature = tl.load(temp_ptr)
    seed = tl.load(seed_ptr)
    best_val = tl.max(tl.full([2], float("-inf"), tl.float32), axis=0)
    best_idx = tl.min(tl.full([2], 0, tl.int32), axis=0) + N
    offs_m = tl.arange(0, 16)
    for i in range(0, count):
        blk = tl.sum(tl.where(mine & (rank == i * P + pid), j, 0), axis=0)
        for sub in tl.static_range(SUBS):
            offs_n = blk * BOUND_N + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            in_blk = (offs_n < blk * BOUND_N + BOUND_N) & (offs_n < N)
            mask_n = in_blk & ~(tl.load(hi_ptr + offs_n, mask=in_blk, other=float("-inf")) < threshold)
            if HAS_MASK:
                mask_n = mask_n & allowed_by(mask_ptr, offs_n, in_blk)
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
            # gemv.py's gemv_kernel at M = 1, plain products, no split: the same tiles and sums
            if USE_DOT:
                acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            k_stop = tl.where(tl.max(mask_n.to(tl.int32), axis=0) > 0, K, 0)
            for k0 in range(0, k_stop, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    mask_k = tl.full([BLOCK_K], 1, tl.int1)
                else:
                    mask_k = k < K
                w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
                if USE_DOT:
                    a = tl.load(
                        x_ptr + offs_m[:, None] * 0 + k[None, :],
                        mask=(offs_m[:, None] < 1) & mask_k[None, :],
                        other=0.0,
                    )
                    if UPCAST:
                        acc += tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
                    elif IEEE:
                        acc += tl.dot(w, tl.trans(a), input_precision="ieee")
                    else:
                        acc += tl.dot(w, tl.trans(a))
                else:
                    cols = k[None, :] + offs_n[:, None] * 0
                    full = mask_k[None, :] & (offs_n[:, None] >= 0)
                    a = tl.load(x_ptr + cols, mask=full, other=0.0)
                    acc += w.to(tl.float32) * a.to(tl.float32)
            if USE_DOT:
                y = tl.sum(tl.where(offs_m[None, :] == 0, acc, 0.0), axis=1)
            else:
                y = tl.sum(acc, axis=1)
            z = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the logits as stored, as gemv.py samples them
            top, idx = best_of_block(z, offs_n, mask_n, temperature, seed, N, TILE, FAST_LOG)
            better = (top > best_val) | ((top == best_val) & (idx < best_idx))
            best_val = tl.where(better, top, best_val)
            best_idx = tl.where(better, idx, best_idx)
    tl.store(part_val_ptr + pid, best_val)
    tl.store(part_idx_ptr + pid, best_idx)


def score_bounds(
    x: torch.Tensor,
    rows: QuantizedRows,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    config: BoundsConfig | None = None,
    bitmask: torch.Tensor | None = None,
) -> ScoreBounds:
    """Pass 1 (module docstring) for the one row x [1, K], the LM head's input.

    Args:
        x: [1, K]; rows: the weight's int8 copy (`quantize_rows`).
        temperature: [1] float32 (0: greedy); seeds: [1] int64, as the fused sampler takes them.
        config: tiles and launch options (default: `default_bounds_config`).
        bitmask: [1, ceil(N / 32)] int32 on x's device, the allowed rows (`check_bitmask`), or None: all.
    """
    packed, scale, slack = rows
    N, K4 = packed.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != 4 * K4:
        raise ValueError(f"x must be [1, {4 * K4}], got {tuple(x.shape)}")
    if packed.dtype != torch.int32 or packed.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("rows.packed must be int32 with contiguous rows (quantize_rows), x contiguous")
    check_bitmask(bitmask, N, x)
    cfg = config or default_bounds_config(x.device)
    if not (is_power_of_2(cfg.block_n) and is_power_of_2(cfg.block_c)):
        raise ValueError(f"block_n and block_c must be powers of two: {cfg}")
    programs = cdiv(N, cfg.block_n)
    hi = torch.empty(N, dtype=torch.float32, device=x.device)
    lo_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    hi_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    _score_bounds_kernel[(programs,)](
        x,
        packed,
        scale,
        slack,
        temperature,
        seeds,
        hi,
        lo_max,
        hi_max,
        hi if bitmask is None else bitmask,  # never read without HAS_MASK
        N,
        K4,
        packed.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_C=min(cfg.block_c, triton.next_power_of_2(K4)),
        STAGES=cfg.num_stages,
        TILE=sampling_tile(),
        FAST_LOG=x.is_cuda,
        HAS_MASK=bitmask is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return ScoreBounds(hi, lo_max, hi_max, cfg.block_n)


def sample_pruned(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: QuantizedRows,
    sampling: GemvSampling,
    config: BoundsConfig | None = None,
    product: GemvConfig | None = None,
    bitmask: torch.Tensor | None = None,
) -> None:
    """The fused sampler's id for the one row of x Wᵀ, into `sampling.ids` (and `host_ids`), from pass 1
    and the product over the rows pass 1 keeps; no logits. It is the id that
    `fused_gemv_fwd(x, weight, sampling=sampling, config=product)` draws; with `bitmask`, the id that the
    fused sampler draws from those logits under it (`sample_greedy_or_gumbel(..., bitmask=bitmask)`).

    Args:
        x: [1, K], the LM head's input.
        weight: [N, K] in x's dtype; rows: its int8 copy (`quantize_rows`).
        sampling: temperature, seed and outputs of the one row (gemv.GemvSampling).
        config: pass 1's tiles and pass 2's programs (default: `default_bounds_config`).
        product: the product's config whose arithmetic pass 2 repeats (default: gemv.py's for this shape).
        bitmask: [1, ceil(N / 32)] int32 on x's device: the rows that may be drawn (module docstring); a
            row that allows nothing draws N. None: every row.
    """
    if rows.packed.shape != (weight.shape[0], weight.shape[1] // 4) or weight.shape[1] % 4:
        raise ValueError(f"rows {tuple(rows.packed.shape)} (packed) do not match the weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"weight ({weight.dtype}) must share x's dtype ({x.dtype}) and have contiguous rows")
    check_sampling(sampling, 1, x)  # gemv.py's, for its one row
    cfg = config or default_bounds_config(x.device)
    bounds = score_bounds(x, rows, sampling.temperature, sampling.seeds, cfg, bitmask)
    N, K = weight.shape
    prod = product or default_config(1, N, K, num_sms(x.device))
    nb = bounds.lo_max.numel()
    vals = torch.empty((1, cfg.programs), dtype=torch.float32, device=x.device)
    idxs = torch.empty((1, cfg.programs), dtype=torch.int32, device=x.device)
    _pruned_product_kernel[(cfg.programs,)](
        x,
        weight,
        bounds.hi,
        bounds.lo_max,
        bounds.hi_max,
        nb,
        sampling.temperature,
        sampling.seeds,
        vals,
        idxs,
        vals if bitmask is None else bitmask,  # never read without HAS_MASK
        N,
        K,
        weight.stride(0),
        BOUND_N=cfg.block_n,
        SUBS=max(1, cfg.block_n // prod.block_n),
        NB_POW2=triton.next_power_of_2(nb),
        BLOCK_N=prod.block_n,
        BLOCK_K=prod.block_k,
        USE_DOT=prod.use_dot,
        EVEN_K=K % prod.block_k == 0,
        UPCAST=upcast_dot(x.device),
        IEEE=x.dtype == torch.float32,
        TILE=sampling_tile(),
        FAST_LOG=x.is_cuda,
        HAS_MASK=bitmask is not None,
        num_warps=prod.num_warps,
        num_stages=prod.num_stages,
    )
    reduce_partials(vals, idxs, N, sampling.ids, sampling.host_ids)
