"""Token bitmasks of constrained rows (xgrammar's packed layout) on the torch side.

A bitmask row is ceil(V / 32) int32 words; token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32``
is set (bit 31 is the word's sign bit). All ones (-1 words) allows everything: the row of an
unconstrained request in a batch that has a bitmask. The fused kernels read the packed words directly
(kernels/sampling.py); this module is the torch path and the tests' reference. The server's API process
imports it (through the logit processors' checks) without torch: torch is imported where it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 packed -> [B, vocab_size] bool."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """[B, V] bool -> [B, ceil(V / 32)] int32 (the inverse of `unpack_bitmask`)."""
    b, v = allowed.shape
    padded = np.zeros((b, bitmask_width(v) * 32), dtype=np.uint64)
    padded[:, :v] = allowed
    words = (padded.reshape(b, -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set, in place, the logits [B, V] of the tokens `bitmask` [B, W] disallows to -inf; returns them."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))
