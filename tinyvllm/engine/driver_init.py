"""The CUDA driver's initialisation, started on a thread while the engine does host work.

The first CUDA call of a process initialises the driver (`cuInit`) and creates the device's primary
context, a sizeable part of the engine's start-up (docs/perf.md §12), in torch calls that hold the GIL
(`torch.cuda.is_available`, the first allocation), so nothing else in the process runs meanwhile.
`DriverInit` makes the same two driver calls through ctypes, which releases the GIL around them, on a
background thread: reading the config and tokenizer and importing the kernels overlap it, and torch's
own calls then find the driver initialised and the primary context (the one the CUDA runtime uses)
already created.

It changes no state torch would not create itself, and any failure (no driver library, no such device)
ends the thread quietly: torch's calls then fail or fall back exactly as they would have.
"""

from __future__ import annotations

import ctypes
import threading


def _driver_ordinal(device: str) -> int | None:
    """The CUDA device ordinal that engine argument `device` selects, or None where it selects none."""
    if device in ("auto", "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


class DriverInit:
    """`cuInit` and the primary context of one device, on a daemon thread.

    Args:
        device: the engine's `device` argument ("auto", "cuda", "cuda:N"; anything else starts nothing).
    """

    def __init__(self, device: str) -> None:
        self.ordinal = _driver_ordinal(device)
        self.loaded = False  # the driver library opened: a CUDA device may be in use
        self.ready = False  # the driver is initialised and the device's primary context exists
        self._thread: threading.Thread | None = None
        if self.ordinal is None:
            return
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return
        self.loaded = True
        self._thread = threading.Thread(target=self._run, name="tinyvllm-cuda-init", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lib = self._lib
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), self.ordinal) != 0:
            return
        # The reference is kept for the process's life, as the CUDA runtime's own is.
        self.ready = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0

    def join(self) -> None:
        """Wait for the thread (immediate when none started)."""
        if self._thread is not None:
            self._thread.join()
