"""The rows megakernel compiled for the H200 (sm_90) without a GPU, in every variant the runner can launch
(bf16 and float32, FP8 weights, an FP8 cache, Qwen2's biases with a window on some layers, Mistral's window
on every layer, Qwen3's q/k norms) and at the real `llama-3.2-1b` and `llama-3.1-8b` shapes: each
compiles, its weight tiles stream through cp.async copies (the software pipeline), its products run on
the tensor cores, and the pipeline fits an SM's shared memory. The traced kernel (benchmarks' `--trace`)
compiles at the 1B shape too, and only it reads the global timer.

tests/engine/test_rows_megakernel_path.py checks what the kernel computes; only the compiler checks that it
compiles (tests/kernels/sm90_compile.py). With `kv_align` (RowsConfig, on by default) phase B's K and V tiles are
16-byte cp.async copies of its key loop's pipeline; without it they are 2-byte synchronous loads (the
caches' layer stride and V offset are unspecialised arguments). Runs in a subprocess without
TRITON_INTERPRET; skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.kernels.sm90_compile import compile_each, facts_from_subprocess
from tinyvllm.kernels.rows_megakernel.launch import DEFAULT_ROWS_CONFIG

SMEM_PER_SM = 227 * 1024  # an H200 SM's shared memory for one program
# name -> (preset, dtype, FP8 weights, FP8 KV cache)
VARIANTS = {
    "bf16": ("tiny", "bfloat16", False, False),
    "f32": ("tiny", "float32", False, False),
    "bf16/fp8w": ("tiny", "bfloat16", True, False),
    "bf16/fp8kv": ("tiny", "bfloat16", False, True),
    "qwen2/bf16": ("tiny-qwen2", "bfloat16", False, False),
    "mistral/bf16/fp8w+fp8kv": ("tiny-mistral", "bfloat16", True, True),
    "qwen3/bf16/fp8kv": ("tiny-qwen3", "bfloat16", False, True),
}
# name -> (FP8 weights, traced, RowsConfig fields)
REAL_SHAPES = {
    "llama-3.2-1b": (False, False, {}),
    "llama-3.1-8b": (False, False, {}),
    "llama-3.2-1b/fp8w": (True, False, {}),
    "llama-3.2-1b/trace": (False, True, {}),
    "llama-3.2-1b/unaligned": (False, False, {"kv_align": 0, "kv_stages": 3}),
}
KV_TILE_COPY = "tensor<64x64x!tt.ptr<bf16>"  # phase B's K or V tile at these shapes (64 keys, head_dim 64)


def _as_on_the_gpu():
    """Inline-assembly barriers, bf16 operands straight into the tensor cores, the trace where asked, as on
    the GPU."""
    from tinyvllm.kernels.rows_megakernel import launch

    real = launch._constexprs
    launch._constexprs = lambda *a, **k: {**real(*a, **k), "ASM": True, "UPCAST": False, "TRACE": bool(k.get("trace"))}


def _loads_from(ptx: str, op: str, source: str) -> int:
    """How many `op` instructions of the PTX the line information attributes to the file `source`."""
    n, here = 0, False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".loc"):
            here = f"// {source}:" in line
        elif here and op in line:
            n += 1
    return n


def _facts(kernel) -> dict:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    return {
        "shared": kernel.metadata.shared,
        "cp_async": ptx.count("cp.async.cg.shared.global"),
        "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
        "globaltimer": ptx.count("%globaltimer"),
        # 2-byte loads by the K/V tile loaders (flash_tiles.py): unvectorised K/V tiles (without kv_align)
        "kv_ld_b16": _loads_from(ptx, "ld.global.b16", "flash_tiles.py"),
        "kv_tile_copies": sum(KV_TILE_COPY in x for x in ttgir.splitlines() if "async_copy_global_to_local" in x),
    }


def compile_variant(preset: str, dtype_name: str, fp8w: bool, fp8kv: bool) -> dict:
    """One decode step of 3 rows through the runner's paths with the rows megakernel, compiled for sm_90."""
    import torch

    from tests.engine.test_fused_path import build
    from tests.engine.test_megakernel_fp8 import fp8_pair, set_kv_scales
    from tests.engine.test_megakernel_path import kv_buffer, views
    from tests.engine.test_rows_megakernel_path import rows_step, with_rows
    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.models.decoder import FP8_KV_DTYPE

    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    if fp8w:
        model, _ = fp8_pair(dtype, cpu, preset=preset)
    else:
        model = build("triton", dtype, cpu, max_positions=512, preset=preset)
    set_kv_scales(model)
    buffer = kv_buffer(model, FP8_KV_DTYPE if fp8kv else dtype)
    paths = with_rows(model)
    ids, positions, meta = rows_step([40, 7, 65], cpu)
    with compile_only_for_sm90() as launched, torch.no_grad():
        paths.hidden_states(ids, positions, meta, views(buffer))
    kernels = dict(launched)
    assert "rows_megakernel_kernel" in kernels, list(kernels)
    return _facts(kernels["rows_megakernel_kernel"])


