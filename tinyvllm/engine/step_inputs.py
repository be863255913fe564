"""Turn a SchedulerOutput into the tensors of one forward pass.

Row order: decode rows (sequences fed one token) first, then prompt chunks, so attention splits the batch
into one decode launch and one prefill launch over contiguous row ranges.

Everything is packed on the host into two flat staging buffers (int64: token ids, positions, slots,
logits rows; int32: sequence lengths, cu_seqlens, block tables) that are pinned on CUDA and alternate
between steps, then reaches the device in two asynchronous copies; the tensors handed to the model are
views into the device copies. Block tables come from the incrementally updated `BlockTableRows`.

A decode step replayed as a CUDA graph is packed instead straight into a host twin of the graphs' input
arena (engine/input_arena.py: the static tensors the graphs read, in one byte buffer); its caller then
copies the used prefix of that arena to the device in ONE copy. Its placeholder inputs are not resolved
by the caller: the arena's `placeholder_src` tells the graph which rows to gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm.core.outputs import PLACEHOLDER, ScheduledSequence, SchedulerOutput
from tinyvllm.engine.block_tables import BlockTableRows
from tinyvllm.engine.input_arena import InputArena
from tinyvllm.kernels.attention_metadata import AttnMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (placeholder rows hold PLACEHOLDER until resolved)
    positions: torch.Tensor  # [T] int64
    meta: AttnMetadata
    logits_indices: torch.Tensor  # [N] int64: the row whose hidden state gives each sample
    sampled: list[ScheduledSequence]  # the N sampled sequences, in row order
    sample_order: list[int]  # j-th sample in SchedulerOutput order = sampled[sample_order[j]]
    placeholder_rows: torch.Tensor | None  # [K] int64: rows whose input is the previous step's sample...
    placeholder_src: torch.Tensor | None  # [K] int64: ...at this index of that step's sampled ids
    # (both None on a graph step: the arena's placeholder_src holds its sources, the graph gathers them)
    num_decodes: int
    num_placeholders: int = 0  # K: rows whose input is the previous step's sample
    prefix_len: int = 0  # the cascade prefix handed to attention (meta.decode_prefix_len's value); 0: none
    arena_bytes: int = 0  # graph steps: the leading bytes of the host arena to copy to the device arena
    ordered: Sequence[ScheduledSequence] = ()  # eager steps: every sequence in row order


def shared_prefix_len(table: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray, block_size: int, align: int) -> int:
    """The cascade prefix of a decode batch: the most leading keys that every row keeps in the same
    cache blocks, short of each row's last key (its own new token), rounded down to `align` keys.

    table: the block-table rows; rows: each decode row's index into it; seq_lens: their context lengths.
    """
    max_blocks = (int(seq_lens.min()) - 1) // block_size
    if max_blocks <= 0:
        return 0
    head = table[rows, :max_blocks]
    same = (head == head[0]).all(axis=0)
    k = max_blocks if same.all() else int(np.argmin(same))
    return k * block_size // align * align


def placeholder_sources(
    decodes: list[ScheduledSequence], ids: np.ndarray, prev_sample_index: dict[str, int] | None
) -> tuple[list[int], list[int]]:
    """The decode rows whose input id (`ids`, one per decode row) is PLACEHOLDER, and for each one its
    row in the previous step's sampled ids (`prev_sample_index`: request id -> that row)."""
    rows: list[int] = []
    srcs: list[int] = []
    for i in np.flatnonzero(ids == PLACEHOLDER).tolist():
        rid = decodes[i].request_id
        if prev_sample_index is None or rid not in prev_sample_index:
            raise RuntimeError(f"request {rid}'s input token is not known yet")
        rows.append(i)
        srcs.append(prev_sample_index[rid])
    return rows, srcs


def _round2(n: int) -> int:
    """n int64 elements, rounded up to whole 16-byte units."""
    return (n + 1) & ~1


def _round4(n: int) -> int:
    """n int32 elements, rounded up to whole 16-byte units."""
    return (n + 3) & ~3


class _Staging:
    """One set of host staging buffers and their device twins."""

    def __init__(self, n64: int, n32: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        if device.type == "cpu":
            self.dev64, self.dev32 = self.host64, self.host32
        else:
            self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
            self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)


