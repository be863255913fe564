"""Programmatic dependent launch (PDL, sm_90+) between the kernels of a step.

A decode step of a few rows is a chain of short kernels (norm, product, RoPE, cache write, attention,
product, ...), each reading what the one before it wrote. Launched the ordinary way, a kernel's
programs start only after the previous kernel has finished and its writes are flushed, so every link
of the chain pays the launch, the ramp-up of the first loads and the tail of the last programs.

With PDL a kernel is launched while the previous one still runs: its programs become resident as
soon as every program of the previous kernel has signalled `gdc_launch_dependents` (or exited), and
wait at `gdc_wait` for it to complete with its memory flushed; the launch and the programs' start-up
overlap the previous kernel's tail instead of following it.

The contract every kernel launched with PDL keeps:
  * before `wait_for_previous`: no load of anything a kernel of this step may have written, and no
    store at all (a store could race a still-running kernel's loads of a reused buffer);
  * `wait_for_previous` (grid_dependency.py) also signals the dependents, so at most one kernel is
    resident ahead of the running one (a kernel releasing its dependents before its own wait would let
    a chain of waiting kernels fill the SMs).
The wait is transitive: kernel k + 1 waits for k, which waited for k − 1 before finishing. A kernel
launched without PDL (cuBLAS, a torch op, a copy) waits for its predecessor in full, as always, and
its successor is only released when it completes.

`programmatic_launches(True)` turns PDL on for the launches made inside it (with `--pdl` the executor
wraps a step's forward in it: the fused path's and the layer loop's, engine/paths/executor.py);
`options(device)` is what a launcher passes to its kernel, and kernels/grid_dependency.py holds the
kernels' half (the wait). On the CPU interpreter and before sm_90 the launches stay ordinary and the
kernels compile without the wait. This module imports no Triton: the engine opens the context on any
backend.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_ENABLED: ContextVar[bool] = ContextVar("tinyvllm_pdl", default=False)


@functools.lru_cache(maxsize=16)
def supported(device: torch.device) -> bool:
    """Whether `device` runs PDL launches: CUDA of compute capability 9.0 or later, not the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True) -> Iterator[None]:
    """Within: kernels that take a PDL flag are launched with programmatic dependent launch (where the
    device supports it)."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def active(device: torch.device) -> bool:
    """Whether a launch on `device` made now uses PDL."""
    return _ENABLED.get() and supported(device)


def options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that takes `PDL: tl.constexpr`: the constexpr and Triton's
    `launch_pdl`, both on or both off."""
    on = active(device)
    return {"PDL": on, "launch_pdl": on}
