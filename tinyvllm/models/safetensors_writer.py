"""Stream tensors into a ``.safetensors`` file, one chunk at a time.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once; a dummy 8B
checkpoint would need 16 GB. The format is simple enough to stream instead: an 8-byte
little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}, ...,
"__metadata__": {...}}`` padded with spaces to a multiple of 8 bytes, then the raw tensor bytes
back to back in header-offset order. Shapes and dtypes are declared up front, so the header is
written first and the data follows as it is generated.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class SafetensorsWriter:
    """Writes the declared tensors, in declaration order, to ``path``.

    Usage::

        with SafetensorsWriter(path, [("w", (4, 8), torch.float32)], {"format": "pt"}) as w:
            w.write("w", [chunk_rows_0_to_1, chunk_rows_2_to_3])

    Each tensor arrives as chunks that concatenate along dim 0 to the declared shape.
    """

    def __init__(
        self,
        path: Path,
        specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        assert sys.byteorder == "little", "safetensors stores little-endian data"
        self._specs = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, shape, dtype in self._specs:
            nbytes = tensor_nbytes(shape, dtype)
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 (the writer is the context manager: close() closes it)
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, chunks: Iterable[torch.Tensor]) -> None:
        """Write the next declared tensor, given as row chunks in the declared dtype."""
        expected_name, shape, dtype = self._specs[self._next]
        assert name == expected_name, f"expected tensor {expected_name!r}, got {name!r}"
        written = 0
        for chunk in chunks:
            assert chunk.dtype == dtype and tuple(chunk.shape[1:]) == tuple(shape[1:]), (name, chunk.shape, chunk.dtype)
            data = chunk.detach().contiguous().cpu().view(torch.uint8).numpy()
            self._file.write(data.data)
            written += data.nbytes
        assert written == tensor_nbytes(shape, dtype), (
            f"{name}: wrote {written} bytes, declared {tensor_nbytes(shape, dtype)}"
        )
        self._next += 1

    def close(self) -> None:
        self._file.close()
        assert self._next == len(self._specs), f"only {self._next} of {len(self._specs)} tensors written"

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