@dataclass
class _Batch:
    """A step's sequences in row order (decode rows, then prompt chunks) and their block-table rows."""

    decodes: list[ScheduledSequence]
    prefills: list[ScheduledSequence]
    ordered: list[ScheduledSequence]  # decodes + prefills
    table_rows: list[int]  # the block-table row of each sequence of `ordered`
    decode_table_rows: np.ndarray  # int64, those of the decodes
    table: np.ndarray  # the block table, read after every row's update
    sampled_rows: list[int]  # the indices into `ordered` of the sequences that sample


@dataclass
class _Int64Layout:
    """Where `StepInputBuilder.build` put the int64 regions: element offsets into the staging buffer.

    Regions: ids at 0, positions at `stride`, slots at 2 * `stride` (`tokens` rows each, padding
    included), then the logits rows, the placeholder rows and their sources.
    """

    tokens: int
    stride: int
    logits_rows: int
    num_logits_rows: int
    placeholder_rows: int
    placeholder_src: int
    num_placeholders: int
    end: int  # elements the device needs


@dataclass
class _Int32Layout:
    """Where `StepInputBuilder.build` put the int32 regions: element offsets into the staging buffer.

    Regions: decode lengths at 0 (`decode_rows`, padding included), prefill lengths, cu_seqlens, the
    decode block tables (`decode_width` columns), the prefill block tables (`prefill_width` columns), and
    the cascade prefix length when `prefix_len` is not 0.
    """

    decode_rows: int
    prefill_lens: int
    cu_seqlens: int
    decode_table: int
    decode_width: int
    prefill_table: int
    prefill_width: int
    prefix: int
    prefix_len: int
    max_decode_seq_len: int
    max_prefill_seq_len: int
    end: int  # elements the device needs


