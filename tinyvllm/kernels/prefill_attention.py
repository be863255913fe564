"""FlashAttention-2 varlen causal forward over the paged KV cache (Dao 2023, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning", §3.1 algorithm, §3.2 parallelism).

Sequence s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1 (q_len rows) and seq_len = seq_lens[s]
tokens of context in the cache, this chunk's included; its row i sits at position p = seq_len − q_len + i
(a chunk of a longer prompt, or a prefix-cache hit) and computes
    out[i] = softmax(scale · q_i Kᵀ[lo(p)..p]) V[lo(p)..p],   lo(p) = 0, or max(0, p − W + 1)
with a sliding window of W keys, with query head h reading KV head h // (Hq / Hk) (GQA: K/V are never
copied per query head).

Grid (FA2 §3.2): (⌈max_seqlen_q / BLOCK_M⌉, Hq, S): one program per tile of BLOCK_M query rows of one
head of one sequence, so a single long sequence still fills the GPU. Tiles run heaviest first (the
last rows of a causal sequence see the most keys), which shortens the tail. Per program:
  1. keys 0 .. (the tile's first row position), rounded down to BLOCK_N, are visible to every row:
     unmasked tiles;
  2. the tiles on the causal diagonal, up to the tile's last row position: masked tiles;
  fully masked tiles (beyond the diagonal) are never loaded. Both passes share `flash_tiles.attn_inner`.
With a sliding window W (HAS_WINDOW; the causal kernel is compiled without any of this), the tile's
rows at positions p_min..p_max see keys from p_min − W + 1 (lowest) and all of them see keys from
p_max − W + 1 on, so a third pass comes first:
  0. from the tile holding key p_min − W + 1 up to the first tile boundary at or past p_max − W + 1:
     masked tiles (per-row window), and pass 1 starts after them.
Tiles wholly below the lowest row's window are never loaded: the work per query tile is O(W + BLOCK_M)
keys, not O(p).
Key tiles are gathered through the block table (`block_tables[s, pos // block_size]`); when a page
holds whole tiles (block_size % BLOCK_N == 0) one table entry serves a tile.
Optionally stores the logsumexp  lse[h, row] = log Σ_j exp(scale · q·k_j)  (natural log, float32).

Batch-invariant mode (INVARIANT, `invariant_prefill_attention` / `invariant_decode_attention`): a row's
result must not depend on the chunk it sits in, on its place in the query tile or on whether it is a
decode row. The unmasked pass rounds s·scale − m as one FMA where the masked pass rounds twice, and which
pass a key tile takes depends on the chunk, so under INVARIANT every tile takes the masked pass, from the
BLOCK_N-aligned tile holding the tile's lowest visible key (0, or the window's edge) up to the diagonal;
tiles are aligned to absolute positions, and a tile wholly masked for a row leaves its (acc, l, m) as
they were (p = 0, α = 1; or, before its first key, α = 0 on zeros). One config serves every chunk
(`INVARIANT_CONFIG`), and decode rows run through this same kernel as chunks of one row, so a decode row
and the prefill row at its position reduce over the same tiles in the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_tiles import attn_inner, queries_for_cache
from tinyvllm.kernels.launch import cdiv, check_kv_scales, check_paged_attention, check_window, upcast_dot

LOG2E = 1.4426950408889634


class PrefillConfig(NamedTuple):
    """Tiles of the prefill: block_m query rows per program, block_n keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Per head dim, for 16-bit inputs on Hopper (227 KB of shared memory per SM): the best of
# `bench_prefill_attention.py --sweep` (docs/perf.md section 3). Big tiles for long sequences, small ones
# (more programs) for chunks of at most SHORT_Q rows. The long entries take 5 stages, the first depth at
# which the paged key loop keeps the next tile's copies in flight (tests/kernels/test_pipeline_depth_codegen.py);
# the block-table indirection takes a stage, so the loop holds two K/V buffers, not five.
DEFAULT_CONFIGS: dict[int, PrefillConfig] = {
    16: PrefillConfig(64, 64, 4, 2),
    32: PrefillConfig(64, 64, 4, 2),
    64: PrefillConfig(128, 64, 8, 5),
    128: PrefillConfig(128, 128, 8, 5),
    256: PrefillConfig(64, 32, 4, 2),
}
SHORT_CONFIGS: dict[int, PrefillConfig] = {  # max_seqlen_q ≤ SHORT_Q
    64: PrefillConfig(64, 64, 4, 2),
    128: PrefillConfig(64, 64, 4, 2),
}
SHORT_Q = 1024

