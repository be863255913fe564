"""Fused greedy / temperature sampling on the device: one pass over each row of logits.

Row b with temperature T_b:
  * T_b == 0: the greedy token argmax_i z_i;
  * T_b > 0: the Gumbel-max trick, argmax_i (z_i / T_b + g_i) with g_i = −log(−log u_i) and u_i uniform
    from Philox keyed by (seed_b, i). This draws exactly from softmax(z / T_b) (Gumbel 1954; Maddison et
    al. 2014), without normalising, sorting or writing probabilities.
Ties resolve to the lowest index. Reads B·V logits once and writes B ids; the torch sampler handles the
rows that need top-k, top-p, min-p, penalties or logprobs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, out_ptr, V,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if not greedy:
            u = tl.rand(seed, offs)
            u = tl.maximum(u, 1e-20)  # rand is in [0, 1): keep log finite
            z = z * inv_t - tl.log(-tl.log(u))
        z = tl.where(mask, z, float("-inf"))
        better = z > best_val  # strict: the earliest index keeps a tie within a lane
        best_idx = tl.where(better, offs, best_idx)
        best_val = tl.where(better, z, best_val)
    top = tl.max(best_val, axis=0)
    # Lowest index among the lanes holding the maximum.
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def sample_greedy_or_gumbel(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (row-contiguous, any float dtype), temperature [B] float32 (0 = greedy), seeds [B]
    int64 → sampled ids [B] int64. Same (logits, T, seed) → same token, whatever the batch."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _sample_kernel[(B,)](logits, logits.stride(0), temperature, seeds, out, V, BLOCK=2048, num_warps=8)
    return out
