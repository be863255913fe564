"""A decode graph's own input load: copy a step's inputs from the pinned host arena into the device
arena and resolve its placeholder inputs, in one single-program kernel inside the graph.

Inputs (engine/input_arena.py): `src` the pinned host twin, `dst` the device arena, both viewed as
32-bit words; word 0 of `src` (`copy_words`) holds n, the number of leading words the step needs. Then

    dst[0:n] = src[0:n];   ids[i] = sampled[ph_src[i]] for the rows i < rows with ph_src[i] ≥ 0

where `ids` and `ph_src` are the device arena's input ids and placeholder sources and `sampled` the
previous step's sampled ids on the device (kernels/placeholders.py's gather). The first BLOCK words
are read in the same PCIe round trip as n (masked by the arena's size, since n is not known yet), and so
are the placeholder sources, from the host twin; words past BLOCK take one more round trip per REST.
One program suits the small arenas of batch-1 steps (a few hundred bytes): a larger arena would pay a
round trip per REST words (kernels/host_copy.py serves larger steps). A CTA barrier orders the copy of
the ids before the gathered ids' stores. With this kernel first and the sampler's host write last
(kernels/sampling.py), a batch-1 decode step is one graph launch, with no copy kernels or copy-engine
hand-overs around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import check_int, next_power_of_2

# Words read in the first round trip: a batch-1 arena's regions and a block table of ~3,400 tokens (a wider
# first read makes the round trip itself longer); then REST words a round trip.
FIRST_READ_WORDS = 256
REST_WORDS = 1024


@triton.jit(do_not_specialize=["capacity", "rows"])
def _load_arena_kernel(
    dst_ptr,
    src_ptr,
    capacity,
    ids_ptr,
    ph_src_host_ptr,
    sampled_ptr,
    rows,
    BLOCK: tl.constexpr,
    REST: tl.constexpr,
    ROWS: tl.constexpr,
    RESOLVE: tl.constexpr,
):
    """dst[0:n] = src[0:n] with n = src[0], then (RESOLVE) ids[i] = sampled[ph_src[i]] for the rows
    i < rows whose source is ≥ 0 (module docstring); ROWS: rows rounded up to a power of two."""
    offs = tl.arange(0, BLOCK)
    n = tl.load(src_ptr)
    first = tl.load(src_ptr + offs, mask=offs < capacity)
    if RESOLVE:  # the sources from the host twin, in the same round trip as the first words
        r = tl.arange(0, ROWS)
        in_range = r < rows
        src = tl.load(ph_src_host_ptr + r, mask=in_range, other=-1)
        take = in_range & (src >= 0)
        token = tl.load(sampled_ptr + src, mask=take, other=0)
    tl.store(dst_ptr + offs, first, mask=offs < n)
    for start in range(BLOCK, n, REST):
        o = start + tl.arange(0, REST)
        tl.store(dst_ptr + o, tl.load(src_ptr + o, mask=o < n), mask=o < n)
    if RESOLVE:
        tl.debug_barrier()  # the copy of the ids before their gathered values
        tl.store(ids_ptr + r, token.to(ids_ptr.dtype.element_ty), mask=take)


def load_arena(
    dst: torch.Tensor,
    src: torch.Tensor,
    input_ids: torch.Tensor,
    placeholder_src: torch.Tensor,
    sampled: torch.Tensor,
    block: int | None = None,
) -> None:
    """dst[:n] ← src[:n] with n = src.view(int32)[0] words, then the placeholder gather over the rows of
    `input_ids` (module docstring).

    Enqueued on the current stream; the host must not rewrite `src` before it has run (the contract of
    an asynchronous copy).

    Args:
        dst, src: uint8 arenas of one size, 4-byte aligned (`src` pinned on CUDA, or both host tensors
            under the interpreter).
        input_ids, placeholder_src: [rows] int64, views of `dst` (the gather reads the sources' twin in
            `src`; no rows: no gather).
        sampled: [M] int64 on the device, the previous step's sampled ids.
        block: the words of the first read (a power of two ≥ 16; default FIRST_READ_WORDS).
    """
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.shape != src.shape or dst.dim() != 1:
        raise ValueError(
            f"load_arena: arenas must be uint8 vectors of one size, got {tuple(src.shape)} "
            f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}"
        )
    if dst.numel() % 4 or dst.data_ptr() % 4 or src.data_ptr() % 4:
        raise ValueError("load_arena: arenas must be whole, aligned 32-bit words")
    if src.is_cuda or (dst.is_cuda and not src.is_pinned()):
        raise ValueError("load_arena: the source must be pinned host memory")
    for name, t in (("input_ids", input_ids), ("placeholder_src", placeholder_src), ("sampled", sampled)):
        check_int(name, t)
        if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
            raise ValueError(f"load_arena: {name} must be one contiguous dimension, got {tuple(t.shape)}")
    rows = input_ids.shape[0]
    if placeholder_src.shape[0] != rows:
        raise ValueError(f"load_arena: placeholder_src has {placeholder_src.shape[0]} rows, input_ids {rows}")
    block = block or FIRST_READ_WORDS
    if block < 16 or block & (block - 1):
        raise ValueError(f"load_arena: block must be a power of two ≥ 16, got {block}")
    src_start = placeholder_src.data_ptr() - dst.data_ptr()
    if rows and not 0 <= src_start <= src_start + 8 * rows <= dst.numel():
        raise ValueError("load_arena: placeholder_src must be a view of the destination")
    # the gather reads the sources from the host twin, in the same round trip as its block's words
    ph_src_host = src[src_start : src_start + 8 * rows].view(placeholder_src.dtype) if rows else src
    d, s = dst.view(torch.int32), src.view(torch.int32)
    _load_arena_kernel[(1,)](
        d,
        s,
        d.numel(),
        input_ids,
        ph_src_host,
        sampled,
        rows,
        BLOCK=block,
        REST=max(block, REST_WORDS),
        ROWS=next_power_of_2(max(rows, 1)),
        RESOLVE=rows > 0,
        num_warps=4,
    )
