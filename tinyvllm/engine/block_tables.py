"""The runner's copy of the block tables: one numpy row per live request, updated incrementally.

A request's blocks only ever grow at the end (until it is released), so a step copies just the new
block ids; a batch's table is then one fancy-indexed gather instead of a Python loop over rows.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tinyvllm.core.outputs import ScheduledSequence


class BlockTableRows:
    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.lengths = np.zeros(num_rows, dtype=np.int64)
        self._rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self.lengths[row] = 0
                self._free.append(row)

    def update(self, seq: ScheduledSequence) -> int:
        """Bring the request's row up to date with `seq.block_ids`; returns the row index."""
        row = self._rows.get(seq.request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._free.pop()
            self._rows[seq.request_id] = row
            self.lengths[row] = 0
        have, want = int(self.lengths[row]), len(seq.block_ids)
        if want > have:
            if want > self.table.shape[1]:
                raise ValueError(f"request {seq.request_id} needs {want} blocks, more than the "
                                 f"{self.table.shape[1]} that max_model_len allows")
            self.table[row, have:want] = seq.block_ids[have:want]
            self.lengths[row] = want
        return row

    def _grow(self) -> None:
        n = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
