"""Grid-wide barriers, the global timer and the phase trace of the decode megakernel.

A barrier is one monotone arrival counter in global memory. Every program arrives once at each barrier
(`arrive`), so the b-th barrier of a launch is open once the counter reads b·P (`wait`, `end_phase`).
Arrival and wait are separate calls: an arrival's release waits for the loads issued before it, so a
phase's prefetches go between its arrival and its wait.

A traced launch (`TRACE`) records global-timer readings in the trace buffer:
    trace[b]              program 0 leaving barrier b's wait (trace[0]: the launch's start)
    trace[5·L]            the last program's exit, after the final norm
    trace[3 + 5·L + 3·l + k]   program 0 in layer l's phase B: its unit computed (k = 0), its ticket
                          taken (1), its merge done (2)
and from TRACE_BASE on, TRACE_BLOCK readings per program (`trace_block`):
    [0] its start;  [b] leaving barrier b's wait;  [400 + b] arriving at barrier b (400 + 5·L: its
    exit);  [800 + 3·l + k] its phase-B points as above.
"""

from __future__ import annotations

import triton
import triton.language as tl

TRACE_BASE = 4096  # where the per-program trace blocks start
TRACE_BLOCK = 1024  # readings per program
TRACE_MAX_LAYERS = (TRACE_BLOCK - 800) // 3  # layers whose phase-B points fit in a block
_TRACE_BASE = tl.constexpr(TRACE_BASE)
_TRACE_BLOCK = tl.constexpr(TRACE_BLOCK)


@triton.jit
def now(x):
    """The GPU's global nanosecond timer (CUDA only); `x` only gives the asm statement an operand."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def trace_start(trace_ptr, pid):
    """A traced launch: this program's start time into its trace block."""
    tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK, now(pid))


@triton.jit
def trace_arrival(trace_ptr, pid, b):
    """A traced launch: this program's arrival time at barrier b (b = 5·L: its exit) into its trace block."""
    tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + 400 + b, now(pid))


@triton.jit
def trace_attention(trace_ptr, pid, layer, tb, k: tl.constexpr, t):
    """A traced launch: this program's k-th phase-B time t (0: its unit computed, 1: its ticket taken,
    2: its merge done) into its trace block, and program 0's also into trace[tb + k]."""
    tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + 800 + 3 * layer + k, t)
    if pid == 0:
        tl.store(trace_ptr + tb + k, t)


@triton.jit
def arrive(count_ptr, trace_ptr, pid, b, TRACE: tl.constexpr):
    """This program's arrival at grid barrier b: a CTA barrier, then one gpu-scope release, so that the
    CTA's earlier stores are visible to whoever acquires the count. Loads issued before the release
    delay it, so prefetches go between `arrive` and the wait."""
    if TRACE:
        trace_arrival(trace_ptr, pid, b)
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait(count_ptr, target):
    """Wait until `target` arrivals in total (the b-th barrier of a launch: b·P), then a CTA barrier."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def wait_asm(count_ptr, target):
    """`wait` as one asm statement (CUDA only): thread 0 spins on a gpu-scope acquire load, then the CTA
    meets at `bar.sync 0`. Triton software-pipelines no loop that holds a nested loop or a
    `tl.debug_barrier`, and the pipelined weight loops hold their barrier's wait."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.ne.u32 p, t, 0; @p bra $$done_${:uid}; "
        "$$spin_${:uid}: ld.acquire.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra $$spin_${:uid}; "
        "$$done_${:uid}: bar.sync 0; }",
        "=r,l,r",
        [count_ptr, target],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE: tl.constexpr, ASM: tl.constexpr):
    """The wait of the launch's b-th grid barrier (b·P arrivals), with `wait_asm` if ASM (CUDA). A traced
    launch then records the time (program 0 also into trace[b]). b = 0, the launch's start: no wait."""
    if b > 0:
        if ASM:
            wait_asm(bar_ptr, b * P)
        else:
            wait(bar_ptr, b * P)
        if TRACE:
            t = now(pid)
            tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + b, t)
            if pid == 0:
                tl.store(trace_ptr + b, t)
