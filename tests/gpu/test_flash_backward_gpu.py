"""The attention backward's three dQ modes on the H200 at the Hopper tables' tiles (bf16, head dims 64
and 128): gradients against float64 autograd through `reference.attention` on packed sequences of
uneven lengths with GQA, and run-to-run bitwise identity of the deterministic modes ("separate",
"ordered") at a size where thousands of programs overlap (the ordered mode's tickets under real
concurrency; its spin-wait completing is itself the no-deadlock check).
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels import flash_attention, reference
from tinyvllm.kernels.flash_attention_op import default_configs

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
MODES = ("separate", "atomic", "ordered")
TOL = 2e-2  # relative, bf16 gradients against float64 (tests/kernels: 1e-2 for outputs, twice for gradients)


def inputs(lens: list[int], hq: int, hk: int, d: int, seed: int = 0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, hq, d, generator=gen, device=CUDA).to(BF16)
    k, v = (torch.randn(T, hk, d, generator=gen, device=CUDA).to(BF16) for _ in range(2))
    do = torch.randn(T, hq, d, generator=gen, device=CUDA).to(BF16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    return q, k, v, do, cu


def grads(q, k, v, do, cu, mode: str, max_seqlen: int):
    cfg = default_configs(q.shape[-1], BF16, CUDA, max_seqlen, deterministic=mode == "separate")[1]
    cfg = cfg._replace(dq_mode=mode)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, True, cu, bwd_config=cfg, deterministic=mode != "atomic")
    out.backward(do)
    return q.grad, k.grad, v.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_modes_match_float64(d, mode):
    lens = [1000, 2900, 77, 1]
    q, k, v, do, cu = inputs(lens, 8, 2, d, seed=d)
    got = grads(q, k, v, do, cu, mode, max(lens))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference.attention(qr, kr, vr, cu, d**-0.5, True)
    out.backward(do.double())
    for name, g, want in zip(("dq", "dk", "dv"), got, (qr.grad, kr.grad, vr.grad)):
        assert rel(g, want) <= TOL, f"{name} {mode} d{d}: relative error {rel(g, want):.2e}"


@pytest.mark.parametrize("mode", ["separate", "ordered"])
def test_deterministic_modes_are_bitwise_reproducible(mode):
    lens = [8192, 8192]
    q, k, v, do, cu = inputs(lens, 16, 4, 128, seed=7)
    first = grads(q, k, v, do, cu, mode, 8192)
    for _ in range(2):
        again = grads(q, k, v, do, cu, mode, 8192)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs ({mode})"
    atomic = grads(q, k, v, do, cu, "atomic", 8192)  # same sums in another order: close, not equal
    for a, b in zip(first, atomic):
        assert rel(b, a) <= 1e-2
