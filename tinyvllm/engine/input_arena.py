"""The decode graphs' input arena: every per-step input of a decode CUDA graph in one byte buffer.

A graph reads static tensors; here they are all views of one uint8 buffer, so that a step's inputs,
packed into a pinned host twin of the buffer, reach the device in ONE copy of its used prefix.
Layout for n rows and W blocks per sequence, every region starting on a 16-byte boundary (Triton
specialises pointer arguments on that alignment):

    copy_words [1] int32 | input_ids [n] int64 | positions [n] int64 | slot_mapping [n] int64 |
    placeholder_src [n] int64 | seeds [n] int64 | temperatures [n] float32 | top_k [n] int32 |
    top_p [n] float32 | min_p [n] float32 | seq_lens [n] int32 | prefix_len [1] int32 |
    block_tables [n, W] int32 | row_index [n] int64 | sampled_ids [n] int64

`placeholder_src[i]` ≥ 0: row i's input is that row of the previous step's sampled ids (async
scheduling; the graph gathers it, kernels/placeholders.py); −1: the row's id is in `input_ids`. The
block tables come after every per-row region, so a step copies the bytes up to the end of its used table
rows only (`bytes_through`). `row_index` (0, 1, …, n−1, the logits rows of a decode-only step) is set
once and never copied. Two regions serve the graphs that do their own copies (cuda_graphs.py, small
buckets): `copy_words`, the number of leading 32-bit words a step needs copied (written by
`set_copy_words`, read by the graph's load kernel from the pinned twin), and `sampled_ids`, where that
graph's sampler writes the step's ids into the pinned twin (never copied in). `top_k`, `top_p` and
`min_p` (0, 1, 0: off) are read by the decode graphs' truncating sampler only (cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm.kernels.attention_metadata import AttnMetadata

_ALIGN = 16


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _regions(n: int, max_blocks_per_seq: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each region, in layout order."""
    i64, i32 = torch.int64, torch.int32
    return [
        ("copy_words", i32, (1,)),
        ("input_ids", i64, (n,)),
        ("positions", i64, (n,)),
        ("slot_mapping", i64, (n,)),
        ("placeholder_src", i64, (n,)),
        ("seeds", i64, (n,)),
        ("temperatures", torch.float32, (n,)),
        ("top_k", i32, (n,)),
        ("top_p", torch.float32, (n,)),
        ("min_p", torch.float32, (n,)),
        ("seq_lens", i32, (n,)),
        ("prefix_len", i32, (1,)),
        ("block_tables", i32, (n, max_blocks_per_seq)),
        ("row_index", i64, (n,)),
        ("sampled_ids", i64, (n,)),
    ]


