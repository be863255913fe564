"""Where an engine's start-up time goes: wall seconds per named phase, in the order they ran.

`LLMEngine.__init__` times its phases with `StartupTimer.phase` and keeps the result as
`LLMEngine.startup_times`; `tinyvllm bench startup` reads it from a fresh process per measurement. On
CUDA a phase ends with a device synchronization, so device work a phase enqueued (weight copies, the
cache's zero fill) is counted in that phase and not in the next. The phases (engine/llm_engine.py):

    config_tokenizer  the checkpoint's config.json, generation_config.json and the tokenizer
    device_init       the device's context (CUDA: driver and context creation, ~0.3 s)
    kernels_import    the kernel backend's modules (Triton's compiler and runtime, our kernels)
    model_init        the model built on the meta device and materialised on the device, the RoPE table
    weights_read      loading the weights, the part spent waiting for reads and host-to-device copies
                      (models/loader.py read_tensors)
    weights           loading the weights, the rest: placing each tensor (the fused QKV and gate/up rows,
                      dtype conversion, FP8 quantization), the checks
    derived_weights   the copies derived from them (the pruned LM head's int8 copy, the megakernel's
                      stacked weights and workspace)
    sampler_init      the sampler's state and workspace
    memory_profile    size the KV cache (on CUDA: a profiling forward of the largest step, which
                      compiles the prefill path's kernels on a cold Triton cache)
    scheduler         the block pool (one object per KV block) and the scheduler
    kv_allocation     allocate the KV cache, the step-input staging and the decode graphs' arenas
    graph_warmup      the eager run before each graph's capture (first launches compile the decode
                      path's kernel variants; 0 with lazy capture, which defers it past start-up)
    graph_capture     the captures themselves (0 with lazy capture)
    engine_state      the request state
    gc_freeze         a full garbage collection, then moving the heap out of the collector

The runner's phases (kernels_import to sampler_init) are timed inside its construction
(`ModelRunner.startup_times`) and moved out of the engine's "weights" phase, which keeps the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StartupTimer:
    """Wall seconds per named phase (`times`, in the order first entered; a phase entered twice adds up).

    Args:
        device: synchronized at the end of every phase when it is a CUDA device.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.times: dict[str, float] = {}

    def set_device(self, device: torch.device) -> None:
        self.device = device

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Record a phase timed elsewhere (e.g. split out of a timed phase, see `move`)."""
        self.times[name] = self.times.get(name, 0.0) + seconds

    def move(self, seconds: float, source: str, target: str) -> None:
        """Attribute `seconds` of phase `source` to phase `target` instead (a sub-phase timed inside it)."""
        self.times[source] -= seconds
        self.add(target, seconds)

    def total(self) -> float:
        return sum(self.times.values())
