"""The kernels' input contract: how one packed batch maps onto the paged KV cache (built by the runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CASCADE_ALIGN = 64  # a cascade prefix (AttnMetadata.decode_prefix_len) is a multiple of this many keys


@dataclass
class AttnMetadata:
    """The batch is T token rows: first `num_decode_tokens` decode rows (one query token per sequence),
    then the prompt-chunk rows of `num_prefills` sequences, packed (varlen).

    Tensors live on the model's device. Host ints (`max_*`) are launch hints for kernels.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each row's K/V; -1 writes nowhere
    num_decode_tokens: int
    decode_seq_lens: torch.Tensor  # [D] int32: context length incl. the new token (0 = padded row)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    max_decode_seq_len: int
    num_prefills: int
    prefill_cu_seqlens_q: torch.Tensor  # [P+1] int32: row offsets of each chunk within the prefill rows
    prefill_seq_lens: torch.Tensor  # [P] int32: context length incl. the chunk
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    max_prefill_q_len: int
    max_prefill_seq_len: int
    # Cascade attention for the decode rows: a device int32 [1] holding P, the number of leading keys
    # every decode row keeps in the same blocks, a multiple of CASCADE_ALIGN and less than every
    # nonzero decode_seq_lens (see kernels.decode_attention); None: not used.
    decode_prefix_len: torch.Tensor | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.slot_mapping.shape[0]) - self.num_decode_tokens
