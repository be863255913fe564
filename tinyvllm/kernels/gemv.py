"""Matrix-vector products for decode batches (M ≤ 16 rows), with the small ops around them fused in:

    out = round(a Wᵀ)                       a: [M, K], W: [N, K] (nn.Linear layout), fp32 accumulation
    out = round(round(a Wᵀ) + residual)      with `residual` [M, N] (added in fp32, as add_rms_norm does)
    out = round(a Wᵀ + b)                    with `bias` b [N] (added to the fp32 sum, as nn.Linear does)
    W = q · s                                FP8 weights (`weight_scale`): q float8_e4m3fn [N, K], s float32 [N]

where the input transform a is one of
    a = x                                     plain
    a = round(w_n ⊙ round(x · rstd)),         `norm_weight` w_n: RMSNorm (rms_norm.py's roundings),
        rstd = 1 / sqrt(mean(x²) + eps)           rstd over the whole row of x, in fp32
    a = round(silu(g) ⊙ u),  x = [g | u]      `silu_mul`: SwiGLU's gate (activation.py), x: [M, 2K]

"round" is to x's dtype. FP8 weights (one float32 scale per output row, quantization/fp8.py) are
dequantized in registers: each tile of q is converted to a's dtype (exactly: e4m3 ⊂ bf16/fp16/fp32),
the float32 sums Σ_k a_k q[n, k] are taken as for any weight, and s[n] multiplies each row's sum once
before the epilogue, so the product is a · dequant(W)ᵀ with the activations unquantized (the
batch-1 maths of docs/fp8.md) at half the weight bytes.

So `fused_gemv(x, W, norm_weight=w)` computes rms_norm(x, w) @ Wᵀ and
`fused_gemv(h, W, silu_mul=True, residual=r)` computes add(silu_and_mul(h) @ Wᵀ, r) with the unfused
ops' roundings: fusing changes only the order of the fp32 sums.

Decode is bound by the bytes of W (each weight is read once and used M times), so the design is about
keeping enough weight bytes in flight on every SM:
  * A program computes a BLOCK_N × M tile of the output from BLOCK_N whole weight rows, streaming
    them in [BLOCK_N, BLOCK_K] tiles. FMA path (default at M = 1): fp32 FMAs into a
    [BLOCK_N, (M,) BLOCK_K] accumulator, summed over K once at the end; at M = 1 x is loaded as a
    [BLOCK_N, BLOCK_K] tile of identical rows so that it lands in W's register layout (L1 serves the
    repeats) instead of being reshuffled through shared memory every tile. Dot path (default at M ≥ 2):
    `tl.dot(W_tile, aᵀ)` with a padded to 16 rows (the tensor cores do the FMAs; W is the 64-row
    operand, so Hopper runs wgmma with W streamed into shared memory by cp.async).
  * Split-K (grid (N / BLOCK_N, splits)) when N alone gives too few programs (N = 2048 rows against
    132 SMs): each split writes its fp32 partial tile to a workspace and takes a ticket from a
    per-tile arrival counter (an acq_rel atomic after a CTA barrier, the semaphore pattern of CUTLASS's
    serial split-K); the program that arrives last sums the partials in split order, so the result is
    deterministic, runs the epilogue and resets the counter for the next launch. One launch, no
    memset, no host sync: safe to capture in a CUDA graph.
  * RMSNorm needs the whole row's statistics before the first product, so each program first reads
    x's rows once for Σx² (x is M·K·2 bytes, from L2); the split heuristic bounds these re-reads by
    the weight bytes.

Tile sizes, warps, stages and the split come from `default_config` (a heuristic on M, N, K and the SM
count); `fused_gemv_fwd(..., config=GemvConfig(...))` overrides it (`bench_gemv.py --sweep`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.launch import (
    cdiv,
    check_dim,
    check_float,
    check_last_dim_contiguous,
    check_same_device,
    is_power_of_2,
    next_power_of_2,
    num_sms,
    upcast_dot,
)
from tinyvllm.kernels.pdl import options as pdl_options
from tinyvllm.kernels.sampling import best_of_block, reduce_partials, sampling_tile

MAX_ROWS = 16  # rows of x per call: decode batches; beyond this a GEMM is the right kernel
FMA_MAX_ROWS = 1  # up to this M, FMAs in registers by default; above, tl.dot with M padded to 16

_PLAIN, _NORM, _SILU = 0, 1, 2


class GemvConfig(NamedTuple):
    block_n: int  # weight rows (outputs) per program
    block_k: int  # reduction tile
    split_k: int  # programs along K per output tile (1: no workspace, no counters)
    num_warps: int
    num_stages: int
    use_dot: bool  # tl.dot with M padded to 16 instead of FMAs (needs block_n ≥ 16, block_k ≥ 16)


def choose_split(
    M: int, N: int, K: int, sms: int, block_n: int, block_k: int, norm: bool, programs_per_sm: int = 4
) -> int:
    """Smallest power-of-two split giving ≥ programs_per_sm · sms programs, with every split at least
    two K tiles long and, for the RMSNorm prologue (each program reads x's M·K values once more),
    no more programs than N / M, so those re-reads stay below the weight bytes."""
    n_blocks = cdiv(N, block_n)
    max_split = max(1, K // (2 * block_k))
    if norm:
        max_split = min(max_split, max(1, N // (M * n_blocks)))
    split = 1
    while n_blocks * split < programs_per_sm * sms and split * 2 <= max_split:
        split *= 2
    return split


# The best of `bench_gemv.py --sweep --sweep-m 1` at M = 1 on the H200 (132 SMs) for the Llama-3.2-1B
# projections, by (N, K).
TUNED_M1_H200: dict[tuple[int, int], GemvConfig] = {
    (3072, 2048): GemvConfig(4, 512, 1, 8, 2, False),  # qkv
    (2048, 2048): GemvConfig(4, 512, 1, 8, 2, False),  # o
    (16384, 2048): GemvConfig(32, 128, 1, 4, 3, True),  # gate_up
    (2048, 8192): GemvConfig(8, 256, 4, 8, 1, False),  # down
    (128256, 2048): GemvConfig(128, 128, 1, 4, 3, True),  # lm_head
}
H200_SMS = 132


@functools.lru_cache(maxsize=4096)  # host cost per launch: a dict lookup
def default_config(M: int, N: int, K: int, sms: int, *, norm: bool = False, fp8: bool = False) -> GemvConfig:
    """The launch config for x [M, K] and W [N, K] on a device with `sms` multiprocessors.

    The Llama-3.2-1B shapes at M = 1 on the H200 take their tuned configs (TUNED_M1_H200). Elsewhere a
    heuristic, reasoned from the sm_90 code Triton emits: a memory-bound program wants ≥ 16 KB of weight
    loads in flight per SM. M = 1: [8, 512] bf16 tiles (8 KB per iteration, 16-byte loads) at 4 warps
    take ~80 registers per thread, so ~6 programs share an SM; split-K by `choose_split` to ≥ 4 programs
    per SM. M ≥ 2: [32, 128] tiles (8 KB) into wgmma with M padded to 16, 4 stages of cp.async, split
    only to ≥ 1 program per SM: few programs, each long enough to fill its pipeline (the FMA path at
    M = 2 needs 120 registers and reshuffles x through shared memory each tile); the rule is the sweep's
    (`bench_gemv.py --sweep --sweep-m 2|8|16`, docs/perf.md §1e). Products wide enough for ≥ 4 programs
    per SM of [64, 128] tiles without a split (the LM head) keep those tiles and 3 stages. FP8 weights
    (`fp8`) take twice the FMA path's block_k, the same bytes per tile (the
    tuned table is bf16's)."""
    tuned = TUNED_M1_H200.get((N, K)) if M == 1 and sms == H200_SMS and not norm and not fp8 else None
    if tuned is not None:
        return tuned
    if M <= FMA_MAX_ROWS:
        block_n, block_k, stages, dot, programs_per_sm = 8, 1024 if fp8 else 512, 2, False, 4
    elif cdiv(N, 64) >= 4 * sms:  # the LM head: 64-row tiles already give ≥ 4 programs per SM
        block_n, block_k, stages, dot, programs_per_sm = 64, 128, 3, True, 4
    else:
        block_n, block_k, stages, dot, programs_per_sm = 32, 128, 4, True, 1
    block_k, warps = min(block_k, max(16, next_power_of_2(K))), 4
    split = choose_split(M, N, K, sms, block_n, block_k, norm, programs_per_sm)
    return GemvConfig(block_n, block_k, split, warps, stages, dot)


def candidate_configs(M: int, N: int, K: int, sms: int, *, norm: bool = False) -> list[GemvConfig]:
    """The grid `bench_gemv.py --sweep` times (deduplicated, the default among them): tiles × warps ×
    stages × split targets of 1, 2, 4 and 8 programs per SM; FMA tiles only for M ≤ 4. One program per SM
    and 5 stages are there for the small products at M ≥ 2, whose default splits leave each program two
    K tiles: a pipeline that never fills, and a split-K reduction per 32 KB of weights."""
    fma = [(4, 512), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512)] if M <= 4 else []
    dot = [(32, 128), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]
    grid = [(False, n, k, w, s) for n, k in fma for w in (4, 8) for s in (1, 2)]
    grid += [(True, n, k, 4, s) for n, k in dot for s in (2, 3, 4, 5)]
    out = [default_config(M, N, K, sms, norm=norm)]
    for use_dot, block_n, block_k, warps, stages in grid:
        block_k = min(block_k, max(16, next_power_of_2(K)))
        for pps in (1, 2, 4, 8):
            split = choose_split(M, N, K, sms, block_n, block_k, norm, pps)
            cfg = GemvConfig(block_n, block_k, split, warps, stages, use_dot)
            if cfg not in out:
                out.append(cfg)
    return out


