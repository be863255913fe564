"""The training forward (`flash_forward`, contiguous K/V) compiled for the H200 (sm_90) without a GPU, at
head dims 64 and 128 in bf16 with the HOPPER_FORWARD tiles. The PTX is searched for `wgmma.mma_async`,
`cp.async.bulk.tensor` (TMA) and `setmaxnreg` (the register split of a warp-specialised kernel): the
forward multiplies on the tensor cores, loads through pointers and is not warp-specialised. Runs in a
subprocess without TRITON_INTERPRET (tests/kernels/sm90_compile.py); skipped where this Triton cannot
compile for CUDA.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.kernels.sm90_compile import compile_each, facts_from_subprocess

# name: (head dim, causal)
VARIANTS = {
    "d64": (64, True),
    "d128": (128, True),
}


def compile_variant(d: int, causal: bool) -> dict:
    """The forward kernel of this variant compiled for sm_90: counts of the instructions above in its PTX."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels import flash_forward
    from tinyvllm.kernels.flash_attention_op import HOPPER_FORWARD

    flash_forward.upcast_operands = lambda q: False  # as on the GPU: bf16 operands into the tensor cores
    cfg = HOPPER_FORWARD[d]
    T, hq, hk = 256, 4, 2
    q = torch.zeros(T, hq, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(T, hk, d, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 100, T], dtype=torch.int32)
    with compile_only_for_sm90() as launched:
        flash_forward.flash_forward(q, k, v, cu, 156, d**-0.5, causal, *cfg)
    [(name, kernel)] = launched
    ptx = kernel.asm["ptx"]
    return {
        "name": name,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": ptx.count("setmaxnreg"),
    }


def summarise() -> dict:
    facts = compile_each({n: functools.partial(compile_variant, *v) for n, v in VARIANTS.items()})
    return facts if "skip" in facts else {"variants": facts}


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)["variants"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_compiles_for_sm90(facts, name):
    """Every variant compiles and multiplies by wgmma, without TMA copies or a warp split (setmaxnreg)."""
    got = facts[name]
    assert "error" not in got, got.get("error")
    assert got["name"] == "_flash_fwd_kernel"
    assert got["wgmma"] > 0
    assert got["tma"] == 0
    assert got["setmaxnreg"] == 0


if __name__ == "__main__":
    print(json.dumps(summarise()))