class StepInputBuilder:
    """Packs a SchedulerOutput into the tensors of one forward pass (module docstring).

    Args:
        block_size: Tokens per KV-cache block.
        max_num_batched_tokens: The most tokens a step schedules.
        max_num_seqs: The most sequences a step schedules.
        max_blocks_per_seq: Block-table width.
        device: Where the model runs.
        cascade: (minimum decode rows, minimum shared keys, alignment) at which a decode-only step's
            shared prefix is handed to cascade attention (`AttnMetadata.decode_prefix_len`); None: never.
    """

    def __init__(
        self,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        cascade: tuple[int, int, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.cascade = cascade
        self.tables = BlockTableRows(max(2 * max_num_seqs, 8), max_blocks_per_seq)
        max_tokens = max(max_num_batched_tokens, max_num_seqs)
        n64 = 4 * max_tokens + 2 * max_num_seqs + 16  # + alignment padding of the 6 regions
        n32 = 3 * (max_num_seqs + 1) + max_num_seqs * max_blocks_per_seq + 36
        self._staging = [_Staging(n64, n32, device) for _ in range(2)]
        self._step = 0

    def release(self, request_ids) -> None:
        self.tables.release(request_ids)

    def _cascade_prefix(self, table: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray) -> int:
        """The cascade prefix of a decode-only step (table rows `rows`, context lengths `seq_lens`)
        when it qualifies for cascade attention (`self.cascade`'s thresholds), else 0."""
        if self.cascade is None or len(rows) < self.cascade[0]:
            return 0
        prefix_len = shared_prefix_len(table, rows, seq_lens, self.block_size, self.cascade[2])
        return prefix_len if prefix_len >= self.cascade[1] else 0

    def build(
        self,
        sched: SchedulerOutput,
        pad_decodes_to: int | None = None,
        prev_sample_index: dict[str, int] | None = None,
        host_arena: InputArena | None = None,
        device_arena: InputArena | None = None,
    ) -> StepInputs:
        """Pack one step.

        Args:
            sched: The step's scheduled sequences.
            pad_decodes_to: For a decode-only step replayed as a CUDA graph: the row count to pad to; the
                padded rows write nowhere (slot −1) and attend to nothing (length 0).
            prev_sample_index: Request id -> its row in the previous step's sampled ids, for the
                PLACEHOLDER inputs of async scheduling.
            host_arena: With `device_arena` (and `pad_decodes_to`): a graph step, packed by
                `_build_into_arena`; nothing is copied to the device.
            device_arena: The arena the graph reads.

        Returns:
            The step's inputs, views of the device copies of the staging buffers.
        """
        if host_arena is not None:
            assert pad_decodes_to is not None and device_arena is not None
            return self._build_into_arena(sched, pad_decodes_to, prev_sample_index, host_arena, device_arena)
        stage = self._staging[self._step % 2]
        self._step += 1
        self.tables.release(sched.released_request_ids)
        seqs = sched.sequences
        batch = self._order_rows(seqs)
        D, prefills = len(batch.decodes), batch.prefills
        num_tokens = D + sum(len(s.token_ids) for s in prefills)
        T = num_tokens if pad_decodes_to is None else pad_decodes_to
        assert pad_decodes_to is None or (not prefills and pad_decodes_to >= D)
        l64 = self._pack_int64(stage.np64, batch, T, num_tokens, prev_sample_index)
        decode_positions = stage.np64[l64.stride : l64.stride + D]
        l32 = self._pack_int32(stage.np32, batch, decode_positions, D if pad_decodes_to is None else T)
        if stage.dev64 is not stage.host64:  # to the device: two copies
            stage.dev64[: l64.end].copy_(stage.host64[: l64.end], non_blocking=True)
            stage.dev32[: l32.end].copy_(stage.host32[: l32.end], non_blocking=True)

        d64 = stage.dev64
        K, N = l64.num_placeholders, l64.num_logits_rows
        return StepInputs(
            input_ids=d64[0:T],
            positions=d64[l64.stride : l64.stride + T],
            meta=_attention_metadata(l64, l32, stage.dev64, stage.dev32, D, prefills),
            logits_indices=d64[l64.logits_rows : l64.logits_rows + N],
            sampled=[batch.ordered[i] for i in batch.sampled_rows],
            sample_order=_sample_order(seqs, batch),
            placeholder_rows=d64[l64.placeholder_rows : l64.placeholder_rows + K] if K else None,
            placeholder_src=d64[l64.placeholder_src : l64.placeholder_src + K] if K else None,
            num_decodes=D,
            num_placeholders=K,
            prefix_len=l32.prefix_len,
            ordered=batch.ordered,
        )

    def _order_rows(self, seqs: list[ScheduledSequence]) -> _Batch:
        """Put the decode rows first, then the prompt chunks, and update their block-table rows."""
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        prefills = [s for s in seqs if len(s.token_ids) > 1] if len(decodes) < len(seqs) else []
        ordered = decodes + prefills if prefills else decodes
        rows = [self.tables.update(s) for s in ordered]
        return _Batch(
            decodes,
            prefills,
            ordered,
            table_rows=rows,
            decode_table_rows=np.asarray(rows[: len(decodes)], dtype=np.int64),
            table=self.tables.table,  # after the updates: a growing table is a new array
            sampled_rows=[i for i, s in enumerate(ordered) if s.sample],
        )

    def _pack_int64(
        self, a64: np.ndarray, batch: _Batch, T: int, num_tokens: int, prev_sample_index: dict[str, int] | None
    ) -> _Int64Layout:
        """Write into `a64` the ids, positions and slots of `T` rows (`num_tokens` of the batch, then
        padding), the logits rows of the sampling sequences, and the placeholder rows and sources."""
        # Every region starts on a 16-byte boundary: Triton specialises pointer arguments on that
        # alignment, so a region that were aligned in one step and not in the next would compile a
        # second variant of every kernel reading it (in the middle of a run).
        T2 = _round2(T)
        ids, pos, slots = a64[0:T], a64[T2 : T2 + T], a64[2 * T2 : 2 * T2 + T]
        bs, table, decodes = self.block_size, batch.table, batch.decodes
        D = len(decodes)
        ph_rows: list[int] = []
        ph_src: list[int] = []
        if D:
            dpos = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=D)
            ids[:D] = [s.token_ids[0] for s in decodes]
            pos[:D] = dpos
            slots[:D] = table[batch.decode_table_rows, dpos // bs].astype(np.int64) * bs + dpos % bs
            ph_rows, ph_src = placeholder_sources(decodes, ids[:D], prev_sample_index)
        if num_tokens < T:  # padding rows
            ids[num_tokens:], pos[num_tokens:], slots[num_tokens:] = 0, 0, -1
        row = D
        last_rows = list(range(D))
        for s, r in zip(batch.prefills, batch.table_rows[D:]):
            n = s.num_new_tokens
            p = np.arange(s.num_computed_tokens, s.num_computed_tokens + n)
            ids[row : row + n] = s.token_ids
            pos[row : row + n] = p
            slots[row : row + n] = table[r, p // bs].astype(np.int64) * bs + p % bs
            row += n
            last_rows.append(row - 1)
        N, K = len(batch.sampled_rows), len(ph_rows)
        o_rows = 3 * T2
        o_ph_rows = o_rows + _round2(N)
        o_ph_src = o_ph_rows + _round2(K)
        a64[o_rows : o_rows + N] = [last_rows[i] for i in batch.sampled_rows]
        a64[o_ph_rows : o_ph_rows + K] = ph_rows
        a64[o_ph_src : o_ph_src + K] = ph_src
        return _Int64Layout(T, T2, o_rows, N, o_ph_rows, o_ph_src, K, end=o_ph_src + K)

    def _pack_int32(self, a32: np.ndarray, batch: _Batch, decode_positions: np.ndarray, Dp: int) -> _Int32Layout:
        """Write into `a32` the decode lengths (`Dp` rows, padding included), the prefill lengths,
        cu_seqlens, both block tables and the cascade prefix length."""
        bs, table, prefills, drows = self.block_size, batch.table, batch.prefills, batch.decode_table_rows
        D, P = len(batch.decodes), len(prefills)
        o_plens = _round4(Dp)
        o_cu = o_plens + _round4(P)
        o_dtab = o_cu + _round4(P + 1)
        dlens = a32[0:Dp]
        if D:
            dlens[:D] = decode_positions + 1
        dlens[D:] = 0
        plens = a32[o_plens : o_plens + P]
        plens[:] = [s.context_len for s in prefills]
        cu = a32[o_cu : o_cu + P + 1]
        cu[0] = 0
        np.cumsum([s.num_new_tokens for s in prefills], out=cu[1:])
        dwidth = max(1, -(-int(dlens[:D].max(initial=0)) // bs))
        o_ptab = o_dtab + _round4(D * dwidth)
        if D:
            a32[o_dtab : o_dtab + D * dwidth].reshape(D, dwidth)[:] = table[drows, :dwidth]
        pwidth = max(1, max((-(-s.context_len // bs) for s in prefills), default=1))
        if P:
            a32[o_ptab : o_ptab + P * pwidth].reshape(P, pwidth)[:] = table[np.asarray(batch.table_rows[D:]), :pwidth]
        end = o_ptab + P * pwidth
        prefix_len = 0 if prefills else self._cascade_prefix(table, drows, dlens[:D])
        o_prefix = _round4(end)
        if prefix_len:
            a32[o_prefix] = prefix_len
            end = o_prefix + 1
        return _Int32Layout(
            decode_rows=Dp,
            prefill_lens=o_plens,
            cu_seqlens=o_cu,
            decode_table=o_dtab,
            decode_width=dwidth,
            prefill_table=o_ptab,
            prefill_width=pwidth,
            prefix=o_prefix,
            prefix_len=prefix_len,
            max_decode_seq_len=int(dlens.max(initial=0)),
            max_prefill_seq_len=int(plens.max(initial=0)),
            end=end,
        )

    def _build_into_arena(
        self,
        sched: SchedulerOutput,
        bucket: int,
        prev_sample_index: dict[str, int] | None,
        host: InputArena,
        device: InputArena,
    ) -> StepInputs:
        """Pack a decode-only step whose every row samples, padded to `bucket` rows, into the host
        arena `host` (its numpy views); the returned inputs view the device arena `device`, valid once
        the caller has copied `arena_bytes` leading bytes of `host` into it.

        Rows 0..D−1 get the same ids (PLACEHOLDER where the input is still on the device), positions,
        slots, lengths and block-table entries as `build` gives them; their `placeholder_src` is the
        row in the previous step's sampled ids (−1: not a placeholder). Rows D..bucket−1 are padding:
        id 0, position 0, slot −1, length 0, source −1. Block-table rows have the arena's full width;
        only the columns covering each row's length (the first `width`, written here) are read, the
        rest and the padding rows' tables keep stale values. `prefix_len` is written every step (0
        without cascade). Temperatures and seeds are the caller's to write."""
        seqs = sched.sequences
        D = len(seqs)
        if not (sched.num_batched_tokens == D and 0 < D <= bucket <= host.max_rows):
            raise ValueError(f"not a decode-only step of 1..{bucket} rows: {D} rows, {sched.num_batched_tokens} tokens")
        if not all(s.sample for s in seqs):
            raise ValueError("every row of a graph step must sample")
        bs = self.block_size
        self.tables.release(sched.released_request_ids)
        rows = np.fromiter((self.tables.update(s) for s in seqs), dtype=np.int64, count=D)
        table = self.tables.table  # after the updates: a growing table is a new array
        a = host.arrays
        pos = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=D)
        a.input_ids[:D] = [s.token_ids[0] for s in seqs]
        a.positions[:D] = pos
        a.slot_mapping[:D] = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        a.seq_lens[:D] = pos + 1
        a.placeholder_src[:bucket] = -1
        ph_rows, ph_src = placeholder_sources(seqs, a.input_ids[:D], prev_sample_index)
        if ph_rows:
            a.placeholder_src[ph_rows] = ph_src
        a.input_ids[D:bucket], a.positions[D:bucket], a.slot_mapping[D:bucket], a.seq_lens[D:bucket] = 0, 0, -1, 0
        max_len = int(pos.max()) + 1
        width = -(-max_len // bs)
        a.block_tables[:D, :width] = table[rows, :width]
        prefix_len = self._cascade_prefix(table, rows, a.seq_lens[:D])
        a.prefix_len[0] = prefix_len
        return StepInputs(
            input_ids=device.input_ids[:bucket],
            positions=device.positions[:bucket],
            meta=device.decode_meta(bucket, max_len, cascade=prefix_len > 0),
            logits_indices=device.row_index[:D],
            sampled=list(seqs),
            sample_order=list(range(D)),
            placeholder_rows=None,
            placeholder_src=None,
            num_decodes=D,
            num_placeholders=len(ph_rows),
            prefix_len=prefix_len,
            arena_bytes=host.bytes_through(D, width),
        )


def _attention_metadata(
    l64: _Int64Layout,
    l32: _Int32Layout,
    d64: torch.Tensor,
    d32: torch.Tensor,
    num_decodes: int,
    prefills: list[ScheduledSequence],
) -> AttnMetadata:
    """The attention metadata of a step packed with layouts `l64` and `l32`, as views of the device
    buffers `d64` and `d32`."""
    D, P, Dp = num_decodes, len(prefills), l32.decode_rows
    o_slots, o_dtab, o_ptab = 2 * l64.stride, l32.decode_table, l32.prefill_table
    return AttnMetadata(
        slot_mapping=d64[o_slots : o_slots + l64.tokens],
        num_decode_tokens=Dp,
        decode_seq_lens=d32[0:Dp],
        decode_block_tables=d32[o_dtab : o_dtab + D * l32.decode_width].view(D, l32.decode_width),
        max_decode_seq_len=l32.max_decode_seq_len,
        num_prefills=P,
        prefill_cu_seqlens_q=d32[l32.cu_seqlens : l32.cu_seqlens + P + 1],
        prefill_seq_lens=d32[l32.prefill_lens : l32.prefill_lens + P],
        prefill_block_tables=d32[o_ptab : o_ptab + P * l32.prefill_width].view(P, l32.prefill_width),
        max_prefill_q_len=max((s.num_new_tokens for s in prefills), default=0),
        max_prefill_seq_len=l32.max_prefill_seq_len,
        decode_prefix_len=d32[l32.prefix : l32.prefix + 1] if l32.prefix_len else None,
    )


def _sample_order(seqs: list[ScheduledSequence], batch: _Batch) -> list[int]:
    """For the j-th sampling sequence in scheduler order (`seqs`), its index among the batch's sampled
    rows (`StepInputs.sample_order`)."""
    sampled_rows = batch.sampled_rows
    if not batch.prefills and len(sampled_rows) == len(batch.decodes):  # decode-only, all sampled: in order
        return list(range(len(sampled_rows)))
    rank = {id(batch.ordered[i]): j for j, i in enumerate(sampled_rows)}
    return [rank[id(s)] for s in seqs if s.sample]
