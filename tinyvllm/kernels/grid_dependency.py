"""Grid dependency control inside a kernel: the wait of programmatic dependent launch (kernels/pdl.py has
the contract and the host half), and an L2 prefetch hint."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has completed and its writes are visible, then let the
    next kernel launch (kernels/pdl.py). Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines at `ptrs` (a hint: no data comes back, nothing waits)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
