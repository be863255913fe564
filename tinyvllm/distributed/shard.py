"""Which part of the model a tensor-parallel rank holds.

With P ranks, rank r holds (Megatron-LM's split, as vLLM has it):
  - query heads r·Hq/P .. (r+1)·Hq/P − 1: the rows of q_proj and the columns of o_proj they use;
  - KV heads r·Hk/P .. (r+1)·Hk/P − 1 when Hk ≥ P; when Hk < P (P a multiple of Hk) the one KV head its
    query heads read, r·Hk/P rounded down: each KV head is replicated on P/Hk ranks;
  - MLP columns r·F/P .. (r+1)·F/P − 1: rows of gate_proj and up_proj, columns of down_proj;
  - vocabulary rows r·V/P .. (r+1)·V/P − 1 of the embedding and of the LM head.
Column-parallel layers (QKV, gate/up) need no communication; each row-parallel layer (o_proj,
down_proj) sums its ranks' partial products by one all-reduce; the embedding is an all-reduce of the
rank's masked lookups and the LM head an all-gather of its logits' columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.config import ModelConfig


@dataclass(frozen=True)
class ModelShard:
    """The slice of a model that rank `rank` of `world_size` holds (module docstring).

    `start`/`size` pairs index the full model's heads, MLP columns and vocabulary rows."""

    rank: int
    world_size: int
    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_size: int
    vocab_start: int

    @classmethod
    def whole(cls, config: ModelConfig) -> ModelShard:
        """One rank holding everything."""
        return cls.for_rank(config, 0, 1)

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, world_size: int) -> ModelShard:
        """Rank `rank`'s slice; the split must be possible (ParallelConfig.check_model)."""
        assert 0 <= rank < world_size
        p, hq, hk = world_size, config.num_attention_heads, config.num_key_value_heads
        assert hq % p == 0 and (hk % p == 0 if hk >= p else p % hk == 0)
        assert config.intermediate_size % p == 0 and config.vocab_size % p == 0
        kv_heads, kv_start = (hk // p, rank * hk // p) if hk >= p else (1, rank * hk // p)
        f, v = config.intermediate_size // p, config.vocab_size // p
        return cls(rank, p, hq // p, rank * hq // p, kv_heads, kv_start, f, rank * f, v, rank * v)

    @property
    def is_whole(self) -> bool:
        return self.world_size == 1

    def q_size(self, head_dim: int) -> int:
        return self.num_heads * head_dim

    def kv_size(self, head_dim: int) -> int:
        return self.num_kv_heads * head_dim
