"""Paged decode attention, one query token per sequence, split-KV ("Flash-Decoding", Dao, Haziza,
Massa & Sizov 2023) over the FlashAttention-2 inner loop (Dao 2023, Algorithm 1):

    out[b] = softmax(scale · q_b Kᵀ[lo_b..L_b−1]) V[lo_b..L_b−1],   L_b = seq_lens[b];  L_b = 0 → zeros,
with lo_b = 0, or lo_b = max(0, L_b − W) under a sliding window of W keys.

Decode reads every K/V byte once and does ~1 FLOP per byte: it is bound by memory bandwidth, so the
design is about bytes and about keeping enough loads in flight:
  * GQA: a program serves all GROUP = Hq/Hk query heads that share a KV head; their q rows form the
    M side of a `tl.dot` (padded to 16 rows), so each KV page is loaded once per group, not per head.
  * Split-KV: grid (num_splits, Hk, B). The host picks num_splits from B·Hk and the longest context so
    that even batch 1 at 32k keeps every SM busy; each sequence's context is cut into num_splits
    chunks of whole BLOCK_N tiles (chunk sizes are computed per sequence in the kernel, so any
    seq_lens ≤ the block table's reach is covered whatever hint the host had).
  * Each split writes its normalised partial output and its logsumexp (log2 units); a second kernel
    merges splits:  out = Σ_s 2^(lse_s − M) o_s / Σ_s 2^(lse_s − M),  M = max_s lse_s.
    With one split the first kernel writes the output directly and the merge is skipped. With
    `fold_merge` there is no second launch: each split takes its (sequence, KV head)'s ticket after
    storing its partial, and the split that takes the last one merges the group's heads (in split order,
    the merge kernel's arithmetic: the same bits whoever merges) and resets the ticket, so the tickets
    (a persistent zeroed buffer, `_tickets`) are zero again after every launch and a CUDA graph replays it.
  * A tile is BLOCK_N tokens (several pages of 16), its page ids read once per tile from the block
    table, its K and V rows gathered and software-pipelined (num_stages) so loads stay in flight.
  * Sliding window (HAS_WINDOW, a constexpr: the causal kernels are compiled without it): the split
    range starts at the tile holding lo_b, so only the window's ~W/BLOCK_N tiles are read, and the
    splits are sized for W keys, not the context. Keys below lo_b are never loaded (their blocks may be
    freed); only the first tile is masked. The merge is unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.attention_metadata import CASCADE_ALIGN  # the tile of both kernels
from tinyvllm.kernels.flash_tiles import attn_inner, queries_for_cache
from tinyvllm.kernels.grid_dependency import wait_for_previous
from tinyvllm.kernels.launch import (
    cdiv,
    check_kv_scales,
    check_paged_attention,
    check_window,
    next_power_of_2,
    num_sms,
    upcast_dot,
)
from tinyvllm.kernels.pdl import options as pdl_options

LOG2E = 1.4426950408889634
MAX_SPLITS = 256
CASCADE_ROWS = 64  # query rows per program of the prefix kernel (sequences × padded group)


class DecodeConfig(NamedTuple):
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    programs_per_sm: int  # split target: B·Hk·num_splits ≈ programs_per_sm · SMs
    min_tiles_per_split: int
    fold_merge: bool = False  # the last split of each (sequence, KV head) merges (module docstring)
    prefix_splits: int = 4  # cascade: the shared prefix's keys cut into this many programs per chunk
    # cascade: the prefix kernel's num_stages (0: 3, which keeps one K/V buffer and waits for every copy
    # each tile; from 5 its key loop keeps two buffers with the next tile's copies in flight)
    prefix_stages: int = 0
    # cascade: the prefix kernel on a second stream, beside the splits (a fork and a join, captured into
    # CUDA graphs as two branches): its tensor-core products overlap the splits' memory-bound reads
    prefix_stream: bool = True


# The best of `bench_decode_attention.py --sweep` on the H200: 64-key tiles (4 pages of 16) with 2 warps
# and 3 stages, about 4 programs per SM.
DEFAULT_CONFIG = DecodeConfig(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4, min_tiles_per_split=1)
# Over an FP8 (e4m3) cache, whose tiles hold half the bytes: bf16's until `bench_decode_attention.py --sweep
# --fp8` (which sweeps the candidates over the FP8 cache too) times them.
FP8_CONFIG = DEFAULT_CONFIG

# Candidates the GPU benchmark sweeps (`bench_decode_attention.py --sweep`). Stages: Triton 3.6 and 3.9
# compile the key loop with one K/V buffer and a full wait each tile up to 4 stages; from 5 they keep two
# buffers and the next tile's copies in flight across the wait (`async_wait` num 1 and 3), the first real
# prefetch (the folded merge measured slower and is left out).
CANDIDATE_CONFIGS: list[DecodeConfig] = [
    DecodeConfig(n, w, s, p, 1) for n in (64, 128) for w in (2, 4) for s in (3, 5) for p in (2, 4, 8)
]


def num_splits_for(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    sms: int,
    cfg: DecodeConfig = DEFAULT_CONFIG,
    window: int | None = None,
) -> int:
    """Splits per (sequence, KV head): enough programs for `programs_per_sm` per SM, but no split
    shorter than `min_tiles_per_split` tiles, and no empty splits for the longest sequence (whose keys
    are at most window + BLOCK_N − 1 from its first read tile on, under a sliding window)."""
    keys = max_seq_len if window is None else min(max_seq_len, window + cfg.block_n - 1)
    tiles = max(1, cdiv(keys, cfg.block_n))
    want = cdiv(cfg.programs_per_sm * sms, max(1, batch * num_kv_heads))
    splits = max(1, min(want, cdiv(tiles, cfg.min_tiles_per_split), MAX_SPLITS))
    return cdiv(tiles, cdiv(tiles, splits))


# Values that vary from step to step (split count, block-table width) are not specialised on: each new
# value class (1, a multiple of 16, other) would otherwise compile another kernel mid-run.
@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    prefix_len_ptr,
    tickets_ptr,
    qk_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    CASCADE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FOLD: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):
    """Program (split, KV head, sequence): keys [start + split·chunk, ...) of the sequence, where start
    is 0, or with CASCADE the shared prefix's length (`_prefix_kernel` covers the keys before it), or
    with HAS_WINDOW at least the tile holding the window's first key seq_len − window. FOLD (with SPLIT):
    the last split to take the (sequence, KV head)'s ticket at tickets_ptr [B, Hk] merges the group's
    partials into out and resets the ticket (module docstring). PDL: launched as a dependent
    (kernels/pdl.py)."""
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_splits = tl.num_programs(0)
    wait_for_previous(PDL)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if CASCADE:
        start = tl.minimum(tl.load(prefix_len_ptr), seq_len)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
        start = tl.maximum(start, (kv_start // BLOCK_N) * BLOCK_N)
    chunk = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, seq_len), lo)
    hi_full = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    lo_full = lo

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    g_valid = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_valid[:, None], other=0.0)
    q = queries_for_cache(q, k_cache_ptr)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (seq_len - 1)

    kv_off = kvh.to(tl.int64) * stride_kh
    bt_row_ptr = block_tables_ptr + b * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    if HAS_WINDOW:  # the tile holding the window's first key, in the split that starts there: masked
        lo_full = tl.minimum(tl.maximum(tl.cdiv(kv_start, BLOCK_N) * BLOCK_N, lo), hi_full)
        acc, l_i, m_i = attn_inner(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_cache_ptr + kv_off,
            v_cache_ptr + kv_off,
            bt_row_ptr,
            lo,
            lo_full,
            hi,
            qk_scale,
            stride_kb,
            stride_kt,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_SIZE,
            PAGE_TILE,
            True,
            UPCAST,
            IEEE,
            kv_start,
            window,
            True,
        )
    acc, l_i, m_i = attn_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr + kv_off,
        v_cache_ptr + kv_off,
        bt_row_ptr,
        lo_full,
        hi_full,
        hi,
        qk_scale,
        stride_kb,
        stride_kt,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_SIZE,
        PAGE_TILE,
        False,
        UPCAST,
        IEEE,
    )
    acc, l_i, m_i = attn_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr + kv_off,
        v_cache_ptr + kv_off,
        bt_row_ptr,
        hi_full,
        hi,
        hi,
        qk_scale,
        stride_kb,
        stride_kt,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_SIZE,
        PAGE_TILE,
        True,
        UPCAST,
        IEEE,
        kv_start,
        window,
        HAS_WINDOW,
    )
    empty = l_i == 0.0  # no keys in this split (or a zero-length sequence)
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i / v_scale)[:, None])
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        p_off = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_lse_ptr + p_off, lse, mask=g_valid)
        # part_o [B, Hq, splits, D] is part_lse [B, Hq, splits] with HEAD_DIM values per entry
        tl.store(part_o_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_valid[:, None])
        if FOLD:
            tl.debug_barrier()  # every thread's partial stored before the release
            ticket_ptr = tickets_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                for g in range(GROUP):
                    _merge_head(
                        part_o_ptr, part_lse_ptr, out_ptr, b, kvh * GROUP + g, num_splits,
                        stride_pb, stride_ph, stride_ps, stride_ob, stride_oh, BLOCK_S, HEAD_DIM, True,
                    )  # fmt: skip
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_valid[:, None],
        )


@triton.jit(do_not_specialize=["B", "slot", "stride_pb", "stride_ph", "stride_bt"])
def _prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    prefix_len_ptr,
    qk_scale,
    v_scale,
    B,
    slot,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    window,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    SEQS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Cascade attention's shared part: program (KV head, chunk of SEQS sequences) attends the
    SEQS·GROUP query rows of its chunk to keys [0, prefix_len), which every sequence of the batch holds
    in the same cache blocks (those of row 0 of the block table). A prefix of P keys is thus read once
    per chunk instead of once per sequence, and its scores are a [SEQS·G_PAD, BLOCK_N] matrix product
    (G_PAD: GROUP rounded up to a power of two). Writes each row's normalised partial output and
    logsumexp (log2) into split `slot` for the merge; rows of empty sequences (seq_len 0: graph
    padding) write an empty split. Grid axis 2 cuts the prefix's tiles into num_programs(2) ranges
    (split-K over the shared keys, so that a large batch's few chunks still fill the SMs), range s
    writing its partial into split slot + s (an empty range writes an empty split). With HAS_WINDOW a
    row sees only the prefix keys from its own window's first key seq_len − window on: the tiles from
    the chunk's lowest window start to the first tile boundary at or past its highest are masked per
    row, and the tiles below every row's window are not read (a row whose window starts past the prefix
    writes an empty split)."""
    kvh = tl.program_id(0)
    chunk = tl.program_id(1)
    part = tl.program_id(2)
    M: tl.constexpr = SEQS * G_PAD
    offs_m = tl.arange(0, M)
    seq = chunk * SEQS + offs_m // G_PAD
    g = offs_m % G_PAD
    heads = kvh * GROUP + g
    valid = (seq < B) & (g < GROUP)
    seq_len = tl.load(seq_lens_ptr + seq, mask=valid, other=0)
    live = seq_len > 0
    offs_d = tl.arange(0, HEAD_DIM)
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0
    )
    q = queries_for_cache(q, k_cache_ptr)
    prefix_len = tl.load(prefix_len_ptr)
    kv_off = kvh.to(tl.int64) * stride_kh
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, HEAD_DIM], dtype=tl.float32)
    q_pos = tl.full([M], 0, tl.int32) + prefix_len  # every row sees the whole prefix
    part_len = tl.cdiv(tl.cdiv(prefix_len, BLOCK_N), tl.num_programs(2)) * BLOCK_N
    lo_part = tl.minimum(part * part_len, prefix_len)  # this program's keys: [lo_part, hi_part)
    hi_part = tl.minimum(lo_part + part_len, prefix_len)
    lo_full = lo_part
    if HAS_WINDOW:
        row_start = tl.maximum(seq_len - window, 0)  # each row's first visible key
        kv_start = tl.min(tl.where(live, row_start, prefix_len), 0)
        lo_full = tl.minimum(tl.cdiv(tl.max(tl.where(live, row_start, 0), 0), BLOCK_N) * BLOCK_N, prefix_len)
        lo_full = tl.maximum(lo_full, (kv_start // BLOCK_N) * BLOCK_N)
        lo_masked = tl.maximum((kv_start // BLOCK_N) * BLOCK_N, lo_part)  # the masked tiles in this range
        lo_full = tl.minimum(tl.maximum(lo_full, lo_part), hi_part)
        acc, l_i, m_i = attn_inner(
            acc,
            l_i,
            m_i,
            q,
            seq_len - 1,  # the rows' own positions: past the prefix, so only the window masks
            k_cache_ptr + kv_off,
            v_cache_ptr + kv_off,
            block_tables_ptr,
            tl.minimum(lo_masked, lo_full),
            lo_full,
            prefix_len,
            qk_scale,
            stride_kb,
            stride_kt,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_SIZE,
            PAGE_TILE,
            True,
            UPCAST,
            IEEE,
            kv_start,
            window,
            True,
        )
    acc, l_i, m_i = attn_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr + kv_off,
        v_cache_ptr + kv_off,
        block_tables_ptr,
        lo_full,
        hi_part,
        prefix_len,
        qk_scale,
        stride_kb,
        stride_kt,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_SIZE,
        PAGE_TILE,
        False,
        UPCAST,
        IEEE,
    )
    empty = (l_i == 0.0) | (seq_len <= 0)
    o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i / v_scale)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    p_off = seq64 * stride_pb + heads * stride_ph + (slot + part) * stride_ps
    tl.store(part_lse_ptr + p_off, lse, mask=valid)
    tl.store(part_o_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :], o, mask=valid[:, None])


@triton.jit
def _merge_head(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    b,
    h,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FROM_L2: tl.constexpr,
):
    """out[b, h] = Σ_s 2^(lse_s − m) o_s / Σ_s 2^(lse_s − m), m the running max, over the head's
    num_splits partials read BLOCK_S at a time in split order. FROM_L2: `.cg` loads, for partials other
    programs of the same launch stored (an SM's L1 does not see them)."""
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    num = tl.zeros([HEAD_DIM], dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_valid = offs_s < num_splits
        p_off = b * stride_pb + h * stride_ph + offs_s * stride_ps
        o_ptrs = part_o_ptr + p_off[:, None] * HEAD_DIM + offs_d[None, :]
        if FROM_L2:
            lse = tl.load(part_lse_ptr + p_off, mask=s_valid, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(o_ptrs, mask=s_valid[:, None], other=0.0, cache_modifier=".cg")
        else:
            lse = tl.load(part_lse_ptr + p_off, mask=s_valid, other=float("-inf"))
            o = tl.load(o_ptrs, mask=s_valid[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: 2^-inf = 0 below
        alpha = tl.math.exp2(m - safe)
        w = tl.math.exp2(lse - safe)
        num = num * alpha + tl.sum(w[:, None] * o, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph"])
def _merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_merge_head` for program (head, sequence) (one compiled kernel for every split count). PDL:
    launched as a dependent (kernels/pdl.py)."""
    wait_for_previous(PDL)
    _merge_head(
        part_o_ptr, part_lse_ptr, out_ptr, tl.program_id(1).to(tl.int64), tl.program_id(0), num_splits,
        stride_pb, stride_ph, stride_ps, stride_ob, stride_oh, BLOCK_S, HEAD_DIM, False,
    )  # fmt: skip


_TICKETS: dict[torch.device, torch.Tensor] = {}
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The CUDA stream the cascade's prefix kernel runs on beside the splits (`DecodeConfig.prefix_stream`),
    one per device, kept across calls; None off CUDA, and while a CUDA graph is being captured before
    the stream exists (a stream made then would not be part of the capture's setup): the caller then
    launches the prefix on the current stream."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def _tickets(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least n tickets on `device`, kept across calls (the folded merge leaves
    it zeroed); None while a CUDA graph is being captured and the buffer is missing or too small (an
    allocation then would belong to the graph's pool): the caller merges with the separate kernel."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _TICKETS[device] = buf
    return buf


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> None:
    """Validate the arguments (shapes, dtypes, devices, strides)."""
    check_paged_attention(q, k_cache, v_cache, scale, seq_lens=seq_lens, block_tables=block_tables)
    B = q.shape[0]
    if seq_lens.shape != (B,) or block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(
            f"q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)} and block_tables "
            f"{tuple(block_tables.shape)} disagree on the batch size"
        )


def _launch_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    parts: tuple[torch.Tensor, torch.Tensor] | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_len: torch.Tensor | None,
    scale: float,
    num_splits: int,
    cfg: DecodeConfig,
    window: int | None,
    v_scale: float = 1.0,
    tickets: torch.Tensor | None = None,
) -> None:
    """`_decode_kernel` on the grid (num_splits, Hk, B): into `out` where `parts` is None (one split, no
    cascade), else into the partials parts = (part_o, part_lse), and with `tickets` ([≥ B·Hk] int32,
    zeroed) merged by the last split of each (sequence, KV head) into `out` too."""
    B, Hq, D = q.shape
    _, Hk, block_size, _ = k_cache.shape
    if parts is None:
        part_o, part_lse, part_strides = out, out, (0, 0, 0)
    else:
        part_o, part_lse = parts
        part_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    _decode_kernel[(num_splits, Hk, B)](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        seq_lens,
        block_tables,
        prefix_len if prefix_len is not None else seq_lens,
        tickets if tickets is not None else seq_lens,
        scale * LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *part_strides,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        window or 0,
        GROUP=Hq // Hk,
        BLOCK_G=max(16, next_power_of_2(Hq // Hk)),
        HEAD_DIM=D,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        PAGE_TILE=block_size % cfg.block_n == 0,
        SPLIT=parts is not None,
        CASCADE=prefix_len is not None,
        UPCAST=upcast_dot(q.device),
        IEEE=q.dtype == torch.float32,
        HAS_WINDOW=window is not None,
        FOLD=tickets is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(q.device),
    )


def _launch_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_len: torch.Tensor,
    scale: float,
    slot: int,
    window: int | None,
    v_scale: float = 1.0,
    prefix_splits: int = 1,
    prefix_stages: int = 0,
) -> None:
    """`_prefix_kernel` on the grid (Hk, chunks of sequences, prefix_splits): the shared prefix's
    partials into slots slot .. slot + prefix_splits − 1, compiled with num_stages prefix_stages (0: 3)."""
    B, Hq, D = q.shape
    _, Hk, block_size, _ = k_cache.shape
    g_pad = next_power_of_2(Hq // Hk)
    seqs = max(1, CASCADE_ROWS // g_pad)
    _prefix_kernel[(Hk, cdiv(B, seqs), prefix_splits)](
        q,
        k_cache,
        v_cache,
        part_o,
        part_lse,
        seq_lens,
        block_tables,
        prefix_len,
        scale * LOG2E,
        v_scale,
        B,
        slot,
        q.stride(0),
        q.stride(1),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        window or 0,
        GROUP=Hq // Hk,
        G_PAD=g_pad,
        SEQS=seqs,
        HEAD_DIM=D,
        BLOCK_N=CASCADE_ALIGN,
        BLOCK_SIZE=block_size,
        PAGE_TILE=block_size % CASCADE_ALIGN == 0,
        UPCAST=upcast_dot(q.device),
        IEEE=q.dtype == torch.float32,
        HAS_WINDOW=window is not None,
        num_warps=4,
        num_stages=prefix_stages or 3,
    )


def decode_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
    prefix_len: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged decode attention of one query token per sequence (module docstring).

    Args:
        q: [B, Hq, D]; k_cache, v_cache: [num_blocks, Hk, block_size, D], q's dtype or float8_e4m3fn.
        seq_lens: [B] int32 context lengths (0: a padded row, whose output is zeros).
        block_tables: [B, max_blocks] int32.
        scale: the softmax scale, positive.
        max_seq_len: a bound on seq_lens that sizes the split count (None: the block table's reach).
        config: tile and split choices (default: DEFAULT_CONFIG, FP8_CONFIG over an FP8 cache).
        num_splits: splits per (sequence, KV head) (None: `num_splits_for`).
        prefix_len: cascade attention, a device int32 tensor of one element, P: the first P keys of
            every sequence with seq_len > 0 sit in the same cache blocks (block table row 0's), P is a
            multiple of the tile size (`CASCADE_ALIGN`) and every such sequence has seq_len > P. The
            shared keys are then attended once per chunk of sequences (`_prefix_kernel`) and the rest per
            sequence, merged by logsumexp; P = 0 is allowed (nothing is shared). Read on the device, so a
            CUDA graph captured with it serves any P. With a window, a row reads only the prefix keys
            inside its window (the others may sit in freed blocks).
        window: a sliding window of this many keys (row b sees keys max(0, L_b − window)..L_b − 1), or
            None (all keys; compiled without the window code).
        k_scale, v_scale: an FP8 cache's scales (K = cache · k_scale, V = cache · v_scale; ignored for a
            cache in q's dtype): k_scale joins the softmax scale, v_scale the output's normalisation.

    Returns:
        out [B, Hq, D].
    """
    _check(q, k_cache, v_cache, seq_lens, block_tables, scale)
    check_window(window)
    if k_cache.dtype == torch.float8_e4m3fn:
        check_kv_scales(k_scale, v_scale)
        scale = scale * k_scale
    else:
        v_scale = 1.0
    B, Hq, D = q.shape
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    cfg = config or (FP8_CONFIG if k_cache.dtype == torch.float8_e4m3fn else DEFAULT_CONFIG)
    cascade = prefix_len is not None
    if cascade and cfg.block_n != CASCADE_ALIGN:
        raise ValueError(f"cascade attention needs {CASCADE_ALIGN}-key tiles, the config has {cfg.block_n}")
    if max_seq_len is None:  # no hint: plan for the longest context the block table can address
        max_seq_len = block_tables.shape[1] * k_cache.shape[2]
    if num_splits is None:
        num_splits = num_splits_for(B, k_cache.shape[1], max_seq_len, num_sms(q.device), cfg, window)
    if num_splits == 1 and not cascade:
        _launch_splits(q, k_cache, v_cache, out, None, seq_lens, block_tables, None, scale, 1, cfg, window, v_scale)
        return out
    slots = num_splits + cascade * cfg.prefix_splits  # the prefix's partials go into the last slots
    part_o = torch.empty((B, Hq, slots, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, slots), dtype=torch.float32, device=q.device)
    parts = (part_o, part_lse)
    tickets = _tickets(q.device, B * k_cache.shape[1]) if cfg.fold_merge and not cascade else None

    def prefix() -> None:  # the shared prefix's partials, into their own slots
        _launch_prefix(
            q, k_cache, v_cache, part_o, part_lse, seq_lens, block_tables, prefix_len, scale, num_splits, window,
            v_scale, cfg.prefix_splits, cfg.prefix_stages,
        )  # fmt: skip

    side = _side_stream(q.device) if cascade and cfg.prefix_stream else None
    if side is not None:  # fork: the prefix beside the splits
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):
            prefix()
    _launch_splits(
        q, k_cache, v_cache, out, parts, seq_lens, block_tables, prefix_len, scale, num_splits, cfg, window, v_scale,
        tickets,
    )  # fmt: skip
    if tickets is not None:
        return out
    if side is not None:  # join: the merge reads both
        torch.cuda.current_stream(q.device).wait_stream(side)
    elif cascade:
        prefix()
    part_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    _merge_kernel[(Hq, B)](
        part_o, part_lse, out, slots, *part_strides, out.stride(0), out.stride(1), BLOCK_S=16, HEAD_DIM=D, num_warps=4,
        **pdl_options(q.device),
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    prefix_len: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The reference's signature (see `reference.decode_attention`): q [B, Hq, D] → out [B, Hq, D]."""
    return decode_attention_fwd(
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        scale,
        max_seq_len,
        prefix_len=prefix_len,
        window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
