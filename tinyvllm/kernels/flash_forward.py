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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_tiles import attn_inner
from tinyvllm.kernels.launch import cdiv, upcast_dot

LOG2E = 1.4426950408889634


def upcast_operands(q: torch.Tensor) -> bool:
    """`launch.upcast_dot` (the interpreter's bf16 products) for our kernels' inputs: float64 operands
    are never cast, since a float32 detour would cost them their precision."""
    return upcast_dot(q.device) and q.dtype != torch.float64


ONE_PAGE = tl.constexpr(1 << 30)  # the "page size" of the one-entry block table: longer than any sequence


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
):
    """Program (query tile, head h, sequence s): out and lse of BLOCK_M query rows (module docstring)."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles first
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on checked arguments (flash_attention_op.flash_attention_fwd checks them).

    q [T, Hq, D], k/v [T, Hk, D] with unit last stride; cu_seqlens [S + 1] int32 on q's device.
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
    grid = (cdiv(max_seqlen, block_m), Hq, S)
    _flash_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens, page, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=Hq // Hk, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        UPCAST=upcast_operands(q), IEEE=q.dtype in (torch.float32, torch.float64),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse
