"""Pure-torch reference for every op in the ops table. These docstrings are the specification: the
Triton kernels must compute the same function, with the same signature, to within rounding.

Shapes: T tokens in the packed batch, Hq query heads, Hk KV heads (Hq % Hk == 0), D head dim,
KV cache per layer `[num_blocks, Hk, block_size, D]` for K and the same for V. Token t of a sequence
lives at slot `block_table[t // block_size] * block_size + t % block_size`.
Arithmetic is in float32 (float64 when the inputs are float64); outputs are in the input dtype.

FP8 KV cache (caches of dtype float8_e4m3fn, kv_cache_dtype="fp8"): the cache holds
e4m3(clamp(K / k_scale, ±448)) and the same of V with v_scale (round to nearest even; 448 is e4m3's
largest value), and attention reads K = cache · k_scale, V = cache · v_scale. The scales are per-tensor
floats (one pair per layer); a cache in any other dtype ignores them.

FP8 activations (the `*_fp8` ops): an op whose output feeds an FP8 linear layer that quantizes its input
per token returns that output quantized instead, (q [T, N] float8_e4m3fn, s [T] float32) =
`quantization.fp8.quantize_rows(y)`: s_t = max_n |y[t, n]| / 448 (1 for an all-zero row) and
q[t] = e4m3(y[t] / s_t), y rounded to its dtype first. The Triton kernels fuse the two steps and must
give the same bits as their unfused kernels followed by quantize_per_token (kernels/fp8_quant.py).
"""

from __future__ import annotations

import itertools

import torch

from tinyvllm.kernels.launch import check_window
from tinyvllm.quantization.fp8 import quantize_rows

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w ⊙ round(x / sqrt(mean(x²) + eps)), normalised in float32 and rounded to x's dtype before
    the weight multiply (Hugging Face LlamaRMSNorm's order). x: [T, H], weight: [H]."""
    xf = x.to(_acc_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add and RMSNorm: r' = round(x + residual); returns (rms_norm(r'), r')."""
    new_residual = (x.to(_acc_dtype(x)) + residual.to(_acc_dtype(x))).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, weight, eps) quantized per token: (q, s) = quantize_rows(rms_norm(...)) (module docstring)."""
    return quantize_rows(rms_norm(x, weight, eps))


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm with its normed output quantized per token: (q, s, r'), (q, s) = quantize_rows(y)."""
    y, new_residual = add_rms_norm(x, residual, weight, eps)
    q, s = quantize_rows(y)
    return q, s, new_residual


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half (GPT-NeoX) layout as in Hugging Face Llama, in place on q and k.

    For each head vector x = [x1, x2] (halves of D/2) at position p, with c = cos_sin[p, :D/2] and
    s = cos_sin[p, D/2:]:  x ← [x1·c − x2·s, x2·c + x1·s].
    q: [T, Hq, D], k: [T, Hk, D], positions: [T] int, cos_sin: [max_pos, D] float32.
    """
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long()).to(_acc_dtype(q))
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(out.to(x.dtype))
    return q, k


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the cache's dtype: e4m3(clamp(x / scale, ±448)) for an FP8 cache, else a plain cast."""
    if cache.dtype != FP8_KV_DTYPE:
        return x.to(cache.dtype)
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def _from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values for attention: x · scale in `dtype` (the accumulation dtype) for FP8 values, else x."""
    return x.to(dtype) * scale if x.dtype == FP8_KV_DTYPE else x


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store token t's K/V at cache slot `slot_mapping[t]`; a negative slot (a padded row) writes
    nothing. k, v: [T, Hk, D]; caches: [num_blocks, Hk, block_size, D]; an FP8 cache stores K / k_scale
    and V / v_scale (module docstring)."""
    block_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = _to_cache(k[valid], k_cache, k_scale)
    v_cache[blocks, :, offsets] = _to_cache(v[valid], v_cache, v_scale)


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
    """`rope` on q and k (in place), then `write_kv_cache` of the rotated k and v: the attention layer's
    two steps before attention, one op (a backend may fuse them). Returns (q, k)."""
    rope(q, k, positions, cos_sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Tokens start..length−1 of one sequence's K or V, contiguous: [length − start, Hk, D]. Only the
    blocks holding them are read."""
    block_size = cache.shape[2]
    first, num_blocks = start // block_size, (length + block_size - 1) // block_size
    blocks = cache[block_table[first:num_blocks].long()]  # [nb, Hk, bs, D]
    flat = blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])
    return flat[start - first * block_size : length - first * block_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    k_start: int = 0,
) -> torch.Tensor:
    """Causal softmax attention of queries at absolute positions q_positions over the keys at positions
    k_start..k_start+len(k)−1; with a window W, the query at p sees only keys p−W+1..p.
    q: [n, Hq, D], k/v: [L, Hk, D] → [n, Hq, D] in the accumulation dtype."""
    acc = _acc_dtype(q)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), kf) * scale
    key_pos = torch.arange(k_start, k_start + k.shape[0], device=q.device)
    q_pos = q_positions[:, None].to(q.device)
    mask = key_pos[None, :] > q_pos  # [n, L]
    if window is not None:
        mask |= key_pos[None, :] <= q_pos - window
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)


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
    """Causal attention for prompt chunks over the paged cache (FlashAttention-2's function).

    Sequence s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1 (q_len_s rows) and has seq_lens[s]
    tokens of context in the cache, this chunk's included; its row i sits at absolute position
    p = seq_lens[s] − q_len_s + i and attends to keys lo(p)..p:
        out[i] = softmax(scale · q_i Kᵀ[lo(p)..p]) V[lo(p)..p]
    with lo(p) = 0 (window None: plain causal) or lo(p) = max(0, p − window + 1) (sliding window: W keys
    including its own; transformers' `kv_idx > q_idx − sliding_window`). Keys below lo(p) are never
    read, so the cache blocks that hold only such keys may have been freed and reused (see
    core.kv_cache_manager). Query head h reads KV head h // (Hq / Hk) (grouped-query attention).
    q: [Tq, Hq, D]; cu_seqlens_q: [S+1] int32; seq_lens: [S] int32; block_tables: [S, max_blocks] int32;
    window: a positive int or None. `max_seqlen_q` is a launch hint for kernels; ignored here. k_scale,
    v_scale: an FP8 cache's scales (module docstring).
    """
    check_window(window)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        first = length - (hi - lo)  # the chunk's first query position
        start = 0 if window is None else max(0, first - window + 1)
        k = _from_cache(gather_kv(k_cache, block_tables[s], length, start), k_scale, _acc_dtype(q))
        v = _from_cache(gather_kv(v_cache, block_tables[s], length, start), v_scale, _acc_dtype(q))
        positions = torch.arange(first, length)
        out[lo:hi] = _attend(q[lo:hi], k, v, positions, scale, window, start).to(q.dtype)
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
    """One query token per sequence, at the last position of its context:
        out[b] = softmax(scale · q_b Kᵀ[lo_b..L_b−1]) V[lo_b..L_b−1],  L_b = seq_lens[b],
    lo_b = 0 (window None) or max(0, L_b − window) (sliding window: the last `window` keys, as in
    `prefill_attention`; keys below lo_b are never read). A row with seq_lens[b] == 0 (a padded row)
    outputs zeros. q: [B, Hq, D]; seq_lens: [B] int32; block_tables: [B, max_blocks] int32; window: a
    positive int or None. `max_seq_len` is a launch hint for kernels, `prefix_len` a promise that the
    first keys sit in shared blocks (cascade attention, see decode_attention.decode_attention_fwd);
    both ignored here: the result is the same. k_scale, v_scale: an FP8 cache's scales (module docstring)."""
    check_window(window)
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        start = 0 if window is None else max(0, length - window)
        k = _from_cache(gather_kv(k_cache, block_tables[b], length, start), k_scale, _acc_dtype(q))
        v = _from_cache(gather_kv(v_cache, block_tables[b], length, start), v_scale, _acc_dtype(q))
        pos = torch.tensor([length - 1])
        out[b] = _attend(q[b : b + 1], k, v, pos, scale, window, start)[0].to(q.dtype)
    return out


def _training_positions(length: int, causal: bool, device: torch.device) -> torch.Tensor:
    """The last key each row of a `length`-row sequence sees: its own position (causal) or the last."""
    if causal:
        return torch.arange(length, device=device)
    return torch.full((length,), length - 1, device=device)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """Self-attention of packed sequences, differentiable (the training op `flash_attention`'s function).

    Sequence s owns rows cu_seqlens[s] .. cu_seqlens[s+1]−1 of q, k and v (n_s rows); its row i computes
        out[i] = softmax(scale · q_i Kᵀ[0..hi(i)]) V[0..hi(i)],   hi(i) = i (causal) or n_s − 1,
    query head h reading KV head h // (Hq / Hk). q: [T, Hq, D]; k, v: [T, Hk, D]; cu_seqlens: [S+1] int.
    Built from torch ops only, so autograd differentiates it; float64 inputs compute in float64.
    """
    pieces = []
    cu = cu_seqlens.tolist()
    for lo, hi in itertools.pairwise(cu):
        if hi > lo:
            positions = _training_positions(hi - lo, causal, q.device)
            pieces.append(_attend(q[lo:hi], k[lo:hi], v[lo:hi], positions, scale).to(q.dtype))
    return torch.cat(pieces) if pieces else q.new_empty(q.shape)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """The logsumexp of `attention`'s rows: lse[h, t] = log Σ_{j ≤ hi(t)} exp(scale · q_t·k_j) (natural
    log), [Hq, T] in float32 (float64 for float64 inputs)."""
    acc = _acc_dtype(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=acc, device=q.device)
    group = q.shape[1] // k.shape[1]
    cu = cu_seqlens.tolist()
    for lo, hi in itertools.pairwise(cu):
        if hi > lo:
            kf = k[lo:hi].to(acc).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi].to(acc), kf) * scale
            last = _training_positions(hi - lo, causal, q.device)
            mask = torch.arange(hi - lo, device=q.device)[None, :] > last[:, None]
            lse[:, lo:hi] = torch.logsumexp(scores.masked_fill(mask[None], float("-inf")), dim=-1)
    return lse


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: x = [g, u] along the last dim (each F wide) → silu(g) ⊙ u, in float32, rounded."""
    f = x.shape[-1] // 2
    xf = x.to(_acc_dtype(x))
    g, u = xf[..., :f], xf[..., f:]
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) quantized per token: x [T, 2F] → (q [T, F], s [T]) = quantize_rows(silu_and_mul(x))."""
    return quantize_rows(silu_and_mul(x))


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """A matrix product of a few rows (decode) with the ops around it fused in; "round" is to x's dtype.

        a = x                               plain;                         x: [M, K]
        a = rms_norm(x, norm_weight, eps)   with norm_weight [K];          x: [M, K]
        a = silu_and_mul(x)                 with silu_mul=True;            x: [M, 2K] = [gate | up]
        y = round(a Wᵀ)                     W: [N, K] (nn.Linear layout), products accumulated in float32
        out = y, or round(y + residual)     with residual [M, N], added in float32 (add_rms_norm's r')

    The roundings are those of the unfused ops, so fusing changes only the order of the float32 sums:
    `fused_gemv(x, W, norm_weight=w)` is `F.linear(rms_norm(x, w), W)`, and the two residual-stream
    updates of a layer are `fused_gemv(attn, Wo, residual=r)` and
    `fused_gemv(h, Wd, silu_mul=True, residual=r)`. x, weight, norm_weight and residual share a dtype.
    The Triton kernel serves M ≤ 16 rows (kernels/gemv.py); this reference takes any M.
    """
    if norm_weight is not None and silu_mul:
        raise ValueError("choose one input transform: norm_weight or silu_mul, not both")
    a = rms_norm(x, norm_weight, eps) if norm_weight is not None else silu_and_mul(x) if silu_mul else x
    y = torch.nn.functional.linear(a, weight)  # torch's product in x's dtype: float32 accumulation
    if residual is None:
        return y
    return (y.to(_acc_dtype(y)) + residual.to(_acc_dtype(y))).to(y.dtype)


def resolve_placeholders(input_ids: torch.Tensor, placeholder_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """Async scheduling's placeholder inputs, in place: input_ids[i] = sampled[placeholder_src[i]] for
    every i with placeholder_src[i] >= 0; the other rows keep their ids. input_ids [n] int64,
    placeholder_src [n] int (−1: not a placeholder), sampled [M] int (the previous step's sampled ids)."""
    take = placeholder_src >= 0
    gathered = sampled[placeholder_src.clamp(min=0)].to(input_ids.dtype)
    input_ids.copy_(torch.where(take, gathered, input_ids))
