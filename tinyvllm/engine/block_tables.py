"""The runner's copy of the block tables: one numpy row per live request, updated incrementally.

A request's blocks only ever grow at the end (until it is released), so a step copies just the new
block ids; a batch's table is then one fancy-indexed gather instead of a Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tinyvllm.core.outputs import ScheduledSequence


class BlockTableRows:
    """A block table of `num_rows` rows (more are added when live requests need them).

    Args:
        num_rows: Rows to start with.
        max_blocks_per_seq: Columns: the most blocks a request may hold.
    """

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, list[int]] = {}  # request id -> [row, number of block ids copied]
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the rows of these requests (unknown ids are ignored)."""
        for rid in request_ids:
            entry = self._rows.pop(rid, None)
            if entry is not None:
                self._free.append(entry[0])

    def update(self, seq: ScheduledSequence) -> int:
        """Bring the request's row up to date with `seq.block_ids`.

        Returns:
            The request's row index.

        Raises:
            ValueError: The request holds more blocks than a row has columns.
        """
        entry = self._rows.get(seq.request_id)
        if entry is None:
            if not self._free:
                self._grow()
            entry = self._rows[seq.request_id] = [self._free.pop(), 0]
        row, have = entry
        want = len(seq.block_ids)
        if want > have:  # most decode steps add no block: nothing to copy
            if want > self.table.shape[1]:
                raise ValueError(
                    f"request {seq.request_id} needs {want} blocks, more than the "
                    f"{self.table.shape[1]} that max_model_len allows"
                )
            self.table[row, have:want] = seq.block_ids[have:want]
            entry[1] = want
        return row

    def _grow(self) -> None:
        n = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
