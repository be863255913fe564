"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts before the one ahead of it in
the stream has finished, does work that does not depend on it, then waits for it.

Contract of a kernel launched with `launch_pdl=True` (the secondary) after a kernel P (the primary):
  * its programs may start once every program of P has executed `launch_dependents()` or exited (a
    P that never calls it releases its secondary only when it exits: the ordinary stream order);
  * before `wait_primary()` it may only read memory that no earlier kernel of the stream writes (here:
    weights, and only as L2 prefetches) and must write nothing;
  * `wait_primary()` returns once P has completed and its memory operations are visible. Since P itself
    waited for its own primary before completing, the whole stream before it is then complete too.
Stream capture turns the launch attribute into a programmatic edge of the CUDA graph, so the same holds
inside the decode graphs. Where a primary's programs fill every SM's registers (the decode megakernel),
its secondary's programs take an SM only once the primary's program there has left.

The batch-1 decode graph is a chain of four kernels (input load → megakernel → LM head → sampler
reduce); each of the last three is a secondary of the one before, and prefetches its first weights
into L2 before it waits (docs/perf.md, v17).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Off: every kernel launches in plain stream order (the A/B switch of docs/perf.md, v17).
PDL_ENABLED = True


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: CUDA compute capability ≥ 9.0
    (the `griddepcontrol` instructions), Triton's `gdc_wait`, and PDL_ENABLED. Never under the CPU
    interpreter, which has no such instructions."""
    if not PDL_ENABLED or device.type != "cuda" or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_primary():
    """`griddepcontrol.wait`: block until the primary grid has completed and its writes are visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents():
    """`griddepcontrol.launch_dependents`: this program no longer holds back the secondary's launch."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (`prefetch.global.L2`, CUDA only; one pointer per line is
    enough). Returns zeros, which the caller may ignore."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)
