"""`PinnedStaging` (models/staging.py): a tensor copied through two small staging buffers, chunk by chunk,
arrives bit for bit, whatever its dtype, shape and size against the chunk (less than one chunk, exactly
one, several with a remainder, empty), from several threads at once. On the CPU the same chunking runs
through unpinned buffers; tests/gpu/test_engine_gpu.py loads real weights through it on CUDA."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tinyvllm.models.staging import PinnedStaging

CHUNK = 64


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),  # 60 bytes: less than a chunk
        torch.randn(16, generator=g),  # 64 bytes: exactly one
        torch.randn(7, 13, generator=g).to(torch.bfloat16),  # 182 bytes: two chunks and a remainder
        torch.randint(-(2**40), 2**40, (33,), generator=g),  # int64, 264 bytes
        torch.randn(9, 4, generator=g).to(torch.float8_e4m3fn),  # 1-byte elements
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 4),  # no bytes
        torch.randn(6, 10, generator=g).t(),  # not contiguous
    ]


@pytest.mark.parametrize("threads", [1, 4])
def test_staged_copies_are_bitwise_equal(threads):
    staging = PinnedStaging(torch.device("cpu"), chunk_bytes=CHUNK)
    tensors = _tensors() * 3
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(staging.to_device, tensors))
    for src, out in zip(tensors, got):
        assert out.dtype == src.dtype and out.shape == src.shape
        assert src.numel() == 0 or out.data_ptr() != src.data_ptr()
        assert torch.equal(out.reshape(-1).view(torch.uint8), src.contiguous().reshape(-1).view(torch.uint8))


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="chunk_bytes"):
        PinnedStaging(torch.device("cpu"), chunk_bytes=0)
