"""Small copies between pinned host memory and the device done by a kernel instead of the copy engines.

A CUDA-graph decode step of a few sequences moves a few hundred bytes in (its input arena) and a few
bytes out (the sampled ids). As `cudaMemcpyAsync` copies they run on the copy engines, and every
hand-over between a copy engine and the compute engine in the stream leaves the device idle for
microseconds. A kernel that reads or writes the pinned buffer through its mapped device address (unified
addressing: a pinned allocation is mapped into the device's address space) keeps the stream on the
compute engine. Such a kernel costs a PCIe round trip and moves a large buffer more slowly than a copy
engine, so only steps of a few rows use it (engine/model_runner.py's KERNEL_COPY_MAX_ROWS), and a
batch-1 graph does its own copies (kernels/arena_load.py, engine/cuda_graphs.py).

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
    """dst[i] = src[i] for i < n; program p copies elements [p·BLOCK, (p+1)·BLOCK)."""
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
    tensors.

    Raises:
        ValueError: for a pageable host tensor on CUDA, which a kernel cannot reach, or mismatched
            tensors.
    """
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
