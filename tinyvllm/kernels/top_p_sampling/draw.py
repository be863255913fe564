"""`sample_top_k_top_p`: each row's threshold (plan.py), then the fused draw over its kept set.

Then the fused Gumbel-max pass (kernels/sampling.py, HAS_THR) draws argmax_{i ∈ K} (l_i + g_i) with
each index's seeded noise g_i: the same ids as the plain fused kernel when K holds every finite token,
and the same id for a row alone or anywhere in any batch.
"""

from __future__ import annotations

import torch

from tinyvllm.kernels.sampling import sample_greedy_or_gumbel
from tinyvllm.kernels.top_p_sampling.plan import truncation_plan


def sample_top_k_top_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    out: torch.Tensor | None = None,
    host_out: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    splits: int | None = None,
    precheck: bool = True,
    radix: bool | None = None,
) -> torch.Tensor:
    """One id per row from softmax(z / T) truncated by top-k, top-p and min-p (the package's docstring),
    with the fused kernel's seeded Gumbel-max noise: the same (logits, parameters, seed) gives the same
    id whatever the batch. No host synchronisation: graph-capturable like `sample_greedy_or_gumbel`.

    Args:
        logits: [B, V], any float dtype (made row-contiguous if needed).
        temperature, top_k, top_p, min_p, bitmask: as in `truncation_thresholds`; seeds: [B] int64.
        out, host_out, splits: as in `sample_greedy_or_gumbel`.
        precheck: draw the plain id first and keep it where it is provably kept (`truncation_plan`; the
            same ids, the search and the draw's read skipped for those rows); False: search every row.
        radix: the top-k rows the radix select serves take it (`truncation_plan`: the same ids, in three
            reads of the row); False: the precheck and the search for every row; None: plan.py's RADIX.

    Returns:
        The sampled ids [B] int64 (`out`).
    """
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("min_p", min_p, torch.float32),
    ):
        if t.dtype != dtype or t.shape != (B,):
            raise ValueError(f"{name} must be [{B}] {dtype}, got {tuple(t.shape)} {t.dtype}")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape != (B, (V + 31) // 32)):
        raise ValueError(f"bitmask must be [{B}, {(V + 31) // 32}] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask is not None and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    thr, _, ids = truncation_plan(
        logits, temperature, seeds, top_k, top_p, min_p, bitmask, precheck=precheck, radix=radix
    )
    return sample_greedy_or_gumbel(
        logits, temperature, seeds, out=out, splits=splits, host_out=host_out, bitmask=bitmask, thresholds=thr,
        decided=ids,
    )  # fmt: skip
