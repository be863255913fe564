"""The truncating sampler's kernels compiled for the H200 (sm_90) without a GPU.

The interpreter that runs the other kernel tests on a CPU executes the kernels as Python, so it never
sees what only the compiler checks: the types that branches and `while` loops carry (a constant that
becomes a tensor in one branch fails to compile). This compiles the threshold kernel (with and without
a bitmask, bf16 and float32 logits) and the fused draw with thresholds, and checks that nothing spills
to local memory. The compiler runs in a subprocess (the tests' interpreter mode replaces the kernels by
Python functions); skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import facts_from_subprocess, missing_cuda_backend


def compile_ptx(kernel, sig: dict, consts: dict, warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{name: "constexpr" for name in consts}}
    compiled = triton.compile(
        ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
    )
    return compiled.asm["ptx"]


def summarise() -> dict:
    """{variant: {"local": whether its PTX touches local memory}}, or {"skip": reason}."""
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    from tinyvllm.kernels.sampling import sample_partial_kernel
    from tinyvllm.kernels.top_p_sampling import truncation_threshold_kernel

    out = {}
    variants = []
    for dtype in ("bf16", "fp32"):
        for has_mask in (False, True):
            sig = {"logits_ptr": f"*{dtype}", "stride_row": "i32", "temperature_ptr": "*fp32", "top_k_ptr": "*i32"}
            sig.update({"top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "mask_ptr": "*i32", "stride_mask": "i32"})
            sig.update({"thr_ptr": "*fp32", "passes_ptr": "*i32", "V": "i32"})
            consts = {"BLOCK": 1024, "NC": 8, "HAS_MASK": has_mask}
            variants.append((f"threshold/{dtype}/mask={has_mask}", truncation_threshold_kernel, sig, consts))
    sig = {"logits_ptr": "*bf16", "stride_row": "i32", "temperature_ptr": "*fp32", "seed_ptr": "*i64"}
    sig.update({"val_ptr": "*fp32", "idx_ptr": "*i32", "mask_ptr": "*i32", "stride_mask": "i32", "thr_ptr": "*fp32"})
    sig.update({"V": "i32", "CHUNK": "i32", "NUM_SPLITS": "i32"})
    consts = {"BLOCK": 2048, "FAST_LOG": True, "HAS_MASK": True, "HAS_THR": True}
    variants.append(("draw/bf16/thresholds", sample_partial_kernel, sig, consts))
    for name, kernel, sig, consts in variants:
        try:
            ptx = compile_ptx(kernel, sig, consts, warps=8)
        except Exception as e:
            if "ptxas" in str(e):
                return {"skip": f"no ptxas: {e}"}
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
            continue
        out[name] = {"local": "ld.local" in ptx or "st.local" in ptx}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=300)


def test_kernels_compile_for_sm90_without_spills(facts):
    assert len(facts) == 5, facts
    for name, fact in facts.items():
        assert "error" not in fact, (name, fact)
        assert not fact["local"], f"{name} spills to local memory"


if __name__ == "__main__":
    print(json.dumps(summarise()))