@dataclass(frozen=True)
class ArenaArrays:
    """Numpy views of a host arena's regions (same names and shapes as `InputArena`'s tensors)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    placeholder_src: np.ndarray
    seeds: np.ndarray
    temperatures: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seq_lens: np.ndarray
    prefix_len: np.ndarray
    block_tables: np.ndarray
    copy_words: np.ndarray
    sampled_ids: np.ndarray


class InputArena:
    """One arena (module docstring); a host arena (CPU) also has numpy views in `arrays`.

    Starts with every row padding: ids, positions, lengths 0, slots and placeholder sources −1, block
    tables 0, no sampling filter (temperature 0, top_k 0, top_p 1, min_p 0); `copy_words` covers every
    region up to the block tables' end.

    Args:
        max_rows: Rows of every per-row region (the largest graph's batch).
        max_blocks_per_seq: Block-table width.
        device: Where the buffer lives: the device arena the graphs read, or the CPU for its host twin.
        pin_memory: Pin a host arena, so that its copy to the device is asynchronous.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, device: torch.device, pin_memory: bool = False) -> None:
        self.max_rows = max_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        offsets: dict[str, int] = {}
        nbytes = 0
        for name, dtype, shape in _regions(max_rows, max_blocks_per_seq):
            offsets[name] = nbytes
            nbytes = _align(nbytes + int(np.prod(shape)) * dtype.itemsize)
        self.nbytes = nbytes
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        views = {}
        for name, dtype, shape in _regions(max_rows, max_blocks_per_seq):
            start = offsets[name]
            views[name] = self.buffer[start : start + int(np.prod(shape)) * dtype.itemsize].view(dtype).view(shape)
        self._table_offset = offsets["block_tables"]
        self.input_ids: torch.Tensor = views["input_ids"]
        self.positions: torch.Tensor = views["positions"]
        self.slot_mapping: torch.Tensor = views["slot_mapping"]
        self.placeholder_src: torch.Tensor = views["placeholder_src"]
        self.seeds: torch.Tensor = views["seeds"]
        self.temperatures: torch.Tensor = views["temperatures"]
        self.top_k: torch.Tensor = views["top_k"]
        self.top_p: torch.Tensor = views["top_p"]
        self.min_p: torch.Tensor = views["min_p"]
        self.seq_lens: torch.Tensor = views["seq_lens"]
        self.prefix_len: torch.Tensor = views["prefix_len"]
        self.block_tables: torch.Tensor = views["block_tables"]
        self.row_index: torch.Tensor = views["row_index"]
        self.copy_words: torch.Tensor = views["copy_words"]
        self.sampled_ids: torch.Tensor = views["sampled_ids"]
        self.arrays: ArenaArrays | None = None
        if self.buffer.device.type == "cpu":
            self.arrays = ArenaArrays(**{name: views[name].numpy() for name in ArenaArrays.__dataclass_fields__})
        self.reset()

    def reset(self) -> None:
        """Every row back to padding (the state the class docstring gives): a graph run over the arena then
        reads no previous step's inputs and writes no KV cache slot. The caller makes sure no copy from
        or to the arena is still pending."""
        self.buffer.zero_()
        self.slot_mapping.fill_(-1)
        self.placeholder_src.fill_(-1)
        self.top_p.fill_(1.0)
        self.row_index.copy_(torch.arange(self.max_rows))
        self.set_copy_words(self.bytes_through(self.max_rows, self.max_blocks_per_seq))

    def bytes_through(self, rows: int, table_width: int) -> int:
        """The leading bytes that hold every per-row region whole and the block tables' first `rows`
        rows up to column `table_width` (rows ≥ 1): what a step of `rows` decode rows must copy."""
        assert 1 <= rows <= self.max_rows and 1 <= table_width <= self.max_blocks_per_seq
        return self._table_offset + ((rows - 1) * self.max_blocks_per_seq + table_width) * 4

    def set_copy_words(self, nbytes: int) -> None:
        """Record that a step needs the first `nbytes` bytes copied (rounded up to whole words)."""
        if not 0 < nbytes <= self.nbytes:
            raise ValueError(f"copy of {nbytes} bytes from an arena of {self.nbytes}")
        words = -(-nbytes // 4)
        if self.arrays is not None:  # a host arena: numpy, no torch dispatch on the step's path
            self.arrays.copy_words[0] = words
        else:
            self.copy_words[0] = words

    def decode_meta(self, rows: int, max_seq_len: int, cascade: bool) -> AttnMetadata:
        """The attention metadata of a decode-only step over the arena's first `rows` rows (full-width
        block tables; `cascade`: with the arena's prefix length)."""
        empty = self.seq_lens[:0]
        return AttnMetadata(
            slot_mapping=self.slot_mapping[:rows],
            num_decode_tokens=rows,
            decode_seq_lens=self.seq_lens[:rows],
            decode_block_tables=self.block_tables[:rows],
            max_decode_seq_len=max_seq_len,
            num_prefills=0,
            prefill_cu_seqlens_q=self.seq_lens[:1],
            prefill_seq_lens=empty,
            prefill_block_tables=self.block_tables[:0],
            max_prefill_q_len=0,
            max_prefill_seq_len=0,
            decode_prefix_len=self.prefix_len if cascade else None,
        )
