"""FlashAttention-2 backward over contiguous, packed Q/K/V (Dao 2023, "FlashAttention-2", §3.1.2 and
Algorithm 2; notation of the Triton fused-attention tutorial).

For one head of one sequence, with S = scale · Q Kᵀ (causally masked or not), P = softmax(S) and
O = P V, the gradients of a loss with upstream gradient dO are
    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D),   dQ = scale · dS K,   dK = scale · dSᵀ Q,
    D  = rowsum(dO ∘ O)  (= rowsum(P ∘ dP), a row's ⟨dO, O⟩).
P is never stored: each tile recomputes it from the forward's logsumexp L as P = exp(S − L), which is
exp2(qk · qk_scale − L · log2 e) with qk_scale = scale · log2 e (one exp2 per score).

Three kernels, none with atomics, so the result is bitwise reproducible:
  1. `_bwd_preprocess_kernel`: D = rowsum(dO ∘ O) per (query head, row), in the accumulation dtype.
  2. `_bwd_dkdv_kernel` (FA2 §3.2, the backward's sequence parallelism): one program per (key tile of
     BLOCK_N keys, KV head, sequence) holds K_j, V_j and accumulates dK_j, dV_j over the query tiles
     and over every query head of the KV head's group (GQA/MQA: dK and dV are summed over the group in
     registers; K and V are never repeated). Causal: query tiles wholly before the key tile are
     skipped, those that straddle the diagonal are masked, the rest run unmasked.
  3. `_bwd_dq_kernel`: one program per (query tile, query head, sequence) accumulates dQ_i over the key
     tiles it sees (the forward's loop shape); it recomputes S and P a second time, which costs the
     2 matrix products of S and dP again, instead of FA2's atomic dQ adds in kernel 2.
Rows past a sequence's end load Q = dO = 0 (and L = D = 0), so in kernel 2 they add exactly zero to dK
and dV; key rows past the end are loaded as zero and their dK, dV never stored. Accumulation is float32
(float64 for float64 inputs); products of 16-bit inputs round P and dS to the input dtype first, as FA2.
All row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_forward import upcast_operands
from tinyvllm.kernels.flash_tiles import dot_pv, dot_qk
from tinyvllm.kernels.launch import cdiv

LOG2E = 1.4426950408889634


@triton.jit
def _bwd_preprocess_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    T,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_delta_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Program (row tile, query head h): delta[h, rows] = Σ_d dO[rows, h, d] · O[rows, h, d]."""
    h = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = rows < T
    o = tl.load(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=valid[:, None], other=0.0)
    acc_dtype = tl.float64 if o.dtype == tl.float64 else tl.float32
    delta = tl.sum(o.to(acc_dtype) * do.to(acc_dtype), axis=1)
    tl.store(delta_ptr + h * stride_delta_h + rows, delta, mask=valid)


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    offs_n,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    lo,
    hi,
    seq_len,
    qk_scale,
    stride_qt,
    stride_dot,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold query rows lo .. hi−1 (lo a multiple of BLOCK_M, hi ≤ seq_len) of one query head into the
    key tile's (dk, dv) [BLOCK_N, HEAD_DIM]. k, v: the tile's keys [BLOCK_N, HEAD_DIM] at positions
    offs_n; q_ptr, do_ptr, lse_ptr, delta_ptr: offset to the sequence's first row of this head.
    MASKED: the causal mask (key ≤ query); unmasked tiles must lie wholly on or below the diagonal."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_valid = offs_m < seq_len
        rows = offs_m.to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        do = tl.load(do_ptr + rows[:, None] * stride_dot + offs_d[None, :], mask=row_valid[:, None], other=0.0)
        lse2 = tl.load(lse_ptr + rows, mask=row_valid, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + rows, mask=row_valid, other=0.0)
        qk_t = dot_qk(k, q, UPCAST, IEEE)  # Sᵀ / scale: [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # Pᵀ = exp(Sᵀ − L)
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = dot_pv(p_t.to(do.dtype), do, dv, UPCAST, IEEE)  # dV += Pᵀ dO
        dp_t = dot_qk(v, do, UPCAST, IEEE)  # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ − D), without the scale
        dk = dot_pv(ds_t.to(q.dtype), q, dk, UPCAST, IEEE)  # dK += dSᵀ Q
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (key tile, KV head hk, sequence s): dK, dV of BLOCK_N keys, summed over the GROUP query
    heads hk·GROUP .. hk·GROUP + GROUP − 1 (module docstring, kernel 2)."""
    hk = tl.program_id(1)
    s = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + s)
    seq_len = tl.load(cu_seqlens_ptr + s + 1) - seq_start
    start_n = tl.program_id(0) * BLOCK_N  # causal: the first key tiles see the most queries, and run first
    if start_n >= seq_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_valid = offs_n < seq_len
    rows_n = (seq_start + offs_n).to(tl.int64)
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
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, seq_len)  # from here all rows see all keys
    else:
        lo = 0
        mid = 0
    row0 = seq_start.to(tl.int64)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_h = q_ptr + row0 * stride_qt + h * stride_qh
        do_h = do_ptr + row0 * stride_dot + h * stride_doh
        lse_h = lse_ptr + h * stride_lse_h + row0
        delta_h = delta_ptr + h * stride_lse_h + row0
        if CAUSAL:  # the diagonal, masked
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, offs_n, q_h, do_h, lse_h, delta_h, lo, mid, seq_len, qk_scale, stride_qt, stride_dot,
                HEAD_DIM, BLOCK_M, True, UPCAST, IEEE,
            )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, offs_n, q_h, do_h, lse_h, delta_h, mid, seq_len, seq_len, qk_scale, stride_qt, stride_dot,
            HEAD_DIM, BLOCK_M, False, UPCAST, IEEE,
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
    k_ptr,
    v_ptr,
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
):
    """Fold keys lo .. hi−1 (lo a multiple of BLOCK_N) into the query tile's dq [BLOCK_M, HEAD_DIM].
    q, do: the tile's rows; lse2: their logsumexp in log2 units; delta: their D; q_pos: the last key each
    row sees. k_ptr, v_ptr: offset to the sequence's first row of the KV head. MASKED: mask keys after
    q_pos and keys ≥ seq_len; unmasked tiles must be visible to every row."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)
        if MASKED:
            key_valid = offs_n < seq_len
            k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=key_valid[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :])
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
):
    """Program (query tile, query head h, sequence s): dQ of BLOCK_M rows (module docstring, kernel 3)."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: heaviest (last) tiles first
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + s)
    seq_len = tl.load(cu_seqlens_ptr + s + 1) - seq_start
    start_m = m_tile * BLOCK_M
    if start_m >= seq_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < seq_len
    rows = (seq_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    do = tl.load(
        do_ptr + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_valid[:, None], other=0.0
    )
    lse2 = tl.load(lse_ptr + h * stride_lse_h + rows, mask=row_valid, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + h * stride_lse_h + rows, mask=row_valid, other=0.0)
    row0 = seq_start.to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    k_h = k_ptr + row0 * stride_kt + hk * stride_kh
    v_h = v_ptr + row0 * stride_vt + hk * stride_vh
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
    dq = _dq_tiles(
        dq, q, do, lse2, delta, q_pos, k_h, v_h, 0, hi_full, seq_len, qk_scale, stride_kt, stride_vt,
        HEAD_DIM, BLOCK_N, False, UPCAST, IEEE,
    )  # fmt: skip
    dq = _dq_tiles(
        dq, q, do, lse2, delta, q_pos, k_h, v_h, hi_full, hi, seq_len, qk_scale, stride_kt, stride_vt,
        HEAD_DIM, BLOCK_N, True, UPCAST, IEEE,
    )  # fmt: skip
    dq = dq * scale
    tl.store(
        dq_ptr + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


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
    """Launch the three kernels on checked arguments (module docstring).

    do, q, out [T, Hq, D]; k, v [T, Hk, D], all with unit last stride; lse [Hq, T] (the forward's);
    cu_seqlens [S + 1] int32; cfg a `flash_attention_op.BackwardConfig`.
    Returns (dq [T, Hq, D], dk [T, Hk, D], dv [T, Hk, D]) in the inputs' dtype."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    S = cu_seqlens.shape[0] - 1
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if T == 0 or S == 0 or max_seqlen == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    _bwd_preprocess_kernel[(cdiv(T, cfg.block_pre), Hq)](
        out, do, delta, T, out.stride(0), out.stride(1), do.stride(0), do.stride(1), delta.stride(0),
        HEAD_DIM=D, BLOCK_M=cfg.block_pre,
    )  # fmt: skip
    common = dict(GROUP=Hq // Hk, HEAD_DIM=D, CAUSAL=causal, UPCAST=upcast_operands(q),
                  IEEE=q.dtype in (torch.float32, torch.float64))  # fmt: skip
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1))
    _bwd_dkdv_kernel[(cdiv(max_seqlen, cfg.dkdv_n), Hk, S)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, scale, scale * LOG2E, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages, **common,
    )  # fmt: skip
    _bwd_dq_kernel[(cdiv(max_seqlen, cfg.dq_m), Hq, S)](
        q, k, v, do, lse, delta, dq, cu_seqlens, scale, scale * LOG2E, *strides,
        dq.stride(0), dq.stride(1), lse.stride(0),
        BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **common,
    )  # fmt: skip
    return dq, dk, dv
