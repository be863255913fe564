"""FlashAttention-2 backward over contiguous, packed Q/K/V (Dao 2023, "FlashAttention-2", §3.1.2 and
Algorithm 2; notation of the Triton fused-attention tutorial).

For one head of one sequence, with S = scale · Q Kᵀ (causally masked or not), P = softmax(S) and
O = P V, the gradients of a loss with upstream gradient dO are
    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D),   dQ = scale · dS K,   dK = scale · dSᵀ Q,
    D  = rowsum(dO ∘ O)  (= rowsum(P ∘ dP), a row's ⟨dO, O⟩).
P is never stored: each tile recomputes it from the forward's logsumexp L as P = exp(S − L), which is
exp2(qk · qk_scale − L · log2 e) with qk_scale = scale · log2 e (one exp2 per score).

Kernels:
  1. `_bwd_preprocess_kernel`: D = rowsum(dO ∘ O) per (query head, row), in the accumulation dtype; in
     the fused modes below it also zeroes the float32 dQ accumulator.
  2. `_bwd_dkdv_kernel` (FA2 §3.2, the backward's sequence parallelism): one program per (key tile of
     BLOCK_N keys, KV head, sequence) loads K_j, V_j once, keeps dK_j, dV_j in registers and streams
     the query tiles (Q, dO, L, D) of every query head of the KV head's group (GQA/MQA: dK and dV are
     summed over the group in registers; K and V are never repeated). Causal: query tiles wholly
     before the key tile are skipped, those that straddle the diagonal are masked (a loop of their
     own), the rest run unmasked.
  3. dQ, by one of three modes (`BackwardConfig.dq_mode`):
     * "separate" (deterministic): `_bwd_dq_kernel`, one program per (query tile, query head, sequence),
       accumulates dQ_i over the key tiles it sees (the forward's loop shape, the same split into
       unmasked tiles then the masked diagonal); it recomputes S and dP, 7 matrix products per score
       tile where 5 are needed, and a second exp2 per score.
     * "atomic" (not deterministic, FA2's Algorithm 2 line 13): kernel 2 also computes dS_i K_j for
       each query tile it visits and adds it to a float32 dQ accumulator with atomic adds; the order
       of the adds into one element varies from run to run, so the float32 sums (and their rounding
       to the output dtype) may differ in the last bits. `_bwd_dq_convert_kernel` then writes
       dQ = scale · accumulator in the input dtype.
     * "ordered" (deterministic, FlashAttention-3's deterministic mode): as "atomic", but the adds into
       query tile i happen in key-tile order: a per-(sequence, head, query tile) ticket counts the key
       tiles that have added; key tile j spins (one thread, acquire) until the ticket reads j, adds,
       and releases j + 1. Every key tile 0 .. j − 1 of a sequence visits each query tile that key tile
       j visits (causal skipping only drops query tiles before a key tile), so the ticket reaches j;
       and program j − 1 of a (KV head, sequence) has the lower block index, so it is running or done
       whenever program j waits (CUDA starts blocks in index order; the interpreter runs the grid in
       order of the key-tile axis), so the wait always ends.
Rows past a sequence's end load Q = dO = 0 (and L = D = 0), so in kernel 2 they add exactly zero to dK
and dV; key rows past the end are loaded as zero, so they add zero to dQ, and their dK, dV are never
stored. Accumulation is float32 (float64 for float64 inputs); products of 16-bit inputs round P and dS
to the input dtype first, as FA2. All row offsets are int64.

Hopper options (`BackwardConfig`'s dkdv_tma, dq_tma, dkdv_ws, dq_ws; without them, the kernels above;
`HOPPER_BACKWARD` turns on the dK/dV kernel's at head dim 128). TMA: a kernel reads its Q, K, V and dO
tiles through tensor descriptors built in the kernel per (sequence, head) (`_seq_rows`, TMA copies on
sm_90), each ending at its sequence's end, so the rows past it read as zeros exactly as the masked
loads do. WS (with TMA): the kernel's query- (dK/dV) or key-tile (dQ) loop is asked to be
warp-specialised (`tl.range(..., warp_specialize=True)`); Triton 3.9 specialises only a kernel whose
loop is one loop without branches and without pointer loads of vectors, so in this form the two loops
become one with every tile masked, tiles past a sequence run empty loops instead of returning early,
and the per-row statistics (L · log2 e, D) are read through descriptors from 16-byte rows that
`_bwd_stats_kernel` packs before each kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_forward import upcast_operands
from tinyvllm.kernels.flash_tiles import dot_pv, dot_qk
from tinyvllm.kernels.launch import cdiv, ensure_tma_allocator, tma_usable

LOG2E = 1.4426950408889634
DQ_MODES = {"separate": 0, "atomic": 1, "ordered": 2}  # the DQ_MODE constexpr of `_bwd_dkdv_kernel`


@triton.jit
def _bwd_preprocess_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    dq_acc_ptr,
    T,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_delta_h,
    stride_at,
    stride_ah,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):
    """Program (row tile, query head h): delta[h, rows] = Σ_d dO[rows, h, d] · O[rows, h, d]; ZERO_DQ:
    also dq_acc[rows, h, :] = 0 (the fused dQ modes' accumulator)."""
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = rows < T
    o = tl.load(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=valid[:, None], other=0.0)
    acc_dtype = tl.float64 if o.dtype == tl.float64 else tl.float32
    delta = tl.sum(o.to(acc_dtype) * do.to(acc_dtype), axis=1)
    tl.store(delta_ptr + h * stride_delta_h + rows, delta, mask=valid)
    if ZERO_DQ:
        zero = tl.zeros([BLOCK_M, HEAD_DIM], dtype=dq_acc_ptr.dtype.element_ty)
        tl.store(dq_acc_ptr + rows[:, None] * stride_at + h * stride_ah + offs_d[None, :], zero, mask=valid[:, None])


@triton.jit
def _seq_rows(base, seq_len, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A tensor descriptor (TMA on sm_90) over one sequence's rows of one head: [seq_len, HEAD_DIM]
    elements from `base` (the sequence's first row of the head), row stride stride_t, loaded as
    [BLOCK, HEAD_DIM] tiles. The descriptor ends where the sequence ends, so rows from seq_len on load as
    zeros, exactly as the masked pointer loads: no row of the next sequence is ever read. An empty
    sequence's descriptor spans one row (a TMA dimension may not be 0); nothing loaded for it is stored.
    base and stride_t · element size must be multiples of 16 bytes (`launch.tma_usable`)."""
    return tl.make_tensor_descriptor(
        base, shape=[tl.maximum(seq_len, 1), HEAD_DIM], strides=[stride_t, 1], block_shape=[BLOCK, HEAD_DIM]
    )


@triton.jit
def _bwd_stats_kernel(
    lse_ptr, delta_ptr, stats_ptr, T, stride_lse_h, stride_sh, BLOCK_M: tl.constexpr
):  # fmt: skip
    """Program (row tile, query head h): stats[h, rows] = (lse · log2 e, D, 0, 0), the per-row statistics
    of the warp-specialised kernels packed into 16-byte rows that a tensor descriptor can load
    (`_stats_rows`): Triton's Hopper warp specialisation takes no pointer loads of vectors."""
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < T
    lse2 = tl.load(lse_ptr + h * stride_lse_h + rows, mask=valid, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + h * stride_lse_h + rows, mask=valid, other=0.0)
    col = tl.arange(0, 4)[None, :]
    packed = tl.where(col == 0, lse2[:, None], tl.where(col == 1, delta[:, None], 0.0))
    tl.store(stats_ptr + h * stride_sh + rows[:, None] * 4 + col, packed, mask=valid[:, None])


@triton.jit
def _stats_rows(stats_h, seq_len, BLOCK: tl.constexpr):
    """A tensor descriptor over one head's `_bwd_stats_kernel` rows of one sequence (stats_h: its first
    row), [seq_len, 4], loaded as [BLOCK, 4] tiles; rows from seq_len on read as zeros."""
    return tl.make_tensor_descriptor(  # one row at least: a TMA dimension may not be 0
        stats_h, shape=[tl.maximum(seq_len, 1), 4], strides=[4, 1], block_shape=[BLOCK, 4]
    )


@triton.jit
def _load_stats(desc, start):
    """(lse · log2 e, D), each [BLOCK], of rows start .. start + BLOCK − 1 from a `_stats_rows` descriptor."""
    tile = desc.load([start, 0])
    even, odd = tl.split(tl.reshape(tile, [tile.shape[0], 2, 2]))  # columns (0, 2) and (1, 3)
    lse2, _ = tl.split(even)
    delta, _ = tl.split(odd)
    return lse2, delta


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    offs_n,
    q_src,
    do_src,
    lse_ptr,
    delta_ptr,
    dq_acc_ptr,
    ticket_ptr,
    key_tile,
    lo,
    hi,
    seq_len,
    qk_scale,
    stride_qt,
    stride_dot,
    stride_at,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    DQ_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    """Fold query rows lo .. hi−1 (lo a multiple of BLOCK_M, hi ≤ seq_len) of one query head into the
    key tile's (dk, dv) [BLOCK_N, HEAD_DIM]. k, v: the tile's keys [BLOCK_N, HEAD_DIM] at positions
    offs_n; q_src, do_src: this head's Q and dO rows of the sequence, as pointers to its first row or
    (TMA) as `_seq_rows` descriptors; lse_ptr, delta_ptr, dq_acc_ptr: offset to the sequence's first row
    of this head (WS: lse_ptr is a `_stats_rows` descriptor, delta_ptr unused); ticket_ptr: this
    (sequence, head)'s tickets, one per query tile; key_tile: j.
    MASKED: the causal mask (key ≤ query); unmasked tiles must lie wholly on or below the diagonal.
    DQ_MODE 1 ("atomic") and 2 ("ordered"): also add dS Kⱼ (unscaled) into the dQ accumulator.
    WS: ask Triton to warp-specialise the loop (`tl.range(..., warp_specialize=True)`)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_valid = offs_m < seq_len
        rows = offs_m.to(tl.int64)
        if TMA:  # rows past the sequence read as zeros (the descriptor's edge), as the masked loads below
            q = q_src.load([start_m, 0])
            do = do_src.load([start_m, 0])
        else:
            q = tl.load(q_src + rows[:, None] * stride_qt + offs_d[None, :], mask=row_valid[:, None], other=0.0)
            do = tl.load(do_src + rows[:, None] * stride_dot + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        if WS:
            lse2, delta = _load_stats(lse_ptr, start_m)
        else:
            lse2 = tl.load(lse_ptr + rows, mask=row_valid, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_ptr + rows, mask=row_valid, other=0.0)
        qk_t = dot_qk(k, q, UPCAST, IEEE)  # Sᵀ / scale: [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # Pᵀ = exp(Sᵀ − L)
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = dot_pv(p_t.to(do.dtype), do, dv, UPCAST, IEEE)  # dV += Pᵀ dO
        dp_t = dot_qk(v, do, UPCAST, IEEE)  # dPᵀ = V dOᵀ
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # dSᵀ = Pᵀ ∘ (dPᵀ − D), without the scale
        ds = tl.trans(ds_t)
        dk = dot_pv(ds_t, q, dk, UPCAST, IEEE)  # dK += dSᵀ Q
        if DQ_MODE != 0:
            dq = dot_pv(ds, k, tl.zeros([BLOCK_M, HEAD_DIM], dtype=dk.dtype), UPCAST, IEEE)  # dS Kⱼ
            dq_ptrs = dq_acc_ptr + rows[:, None] * stride_at + offs_d[None, :]
            if DQ_MODE == 2:
                ticket = ticket_ptr + start_m // BLOCK_M
                while tl.atomic_add(ticket, 0, sem="acquire") != key_tile:  # key tiles 0 .. j − 1 first
                    pass
            tl.atomic_add(dq_ptrs, dq, mask=row_valid[:, None], sem="relaxed")
            if DQ_MODE == 2:
                tl.debug_barrier()  # every thread's adds precede the release
                tl.atomic_add(ticket, 1, sem="release")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dq_acc_ptr,
    tickets_ptr,
    cu_seqlens_ptr,
    scale,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lse_h,
    stride_at,
    stride_ah,
    stride_ticket_s,
    stride_ticket_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DQ_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    """Program (key tile, KV head hk, sequence s): dK, dV of BLOCK_N keys, summed over the GROUP query
    heads hk·GROUP .. hk·GROUP + GROUP − 1 (module docstring, kernel 2); DQ_MODE 1, 2: also their
    contributions to dQ (kernel 3's fused modes). dq_acc_ptr, tickets_ptr: unused in DQ_MODE 0.
    TMA: the K, V, Q and dO tiles come through per-(sequence, head) tensor descriptors (`_seq_rows`).
    WS (with TMA): one warp-specialised loop per query head, every tile causally masked, the row
    statistics read through descriptors (lse_ptr: `_bwd_stats_kernel`'s rows, stride_lse_h its head
    stride; delta_ptr unused): Triton's Hopper warp specialisation (3.9) specialises a single loop
    without branches and with no pointer loads of vectors, and aborts otherwise."""
    hk = tl.program_id(1)
    s = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + s)
    seq_len = tl.load(cu_seqlens_ptr + s + 1) - seq_start
    key_tile = tl.program_id(0)
    start_n = key_tile * BLOCK_N  # causal: the first key tiles see the most queries, and run first
    q_end = seq_len  # where the query-tile loops end
    if WS:  # no early return: Triton's warp specialisation takes structured control flow only
        q_end = tl.where(start_n < seq_len, seq_len, 0)  # a tile past the sequence: empty loops, no stores
    elif start_n >= seq_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_valid = offs_n < seq_len
    rows_n = (seq_start + offs_n).to(tl.int64)
    if TMA:
        k_seq = k_ptr + seq_start.to(tl.int64) * stride_kt + hk * stride_kh
        v_seq = v_ptr + seq_start.to(tl.int64) * stride_vt + hk * stride_vh
        k = _seq_rows(k_seq, seq_len, stride_kt, BLOCK_N, HEAD_DIM).load([start_n, 0])
        v = _seq_rows(v_seq, seq_len, stride_vt, BLOCK_N, HEAD_DIM).load([start_n, 0])
    else:
        k = tl.load(
            k_ptr + rows_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=key_valid[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + rows_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=key_valid[:, None], other=0.0
        )
    acc_dtype = tl.float64 if k.dtype == tl.float64 else tl.float32
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=acc_dtype)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=acc_dtype)
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # query tiles before it see none of these keys: skipped
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, q_end)  # from here all rows see all keys
    else:
        lo = 0
        mid = 0
    row0 = seq_start.to(tl.int64)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_h = q_ptr + row0 * stride_qt + h * stride_qh
        do_h = do_ptr + row0 * stride_dot + h * stride_doh
        if TMA:
            q_h = _seq_rows(q_h, seq_len, stride_qt, BLOCK_M, HEAD_DIM)
            do_h = _seq_rows(do_h, seq_len, stride_dot, BLOCK_M, HEAD_DIM)
        lse_h = lse_ptr + h * stride_lse_h + row0
        delta_h = delta_ptr + h * stride_lse_h + row0
        dq_h = dq_acc_ptr + row0 * stride_at + h * stride_ah
        tickets_h = tickets_ptr + s * stride_ticket_s + h * stride_ticket_h
        if WS:  # one loop from the first query tile that sees the keys, masked where causal
            lse_h = _stats_rows(lse_ptr + h * stride_lse_h + row0 * 4, seq_len, BLOCK_M)
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, offs_n, q_h, do_h, lse_h, delta_h, dq_h, tickets_h, key_tile, lo, q_end, seq_len,
                qk_scale, stride_qt, stride_dot, stride_at, HEAD_DIM, BLOCK_M, CAUSAL, DQ_MODE, UPCAST, IEEE, TMA, True,
            )  # fmt: skip
        else:
            if CAUSAL:  # the diagonal, masked
                dk, dv = _dkdv_tiles(
                    dk, dv, k, v, offs_n, q_h, do_h, lse_h, delta_h, dq_h, tickets_h, key_tile, lo, mid, seq_len,
                    qk_scale, stride_qt, stride_dot, stride_at, HEAD_DIM, BLOCK_M, True, DQ_MODE, UPCAST, IEEE, TMA,
                    False,
                )  # fmt: skip
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, offs_n, q_h, do_h, lse_h, delta_h, dq_h, tickets_h, key_tile, mid, q_end, seq_len,
                qk_scale, stride_qt, stride_dot, stride_at, HEAD_DIM, BLOCK_M, False, DQ_MODE, UPCAST, IEEE, TMA,
                False,
            )  # fmt: skip
    dk = dk * scale
    tl.store(
        dk_ptr + rows_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=key_valid[:, None],
    )
    tl.store(
        dv_ptr + rows_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=key_valid[:, None],
    )


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    q_pos,
    k_src,
    v_src,
    lo,
    hi,
    seq_len,
    qk_scale,
    stride_kt,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    """Fold keys lo .. hi−1 (lo a multiple of BLOCK_N) into the query tile's dq [BLOCK_M, HEAD_DIM].
    q, do: the tile's rows; lse2: their logsumexp in log2 units; delta: their D; q_pos: the last key each
    row sees. k_src, v_src: the KV head's rows of the sequence, as pointers to its first row or (TMA) as
    `_seq_rows` descriptors (keys ≥ seq_len read as zeros). MASKED: mask keys after q_pos and keys
    ≥ seq_len; unmasked tiles must be visible to every row. WS: warp-specialise the loop."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)
        if TMA:
            key_valid = offs_n < seq_len
            k = k_src.load([start_n, 0])
            v = v_src.load([start_n, 0])
        elif MASKED:
            key_valid = offs_n < seq_len
            k = tl.load(k_src + rows[:, None] * stride_kt + offs_d[None, :], mask=key_valid[:, None], other=0.0)
            v = tl.load(v_src + rows[:, None] * stride_vt + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        else:
            k = tl.load(k_src + rows[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(v_src + rows[:, None] * stride_vt + offs_d[None, :])
        qk = dot_qk(q, k, UPCAST, IEEE)  # S / scale: [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # P = exp(S − L)
        if MASKED:
            p = tl.where((offs_n[None, :] <= q_pos[:, None]) & key_valid[None, :], p, 0.0)
        dp = dot_qk(do, v, UPCAST, IEEE)  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP − D), without the scale
        dq = dot_pv(ds.to(k.dtype), k, dq, UPCAST, IEEE)  # dQ += dS K
    return dq


@triton.jit
def _bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_seqlens_ptr,
    scale,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lse_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    """Program (query tile, query head h, sequence s): dQ of BLOCK_M rows (module docstring, kernel 3).
    TMA: the Q, dO, K and V tiles come through per-(sequence, head) tensor descriptors (`_seq_rows`).
    WS (with TMA): one warp-specialised loop over the keys, every tile masked, the row statistics read
    through a descriptor (lse_ptr: `_bwd_stats_kernel`'s rows, stride_lse_h their head stride;
    delta_ptr unused), for the reasons `_bwd_dkdv_kernel` gives."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: heaviest (last) tiles first
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + s)
    seq_len = tl.load(cu_seqlens_ptr + s + 1) - seq_start
    start_m = m_tile * BLOCK_M
    if WS:  # no early return: Triton's warp specialisation takes structured control flow only
        live = start_m < seq_len  # a tile past the sequence runs empty loops (below) and stores nothing
    elif start_m >= seq_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_len
    rows = (seq_start + offs_m).to(tl.int64)
    if TMA:
        q_seq = q_ptr + seq_start.to(tl.int64) * stride_qt + h * stride_qh
        do_seq = do_ptr + seq_start.to(tl.int64) * stride_dot + h * stride_doh
        q = _seq_rows(q_seq, seq_len, stride_qt, BLOCK_M, HEAD_DIM).load([start_m, 0])
        do = _seq_rows(do_seq, seq_len, stride_dot, BLOCK_M, HEAD_DIM).load([start_m, 0])
    else:
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0
        )
        do = tl.load(
            do_ptr + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_valid[:, None], other=0.0
        )
    if WS:
        stats = _stats_rows(lse_ptr + h * stride_lse_h + seq_start.to(tl.int64) * 4, seq_len, BLOCK_M)
        lse2, delta = _load_stats(stats, start_m)
    else:
        lse2 = tl.load(lse_ptr + h * stride_lse_h + rows, mask=row_valid, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + h * stride_lse_h + rows, mask=row_valid, other=0.0)
    row0 = seq_start.to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    k_h = k_ptr + row0 * stride_kt + hk * stride_kh
    v_h = v_ptr + row0 * stride_vt + hk * stride_vh
    if TMA:
        k_h = _seq_rows(k_h, seq_len, stride_kt, BLOCK_N, HEAD_DIM)
        v_h = _seq_rows(v_h, seq_len, stride_vt, BLOCK_N, HEAD_DIM)
    acc_dtype = tl.float64 if q.dtype == tl.float64 else tl.float32
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=acc_dtype)
    if CAUSAL:
        q_pos = offs_m
        hi_full = ((start_m + 1) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
        hi = tl.minimum(start_m + BLOCK_M, seq_len)  # tiles past the diagonal: skipped
    else:
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
        hi_full = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    if WS:  # one loop, every tile masked; a tile past the sequence runs none
        dq = _dq_tiles(
            dq, q, do, lse2, delta, q_pos, k_h, v_h, 0, tl.where(live, hi, 0), seq_len, qk_scale, stride_kt,
            stride_vt, HEAD_DIM, BLOCK_N, True, UPCAST, IEEE, TMA, True,
        )  # fmt: skip
    else:
        dq = _dq_tiles(
            dq, q, do, lse2, delta, q_pos, k_h, v_h, 0, hi_full, seq_len, qk_scale, stride_kt, stride_vt,
            HEAD_DIM, BLOCK_N, False, UPCAST, IEEE, TMA, False,
        )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse2, delta, q_pos, k_h, v_h, hi_full, hi, seq_len, qk_scale, stride_kt, stride_vt,
            HEAD_DIM, BLOCK_N, True, UPCAST, IEEE, TMA, False,
        )  # fmt: skip
    dq = dq * scale
    tl.store(
        dq_ptr + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


@triton.jit
def _bwd_dq_convert_kernel(
    dq_acc_ptr,
    dq_ptr,
    T,
    scale,
    stride_at,
    stride_ah,
    stride_dqt,
    stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Program (row tile, query head h): dq[rows, h] = scale · dq_acc[rows, h] in dq's dtype."""
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = rows < T
    acc = tl.load(dq_acc_ptr + rows[:, None] * stride_at + h * stride_ah + offs_d[None, :], mask=valid[:, None])
    tl.store(
        dq_ptr + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        (acc * scale).to(dq_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


class BackwardLaunch:
    """One backward's buffers and launches, so that a tile sweep can time each kernel alone:
    `preprocess()`, then `dkdv()`, then `dq()` (dq_mode "separate") or `convert()` (the fused modes).

    do, q, out [T, Hq, D]; k, v [T, Hk, D], all with unit last stride; lse [Hq, T] (the forward's);
    cu_seqlens [S + 1] int32; cfg a `flash_attention_op.BackwardConfig`. The outputs dq [T, Hq, D],
    dk, dv [T, Hk, D] are in the inputs' dtype."""

    def __init__(self, do, q, k, v, out, lse, cu_seqlens, max_seqlen: int, scale: float, causal: bool, cfg):
        if cfg.dq_mode not in DQ_MODES:
            raise ValueError(f"dq_mode must be one of {list(DQ_MODES)}, got {cfg.dq_mode!r}")
        if cfg.dkdv_ws and cfg.dq_mode == "ordered":
            raise ValueError("dkdv_ws does not go with dq_mode='ordered' (a spin wait inside a warp-specialised loop)")
        self.do, self.q, self.k, self.v, self.out, self.lse, self.cu = do, q, k, v, out, lse, cu_seqlens
        self.max_seqlen, self.scale, self.causal, self.cfg = max_seqlen, scale, causal, cfg
        self.mode = DQ_MODES[cfg.dq_mode]
        T, Hq, D = q.shape
        self.T, self.Hq, self.Hk, self.D, self.S = T, Hq, k.shape[1], D, cu_seqlens.shape[0] - 1
        self.dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        self.dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        self.delta = torch.empty_like(lse)
        # The fused modes' dQ accumulator (zeroed by the preprocess) and the ordered mode's tickets.
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.dq_acc = torch.empty((T, Hq, D), dtype=acc_dtype, device=q.device) if self.mode else self.dq
        self.tickets = self.delta  # a placeholder unless "ordered"
        if self.mode == 2:  # zeroed before each dkdv()
            self.tickets = torch.empty((self.S, Hq, cdiv(max_seqlen, cfg.dkdv_m)), dtype=torch.int32, device=q.device)
        self.common = dict(GROUP=Hq // self.Hk, HEAD_DIM=D, CAUSAL=causal, UPCAST=upcast_operands(q),
                           IEEE=q.dtype in (torch.float32, torch.float64))  # fmt: skip
        # Descriptor loads where asked for and the streamed tensors allow them; pointer loads otherwise.
        usable = (cfg.dkdv_tma or cfg.dq_tma) and tma_usable(q, k, v, do)
        self.dkdv_tma, self.dq_tma = bool(cfg.dkdv_tma and usable), bool(cfg.dq_tma and usable)
        # The warp-specialised loops read every tile through descriptors: without them, the plain kernels.
        self.dkdv_ws, self.dq_ws = (
            bool(cfg.dkdv_ws and self.dkdv_tma),
            bool(cfg.dq_ws and self.dq_tma and not self.mode),
        )
        if (self.dkdv_tma or (self.dq_tma and self.mode == 0)) and q.device.type == "cuda":
            ensure_tma_allocator()
        # Their row statistics, packed (`_bwd_stats_kernel`): [Hq, T, 4] in lse's dtype.
        self.stats = torch.empty((Hq, T, 4), dtype=lse.dtype, device=q.device) if self.dkdv_ws or self.dq_ws else None

    @property
    def empty(self) -> bool:
        return self.T == 0 or self.S == 0 or self.max_seqlen == 0

    def _strides(self) -> tuple[int, ...]:
        q, k, v, do = self.q, self.k, self.v, self.do
        return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                do.stride(0), do.stride(1))  # fmt: skip

    def preprocess(self) -> None:
        out, do, a = self.out, self.do, self.dq_acc
        _bwd_preprocess_kernel[(cdiv(self.T, self.cfg.block_pre), self.Hq)](
            out, do, self.delta, a, self.T, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
            self.delta.stride(0), a.stride(0), a.stride(1),
            HEAD_DIM=self.D, BLOCK_M=self.cfg.block_pre, ZERO_DQ=self.mode != 0,
        )  # fmt: skip

    def _row_stats(self, ws: bool) -> torch.Tensor:
        """What a kernel's lse_ptr receives: the logsumexp, or (ws) the packed statistics, made here
        (after the preprocess's D) by `_bwd_stats_kernel`."""
        if not ws:
            return self.lse
        st = self.stats
        _bwd_stats_kernel[(cdiv(self.T, 64), self.Hq)](
            self.lse, self.delta, st, self.T, self.lse.stride(0), st.stride(0), BLOCK_M=64
        )  # fmt: skip
        return st

    def dkdv(self) -> None:
        cfg, dk, dv, a, t = self.cfg, self.dk, self.dv, self.dq_acc, self.tickets
        if self.mode == 2:
            t.zero_()
        lse = self._row_stats(self.dkdv_ws)
        _bwd_dkdv_kernel[(cdiv(self.max_seqlen, cfg.dkdv_n), self.Hk, self.S)](
            self.q, self.k, self.v, self.do, lse, self.delta, dk, dv, a, t, self.cu, self.scale,
            self.scale * LOG2E, *self._strides(), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            lse.stride(0), a.stride(0), a.stride(1), t.stride(0), t.stride(1),
            BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, DQ_MODE=self.mode, TMA=self.dkdv_tma, WS=self.dkdv_ws,
            num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages, **self.common,
        )  # fmt: skip

    def dq_pass(self) -> None:
        cfg, dq = self.cfg, self.dq
        lse = self._row_stats(self.dq_ws)
        _bwd_dq_kernel[(cdiv(self.max_seqlen, cfg.dq_m), self.Hq, self.S)](
            self.q, self.k, self.v, self.do, lse, self.delta, dq, self.cu, self.scale, self.scale * LOG2E,
            *self._strides(), dq.stride(0), dq.stride(1), lse.stride(0),
            BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, TMA=self.dq_tma, WS=self.dq_ws, num_warps=cfg.dq_warps,
            num_stages=cfg.dq_stages, **self.common,
        )  # fmt: skip

    def convert(self) -> None:
        a, dq = self.dq_acc, self.dq
        _bwd_dq_convert_kernel[(cdiv(self.T, self.cfg.block_pre), self.Hq)](
            a, dq, self.T, self.scale, a.stride(0), a.stride(1), dq.stride(0), dq.stride(1),
            HEAD_DIM=self.D, BLOCK_M=self.cfg.block_pre,
        )  # fmt: skip

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every launch in order; returns (dq, dk, dv)."""
        if not self.empty:
            self.preprocess()
            self.dkdv()
            if self.mode == 0:
                self.dq_pass()
            else:
                self.convert()
        return self.dq, self.dk, self.dv


def flash_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool,
    cfg,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward on checked arguments (module docstring; arguments as `BackwardLaunch`).
    Returns (dq [T, Hq, D], dk [T, Hk, D], dv [T, Hk, D]) in the inputs' dtype."""
    return BackwardLaunch(do, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal, cfg).run()
