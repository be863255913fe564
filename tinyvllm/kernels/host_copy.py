"""Small copies between pinned host memory and the device done by a kernel instead of the copy engines.

A CUDA-graph decode step of one sequence moves a few hundred bytes in (its input arena) and 8 bytes out
(the sampled id). As `cudaMemcpyAsync` copies they run on the copy engines, and every hand-over between
a copy engine and the compute engine in the stream leaves the device idle: on the H200 the `latency`
workload's step had 21 µs of idle device time, all of it at those hand-overs (profile of the v12 engine:
10.8 µs from the input copy to the graph's first kernel, 5.1 µs from the sampler to the id copy, 5.0 µs
from the id copy to the next input copy). A kernel that reads or writes the pinned buffer through its
mapped device address (unified addressing: a pinned allocation is mapped into the device's address
space) keeps the stream on the compute engine. Measured on the H200 (docs/perf.md, v13): a batch-1 step's
idle device time 21 → 9.5 µs, 1,208 → 1,222 tok/s in the same calls; each copy kernel itself takes ~2 µs
(a PCIe round trip), which is why larger steps, whose arenas are hundreds of KB, keep the copy engines.
Since v15 a batch-1 graph does its own copies (kernels/arena_load.py, engine/cuda_graphs.py); these kernels
serve the graph steps of 2 to KERNEL_COPY_MAX_ROWS rows.

The contract is that of an asynchronous copy in stream order: the host must not rewrite a pinned source
before the copy has run, and reads a pinned destination only after an event recorded after it has
completed (a kernel's writes to mapped host memory are visible to the host once it has synchronised
with the kernel's completion).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.launch import cdiv

_BLOCK = 1024


@triton.jit(do_not_specialize=["n"])  # one compile for every size
def _copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A byte tensor as 32-bit words where its size and address allow (fewer, wider accesses)."""
    if t.dtype == torch.uint8 and t.numel() % 4 == 0 and t.data_ptr() % 4 == 0:
        return t.view(torch.int32)
    return t


def kernel_copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst ← src by a kernel on the current stream; returns dst.

    Both one contiguous dimension, same dtype and size. On CUDA, one of them may be a pinned host
    tensor (the kernel reaches it through its mapped address); under the CPU interpreter both are host
    tensors. Raises for a pageable host tensor on CUDA, which a kernel cannot reach."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(f"kernel_copy_: {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
    for name, t in (("dst", dst), ("src", src)):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"kernel_copy_: {name} must be one contiguous dimension, got {tuple(t.shape)}")
    cuda = dst.is_cuda or src.is_cuda
    if cuda:
        for name, t in (("dst", dst), ("src", src)):
            if not t.is_cuda and not t.is_pinned():
                raise ValueError(f"kernel_copy_: {name} is pageable host memory, which a kernel cannot reach")
    n = dst.numel()
    if n == 0:
        return dst
    d, s = _as_words(dst), _as_words(src)
    if d.dtype != s.dtype:  # one was viewable as words and the other not: copy bytes
        d, s = dst, src
    device = dst.device if dst.is_cuda else src.device
    other_device = cuda and device.index is not None and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if other_device else contextlib.nullcontext():  # launches go to the current one
        _copy_kernel[(cdiv(d.numel(), _BLOCK),)](d, s, d.numel(), BLOCK=_BLOCK, num_warps=4)
    return dst