# Candidates the GPU benchmark sweeps (`bench_prefill_attention.py --sweep`): a grid of tiles, then
# five-stage pipelines.
CANDIDATE_CONFIGS: list[PrefillConfig] = [
    PrefillConfig(m, n, w, s)
    for m, n in ((128, 64), (128, 128), (64, 64), (64, 128))
    for w in (4, 8)
    for s in (2, 3, 4)
] + [
    # 5 stages: the first depth at which Triton 3.6 / 3.9 keep the next K/V tile's copies in flight across
    # the loop's wait (two buffers, `async_wait` num 1 and 3; up to 4 stages: one buffer, num 0)
    PrefillConfig(m, n, w, 5)
    for m, n, w in ((64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8))
]


def default_config(
    head_dim: int, dtype: torch.dtype, max_seqlen_q: int | None = None, device: torch.device | None = None
) -> PrefillConfig:
    """The tile config for this head dim and dtype; chunks of at most SHORT_Q rows take smaller tiles.
    Before Hopper (a CUDA device of compute capability < 9: at most 163 KB of shared memory per block)
    the long entries keep 3 stages, one K/V buffer."""
    cfg = DEFAULT_CONFIGS[head_dim]
    if max_seqlen_q is not None and max_seqlen_q <= SHORT_Q:
        cfg = SHORT_CONFIGS.get(head_dim, cfg)
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        cfg = cfg._replace(num_stages=min(cfg.num_stages, 3))
    if dtype == torch.float32:  # 4-byte tiles: halve them to stay inside shared memory
        cfg = cfg._replace(
            block_m=max(16, cfg.block_m // 2), block_n=max(16, cfg.block_n // 2), num_stages=min(cfg.num_stages, 2)
        )
    return cfg


@triton.jit(do_not_specialize=["stride_lse_h", "stride_bt"])  # they vary per step: see decode_attention
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_lse_h,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INVARIANT: tl.constexpr = False,
    DECODE_GROUP: tl.constexpr = False,
):
    """Program (query tile, head h, sequence s): out[rows] = softmax(scale · q Kᵀ) V for BLOCK_M query rows of
    head h of sequence s, causal (and inside a `window`-key sliding window with HAS_WINDOW), over the paged
    cache (FA2 Algorithm 1, §3.1; grid of §3.2). Writes the rows' logsumexp too with STORE_LSE.

    DECODE_GROUP (with INVARIANT, chunks of one row, no STORE_LSE): program (0, KV head h, sequence s), its
    tile's rows the GROUP query heads of h at the one position, so K/V are read once per group: each row
    goes through the same tiles and arithmetic as in a one-head program, at another row of the tile."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles first
    h = tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + s)
    q_len = tl.load(cu_seqlens_ptr + s + 1) - q_start
    start_m = m_tile * BLOCK_M
    if start_m >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len  # tokens before this chunk
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    if DECODE_GROUP:  # h is a KV head; the tile's rows are its GROUP query heads at the one position
        heads = h * GROUP + tl.arange(0, BLOCK_M)
        row_valid = tl.arange(0, BLOCK_M) < GROUP
        q_pos = ctx + tl.zeros([BLOCK_M], tl.int32)
        q_rows = q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        o_rows = q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        kv_off = h.to(tl.int64) * stride_kh
    else:
        row_valid = offs_m < q_len
        q_pos = ctx + offs_m
        q_rows = rows[:, None] * stride_qt + h * stride_qh
        o_rows = rows[:, None] * stride_ot + h * stride_oh
        kv_off = (h // GROUP).to(tl.int64) * stride_kh
    q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q = queries_for_cache(q, k_cache_ptr)

    k_ptr = k_cache_ptr + kv_off
    v_ptr = v_cache_ptr + kv_off
    bt_row_ptr = block_tables_ptr + s.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi_full = ((ctx + start_m + 1) // BLOCK_N) * BLOCK_N
    lo_full = 0
    kv_start = 0
    if INVARIANT:  # every tile masked (module docstring): pass 2 only, from the first visible key's tile
        if HAS_WINDOW:
            kv_start = tl.maximum(ctx + start_m - window + 1, 0)
        hi_full = (kv_start // BLOCK_N) * BLOCK_N
        lo_full = hi_full  # pass 1 is empty
    elif HAS_WINDOW:
        # 0. The window's lower edge: keys some rows see and others do not. lo_full ∈ [kv_start, hi_full].
        kv_start = tl.maximum(ctx + start_m - window + 1, 0)  # the lowest key the tile's first row sees
        p_max = ctx + tl.minimum(start_m + BLOCK_M, q_len) - 1  # the tile's last row
        lo_full = tl.minimum(tl.cdiv(tl.maximum(p_max - window + 1, 0), BLOCK_N) * BLOCK_N, hi_full)
        acc, l_i, m_i = attn_inner(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_ptr,
            v_ptr,
            bt_row_ptr,
            (kv_start // BLOCK_N) * BLOCK_N,
            lo_full,
            seq_len,
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
    # 1. Off the diagonal: keys lo_full .. ctx + start_m are visible to every row of the tile.
    acc, l_i, m_i = attn_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        lo_full,
        hi_full,
        seq_len,
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
    # 2. On the diagonal: up to the last row's position, masked.
    hi = tl.minimum(ctx + start_m + BLOCK_M, seq_len)
    acc, l_i, m_i = attn_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        hi_full,
        hi,
        seq_len,
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

    if HAS_WINDOW:  # a padding row past q_len may see no key at all: keep it finite (it is not stored)
        l_i = tl.where(row_valid, l_i, 1.0)
    if INVARIANT:  # a decode row of an empty (padded) sequence sees no key: zeros, as the reference's
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / (l_i / v_scale)[:, None]  # v_scale: an FP8 cache's (1 otherwise: the same bits as acc / l_i)
    tl.store(
        out_ptr + o_rows + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
    if STORE_LSE:
        lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back from log2 to natural log
        tl.store(lse_ptr + h * stride_lse_h + rows, lse, mask=row_valid)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int | None,
) -> None:
    """Validate the arguments (shapes, dtypes, devices, strides, window)."""
    check_paged_attention(
        q, k_cache, v_cache, scale, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, block_tables=block_tables
    )
    check_window(window)
    S = seq_lens.shape[0]
    if cu_seqlens_q.shape != (S + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != S:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, seq_lens {tuple(seq_lens.shape)} and "
            f"block_tables {tuple(block_tables.shape)} disagree on the number of sequences"
        )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    cfg: PrefillConfig,
    window: int | None,
    invariant: bool = False,
    decode_group: bool = False,
    v_scale: float = 1.0,
) -> None:
    """Launch `_prefill_kernel` on the grid (query tiles of the longest chunk, heads, sequences); with
    `decode_group` (chunks of one row), (1, KV heads, sequences)."""
    _, Hq, D = q.shape
    _, Hk, block_size, _ = k_cache.shape
    if decode_group:
        assert invariant and lse is None and max_seqlen_q == 1 and Hq // Hk <= cfg.block_m
        grid = (1, Hk, seq_lens.shape[0])
    else:
        grid = (cdiv(max_seqlen_q, cfg.block_m), Hq, seq_lens.shape[0])
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        lse if lse is not None else out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale * LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        window or 0,
        GROUP=Hq // Hk,
        HEAD_DIM=D,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        PAGE_TILE=block_size % cfg.block_n == 0,
        STORE_LSE=lse is not None,
        UPCAST=upcast_dot(q.device),
        IEEE=q.dtype == torch.float32,
        HAS_WINDOW=window is not None,
        INVARIANT=invariant,
        DECODE_GROUP=decode_group,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def prefill_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    *,
    window: int | None = None,
    return_lse: bool = False,
    config: PrefillConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of packed prompt chunks over the paged cache (module docstring).

    Rows past cu_seqlens_q[-1] are left unwritten, as in the reference.

    Args:
        q: [Tq, Hq, D] query rows of every chunk, packed.
        k_cache, v_cache: [num_blocks, Hk, block_size, D], q's dtype or float8_e4m3fn.
        cu_seqlens_q: [S + 1] int32 row offsets of the chunks; seq_lens: [S] int32 context lengths
            including the chunk; block_tables: [S, max_blocks] int32.
        scale: the softmax scale, positive (the unmasked tiles take the row max before scaling).
        max_seqlen_q: the longest chunk (it sizes the grid); None: computed, which synchronises with the
            device.
        window: a sliding window of this many keys (the row at p sees keys max(0, p − window + 1)..p),
            or None (causal; compiled without the window code).
        return_lse: also return the rows' logsumexp (natural log, float32).
        config: the tile config (default: `default_config`).
        k_scale, v_scale: an FP8 cache's scales (K = cache · k_scale, V = cache · v_scale; ignored for a
            cache in q's dtype): k_scale joins the softmax scale, v_scale the output's normalisation.

    Returns:
        (out [Tq, Hq, D], lse [Hq, Tq] or None).
    """
    _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window)
    if k_cache.dtype == torch.float8_e4m3fn:
        check_kv_scales(k_scale, v_scale)
        scale = scale * k_scale  # the returned lse is then that of the dequantized keys, as it should be
    else:
        v_scale = 1.0
    Tq, Hq, D = q.shape
    out = torch.empty((Tq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, Tq), dtype=torch.float32, device=q.device) if return_lse else None
    if Tq == 0 or seq_lens.shape[0] == 0:
        return out, lse
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cfg = config or default_config(D, q.dtype, max_seqlen_q, q.device)
    _launch(
        q,
        k_cache,
        v_cache,
        out,
        lse,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale,
        max_seqlen_q,
        cfg,
        window,
        v_scale=v_scale,
    )
    return out, lse


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The reference's signature (see `reference.prefill_attention`): q [Tq, Hq, D] → out [Tq, Hq, D]."""
    out, _ = prefill_attention_fwd(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale,
        max_seqlen_q,
        window=window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return out


def invariant_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The one tile config of the batch-invariant mode: the short-chunk config, whatever the chunk."""
    return default_config(head_dim, dtype, max_seqlen_q=1)


def invariant_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`prefill_attention`, batch-invariant (module docstring): every tile masked, one tile config."""
    _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, window)
    out = torch.empty_like(q)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cfg = invariant_config(q.shape[2], q.dtype)
    _launch(
        q, k_cache, v_cache, out, None, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, cfg, window, True
    )
    return out


