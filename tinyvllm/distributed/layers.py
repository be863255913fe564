"""The vocabulary-parallel embedding: rank r holds rows vocab_start .. vocab_start + n − 1 of the table.

    e(t) = Σ_r [vocab_start_r ≤ t < vocab_start_r + n] · W_r[t − vocab_start_r]

Each rank looks up the ids it holds (the others read row 0, then are zeroed) and one all-reduce sums the
ranks' rows: exactly one rank contributes each token's row, so the sum is that row, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyvllm.distributed.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    """The rows [vocab_start, vocab_start + num_embeddings) of an embedding table, `weight`
    [num_embeddings, embedding_dim]; `forward(ids)` [T] → [T, embedding_dim], every rank the full rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, vocab_start: int, group: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = vocab_start
        self.group = group
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.num_embeddings - 1}, dim {self.embedding_dim}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = nn.functional.embedding(torch.where(held, local, 0), self.weight)
        rows = rows * held.unsqueeze(-1).to(rows.dtype)
        return self.group.all_reduce(rows)
