"""StepInputBuilder's packing: every tensor handed to the kernels starts on a 16-byte boundary (Triton
specialises pointer arguments on it: an unaligned view in one step and an aligned one in the next would
compile a second kernel variant mid-run), and the packed values are the hand-computed ones."""

import torch

from tinyvllm.core.outputs import PLACEHOLDER, ScheduledSequence, SchedulerOutput
from tinyvllm.engine.step_inputs import StepInputBuilder

BS = 4


def seq(rid: str, tokens: list[int], computed: int, blocks: list[int], sample: bool = True) -> ScheduledSequence:
    return ScheduledSequence(rid, tokens, computed, blocks, sample, False)


def test_regions_are_16_byte_aligned_and_values_hand_computed():
    builder = StepInputBuilder(
        block_size=BS, max_num_batched_tokens=64, max_num_seqs=8, max_blocks_per_seq=8, device=torch.device("cpu")
    )
    for n_dec in range(0, 4):  # odd and even counts of every region
        for chunk in (2, 3, 5):
            decodes = [seq(f"d{i}", [PLACEHOLDER if i == 1 else 7 + i], 5 + i, [10 + i, 20 + i]) for i in range(n_dec)]
            prefill = seq("p", list(range(100, 100 + chunk)), 1, [1, 2], sample=chunk != 3)
            sched = SchedulerOutput([*decodes, prefill], n_dec + chunk)
            inputs = builder.build(sched, prev_sample_index={"d1": 6})
            m = inputs.meta
            tensors = [
                inputs.input_ids,
                inputs.positions,
                inputs.logits_indices,
                m.slot_mapping,
                m.decode_seq_lens,
                m.decode_block_tables,
                m.prefill_cu_seqlens_q,
                m.prefill_seq_lens,
                m.prefill_block_tables,
            ]
            if inputs.placeholder_rows is not None:
                tensors += [inputs.placeholder_rows, inputs.placeholder_src]
            for t in tensors:
                assert t.data_ptr() % 16 == 0, (n_dec, chunk, t)
            T = n_dec + chunk
            assert inputs.positions.tolist() == [5 + i for i in range(n_dec)] + list(range(1, 1 + chunk))
            slots = [(20 + i) * BS + (5 + i) % BS for i in range(n_dec)]  # position 5+i is in block 1
            slots += [[1, 2][p // BS] * BS + p % BS for p in range(1, 1 + chunk)]
            assert m.slot_mapping.tolist() == slots
            assert m.decode_seq_lens.tolist() == [6 + i for i in range(n_dec)]
            assert m.prefill_cu_seqlens_q.tolist() == [0, chunk] and m.prefill_seq_lens.tolist() == [1 + chunk]
            assert inputs.logits_indices.tolist() == list(range(n_dec)) + ([T - 1] if chunk != 3 else [])
            if n_dec > 1:
                assert inputs.placeholder_rows.tolist() == [1] and inputs.placeholder_src.tolist() == [6]
            builder.release([s.request_id for s in sched.sequences])


def test_shared_prefix_len_hand_computed():
    """The cascade prefix: leading block columns equal in every row, short of each row's last key,
    rounded down to the alignment."""
    import numpy as np

    from tinyvllm.engine.step_inputs import shared_prefix_len

    table = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3], [0, 0, 0, 0, 0]], dtype=np.int32)
    rows = np.array([0, 1, 2])
    # blocks of 4 keys; rows share 3 blocks (12 keys); the shortest row has 13 keys, so 3 blocks are usable.
    assert shared_prefix_len(table, rows, np.array([20, 13, 17]), 4, 4) == 12
    assert shared_prefix_len(table, rows, np.array([20, 13, 17]), 4, 8) == 8  # rounded down to 8
    assert shared_prefix_len(table, rows, np.array([20, 12, 17]), 4, 4) == 8  # 12 keys: its last is own
    assert shared_prefix_len(table, np.array([0, 2]), np.array([20, 20]), 4, 4) == 16
    assert shared_prefix_len(table, np.array([0, 3]), np.array([20, 20]), 4, 4) == 0
    assert shared_prefix_len(table, rows, np.array([1, 20, 20]), 4, 4) == 0