def invariant_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    prefix_len: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """reference.decode_attention's function as `invariant_prefill_attention` over chunks of one row: a
    decode row reduces over the same key tiles, in the same order, as the prefill row at its position.
    A program serves a KV head's whole query group (DECODE_GROUP: K/V read once per group, as the split
    decode kernel reads them). No split-KV and no cascade (`prefix_len` is ignored)."""
    _check(
        q,
        k_cache,
        v_cache,
        torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device),
        seq_lens,
        block_tables,
        scale,
        window,
    )
    out = torch.empty_like(q)
    B, Hq, D = q.shape
    if B == 0:
        return out
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    cfg = invariant_config(D, q.dtype)
    if Hq // k_cache.shape[1] > cfg.block_m:  # a group larger than the tile: one head per program
        return invariant_prefill_attention(q, k_cache, v_cache, cu, seq_lens, block_tables, scale, 1, window)
    _launch(q, k_cache, v_cache, out, None, cu, seq_lens, block_tables, scale, 1, cfg, window, True, True)
    return out


__all__ = [
    "CANDIDATE_CONFIGS",
    "DEFAULT_CONFIGS",
    "PrefillConfig",
    "default_config",
    "invariant_config",
    "invariant_decode_attention",
    "invariant_prefill_attention",
    "prefill_attention",
    "prefill_attention_fwd",
]
