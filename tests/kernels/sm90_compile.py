"""Compile every Triton kernel a piece of code launches for the H200 (sm_90) on a machine without a GPU.

The CPU interpreter that runs the kernel tests executes kernels as Python: it never sees what only the
compiler checks (the types that branches, returns and loops carry; a constexpr branch that produces a
different dtype; inline assembly). `compile_only_for_sm90()` makes Triton believe an sm_90 device is
active and turns every launch into a compile (`JITFunction.run(..., warmup=True)`): the code under it runs
as usual on CPU tensors, each launch compiles its kernel variant to PTX and SASS (ptxas ships with
Triton) and launches nothing, so the kernels' outputs are whatever the tensors held. Run it in a process
of its own without TRITON_INTERPRET (the interpreter replaces the kernels by Python functions):
`facts_from_subprocess` runs a test module that way and reads back what it found.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def missing_cuda_backend() -> str | None:
    """Why this Triton cannot compile for CUDA ahead of time, or None when it can."""
    try:
        for module in ("triton.backends.nvidia", "triton.backends.compiler", "triton.compiler"):
            importlib.import_module(module)
    except ImportError as e:
        return f"no CUDA backend or AOT API in this Triton: {e}"
    return None


def compiled_or_skip(key: str, compile_all: Callable[[], object]) -> dict:
    """{key: compile_all()}, or {"skip": reason} where this Triton cannot compile for CUDA or ships no
    ptxas: what a codegen test module's `__main__` prints for `facts_from_subprocess`."""
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    try:
        return {key: compile_all()}
    except Exception as e:
        if "ptxas" in str(e) and "not found" in str(e):
            return {"skip": f"no ptxas: {e}"}
        raise


def compile_each(jobs: dict[str, Callable[[], object]]) -> dict:
    """{name: job()} for every job, a job that raises recorded as {"error": its message}; or {"skip":
    reason} where this Triton cannot compile for CUDA or ships no ptxas: what a codegen test module's
    `__main__` prints for `facts_from_subprocess` when its variants are checked one by one."""
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    out: dict = {}
    for name, job in jobs.items():
        try:
            out[name] = job()
        except Exception as e:
            if "ptxas" in str(e) and "not found" in str(e):
                return {"skip": f"no ptxas: {e}"}
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    return out


def facts_from_subprocess(script: str, timeout: float) -> dict:
    """Run the test module `script`, whose `__main__` prints what it compiled as one JSON line, in a
    process of its own without TRITON_INTERPRET; that JSON, or a pytest skip with the reason it gives
    under "skip"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def resource_usage(compiled) -> dict[str, int]:
    """{"registers": per thread, "stack": bytes of stack frame per thread} of a compiled kernel, from its
    cubin (`cuobjdump -res-usage`, shipped with Triton). Register spills land in the stack frame, which
    PTX does not show (ptxas allocates registers after it): a stack > 0 is a spill in a Triton kernel,
    which declares no local arrays."""
    import re
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[-500:]}")
    return {"registers": int(found[1]), "stack": int(found[2])}


class _Sm90Driver:
    """The three questions Triton's launcher asks the active driver, answered for one sm_90 device."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def compile_only_for_sm90() -> Iterator[list[tuple[str, object]]]:
    """Within: every Triton launch compiles for sm_90 and runs nothing; yields the list of (kernel name,
    compiled kernel) it appends each launch to (`.asm["ptx"]` holds the PTX)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    launched: list[tuple[str, object]] = []
    original = JITFunction.run
    previous = driver._active  # None where no driver was made yet (and none can be: no GPU)

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self.__name__, kernel))
        return kernel

    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    try:
        yield launched
    finally:
        JITFunction.run = original
        driver._active = previous


def stand_in_model(name: str, fp8w: bool = False, fp8kv: bool = False, layers: int = 2):
    """(shape, StackedWeights, per-layer (K, V) caches, the caches' buffer) of a real model's shape (`name`:
    a preset, optionally "/<variant>") from zero stand-in tensors, for the megakernels' compile-only tests:
    a compile reads only the tensors' dtypes and the scales' shapes; every size comes from the config.
    The family's tensors (QKV biases, per-head q/k norms) are there where the shape asks for them.
    `fp8w`: FP8 weights with float32 row scales; `fp8kv`: an FP8 cache with its per-layer scales."""
    import torch

    from tinyvllm.config import ModelConfig
    from tinyvllm.engine.paths.megakernel import model_shape
    from tinyvllm.kernels.decode_megakernel import StackedWeights
    from tinyvllm.models.checkpoint import make_config

    shape = model_shape(type("M", (), {"config": ModelConfig.from_dict(make_config(name.split("/")[0]))})())
    dt = torch.bfloat16
    z = lambda *s, d=dt: torch.zeros(*s, dtype=d)  # noqa: E731
    rows = {
        "qkv": (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim,
        "o": shape.hidden,
        "gate_up": 2 * shape.intermediate,
        "down": shape.hidden,
    }
    wd = torch.float8_e4m3fn if fp8w else dt
    scales = {f"{k}_scale": z(layers, n, d=torch.float32) for k, n in rows.items()} if fp8w else {}
    w = StackedWeights(
        embed=z(4, shape.hidden),
        **{k: z(layers, n, 1, d=wd) for k, n in rows.items()},
        **scales,
        norm1=z(layers, shape.hidden),
        norm2=z(layers, shape.hidden),
        norm_final=z(shape.hidden),
        kv_scales=z(layers, 2, d=torch.float32) if fp8kv else None,
        qkv_bias=z(layers, rows["qkv"]) if shape.qkv_bias else None,
        q_norm=z(layers, shape.head_dim) if shape.qk_norm else None,
        k_norm=z(layers, shape.head_dim) if shape.qk_norm else None,
    )
    buf = z(layers, 2, 4, shape.num_kv_heads, 16, shape.head_dim, d=torch.float8_e4m3fn if fp8kv else dt)
    return shape, w, [(buf[i, 0], buf[i, 1]) for i in range(layers)], buf