@triton.jit
def _row_rstd(x_rows, mask_m, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x²) + eps) of each of the BLOCK_M rows, in fp32 (rms_norm.py's expression)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _load_a(x_rows, nw_ptr, cols, mask, nw_mask, rstd, K, MODE: tl.constexpr):
    """The transformed input tile a = f(x[rows, cols]) in x's dtype, with the unfused ops' roundings;
    rstd: [rows] (RMSNorm only). The norm weight is loaded at `cols`, in the tile's own layout."""
    if MODE == 2:  # silu(g) ⊙ u, as activation.py
        g = tl.load(x_rows + cols, mask=mask, other=0.0)
        u = tl.load(x_rows + K + cols, mask=mask, other=0.0)
        gf, uf = g.to(tl.float32), u.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf)) * uf).to(g.dtype)
    else:
        a = tl.load(x_rows + cols, mask=mask, other=0.0)
        if MODE == 1:  # w ⊙ round(x · rstd), as rms_norm.py
            nw = tl.load(nw_ptr + cols, mask=nw_mask, other=0.0)
            normed = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)
            a = (nw.to(tl.float32) * normed.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _epilogue(
    y,
    offs_n,
    offs_m,
    mask,
    res_ptr,
    bias_ptr,
    out_ptr,
    stride_rm,
    stride_om,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """y: the fp32 tile [BLOCK_N, BLOCK_M] → out[m, n] = round(y), round(y + bias[n]) (HAS_BIAS), or
    round(round(y) + residual)."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n[:, None] + offs_m[None, :] * 0, mask=mask, other=0.0)
        y = y + b.to(tl.float32)
    out = y.to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], out, mask=mask)


@triton.jit
def _sample_epilogue(
    y,
    offs_n,
    offs_m,
    mask_n,
    M,
    N,
    pid_n,
    temp_ptr,
    seed_ptr,
    part_val_ptr,
    part_idx_ptr,
    out_dtype: tl.constexpr,
    TILE: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """The fused sampler's first half over this program's logits y [BLOCK_N, BLOCK_M] (as stored:
    rounded to out_dtype): each row's best (value, index) into the partials [M, programs], as the
    sampler's partial kernel finds them (sampling.py: same noise, same ties)."""
    z = y.to(out_dtype).to(tl.float32)
    num_blocks = tl.num_programs(0)
    for m in range(0, M):
        zm = tl.sum(tl.where(offs_m[None, :] == m, z, 0.0), axis=1)
        top, idx = best_of_block(zm, offs_n, mask_n, tl.load(temp_ptr + m), tl.load(seed_ptr + m), N, TILE, FAST_LOG)
        tl.store(part_val_ptr + m * num_blocks + pid_n, top)
        tl.store(part_idx_ptr + m * num_blocks + pid_n, idx)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every batch size on a path
def gemv_kernel(
    x_ptr,
    w_ptr,
    ws_scale_ptr,
    nw_ptr,
    res_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    tickets_ptr,
    M,
    N,
    K,
    k_per_split,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    temp_ptr,
    seed_ptr,
    part_val_ptr,
    part_idx_ptr,
    MODE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    SAMPLE: tl.constexpr,
    TILE: tl.constexpr,
    FAST_LOG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (n-block, k-split): out[:, n-block] of a = f(x) [M, K] times W [N, K]ᵀ over the program's
    K range (module docstring), f by MODE (0 plain, 1 RMSNorm, 2 SwiGLU), plus the residual with
    HAS_RESIDUAL, or the bias with HAS_BIAS. W_SCALE: W is FP8 with the row scales at ws_scale_ptr [N]
    (each tile converted to a's dtype; the scales multiply the finished float32 sums). SPLIT: the K
    ranges' fp32 partials go to the workspace and
    the last split to take the tile's ticket sums them in split order. SAMPLE: the tile's best (value,
    index) per row into the sampler's partials (`_sample_epilogue`). PDL: launched as a dependent
    (kernels/pdl.py)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    wait_for_previous(PDL)

    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MODE == 1:
        rstd = _row_rstd(x_rows, mask_m, K, eps, BLOCK_M, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)

    k_start = pid_k * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # every tile lies inside [0, K): an all-true mask, which the compiler folds away
            mask_k = tl.full([BLOCK_K], 1, tl.int1)
        else:
            mask_k = k < K
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if BLOCK_M == 1 and not USE_DOT and MODE != 2:
            # x's one row loaded as a [BLOCK_N, BLOCK_K] tile (every row the same addresses, L1 hits):
            # the same shape as W's tile gets the same register layout, so no shared-memory shuffle.
            # (Not for SwiGLU: each thread would compute its columns' sigmoids once per row it holds.)
            cols = k[None, :] + offs_n[:, None] * 0
            full = mask_k[None, :] & (offs_n[:, None] >= 0)
            a = _load_a(x_ptr, nw_ptr, cols, full, full, rstd, K, MODE)
        else:
            a = _load_a(x_rows, nw_ptr, k[None, :], mask_m[:, None] & mask_k[None, :], mask_k[None, :], rstd, K, MODE)
        if W_SCALE and USE_DOT:  # FP8 weights: exact in a's dtype (the FMA paths convert to float32)
            w = w.to(a.dtype)
        if USE_DOT:
            if UPCAST:  # CPU interpreter only: see launch.upcast_dot
                acc += tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(w, tl.trans(a), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(a))
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * a.to(tl.float32)
        else:
            acc += w.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :]
    if USE_DOT:
        y = acc
    elif BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[:, None]
    else:
        y = tl.sum(acc, axis=2)

    mask = mask_n[:, None] & mask_m[None, :]
    if not SPLIT:
        if W_SCALE:
            y = y * tl.load(ws_scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        _epilogue(y, offs_n, offs_m, mask, res_ptr, bias_ptr, out_ptr, stride_rm, stride_om, HAS_RESIDUAL, HAS_BIAS)
        if SAMPLE:  # plain products only (the launcher checks): the logits are round(y)
            _sample_epilogue(
                y,
                offs_n,
                offs_m,
                mask_n,
                M,
                N,
                pid_n,
                temp_ptr,
                seed_ptr,
                part_val_ptr,
                part_idx_ptr,
                out_ptr.dtype.element_ty,
                TILE,
                FAST_LOG,
            )
    else:
        # Workspace [splits, M, N] fp32. Publish this split's partial, then take a ticket: the barrier
        # orders every thread's stores before the (gpu-scope, acq_rel) atomic of the CTA's one thread.
        ws_tile = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_tile + pid_k.to(tl.int64) * M * N, y, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        num_splits = tl.num_programs(1)
        if ticket == num_splits - 1:  # the last to arrive: sum in split order (deterministic)
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(num_splits):
                total += tl.load(ws_tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if W_SCALE:
                total = total * tl.load(ws_scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
            _epilogue(
                total, offs_n, offs_m, mask, res_ptr, bias_ptr, out_ptr, stride_rm, stride_om, HAS_RESIDUAL, HAS_BIAS
            )
            tl.atomic_xchg(tickets_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch


# Split-K arrival counters, one int32 per output tile, per device. Zero between launches: the last
# program of each tile resets its own. Allocated on first use (the model's warm-up, before any graph
# capture); a buffer that has to grow is kept alive, since captured graphs may point at it. Launches
# on two streams of one device at once would share counters: the engine runs one stream.
_TICKETS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_TICKETS = 1 << 16


def split_k_tickets(device: torch.device, n: int) -> torch.Tensor:
    """The split-K arrival counters of `device`, at least n of them (zero between launches)."""
    bufs = _TICKETS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, _MIN_TICKETS), dtype=torch.int32, device=device))
    return bufs[-1]


class GemvSampling(NamedTuple):
    """The fused greedy/Gumbel sampler (kernels/sampling.py) run in the product's epilogue, for each of
    the M rows: temperature [M] float32 (0: greedy), seeds [M] int64, the ids into `ids` [M] int64 on
    the device and, when given, `host_ids` [M] int64 in pinned host memory. The same ids as
    `sample_greedy_or_gumbel` over the returned logits: the product's programs find their blocks' bests
    and the sampler's reduce kernel picks each row's, two kernels instead of three. The reduce stays a
    kernel of its own: reducing in the product's last program would put a release and an atomic ticket
    in every program of the product (1,002 for the Llama-3.2-1B LM head), which costs more than a launch."""

    temperature: torch.Tensor
    seeds: torch.Tensor
    ids: torch.Tensor
    host_ids: torch.Tensor | None = None


def check_sampling(s: GemvSampling, M: int, x: torch.Tensor) -> None:
    """Raise ValueError unless `s` fits M rows of x (shapes, dtypes, device; host_ids pinned)."""
    for name, t, dtype in (
        ("temperature", s.temperature, torch.float32),
        ("seeds", s.seeds, torch.int64),
        ("ids", s.ids, torch.int64),
    ):
        if t.shape != (M,) or t.dtype != dtype or not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                f"sampling.{name} must be [{M}] contiguous {dtype} on {x.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    h = s.host_ids
    if h is not None:
        if h.shape != (M,) or h.dtype != torch.int64 or not h.is_contiguous():
            raise ValueError(f"sampling.host_ids must be [{M}] contiguous int64, got {tuple(h.shape)} {h.dtype}")
        if h.is_cuda or (x.is_cuda and not h.is_pinned()):
            raise ValueError("sampling.host_ids must be pinned host memory")


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    silu_mul: bool,
    residual: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """Validate the arguments; returns (M, N, K)."""
    check_dim("x", x, 2)
    check_dim("weight", weight, 2)
    check_float("x", x)
    M, K_in = x.shape
    N, K = weight.shape
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(f"weight_scale goes with a float8_e4m3fn weight, got {weight.dtype}")
        if weight_scale.shape != (N,) or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
            raise ValueError(
                f"weight_scale must be [{N}] contiguous float32, got {tuple(weight_scale.shape)} {weight_scale.dtype}"
            )
    elif weight.dtype != x.dtype:
        raise TypeError(f"weight ({weight.dtype}) and x ({x.dtype}) must share a dtype (FP8 weights need weight_scale)")
    if M > MAX_ROWS:
        raise ValueError(f"fused_gemv serves at most {MAX_ROWS} rows (decode batches), got {M}")
    if norm_weight is not None and silu_mul:
        raise ValueError("choose one input transform: norm_weight or silu_mul, not both")
    if K_in != (2 * K if silu_mul else K):
        want = f"2·{K} (gate | up)" if silu_mul else str(K)
        raise ValueError(f"x has {K_in} columns; weight {tuple(weight.shape)} needs {want}")
    tensors = {"x": x, "weight": weight}
    if weight_scale is not None:
        tensors["weight_scale"] = weight_scale
    if norm_weight is not None:
        if norm_weight.shape != (K,) or norm_weight.dtype != x.dtype:
            raise ValueError(
                f"norm_weight must be [{K}] in {x.dtype}, got {tuple(norm_weight.shape)} {norm_weight.dtype}"
            )
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        if residual.shape != (M, N) or residual.dtype != x.dtype:
            raise ValueError(f"residual must be [{M}, {N}] in {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
        check_last_dim_contiguous("residual", residual)
        tensors["residual"] = residual
    if bias is not None:
        if residual is not None:
            raise ValueError("choose one epilogue: bias or residual, not both")
        if bias.shape != (N,) or bias.dtype != x.dtype or not bias.is_contiguous():
            raise ValueError(f"bias must be [{N}] contiguous in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
        tensors["bias"] = bias
    check_same_device(**tensors)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    return M, N, K


def check_config(cfg: GemvConfig) -> None:
    """Raise ValueError for a config the kernel cannot run (tile sizes, split, tl.dot's minimum of 16)."""
    if not (is_power_of_2(cfg.block_n) and is_power_of_2(cfg.block_k) and cfg.split_k >= 1):
        raise ValueError(f"block_n and block_k must be powers of two and split_k ≥ 1: {cfg}")
    if cfg.use_dot and (cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"tl.dot needs block_n ≥ 16 and block_k ≥ 16: {cfg}")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    silu_mul: bool,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    cfg: GemvConfig,
    sampling: GemvSampling | None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`gemv_kernel` on the grid (N / block_n, splits) into `out`. Returns the sampler's partials
    (values [M, blocks] float32, indices [M, blocks] int32) where `sampling` is given, else None."""
    M, N = out.shape
    K = weight.shape[1]
    block_m = 16 if cfg.use_dot else next_power_of_2(M)
    k_per_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(K, k_per_split) if K else 1
    n_blocks = cdiv(N, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        tickets = split_k_tickets(x.device, n_blocks)
    else:
        ws = tickets = out
    s, parts = sampling, None
    if s is not None:
        parts = (
            torch.empty((M, n_blocks), dtype=torch.float32, device=x.device),
            torch.empty((M, n_blocks), dtype=torch.int32, device=x.device),
        )
    gemv_kernel[(n_blocks, split)](
        x,
        weight,
        weight_scale if weight_scale is not None else out,
        norm_weight if norm_weight is not None else x,
        residual if residual is not None else out,
        bias if bias is not None else out,
        out,
        ws,
        tickets,
        M,
        N,
        K,
        k_per_split,
        eps,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        *((s.temperature, s.seeds, *parts) if s is not None else (out,) * 4),
        MODE=_NORM if norm_weight is not None else _SILU if silu_mul else _PLAIN,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        W_SCALE=weight_scale is not None,
        SPLIT=split > 1,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot,
        EVEN_K=split * k_per_split == K,
        UPCAST=upcast_dot(x.device),
        IEEE=x.dtype == torch.float32,
        SAMPLE=s is not None,
        TILE=sampling_tile(),
        FAST_LOG=x.is_cuda,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(x.device),
    )
    return parts


def fused_gemv_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    sampling: GemvSampling | None = None,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = the product of x's transformed rows and Wᵀ, with the residual added (module docstring).

    Args:
        x: [M ≤ 16, K], or [M, 2K] (gate | up) with `silu_mul`.
        weight: [N, K] in x's dtype (nn.Linear layout), or float8_e4m3fn with `weight_scale`.
        norm_weight: [K]: RMSNorm x's rows with this weight (and `eps`) first.
        silu_mul: take silu(gate) ⊙ up of x's halves first.
        residual: [M, N]: add it to the rounded product.
        bias: [N]: add it to the float32 product before its one rounding (nn.Linear's bias; not with
            `residual`).
        weight_scale: [N] float32: W = weight · weight_scale[:, None], row by row (FP8 weights; module
            docstring).
        config: tiles, split and launch options (default: `default_config`).
        sampling: plain products only (the LM head): also sample every row's id from out
            (`GemvSampling`).

    Returns:
        out [M, N] in x's dtype.
    """
    M, N, K = _check(x, weight, norm_weight, silu_mul, residual, bias, weight_scale)
    if sampling is not None:
        if norm_weight is not None or silu_mul or residual is not None or bias is not None:
            raise ValueError("fused sampling needs a plain product (the logits)")
        check_sampling(sampling, M, x)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    fp8 = weight_scale is not None
    cfg = config or default_config(M, N, K, num_sms(x.device), norm=norm_weight is not None, fp8=fp8)
    if sampling is not None:
        cfg = cfg._replace(split_k=1)  # each program's logits whole, for its partial
    check_config(cfg)
    parts = _launch(x, weight, norm_weight, eps, silu_mul, residual, out, cfg, sampling, bias, weight_scale)
    if parts is not None:
        reduce_partials(*parts, N, sampling.ids, sampling.host_ids)
    return out


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's signature (see `reference.fused_gemv`): x [M ≤ 16, K or 2K], W [N, K] → [M, N]."""
    return fused_gemv_fwd(x, weight, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual)
