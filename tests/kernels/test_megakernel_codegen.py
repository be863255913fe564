"""The decode megakernel and the fused matrix-vector path compiled for the H200 (sm_90) without a GPU,
in every variant the runner can launch: bf16 and float32 weights, FP8 weights (row scales), an FP8 KV
cache, a query group that is not a power of two (padded), QKV bias and QK norm, sliding windows.

The interpreter tests (tests/engine/test_megakernel_path.py, test_megakernel_fp8.py) check what these
kernels compute; only the compiler checks that they compile (tests/kernels/sm90_compile.py says what it
catches that the interpreter cannot). Each variant runs one decode step of a 2-layer model through the
runner's paths with every launch turned into a compile, in a subprocess without TRITON_INTERPRET;
skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import facts_from_subprocess, missing_cuda_backend

GROUP_OF_3 = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}  # padded to 4
# name -> (preset, dtype, FP8 weights, FP8 KV cache, config.json overrides)
VARIANTS = {
    "bf16": ("tiny", "bfloat16", False, False, {}),
    "f32": ("tiny", "float32", False, False, {}),
    "bf16/fp8w": ("tiny", "bfloat16", True, False, {}),
    "bf16/fp8kv": ("tiny", "bfloat16", False, True, {}),
    "bf16/fp8w+fp8kv": ("tiny", "bfloat16", True, True, {}),
    "bf16/group3": ("tiny", "bfloat16", False, False, GROUP_OF_3),
    "bf16/fp8w+fp8kv/group3": ("tiny", "bfloat16", True, True, GROUP_OF_3),
    "qwen2/bf16/group3": ("tiny-qwen2", "bfloat16", False, False, GROUP_OF_3),
    "qwen3/bf16/fp8w": ("tiny-qwen3", "bfloat16", True, False, {}),
    "mistral/bf16/fp8kv": ("tiny-mistral", "bfloat16", False, True, {}),
}


def compile_variant(preset: str, dtype_name: str, fp8w: bool, fp8kv: bool, overrides: dict) -> list[str]:
    """The kernels one decode step launches through the megakernel and through the fused path (the
    megakernel off) for this variant, each compiled for sm_90."""
    import torch

    from tests.engine.test_fused_path import build
    from tests.engine.test_megakernel_fp8 import fp8_pair, set_kv_scales
    from tests.engine.test_megakernel_path import kv_buffer, step, views, with_megakernel
    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.config import RunnerConfig
    from tinyvllm.engine.paths.executor import ModelExecutor
    from tinyvllm.kernels.decode_megakernel import launch
    from tinyvllm.models.decoder import FP8_KV_DTYPE

    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    if fp8w:
        model, _ = fp8_pair(dtype, cpu, preset=preset, **overrides)
    else:
        model = build("triton", dtype, cpu, max_positions=512, preset=preset, **overrides)
    set_kv_scales(model)
    buffer = kv_buffer(model, FP8_KV_DTYPE if fp8kv else dtype)
    # As on the GPU: inline-assembly barriers, bf16 operands straight into the tensor cores.
    real_constexprs = launch._constexprs
    launch._constexprs = lambda *a, **k: {**real_constexprs(*a, **k), "ASM": True, "UPCAST": False}
    names = []
    fused = ModelExecutor(model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), "cuda")
    for paths in (with_megakernel(model), fused):
        ids, positions, meta = step(40)
        with compile_only_for_sm90() as launched, torch.no_grad():
            paths.hidden_states(ids, positions, meta, views(buffer))
        names += [name for name, _ in launched]
    return names


def summarise() -> dict:
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    out = {}
    for name, variant in VARIANTS.items():
        try:
            out[name] = {"kernels": compile_variant(*variant)}
        except Exception as e:
            if "ptxas" in str(e) and "not found" in str(e):
                return {"skip": f"no ptxas: {e}"}
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_paths_compile_for_sm90(facts, variant):
    got = facts[variant]
    assert "error" not in got, got.get("error")
    assert "decode_megakernel_kernel" in got["kernels"], got["kernels"]


if __name__ == "__main__":
    print(json.dumps(summarise()))
