"""Turn a SchedulerOutput into the tensors of one forward pass.

Row order: decode rows (sequences fed one token) first, then prompt chunks, so attention can split the
batch into one decode launch and one prefill launch over contiguous row ranges.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm.core.outputs import ScheduledSequence, SchedulerOutput
from tinyvllm.models.attention_metadata import AttnMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttnMetadata
    logits_indices: torch.Tensor  # [N] int64: the row whose hidden state gives each sample
    sampled: list[ScheduledSequence]  # the N sequences sampled, in row order
    sample_order: list[int]  # sample_order[j] = row-order index of the j-th sampled sequence in
    # SchedulerOutput order


def _block_table(seqs: Sequence[ScheduledSequence]) -> np.ndarray:
    width = max((len(s.block_ids) for s in seqs), default=0)
    table = np.zeros((len(seqs), max(width, 1)), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.block_ids)] = s.block_ids
    return table


def build_step_inputs(sched: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    """Pack the scheduled sequences into flat token rows with their cache slots and attention metadata."""
    decodes = [s for s in sched.sequences if s.num_new_tokens == 1]
    prefills = [s for s in sched.sequences if s.num_new_tokens > 1]
    ordered = decodes + prefills

    total = sum(s.num_new_tokens for s in ordered)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    last_rows = np.empty(len(ordered), dtype=np.int64)
    row = 0
    for i, s in enumerate(ordered):
        n = s.num_new_tokens
        pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + n)
        blocks = np.asarray(s.block_ids, dtype=np.int64)[pos // block_size]
        input_ids[row:row + n] = s.token_ids
        positions[row:row + n] = pos
        slots[row:row + n] = blocks * block_size + pos % block_size
        row += n
        last_rows[i] = row - 1

    decode_lens = np.array([s.context_len for s in decodes], dtype=np.int32)
    prefill_lens = np.array([s.context_len for s in prefills], dtype=np.int32)
    cu = np.zeros(len(prefills) + 1, dtype=np.int32)
    np.cumsum([s.num_new_tokens for s in prefills], out=cu[1:])

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    meta = AttnMetadata(
        slot_mapping=dev(slots),
        num_decode_tokens=len(decodes),
        decode_seq_lens=dev(decode_lens),
        decode_block_tables=dev(_block_table(decodes)),
        max_decode_seq_len=int(decode_lens.max(initial=0)),
        num_prefills=len(prefills),
        prefill_cu_seqlens_q=dev(cu),
        prefill_seq_lens=dev(prefill_lens),
        prefill_block_tables=dev(_block_table(prefills)),
        max_prefill_q_len=max((s.num_new_tokens for s in prefills), default=0),
        max_prefill_seq_len=int(prefill_lens.max(initial=0)),
    )
    sampled_rows = [i for i, s in enumerate(ordered) if s.sample]
    rank = {id(ordered[i]): j for j, i in enumerate(sampled_rows)}
    sample_order = [rank[id(s)] for s in sched.sequences if s.sample]
    return StepInputs(
        input_ids=dev(input_ids),
        positions=dev(positions),
        meta=meta,
        logits_indices=dev(last_rows[sampled_rows]),
        sampled=[ordered[i] for i in sampled_rows],
        sample_order=sample_order,
    )
