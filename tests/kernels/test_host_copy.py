"""Copies by kernel between (pinned) host and device memory (kernels/host_copy.py): the bytes arrive
exactly, in every size and dtype the engine uses, and bad arguments are refused. On CUDA the host side
is a pinned buffer, reached through its mapped address, both ways."""

import pytest
import torch

from tinyvllm.kernels.host_copy import kernel_copy_


def _host(t: torch.Tensor, device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


@pytest.mark.parametrize("nbytes", [1, 7, 64, 1028, 5000])
def test_arena_bytes_reach_the_device(device, nbytes):
    """A byte buffer (the input arena's prefix): word-sized copies where the size allows, bytes otherwise."""
    src = _host(
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)), device
    )
    dst = torch.zeros(nbytes + 16, dtype=torch.uint8, device=device)
    kernel_copy_(dst[:nbytes], src)
    assert torch.equal(dst[:nbytes].cpu(), src.cpu())
    assert not dst[nbytes:].any()  # nothing written past the end


@pytest.mark.parametrize("n", [1, 3, 2049])
def test_sampled_ids_reach_the_host(device, n):
    """int64 ids, large values (all 64 bits must arrive), into a pinned host buffer, then read after sync."""
    ids = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(n))
    dst = _host(torch.zeros(n + 5, dtype=torch.int64), device)
    kernel_copy_(dst[:n], ids.to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst[:n], ids)
    assert not dst[n:].any()


def test_bad_arguments_are_refused(device):
    a = torch.zeros(8, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="into"):
        kernel_copy_(a, torch.zeros(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="into"):
        kernel_copy_(a, torch.zeros(9, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        kernel_copy_(a[::2], torch.zeros(4, dtype=torch.int64, device=device))
    assert kernel_copy_(a[:0], a[:0]).numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pageable host memory matters on CUDA only")
def test_pageable_host_memory_is_refused():
    with pytest.raises(ValueError, match="pageable"):
        kernel_copy_(torch.zeros(4, dtype=torch.int64, device="cuda"), torch.zeros(4, dtype=torch.int64))
