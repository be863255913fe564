"""The FlashAttention-2 backward's kernels compiled for the H200 (sm_90) without a GPU, in each dQ mode
("separate", "atomic", "ordered") at head dims 64 and 128 in bf16 with the Hopper tables' tiles, causal
and not. The interpreter tests (test_flash_attention_backward.py) check what they compute; only the
compiler checks the spin loop's scalar atomics, the transposed dS product and the pipelined loops
(tests/kernels/sm90_compile.py). Runs in a subprocess without TRITON_INTERPRET; skipped where this
Triton cannot compile for CUDA.
"""

from __future__ import annotations

import json

import pytest

from tests.kernels.sm90_compile import facts_from_subprocess, missing_cuda_backend

VARIANTS = [(d, mode, causal) for d in (64, 128) for mode in ("separate", "atomic", "ordered") for causal in (True,)]
VARIANTS.append((64, "ordered", False))


def compile_variant(d: int, mode: str, causal: bool) -> list[str]:
    """Names of the kernels one backward launches for this variant, each compiled for sm_90."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels import flash_backward
    from tinyvllm.kernels.flash_attention_op import HOPPER_BACKWARD, HOPPER_BACKWARD_ATOMIC

    flash_backward.upcast_operands = lambda q: False  # as on the GPU: bf16 operands into the tensor cores
    table = HOPPER_BACKWARD_ATOMIC if mode != "separate" else HOPPER_BACKWARD
    cfg = table[d][1]._replace(dq_mode=mode)
    T, hq, hk = 256, 4, 2
    q, do, out = (torch.zeros(T, hq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(T, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(hq, T)
    cu = torch.tensor([0, 100, T], dtype=torch.int32)
    with compile_only_for_sm90() as launched:
        flash_backward.flash_backward(do, q, k, v, out, lse, cu, 156, d**-0.5, causal, cfg)
    return [name for name, _ in launched]


def summarise() -> dict:
    missing = missing_cuda_backend()
    if missing is not None:
        return {"skip": missing}
    out = {}
    for variant in VARIANTS:
        try:
            out[repr(variant)] = {"kernels": compile_variant(*variant)}
        except Exception as e:
            if "ptxas" in str(e) and "not found" in str(e):
                return {"skip": f"no ptxas: {e}"}
            out[repr(variant)] = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    return out


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)


@pytest.mark.parametrize(
    "d,mode,causal", VARIANTS, ids=[f"d{d}-{m}-{'causal' if c else 'full'}" for d, m, c in VARIANTS]
)
def test_backward_compiles_for_sm90(facts, d, mode, causal):
    got = facts[repr((d, mode, causal))]
    assert "error" not in got, got.get("error")
    last = "_bwd_dq_kernel" if mode == "separate" else "_bwd_dq_convert_kernel"
    assert got["kernels"] == ["_bwd_preprocess_kernel", "_bwd_dkdv_kernel", last], got["kernels"]


if __name__ == "__main__":
    print(json.dumps(summarise()))
