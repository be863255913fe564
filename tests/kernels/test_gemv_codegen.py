"""fused_gemv's kernel compiled for the H200 (sm_90) without a GPU: every fused variant of both default
paths must compile, and the code must have the shape the config heuristic assumes (kernels/gemv.py):
  * M = 1 (FMA path): the weight tile streamed with 16-byte loads, no barrier inside the K loop (a
    shared-memory reshuffle of x per tile would stall every warp of the program);
  * M ≥ 2 (dot path): wgmma fed by cp.async (multi-stage software pipelining), also with the sampler's
    partials in the epilogue (the LM head's `sampling=`).
The integer arguments are marked divisible by 16 and the pointers 16-byte aligned, as Triton's JIT
specialises them at the real shapes. The compiler runs in a subprocess (the tests' interpreter mode
replaces the kernels by Python functions); skipped where this Triton cannot compile for CUDA. On a GPU
the real launches of test_gpu_shapes.py cover the same ground.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.kernels.sm90_compile import facts_from_subprocess, missing_cuda_backend

DIVISIBLE = [
    "x_ptr",
    "w_ptr",
    "nw_ptr",
    "res_ptr",
    "out_ptr",
    "ws_ptr",
    "tickets_ptr",
    "N",
    "K",
    "k_per_split",
    "stride_xm",
    "stride_wn",
    "stride_rm",
    "stride_om",
]
VARIANTS = {"plain": (0, False), "norm": (1, False), "residual": (0, True), "silu_residual": (2, True)}
PATHS = {
    "fma": dict(block_m=1, block_n=8, block_k=512, dot=False, warps=4, stages=2),
    "dot": dict(block_m=16, block_n=64, block_k=128, dot=True, warps=4, stages=3),
}


def compile_ptx(
    mode: int,
    residual: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    dot: bool,
    warps: int,
    stages: int,
    sample: bool = False,
) -> str:
    """PTX of gemv_kernel for sm_90, split-K variant (it contains the unsplit epilogue too); `sample`:
    unsplit, with the sampler's partials in the epilogue (the LM head's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tinyvllm.kernels.gemv import gemv_kernel

    sig = {name: "*bf16" for name in ("x_ptr", "w_ptr", "nw_ptr", "res_ptr", "bias_ptr", "out_ptr")}
    sig.update(
        {
            "ws_scale_ptr": "*fp32",
            "ws_ptr": "*fp32",
            "tickets_ptr": "*i32",
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "k_per_split": "i32",
            "eps": "fp32",
            "stride_xm": "i32",
            "stride_wn": "i32",
            "stride_rm": "i32",
            "stride_om": "i32",
            "temp_ptr": "*fp32",
            "seed_ptr": "*i64",
            "part_val_ptr": "*fp32",
            "part_idx_ptr": "*i32",
        }
    )
    consts = {
        "MODE": mode,
        "HAS_RESIDUAL": residual,
        "HAS_BIAS": False,
        "W_SCALE": False,
        "SPLIT": not sample,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "USE_DOT": dot,
        "EVEN_K": True,
        "UPCAST": False,
        "IEEE": False,
        "SAMPLE": sample,
        "TILE": 2048,
        "FAST_LOG": True,
        "PDL": False,
    }
    sig.update({name: "constexpr" for name in consts})
    attrs = {(gemv_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    compiled = triton.compile(
        ASTSource(gemv_kernel, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    return compiled.asm["ptx"]


def k_loop(ptx: str) -> str:
    """The body of the main K loop: of the PTX's loops, the one with the most 16-byte global loads."""
    bodies = re.findall(r"Inner Loop Header.*?\n(.*?)\n\s*@%p\d+ bra", ptx, flags=re.S)
    return max(bodies, key=lambda b: b.count("ld.global.v4"), default="")


def summarise() -> dict:
    """{path/variant: facts about its PTX}, or {"skip": reason}."""
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    out = {}
    for path, cfg in PATHS.items():
        for variant, (mode, residual) in {**VARIANTS, "plain_sample": (0, False)}.items():
            try:
                ptx = compile_ptx(mode, residual, **cfg, sample=variant.endswith("_sample"))
            except Exception as e:
                if "ptxas" in str(e):
                    return {"skip": f"no ptxas: {e}"}
                out[f"{path}/{variant}"] = {"error": f"{type(e).__name__}: {e}"}
                continue
            body = k_loop(ptx)
            out[f"{path}/{variant}"] = {
                "v4_loads_in_loop": body.count("ld.global.v4"),
                "barrier_in_loop": "bar.sync" in body,
                "wgmma": "wgmma.mma_async" in ptx,
                "cp_async": "cp.async" in ptx,
            }
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=300)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fma_path_streams_without_barriers(facts, variant):
    f = facts[f"fma/{variant}"]
    assert "error" not in f, f["error"]
    assert f["v4_loads_in_loop"] >= 4, "the [8, 512] weight tile should take 4 16-byte loads per thread"
    if variant != "silu_residual":  # SwiGLU computes [1, BLOCK_K] once and reshuffles it (see the kernel)
        assert not f["barrier_in_loop"]


@pytest.mark.parametrize("variant", [*VARIANTS, "plain_sample"])
def test_dot_path_uses_wgmma_and_cp_async(facts, variant):
    f = facts[f"dot/{variant}"]
    assert "error" not in f, f["error"]
    assert f["wgmma"] and f["cp_async"]


if __name__ == "__main__":
    print(json.dumps(summarise()))
