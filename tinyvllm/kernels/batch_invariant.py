"""The torch reference in batch-invariant form: a token row's result depends on that row alone.

The reference ops (kernels/reference.py) compute each op over the whole packed batch at once, and a CPU
kernel picks its blocking, its vector tails and its thread split from the tensor's shape: a row's last
bits may change with the number of rows around it. Here every op that mixes numbers within a row is
called on one token row at a time, so each call has a shape fixed by the model alone and the kernel
computes that row the same way whatever the batch:

    linear(x, W, b)[t]      = F.linear(x[t : t + 1], W, b)                    (one [1, K] × [K, N] call)
    rms_norm, add_rms_norm, silu_and_mul, rope: the reference's, row by row
    rms_norm_fp8, add_rms_norm_fp8, silu_and_mul_fp8: those, then quantize_rows (a row's own maximum)
    attention row at position p (prefill and decode alike, `attend_row`): keys lo(p)..p in tiles of
        ATTN_TILE keys aligned to absolute positions (tile j holds keys j·ATTN_TILE + [0, ATTN_TILE)),
        each tile a fixed-shape [Hq, ATTN_TILE, D] computation, folded in increasing j by the online
        softmax (FlashAttention-2, Algorithm 1):
            m' = max(m, max_j s);  l ← e^(m − m')·l + Σ_j e^(s_j − m');  acc ← e^(m − m')·acc + Σ_j e^(s_j − m') v_j
        and out = acc / l. Keys outside lo(p)..p score −inf; keys past the context are zero padding.

So a row's tokens and logprobs do not depend on the other rows of the step, on where its prompt was cut
into chunks (tiles are aligned to positions, not to the chunk), or on a prefix-cache hit (the cached K/V
are the bits this row would have written). Exact ops (embedding gather, cache writes, the residual's
rounded add) need no care. The cost is one call per row per op: this is the CPU's (CI's) form, where
speed does not matter; on CUDA the Triton ops take `batch_invariant` instead (kernels/__init__.py).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tinyvllm.kernels import reference as ref
from tinyvllm.kernels.launch import check_window
from tinyvllm.quantization.fp8 import quantize_rows

ATTN_TILE = 16  # keys per attention tile, aligned to absolute positions


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The reference's accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rows(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """fn(x[t : t + 1], *args) for every row t, concatenated ([0, ...] rows give fn's empty result)."""
    if x.shape[0] == 0:
        return fn(x, *args)
    return torch.cat([fn(x[t : t + 1], *args) for t in range(x.shape[0])])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weightᵀ (+ bias) → [T, N], each row by its own [1, K] product."""
    return _rows(F.linear, x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm, row by row."""
    return _rows(ref.rms_norm, x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm: the add is exact elementwise; the norm row by row."""
    new_residual = (x.to(_acc_dtype(x)) + residual.to(_acc_dtype(x))).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul, row by row (its sigmoid's vector and scalar code differ in the last bit)."""
    return _rows(ref.silu_and_mul, x)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm_fp8 on this module's rms_norm."""
    return quantize_rows(rms_norm(x, weight, eps))


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm_fp8 on this module's add_rms_norm."""
    y, new_residual = add_rms_norm(x, residual, weight, eps)
    q, s = quantize_rows(y)
    return q, s, new_residual


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.silu_and_mul_fp8 on this module's silu_and_mul."""
    return quantize_rows(silu_and_mul(x))


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rope, in place, row by row."""
    for t in range(q.shape[0]):
        ref.rope(q[t : t + 1], k[t : t + 1], positions[t : t + 1], cos_sin)
    return q, k


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rope_write_kv with this module's rope (row by row); the cache write is per row already."""
    rope(q, k, positions, cos_sin)
    ref.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def attend_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    pos: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of one query row q [Hq, D] at position `pos` over its sequence's keys lo..pos (lo = 0, or
    max(0, pos − window + 1)) by tiles aligned to absolute positions (module docstring) → [Hq, D] in the
    accumulation dtype."""
    acc_dtype = _acc_dtype(q)
    Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    lo = 0 if window is None else max(0, pos - window + 1)
    qf = q.to(acc_dtype)[:, None, :]  # [Hq, 1, D]
    m = torch.full((Hq,), float("-inf"), dtype=acc_dtype)
    l_i = torch.zeros((Hq,), dtype=acc_dtype)
    acc = torch.zeros((Hq, D), dtype=acc_dtype)
    offs = torch.arange(ATTN_TILE)
    for t0 in range(lo - lo % ATTN_TILE, pos + 1, ATTN_TILE):
        end = min(t0 + ATTN_TILE, pos + 1)  # keys past pos are not read (their blocks may not exist)
        pad = (0, 0, 0, 0, 0, t0 + ATTN_TILE - end)
        k = F.pad(ref.gather_kv(k_cache, block_table, end, t0).to(acc_dtype), pad)  # [TILE, Hk, D]
        v = F.pad(ref.gather_kv(v_cache, block_table, end, t0).to(acc_dtype), pad)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, TILE, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qf * k).sum(-1) * scale  # [Hq, TILE]
        keys = t0 + offs
        s = s.masked_fill(((keys < lo) | (keys > pos))[None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))  # finite: the first tile holds key lo
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l_i = l_i * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + (p[:, :, None] * v).sum(1)
        m = m_new
    return acc / l_i[:, None]


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
) -> torch.Tensor:
    """reference.prefill_attention's function, each row by `attend_row`."""
    check_window(window)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        first = length - (cu[s + 1] - cu[s])
        for i, row in enumerate(range(cu[s], cu[s + 1])):
            out[row] = attend_row(q[row], k_cache, v_cache, block_tables[s], first + i, scale, window).to(q.dtype)
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
) -> torch.Tensor:
    """reference.decode_attention's function, each row by `attend_row` (the same tiles as a prefill row at
    that position); `prefix_len` (cascade) is ignored."""
    check_window(window)
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length:
            out[b] = attend_row(q[b], k_cache, v_cache, block_tables[b], length - 1, scale, window).to(q.dtype)
    return out
