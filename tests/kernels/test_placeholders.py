"""The placeholder gather that starts a decode graph: rows with a source index take that row of the
previous step's sampled ids, the others keep their input id; the Triton kernel equals the torch
reference and a hand-computed case."""

import pytest
import torch

from tinyvllm.kernels import reference


def _resolve(device, ids, src, sampled):
    from tinyvllm.kernels.placeholders import resolve_placeholders

    ids = ids.to(device)
    resolve_placeholders(ids, src.to(device), sampled.to(device))
    return ids.cpu()


def test_hand_computed(device):
    ids = torch.tensor([5, -1, 7, -1, 0, 0])  # rows 1 and 3 are placeholders, 4 and 5 padding
    src = torch.tensor([-1, 2, -1, 0, -1, -1])
    sampled = torch.tensor([100, 101, 102, 103])
    want = [5, 102, 7, 100, 0, 0]
    assert _resolve(device, ids, src, sampled).tolist() == want
    ref = ids.clone()
    reference.resolve_placeholders(ref, src, sampled)
    assert ref.tolist() == want


@pytest.mark.parametrize("n", [1, 2, 127, 128, 300])
def test_equals_the_reference(device, n):
    """Several programs (BLOCK 128), large token ids, sources anywhere in a longer sampled buffer."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1 << 40, (n,), generator=g)
    sampled = torch.randint(0, 1 << 40, (n + 50,), generator=g)
    src = torch.randint(0, n + 50, (n,), generator=g)
    src[torch.rand(n, generator=g) < 0.4] = -1
    want = ids.clone()
    reference.resolve_placeholders(want, src, sampled)
    assert torch.equal(want, torch.where(src >= 0, sampled[src.clamp(min=0)], ids))
    assert torch.equal(_resolve(device, ids, src, sampled), want)


def test_no_placeholder_and_empty(device):
    ids = torch.tensor([3, 4, 5])
    assert _resolve(device, ids, torch.full((3,), -1), torch.tensor([9])).tolist() == [3, 4, 5]
    assert _resolve(device, ids[:0], torch.zeros(0, dtype=torch.int64), torch.tensor([9])).tolist() == []


def test_rejects_mismatched_rows(device):
    from tinyvllm.kernels.placeholders import resolve_placeholders

    with pytest.raises(ValueError):
        resolve_placeholders(
            torch.zeros(3, dtype=torch.int64, device=device),
            torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros(4, dtype=torch.int64, device=device),
        )