def compile_real_shape(name: str, fp8w: bool, trace: bool, fields: dict | None = None) -> dict:
    """`real_shape_kernel`'s facts."""
    return _facts(real_shape_kernel(name, fp8w, trace, fields))


def real_shape_kernel(name: str, fp8w: bool, trace: bool, fields: dict | None = None, fp8kv: bool = False):
    """The kernel compiled at a real model's shape (bf16 activations, 132 programs; `fp8w`: FP8 weights
    with row scales; `trace`: traced; `fields`: RowsConfig fields; `fp8kv`: an FP8 cache), from stand-in
    weight tensors: a compile reads only their dtypes and the scales' shapes; the shapes come from the
    model's config. Call `_as_on_the_gpu` first."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90, stand_in_model
    from tinyvllm.kernels.rows_megakernel import RowsConfig, RowsWorkspace, rows_megakernel_fwd

    shape, w, kv, _ = stand_in_model(name, fp8w=fp8w, fp8kv=fp8kv)
    ws = RowsWorkspace(shape, torch.bfloat16, torch.device("cpu"), 132, RowsConfig(**(fields or {})))
    t = torch.zeros(8, dtype=torch.int64)
    with compile_only_for_sm90() as launched:
        rows_megakernel_fwd(
            t, t, t, t.int(), torch.zeros(8, 4, dtype=torch.int32), w, torch.zeros(64, shape.head_dim), kv, shape,
            1e-5, 0.1, ws, trace,
        )  # fmt: skip
    return launched[0][1]


def summarise() -> dict:
    _as_on_the_gpu()
    jobs = {n: functools.partial(compile_variant, *v) for n, v in VARIANTS.items()}
    jobs |= {p: functools.partial(compile_real_shape, p, *f) for p, f in REAL_SHAPES.items()}
    return compile_each(jobs)


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)


@pytest.mark.parametrize("variant", list(VARIANTS) + list(REAL_SHAPES))
def test_rows_megakernel_compiles_for_sm90(facts, variant):
    """Every variant compiles within an SM's shared memory; 16-bit products run on the tensor cores (float32
    ones take exact FMAs); at real shapes the weight tiles stream through cp.async (the tiny shapes' FP8
    rows of 64 bytes are below its 16-byte vectors' pipelining)."""
    got = facts[variant]
    assert "error" not in got, got.get("error")
    assert got["shared"] <= SMEM_PER_SM, got["shared"]
    if variant not in VARIANTS or VARIANTS[variant][1] != "float32":
        assert got["mma"] > 0, "the products do not run on the tensor cores"
    if variant in REAL_SHAPES:
        assert got["cp_async"] > 0, "the weight tiles are not software-pipelined"
    traced = variant in REAL_SHAPES and REAL_SHAPES[variant][1]
    assert (got["globaltimer"] > 0) == traced, got["globaltimer"]
    aligned = variant in REAL_SHAPES and REAL_SHAPES[variant][2].get("kv_align", DEFAULT_ROWS_CONFIG.kv_align)
    if aligned and variant.startswith("llama-3.2-1b"):  # KV_TILE_COPY's shape (head dim 64)
        # phase B's K and V tiles: 16-byte cp.async copies in its key loop's pipeline, no 2-byte loads
        assert got["kv_ld_b16"] == 0 and got["kv_tile_copies"] >= 2, got
    elif variant == "llama-3.2-1b/unaligned":  # the unhinted tiles: 2-byte loads, no cp.async copies
        assert got["kv_ld_b16"] > 0 and got["kv_tile_copies"] == 0, got


if __name__ == "__main__":
    print(json.dumps(summarise()))
