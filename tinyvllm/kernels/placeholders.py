"""Resolve async scheduling's placeholder inputs on the device, in one launch.

With async scheduling, a decode row's input token can be the one the previous step sampled, still on
the device. A decode CUDA graph starts with this kernel: row i takes `sampled[src[i]]` where
`src[i] >= 0` and keeps its input id where `src[i] < 0` (not a placeholder, or a padded row). Pure data
movement: n source indices read, at most n ids gathered and written. Grid: (n / BLOCK,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import cdiv, check_int, check_same_device

_BLOCK = 128


@triton.jit(do_not_specialize=["n"])  # one compile for every graph's batch size
def _resolve_placeholders_kernel(ids_ptr, src_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    """ids[i] = sampled[src[i]] for the BLOCK rows i of this program with i < n and src[i] ≥ 0."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < n
    src = tl.load(src_ptr + rows, mask=in_range, other=-1)
    take = in_range & (src >= 0)
    token = tl.load(sampled_ptr + src, mask=take, other=0)
    tl.store(ids_ptr + rows, token.to(ids_ptr.dtype.element_ty), mask=take)


def resolve_placeholders(input_ids: torch.Tensor, placeholder_src: torch.Tensor, sampled: torch.Tensor) -> None:
    """In place: input_ids[i] = sampled[placeholder_src[i]] for every i with placeholder_src[i] >= 0.

    input_ids [n] int64, placeholder_src [n] int (−1: keep the row's id), sampled [M] int (the
    previous step's sampled ids; every non-negative source must be < M). Contiguous, one device."""
    for name, t in (("input_ids", input_ids), ("placeholder_src", placeholder_src), ("sampled", sampled)):
        check_int(name, t)
        if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be one contiguous dimension, got shape {tuple(t.shape)}")
    check_same_device(input_ids=input_ids, placeholder_src=placeholder_src, sampled=sampled)
    n = input_ids.shape[0]
    if placeholder_src.shape[0] != n:
        raise ValueError(f"placeholder_src has {placeholder_src.shape[0]} rows, input_ids {n}")
    if n == 0:
        return
    _resolve_placeholders_kernel[(cdiv(n, _BLOCK),)](input_ids, placeholder_src, sampled, n, BLOCK=_BLOCK, num_warps=4)
