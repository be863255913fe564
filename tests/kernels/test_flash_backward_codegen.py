"""The FlashAttention-2 backward's kernels compiled for the H200 (sm_90) without a GPU, in each dQ mode
("separate", "atomic", "ordered") at head dims 64 and 128 in bf16 with the Hopper tables' tiles, causal
and not; and the Hopper options of `BackwardConfig` (tensor-descriptor loads, warp-specialised loops).
The interpreter tests (test_flash_attention_backward.py) check what they compute; only the compiler
checks the spin loop's scalar atomics, the transposed dS product, the pipelined loops and the
descriptors' lowering to TMA (tests/kernels/sm90_compile.py). Each compiled kernel's PTX is searched
for `wgmma.mma_async` (Hopper's asynchronous tensor-core product), `cp.async.bulk.tensor` (a TMA copy)
and `setmaxnreg` (register reallocation between warp groups: the mark of a warp-specialised kernel);
its cubin for registers and spills (stack bytes), recorded for reading (the wide dK/dV tiles spill at
every config the sweep tries but (32, 64, 8 warps, 2 stages): docs/perf.md §3a).
Runs in a subprocess without TRITON_INTERPRET; skipped where this Triton cannot compile for CUDA.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.kernels.sm90_compile import compile_each, facts_from_subprocess, resource_usage
from tinyvllm.kernels.flash_attention_op import HOPPER_BACKWARD

VARIANTS = [(d, mode, causal) for d in (64, 128) for mode in ("separate", "atomic", "ordered") for causal in (True,)]
VARIANTS.append((64, "ordered", False))

TMA = dict(dkdv_tma=True, dq_tma=True)
WS = dict(dkdv_ws=True, dq_ws=True)
W4 = dict(dkdv_warps=4, dq_warps=4, dkdv_n=64, dq_m=128, dq_n=64)  # where Triton 3.9 specialises both
# The long-sequence table entry's tiles with every Hopper option off: the variants below turn theirs on.
PLAIN = dict(dkdv_tma=False, dkdv_ws=False, dq_tma=False, dq_ws=False)
# name: (head dim, dq_mode, causal, BackwardConfig fields replaced in PLAIN's config)
HOPPER_VARIANTS = {
    "tma-d64-separate": (64, "separate", True, TMA),
    "tma-d128-separate": (128, "separate", True, TMA),
    "tma-d128-separate-full": (128, "separate", False, TMA),
    "tma-d128-atomic": (128, "atomic", True, dict(dkdv_tma=True)),
    "tma-d64-ordered": (64, "ordered", True, dict(dkdv_tma=True)),
    "tma-d128-128x128-w8": (128, "separate", True, dict(dkdv_m=128, dq_n=128, **TMA)),
    "ws-without-tma-d128": (128, "separate", True, WS),
    "tma-ws-w4-d64": (64, "separate", True, dict(**W4, **TMA, **WS)),
    "tma-ws-w4-d128": (128, "separate", True, dict(**W4, **TMA, **WS)),
    "tma-ws-w4-d128-full": (128, "separate", False, dict(**W4, **TMA, **WS)),
    "tma-ws-w8-d128": (128, "separate", True, dict(dkdv_warps=8, dq_warps=8, **TMA, **WS)),
    "tma-ws-w4-d64-128keys": (64, "separate", True, dict(W4, dkdv_n=128, **TMA, **WS)),
    "tma-ws-w4-d64-atomic": (64, "atomic", True, dict(W4, dkdv_tma=True, dkdv_ws=True)),
}
# Triton 3.9's Hopper warp-specialisation pass (NVGPUWarpSpecialization) aborts on the dK/dV kernel
# with 128 keys ("value not sliced" in its data partitioning) and on the fused mode's atomic adds
# ("operation destroyed but still has uses"); with 8 warps it compiles the loops unspecialised.
WS_FAILS_HERE = {"tma-ws-w4-d64-128keys", "tma-ws-w4-d64-atomic"}


def _facts(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        **resource_usage(kernel),
    }


def compile_variant(d: int, mode: str, causal: bool, knobs: dict | None = None) -> list[dict]:
    """Per kernel that one backward launches for this variant, compiled for sm_90: its name and the
    facts `_facts` reads from it. knobs: fields replaced in PLAIN's config (None: the table's
    long-sequence config as it is)."""
    import torch

    from tests.kernels.sm90_compile import compile_only_for_sm90
    from tinyvllm.kernels import flash_backward
    from tinyvllm.kernels.flash_attention_op import HOPPER_BACKWARD, HOPPER_BACKWARD_ATOMIC

    flash_backward.upcast_operands = lambda q: False  # as on the GPU: bf16 operands into the tensor cores
    table = HOPPER_BACKWARD_ATOMIC if mode != "separate" else HOPPER_BACKWARD
    cfg = table[d][1]._replace(dq_mode=mode, **({} if knobs is None else {**PLAIN, **knobs}))
    T, hq, hk = 256, 4, 2
    q, do, out = (torch.zeros(T, hq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(T, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(hq, T)
    cu = torch.tensor([0, 100, T], dtype=torch.int32)
    with compile_only_for_sm90() as launched:
        flash_backward.flash_backward(do, q, k, v, out, lse, cu, 156, d**-0.5, causal, cfg)
    return [{"name": name, **_facts(kernel)} for name, kernel in launched]


def summarise() -> dict:
    jobs = {repr(v): v for v in VARIANTS} | {name: v for name, v in HOPPER_VARIANTS.items()}
    return compile_each({key: functools.partial(_compiled, v) for key, v in jobs.items()})


def _compiled(variant) -> dict:
    return {"kernels": compile_variant(*variant)}


@pytest.fixture(scope="module")
def facts() -> dict:
    return facts_from_subprocess(__file__, timeout=900)


def _kernels(got: dict) -> dict[str, dict]:
    assert "error" not in got, got.get("error")
    return {k["name"]: k for k in got["kernels"]}


@pytest.mark.parametrize(
    "d,mode,causal", VARIANTS, ids=[f"d{d}-{m}-{'causal' if c else 'full'}" for d, m, c in VARIANTS]
)
def test_backward_compiles_for_sm90(facts, d, mode, causal):
    """The tables' kernels: the three launches (four where the dK/dV loop is warp-specialised: its row
    statistics packed first), tensor-core products by wgmma, TMA copies in the kernels whose table entry
    asks for descriptor loads and in no other."""
    from tinyvllm.kernels.flash_attention_op import HOPPER_BACKWARD_ATOMIC

    cfg = (HOPPER_BACKWARD if mode == "separate" else HOPPER_BACKWARD_ATOMIC)[d][1]
    kernels = _kernels(facts[repr((d, mode, causal))])
    last = "_bwd_dq_kernel" if mode == "separate" else "_bwd_dq_convert_kernel"
    stats = ["_bwd_stats_kernel"] if cfg.dkdv_tma and cfg.dkdv_ws else []
    assert list(kernels) == ["_bwd_preprocess_kernel", *stats, "_bwd_dkdv_kernel", last], list(kernels)
    assert kernels["_bwd_dkdv_kernel"]["wgmma"] > 0
    assert (kernels["_bwd_dkdv_kernel"]["tma"] > 0) == cfg.dkdv_tma
    assert (kernels[last]["tma"] > 0) == (mode == "separate" and cfg.dq_tma)
    assert kernels["_bwd_preprocess_kernel"]["tma"] == 0


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="Triton 3.9's Hopper warp specialisation"))
        if n in WS_FAILS_HERE
        else n
        for n in HOPPER_VARIANTS
    ],
)
def test_hopper_variant_compiles_for_sm90(facts, name):
    """Each Hopper option compiles for sm_90: descriptor loads become TMA copies in every kernel that
    asks for them (and only there); the products stay on wgmma; with 4 warps, the warp-specialised
    loops are split into producer and consumer warps (setmaxnreg), and only those; warp specialisation
    without descriptors is the plain kernel."""
    mode, knobs = HOPPER_VARIANTS[name][1], HOPPER_VARIANTS[name][3]
    kernels = _kernels(facts[name])
    parts = [("dkdv", kernels["_bwd_dkdv_kernel"])]
    if mode == "separate":
        parts.append(("dq", kernels["_bwd_dq_kernel"]))
    for part, kernel in parts:
        tma, ws = bool(knobs.get(f"{part}_tma")), bool(knobs.get(f"{part}_ws"))
        assert kernel["wgmma"] > 0, part
        assert (kernel["tma"] > 0) == tma, part
        if tma and ws and knobs.get(f"{part}_warps") == 4:
            assert kernel["setmaxnreg"] > 0, part
        if not (tma and ws):
            assert kernel["setmaxnreg"] == 0, part
    if knobs.get("dkdv_ws") or knobs.get("dq_ws"):
        stats = "_bwd_stats_kernel" in kernels
        assert stats == bool(knobs.get("dkdv_tma") or knobs.get("dq_tma")), list(kernels)


if __name__ == "__main__":
    print(json.dumps(summarise()))
