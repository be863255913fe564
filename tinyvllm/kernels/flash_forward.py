"""FlashAttention-2 training forward over contiguous, packed K/V: the output and its logsumexp, which the
backward (`flash_backward`) needs to recompute P without storing it (Dao 2023, "FlashAttention-2",
Algorithm 1; the logsumexp L_i = m_i + log(l_i) of its line 13).

Sequence s owns rows cu_seqlens[s] .. cu_seqlens[s+1]−1 of q, k and v (self-attention: n_s queries and
n_s keys); its query row i computes
    out[i] = softmax(scale · q_i Kᵀ[0..hi(i)]) V[0..hi(i)],   hi(i) = i (causal) or n_s − 1,
    lse[h, i] = log Σ_{j ≤ hi(i)} exp(scale · q_i·k_j)   (natural log, float32, or float64 for float64)
with query head h reading KV head h // (Hq / Hk).

The tile loop is the inference kernel's (`flash_tiles.attn_inner`), fed a one-entry block table whose
single page spans the whole sequence: page 0 at the sequence's first row, so row offsets are
(key position) · stride_t, int64. A non-causal row is given the position n_s − 1, so the causal mask
`key ≤ q_pos` masks nothing and only the sequence end does.
Grid (FA2 §3.2): (⌈max n_s / BLOCK_M⌉, Hq, S), heaviest (last) query tiles first. Per program:
  1. keys below the tile's first row (causal), or every whole tile of keys (non-causal): unmasked;
  2. the causal diagonal, or the last partial tile of keys: masked.

Hopper options (`ForwardConfig.tma`, `.ws`; off by default, which leaves the kernel above unchanged):
tma reads Q, K and V through tensor descriptors built per (sequence, head) (`seq_rows`; TMA copies on
sm_90) and runs `_desc_tiles`, attn_inner's arithmetic without its paging; ws (with tma) merges the two
loops into one warp-specialised loop with every tile masked (the form Triton 3.9's Hopper warp
specialisation accepts: one loop, no branch inside, no early return).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_tiles import attn_inner, dot_pv, dot_qk
from tinyvllm.kernels.launch import cdiv, ensure_tma_allocator, tma_usable, upcast_dot

LOG2E = 1.4426950408889634


def upcast_operands(q: torch.Tensor) -> bool:
    """`launch.upcast_dot` (the interpreter's bf16 products) for our kernels' inputs: float64 operands
    are never cast, since a float32 detour would cost them their precision."""
    return upcast_dot(q.device) and q.dtype != torch.float64


ONE_PAGE = tl.constexpr(1 << 30)  # the "page size" of the one-entry block table: longer than any sequence


@triton.jit
def seq_rows(base, seq_len, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
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
def _desc_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_desc,
    v_desc,
    lo,
    hi,
    kv_end,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    WS: tl.constexpr,
):
    """`flash_tiles.attn_inner`'s fold of keys lo .. hi−1 into (acc, l_i, m_i), for contiguous K/V read
    through `seq_rows` descriptors (keys from kv_end on read as zeros): the same operations in the same
    order, without the paging, FP8 and window cases. WS: warp-specialise the loop."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start = tl.multiple_of(start, BLOCK_N)
        k = k_desc.load([start, 0])
        qk = dot_qk(q, k, UPCAST, IEEE)
        if MASKED:
            visible = ((start + offs_n)[None, :] <= q_pos[:, None]) & ((start + offs_n) < kv_end)[None, :]
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:  # qk_scale > 0: max commutes with the scaling
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start, 0])
        acc = acc * alpha[:, None]
        acc = dot_pv(p.to(v.dtype), v, acc, UPCAST, IEEE)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    page_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
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
    """Program (query tile, head h, sequence s): out and lse of BLOCK_M query rows (module docstring).
    TMA: Q, K and V through per-(sequence, head) tensor descriptors (`seq_rows`, `_desc_tiles`). WS
    (with TMA): the two key loops become one warp-specialised loop with every tile masked: Triton's
    Hopper warp specialisation (3.9) specialises a kernel's only loop, without branches in its body, and
    aborts on two loops in a row."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles first
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
        q = seq_rows(q_seq, seq_len, stride_qt, BLOCK_M, HEAD_DIM).load([start_m, 0])
    else:
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0
        )
    # K and V rows share one offset in attn_inner: the launcher makes their strides equal.
    kv_off = seq_start.to(tl.int64) * stride_kt + (h // GROUP).to(tl.int64) * stride_kh
    acc_dtype = tl.float64 if q.dtype == tl.float64 else tl.float32
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc_dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc_dtype)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=acc_dtype)
    if CAUSAL:
        q_pos = offs_m
        hi_full = ((start_m + 1) // BLOCK_N) * BLOCK_N  # keys every row of the tile sees
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1
        hi_full = (seq_len // BLOCK_N) * BLOCK_N
        hi = seq_len
    if WS:
        hi_full = tl.where(live, hi_full, 0)
        hi = tl.where(live, hi, 0)
    if TMA:
        k_desc = seq_rows(k_ptr + kv_off, seq_len, stride_kt, BLOCK_N, HEAD_DIM)
        v_desc = seq_rows(v_ptr + kv_off, seq_len, stride_kt, BLOCK_N, HEAD_DIM)
        if WS:  # one loop, every tile masked: Triton's Hopper warp specialisation takes a single loop
            acc, l_i, m_i = _desc_tiles(
                acc, l_i, m_i, q, q_pos, k_desc, v_desc, 0, hi, seq_len, qk_scale, BLOCK_N, True, UPCAST, IEEE, True
            )
        else:
            acc, l_i, m_i = _desc_tiles(
                acc, l_i, m_i, q, q_pos, k_desc, v_desc, 0, hi_full, seq_len, qk_scale, BLOCK_N, False, UPCAST, IEEE,
                False,
            )  # fmt: skip
            acc, l_i, m_i = _desc_tiles(
                acc, l_i, m_i, q, q_pos, k_desc, v_desc, hi_full, hi, seq_len, qk_scale, BLOCK_N, True, UPCAST, IEEE,
                False,
            )  # fmt: skip
    else:
        acc, l_i, m_i = attn_inner(
            acc, l_i, m_i, q, q_pos, k_ptr + kv_off, v_ptr + kv_off, page_ptr, 0, hi_full, seq_len, qk_scale,
            0, stride_kt, HEAD_DIM, BLOCK_N, ONE_PAGE, True, False, UPCAST, IEEE,
        )  # fmt: skip
        acc, l_i, m_i = attn_inner(
            acc, l_i, m_i, q, q_pos, k_ptr + kv_off, v_ptr + kv_off, page_ptr, hi_full, hi, seq_len, qk_scale,
            0, stride_kt, HEAD_DIM, BLOCK_N, ONE_PAGE, True, True, UPCAST, IEEE,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back from log2 to natural log
    tl.store(lse_ptr + h * stride_lse_h + rows, lse, mask=row_valid)


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    causal: bool,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    tma: bool = False,
    ws: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on checked arguments (flash_attention_op.flash_attention_fwd checks them).

    q [T, Hq, D], k/v [T, Hk, D] with unit last stride; cu_seqlens [S + 1] int32 on q's device.
    tma: read Q, K and V through tensor descriptors where their alignment allows (`launch.tma_usable`);
    ws (with tma): one warp-specialised loop over the keys, every tile masked (`_flash_fwd_kernel`).
    Returns (out [T, Hq, D] contiguous, lse [Hq, T] float32, float64 for float64 inputs)."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    if v.stride() != k.stride():  # attn_inner addresses K and V rows with one offset
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty((Hq, T), dtype=lse_dtype, device=q.device)
    S = cu_seqlens.shape[0] - 1
    if T == 0 or S == 0 or max_seqlen == 0:
        return out, lse
    page = torch.zeros(1, dtype=torch.int32, device=q.device)
    tma = bool(tma) and tma_usable(q, k, v)
    ws = bool(ws) and tma  # the warp-specialised loop reads K and V through descriptors
    if tma and q.device.type == "cuda":
        ensure_tma_allocator()
    grid = (cdiv(max_seqlen, block_m), Hq, S)
    _flash_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens, page, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=Hq // Hk, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        UPCAST=upcast_operands(q), IEEE=q.dtype in (torch.float32, torch.float64), TMA=tma, WS=ws,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse
