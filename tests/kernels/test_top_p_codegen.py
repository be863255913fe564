"""The truncating sampler's kernels compiled for the H200 (sm_90) without a GPU.

The interpreter that runs the other kernel tests on a CPU executes the kernels as Python, so it never
sees what only the compiler checks: the types that branches and `while` loops carry (a constant that
becomes a tensor in one branch fails to compile). This compiles every kernel the truncating sampler
launches (the radix select's, the threshold search's and the draw's; with and without a bitmask, bf16
and float32 logits; the search pass in each layout of `SEARCH_LAYOUTS`, which the benchmark sweeps) and
checks that nothing spills: no local memory in the PTX, and no stack frame in the cubin (where ptxas puts
the registers it spills; tests/kernels/sm90_compile.py `resource_usage`). The compiler runs in a
subprocess (the tests' interpreter mode replaces the kernels by Python functions); skipped where this
Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import facts_from_subprocess, missing_cuda_backend


def summarise() -> dict:
    """{launch: {"local": whether its PTX touches local memory}}, or {"skip": reason}: every kernel
    `sample_top_k_top_p` launches (the radix select's four, two of them in two variants, the threshold
    search's five, the precheck's two and the draw's two; with the radix select and the precheck, the
    radix select alone, and the precheck alone), bf16 with and without a bitmask and float32 without. A
    kernel launched in a second variant within one call (R1's and R2's histogram and per-row programs)
    is listed again as name#2."""
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90, resource_usage
    from tinyvllm.kernels.top_p_sampling import SEARCH_LAYOUTS, sample_top_k_top_p, truncation_thresholds

    B, V = 4, 128256
    out = {}
    for dtype, has_mask in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        logits = torch.zeros(B, V, dtype=dtype)
        ones = torch.ones(B)
        bitmask = torch.full((B, (V + 31) // 32), -1, dtype=torch.int32) if has_mask else None
        args = (logits, ones, torch.zeros(B, dtype=torch.int64), torch.full((B,), 50, dtype=torch.int32), ones, ones)
        calls = {"precheck": dict(radix=True), "search": dict(precheck=False, radix=True), "noradix": dict(radix=False)}
        for variant, kwargs in calls.items():
            try:
                with compile_only_for_sm90() as launched:
                    sample_top_k_top_p(*args, bitmask=bitmask, **kwargs)
            except Exception as e:
                if "ptxas" in str(e):
                    return {"skip": f"no ptxas: {e}"}
                out[f"{dtype}/mask={has_mask}/{variant}"] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
                continue
            variants: dict[str, list] = {}
            for name, compiled in launched:
                seen = variants.setdefault(name, [])
                if compiled.hash not in seen:
                    seen.append(compiled.hash)
                ptx = compiled.asm["ptx"]
                suffix = "" if len(seen) == 1 else f"#{len(seen)}"
                out[f"{name}{suffix}/{str(dtype).removeprefix('torch.')}/mask={has_mask}/{variant}"] = {
                    "local": "ld.local" in ptx or "st.local" in ptx,
                    **resource_usage(compiled),
                }
    logits, ones, k = torch.zeros(B, V, dtype=torch.bfloat16), torch.ones(B), torch.full((B,), 50, dtype=torch.int32)
    for search in SEARCH_LAYOUTS:
        layout = ",".join(f"{key}={value}" for key, value in search.items())
        try:
            with compile_only_for_sm90() as launched:
                truncation_thresholds(logits, ones, k, ones, ones, **search)
        except Exception as e:
            out[f"search/{layout}"] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
            continue
        for name, compiled in launched:
            if name in ("threshold_pass_kernel", "threshold_finish_kernel"):
                ptx = compiled.asm["ptx"]
                out[f"{name}/{layout}"] = {"local": "ld.local" in ptx or "st.local" in ptx, **resource_usage(compiled)}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=300)


def test_kernels_compile_for_sm90_without_spills(facts):
    names = {name.split("/")[0] for name in facts}
    assert {"threshold_stats_kernel", "threshold_begin_kernel", "threshold_pass_kernel"} <= names, facts
    assert {"threshold_reduce_kernel", "threshold_finish_kernel", "sample_partial_kernel"} <= names, facts
    assert {"threshold_check_kernel", "threshold_check_reduce_kernel"} <= names, facts
    radix = {"radix_hist_kernel", "radix_hist_kernel#2", "radix_select_kernel", "radix_select_kernel#2"}
    assert radix | {"radix_gather_kernel", "radix_finish_kernel"} <= names, facts
    assert sum(name.endswith("/search") for name in facts) == sum(name.endswith("/precheck") for name in facts) - 6
    assert sum(name.endswith("/noradix") for name in facts) == sum(name.endswith("/precheck") for name in facts) - 18
    assert sum(name.startswith("threshold_pass_kernel/candidates=") for name in facts) == 16, facts
    for name, fact in facts.items():
        assert "error" not in fact, (name, fact)
        assert not fact["local"], f"{name} uses local memory in its PTX"
        # The whole-row search keeps one or two loop-carried words of its `while` on the stack (72-128
        # registers, so not pressure; a load and a store per pass over the row, ~1,000 loads).
        allowed = 24 if name.startswith("threshold_finish_kernel") else 0
        assert fact["stack"] <= allowed, f"{name} spills registers: {fact}"


if __name__ == "__main__":
    print(json.dumps(summarise()))
