"""The LM head's paths: logits by the plain or the fused product, sampled ids without a logits pass.

- `logits`: [N, H] → [N, V], by the ops table's product (cuBLAS, or the batch-invariant one) or, on
  the fused small-batch path, by our matrix-vector kernel.
- `logits_sampled`: the logits, and every row's id drawn by the fused greedy/Gumbel sampler
  (kernels/sampling.py). Where the fused Triton product computes the logits, its programs also find
  the sampler's per-block bests and only the sampler's reduce kernel follows (kernels/gemv.py,
  `sampling=`: two kernels instead of three).
- `sample_pruned`: one row's sampled id without its logits. An int8 copy of the LM head bounds every
  row's score, and the product runs over only the rows that can hold the sampled id
  (kernels/lm_head_bounds.py: the same id, bit for bit, from about half the LM head's bytes). With a
  token bitmask (a constrained row) the same holds over the allowed tokens: the id is the masked sampler's.
"""

from __future__ import annotations

import torch

from tinyvllm.distributed.group import TPGroup
from tinyvllm.kernels import Ops
from tinyvllm.kernels.pdl import programmatic_launches


class LMHead:
    """The LM head of a model, `weight` [V, H], computed the way the runner's configuration asks.

    Args:
        weight: the LM head's weight (the embedding table when tied).
        ops: the kernel ops table.
        fused_max_rows: batches of at most this many rows take the fused matrix-vector product;
            0: never (the ops table has no fused product, or the runner turned it off).
        pruned: keep an int8 copy of the weight (V·H bytes) for `sample_pruned`; needs the Triton ops.
        group: under tensor parallelism, the ranks' group: `weight` is the rank's vocabulary rows and
            `logits` gathers every rank's columns (no fused sampling inside the product then).
        pdl: the fused product is launched with programmatic dependent launch (kernels/pdl.py), as the
            fused path's kernels before it are.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        ops: Ops,
        fused_max_rows: int,
        pruned: bool = False,
        group: TPGroup | None = None,
        pdl: bool = False,
    ) -> None:
        assert group is None or not pruned, "the pruned LM head reads the whole weight"
        self.pdl = pdl
        self.weight = weight
        self.ops = ops
        self.group = group
        self.fused_max_rows = fused_max_rows if ops.fused_gemv is not None else 0
        self.rows = None
        if pruned and ops.name == "triton" and self.fused_max_rows >= 1:
            from tinyvllm.kernels.int8_rows import quantize_rows

            self.rows = quantize_rows(weight)

    def is_fused(self, num_rows: int) -> bool:
        """Whether `num_rows` hidden rows take the fused matrix-vector product."""
        return 0 < num_rows <= self.fused_max_rows

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, H] → [N, V] logits in `dtype` (None: the weight's dtype; the samplers upcast as they read)."""
        if self.is_fused(hidden.shape[0]):
            with programmatic_launches(self.pdl):
                logits = self.ops.fused_gemv(hidden, self.weight)
        else:
            logits = self.ops.linear(hidden, self.weight)
        if self.group is not None:
            logits = self.group.all_gather_last(logits)
        return logits if dtype is None else logits.to(dtype)

    def logits_sampled(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        ids: torch.Tensor,
        host_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`logits(hidden, dtype=None)`, and every row's id drawn by the fused greedy/Gumbel sampler into
        `ids` [N] int64 and, when given, `host_ids` (pinned host memory).

        Args:
            temperature: [N] float32, 0 for greedy rows.
            seeds: [N] int64, the rows' Gumbel-noise seeds.
        """
        if self.is_fused(hidden.shape[0]) and self.ops.name == "triton" and self.group is None:
            from tinyvllm.kernels.gemv import GemvSampling, fused_gemv_fwd

            with programmatic_launches(self.pdl):
                return fused_gemv_fwd(hidden, self.weight, sampling=GemvSampling(temperature, seeds, ids, host_ids))
        from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

        logits = self.logits(hidden, dtype=None)
        sample_greedy_or_gumbel(logits, temperature, seeds, out=ids, host_out=host_ids)
        return logits

    def can_sample_pruned(self, num_rows: int) -> bool:
        """Whether `sample_pruned` serves `num_rows` hidden rows (one, with the int8 copy)."""
        return num_rows == 1 and self.rows is not None and self.is_fused(1)

    def sample_pruned(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        ids: torch.Tensor,
        host_ids: torch.Tensor | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> None:
        """`logits_sampled`'s ids for one row, without its logits (module docstring); with `bitmask`
        ([1, ceil(V / 32)] int32 on the device), the id the fused sampler draws under it."""
        if not self.can_sample_pruned(hidden.shape[0]):
            raise RuntimeError("sample_pruned needs the int8 copy (pruned=True), the Triton ops and one row")
        from tinyvllm.kernels.gemv import GemvSampling
        from tinyvllm.kernels.lm_head_bounds import sample_pruned

        sample_pruned(hidden, self.weight, self.rows, GemvSampling(temperature, seeds, ids, host_ids), bitmask=bitmask)
