"""Where each tensor of a ``.safetensors`` file lies, and reading its bytes straight into a buffer.

The format (see safetensors_writer.py): an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data; a
tensor's bytes are ``[8 + N + begin, 8 + N + end)`` of the file, row-major, little-endian.

`read_into` fills a caller's buffer (pinned staging, or the tensor's own memory) with positional
reads (`os.preadv`), which release the GIL: several threads read one file at once, each into its own
buffer, with one copy out of the page cache and no page faults on a memory map.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype names → torch; a tensor of another dtype has `TensorEntry.dtype` None.
TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its dtype (None: not one of `TORCH_DTYPES`), shape, and where its bytes are."""

    name: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of the safetensors file `path` by name, checked against the file's size.

    Raises:
        ValueError: a header that is not the format's, or a tensor whose bytes do not match its
            dtype and shape or lie outside the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        n = int.from_bytes(raw_len, "little")
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        dtype = TORCH_DTYPES.get(info["dtype"])
        if not 0 <= begin <= end <= size - base:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file (data_offsets {begin}, {end})")
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} of {info['dtype']}")
        entries[name] = TensorEntry(name, dtype, shape, base + begin, end - begin)
    return entries


def read_into(fd: int, buffer: memoryview, offset: int) -> None:
    """Fill `buffer` (bytes) from the open file `fd`, starting at byte `offset` of the file."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            raise ValueError(f"the file ended {len(buffer) - done} bytes early (reading at {offset + done})")
        done += n


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor `tensor`, writable in place."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
