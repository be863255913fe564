"""`flash_attention`, the training op (FlashAttention-2 forward and backward kernels), against float64
autograd through `reference.attention` on the same rounded inputs: out, logsumexp, dq, dk, dv on packed
sequences whose lengths are off the tile grid (and an empty one), causal and not, GQA groups 1/2/4 and
MQA, head dims 16..128, square and non-square tiles; the same for the fused dQ modes ("atomic": dQ added
inside the dK/dV kernel with atomics; "ordered": those adds in a fixed order); `gradcheck` of the
kernels in float64 in each dQ mode; two backward runs bitwise equal by default and in the "ordered"
mode; the argument errors.

Gradient tolerances are twice the output's (`kernel_helpers.TOL`): the backward rounds P and
dS = P ∘ (dP − D) to the input dtype before its products, two roundings where the forward has one, and
dS is a difference whose terms can nearly cancel.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close

from tinyvllm.kernels import flash_attention, reference
from tinyvllm.kernels.flash_attention_op import BackwardConfig, ForwardConfig, flash_attention_fwd

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
LENS = [13, 37, 1, 0, 20]  # off the 16/32 tile grid, a one-row and an empty sequence
GRAD_FACTOR = 2.0


def make_inputs(lens, hq, hk, d, dtype, device, seed=0):
    """Packed q [T, hq, d], k, v [T, hk, d] (strided views into a wider fused-qkv tensor, as a model
    makes them), cu_seqlens int32 and an upstream gradient dO."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)
    qkv = torch.randn(T, hq + 2 * hk, d, generator=gen, device=device).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    do = torch.randn(T, hq, d, generator=gen, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, do


def kernel_grads(q, k, v, do, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, backend="triton", **kw)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def assert_grads_match(q, k, v, do, cu, causal, cfg, dtype):
    """dq, dk, dv of the kernels with backward config `cfg` (the fused dQ modes allowed) against the float64
    reference's, within GRAD_FACTOR of the dtype's tolerance."""
    _, dq, dk, dv = kernel_grads(q, k, v, do, causal=causal, cu_seqlens=cu, bwd_config=cfg, deterministic=False)
    _, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, do, cu, causal)
    assert_close(dq, ref_dq, dtype, GRAD_FACTOR)
    assert_close(dk, ref_dk, dtype, GRAD_FACTOR)
    assert_close(dv, ref_dv, dtype, GRAD_FACTOR)


def reference_grads(q, k, v, do, cu, causal, scale=None):
    """out, dq, dk, dv in float64 through autograd of `reference.attention`."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference.attention(q, k, v, cu, scale or q.shape[-1] ** -0.5, causal)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


CASES = [  # dtype, Hq, Hk, D, causal, tiles (fwd M, N; dkdv M, N; dq M, N) or None for the default
    (BF16, 4, 2, 64, True, None),
    (BF16, 2, 2, 128, False, None),
    (F16, 8, 2, 32, True, ((16, 32), (16, 32), (32, 16))),
    (F16, 4, 1, 64, False, ((32, 16), (32, 16), (16, 32))),
    (F32, 4, 1, 128, True, ((32, 16), (32, 16), (16, 32))),
    (F32, 2, 1, 16, False, ((16, 32), (16, 32), (32, 16))),
]


@pytest.mark.parametrize(
    "dtype,hq,hk,d,causal,tiles",
    CASES,
    ids=[f"{str(c[0])[6:]}-g{c[1] // c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}-{c[5] or 'default'}" for c in CASES],
)
def test_matches_float64_autograd(dtype, hq, hk, d, causal, tiles, device):
    q, k, v, cu, do = make_inputs(LENS, hq, hk, d, dtype, device)
    cfg = {}
    if tiles:
        (fm, fn), (km, kn), (qm, qn) = tiles
        cfg = dict(fwd_config=ForwardConfig(fm, fn, 4, 1), bwd_config=BackwardConfig(km, kn, 4, 1, qm, qn, 4, 1, 16))
    out, dq, dk, dv = kernel_grads(q, k, v, do, causal=causal, cu_seqlens=cu, **cfg)
    ref_out, ref_dq, ref_dk, ref_dv = reference_grads(q, k, v, do, cu, causal)
    assert_close(out, ref_out, dtype)
    assert_close(dq, ref_dq, dtype, GRAD_FACTOR)
    assert_close(dk, ref_dk, dtype, GRAD_FACTOR)
    assert_close(dv, ref_dv, dtype, GRAD_FACTOR)
    _, lse = flash_attention_fwd(q, k, v, causal, cu, backend="triton", fwd_config=cfg.get("fwd_config"))
    ref_lse = reference.attention_lse(q.double(), k.double(), cu, d**-0.5, causal)
    assert_close(lse, ref_lse, F32)  # float32 statistics whatever the input dtype


def test_dense_layout_and_scale(device):
    """[B, L, H, D] inputs (packed by a reshape, gradients reshaped back) and an explicit scale."""
    B, L, hq, hk, d = 2, 21, 4, 2, 32
    q, k, v, cu, do = make_inputs([L] * B, hq, hk, d, BF16, device, seed=3)
    dense = [t.reshape(B, L, *t.shape[1:]) for t in (q, k, v, do)]
    out, dq, dk, dv = kernel_grads(*dense[:3], dense[3], causal=True, scale=0.3)
    assert out.shape == (B, L, hq, d) and dk.shape == (B, L, hk, d)
    ref = reference_grads(q, k, v, do, cu, True, scale=0.3)
    for got, want, factor in zip((out, dq, dk, dv), ref, (1, GRAD_FACTOR, GRAD_FACTOR, GRAD_FACTOR)):
        assert_close(got.reshape(want.shape), want, BF16, factor)


FUSED_CASES = [  # dq_mode, dtype, Hq, Hk, D, causal, dK/dV tiles (M, N)
    ("atomic", BF16, 4, 2, 64, True, (16, 32)),
    ("atomic", F32, 4, 1, 32, False, (32, 16)),
    ("ordered", BF16, 4, 2, 64, True, (32, 16)),
    ("ordered", F16, 8, 2, 32, False, (16, 32)),
    ("ordered", F32, 2, 2, 16, True, (16, 16)),
]


@pytest.mark.parametrize(
    "mode,dtype,hq,hk,d,causal,tiles",
    FUSED_CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-g{c[2] // c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}-{c[6]}" for c in FUSED_CASES],
)
def test_fused_dq_modes_match_float64_autograd(mode, dtype, hq, hk, d, causal, tiles, device):
    """dQ summed inside the dK/dV kernel (float32 atomic adds, in any or in key-tile order), on packed
    sequences off the tile grid (and an empty one), GQA/MQA, causal and not."""
    q, k, v, cu, do = make_inputs(LENS, hq, hk, d, dtype, device, seed=4)
    cfg = BackwardConfig(*tiles, 4, 1, 16, 16, 4, 1, 16, mode)
    assert_grads_match(q, k, v, do, cu, causal, cfg, dtype)


TMA = dict(dkdv_tma=True, dq_tma=True)
WS = dict(dkdv_ws=True, dq_ws=True)
HOPPER_CASES = [  # dq_mode, dtype, Hq, Hk, D, causal, the Hopper knobs turned on
    ("separate", BF16, 4, 2, 64, True, TMA),
    ("separate", F16, 4, 1, 32, False, TMA | WS),
    ("separate", F32, 2, 2, 16, True, TMA | WS),
    ("separate", BF16, 8, 2, 128, True, TMA | WS),
    ("separate", BF16, 4, 2, 32, True, WS),  # warp specialisation without descriptors: the plain kernels
    ("atomic", BF16, 4, 2, 64, True, dict(dkdv_tma=True, dkdv_ws=True)),
    ("atomic", F32, 2, 1, 32, False, dict(dkdv_tma=True, dkdv_ws=True)),
    ("ordered", F16, 8, 2, 32, False, dict(dkdv_tma=True)),
]


@pytest.mark.parametrize(
    "mode,dtype,hq,hk,d,causal,knobs",
    HOPPER_CASES,
    ids=[
        f"{c[0]}-{str(c[1])[6:]}-g{c[2] // c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}-{'+'.join(c[6])}"
        for c in HOPPER_CASES
    ],
)
def test_hopper_knobs_match_float64_autograd(mode, dtype, hq, hk, d, causal, knobs, device):
    """Tensor-descriptor loads (`dkdv_tma`, `dq_tma`) and the warp-specialised single loops (`dkdv_ws`,
    `dq_ws`: every tile masked, the row statistics packed by `_bwd_stats_kernel`) give the reference's
    gradients on packed sequences off the tile grid (and an empty one: key and query tiles past a
    sequence's end run no loop), GQA/MQA, causal and not, in each dQ mode: the per-sequence
    descriptors must read the rows past a sequence as zeros, never the next sequence's rows. The inputs
    are strided views that descriptors accept, so the descriptor path runs (asserted)."""
    from tinyvllm.kernels.launch import tma_usable

    q, k, v, cu, do = make_inputs(LENS, hq, hk, d, dtype, device, seed=6)
    assert tma_usable(q, do) and tma_usable(k, v)
    cfg = BackwardConfig(16, 32, 4, 1, 32, 16, 4, 1, 16, mode)._replace(**knobs)
    assert_grads_match(q, k, v, do, cu, causal, cfg, dtype)


def test_tma_falls_back_on_misaligned_inputs(device):
    """Inputs whose base is not 16-byte aligned cannot be read through descriptors: `tma_usable` says
    so, and a config asking for them takes the pointer loads and still gives the reference's gradients."""
    from tinyvllm.kernels.launch import tma_usable

    q, k, v, cu, do = make_inputs([11, 6], 2, 1, 32, BF16, device, seed=7)
    wide = torch.zeros(q.shape[0], 2, 33, dtype=BF16, device=device)
    wide[:, :, 1:] = q
    q_off = wide[:, :, 1:]  # the same values, one element (2 bytes) past an aligned base
    assert not tma_usable(q_off, do) and tma_usable(q, do)
    cfg = BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, dkdv_tma=True, dq_tma=True)
    _, dq, dk, dv = kernel_grads(q_off, k, v, do, causal=True, cu_seqlens=cu, bwd_config=cfg)
    for got, want in zip((dq, dk, dv), reference_grads(q, k, v, do, cu, True)[1:]):
        assert_close(got, want, BF16, GRAD_FACTOR)


def test_ordered_mode_refuses_warp_specialisation(device):
    q, k, v, cu, do = make_inputs([7, 9], 4, 2, 32, BF16, device)
    cfg = BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, "ordered", dkdv_ws=True)
    with pytest.raises(ValueError, match="ordered"):
        kernel_grads(q, k, v, do, causal=True, cu_seqlens=cu, bwd_config=cfg)


def test_deterministic_false_defaults_to_atomic(device):
    """deterministic=False without a config takes the atomic mode's default tiles; the gradients match."""
    q, k, v, cu, do = make_inputs([23, 9], 4, 2, 32, BF16, device, seed=5)
    _, dq, dk, dv = kernel_grads(q, k, v, do, causal=True, cu_seqlens=cu, deterministic=False)
    for got, want in zip((dq, dk, dv), reference_grads(q, k, v, do, cu, True)[1:]):
        assert_close(got, want, BF16, GRAD_FACTOR)
    from tinyvllm.kernels.flash_attention_op import default_configs

    assert default_configs(32, BF16, device, 32, deterministic=False)[1].dq_mode == "atomic"
    assert default_configs(32, BF16, device, 32)[1].dq_mode in ("separate", "ordered")


@pytest.mark.parametrize("causal,mode", [(True, "separate"), (False, "separate"), (True, "atomic"), (False, "ordered")])
def test_gradcheck_float64(causal, mode, device):
    """torch.autograd.gradcheck of the Triton kernels in float64 (IEEE products, float64 accumulation;
    the scale reaches the kernels as a float32 scalar, so the analytic and numerical Jacobians share it).
    Fast mode (a random projection of the Jacobian) keeps the interpreter to a few forward passes."""
    q, k, v, cu, _ = make_inputs([5, 19], 2, 1, 16, F64, device, seed=1)
    inputs = tuple(t.detach().contiguous().requires_grad_() for t in (q, k, v))

    cfg = BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, mode)

    def fn(q, k, v):
        return flash_attention(q, k, v, causal, cu, backend="triton", bwd_config=cfg, deterministic=mode != "atomic")

    if inputs[0].device.type == "cuda":  # float64 is an interpreter-only kernel dtype: a clear error on CUDA
        with pytest.raises(TypeError, match="backend='torch'"):
            fn(*inputs)
        return
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)


@pytest.mark.parametrize("mode", [None, "separate", "ordered"])
def test_backward_is_deterministic(mode, device):
    """Two backward passes of the same inputs give bitwise equal gradients: by default (no config) and
    in each deterministic dQ mode."""
    q, k, v, cu, do = make_inputs(LENS, 4, 2, 32, BF16, device, seed=2)
    kw = {} if mode is None else dict(bwd_config=BackwardConfig(16, 32, 4, 1, 16, 16, 4, 1, 16, mode))
    first = kernel_grads(q, k, v, do, causal=True, cu_seqlens=cu, **kw)
    second = kernel_grads(q, k, v, do, causal=True, cu_seqlens=cu, **kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_cpu_default_is_the_reference():
    """On the CPU without backend= the reference runs, with autograd, at any dtype and head dim."""
    q, k, v, cu, do = make_inputs([9, 4], 3, 1, 24, F32, torch.device("cpu"))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attention(q, k, v, False, cu)
    out.backward(do)
    ref = reference_grads(q, k, v, do, cu, False)
    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
        assert_close(got, want, F32)


def _bad(device, **change):
    """Valid packed arguments with `change` applied; the kernel backend."""
    q, k, v, cu, _ = make_inputs([7, 9], 4, 2, 32, BF16, device)
    args = dict(q=q, k=k, v=v, causal=True, cu_seqlens=cu, backend="triton")
    args.update(change)
    return lambda: flash_attention(**args)


def test_errors(device, monkeypatch):
    q, k, v, cu, _ = make_inputs([7, 9], 4, 2, 32, BF16, device)
    cases = [
        (TypeError, "share one floating dtype", dict(k=k.float())),
        (TypeError, "int32", dict(cu_seqlens=cu.long())),
        (ValueError, "without decreasing", dict(cu_seqlens=cu.flip(0))),
        (ValueError, "without decreasing", dict(cu_seqlens=cu[:-1])),
        (ValueError, "multiple of Hk", dict(k=k[:, :1].expand(-1, 3, -1), v=v[:, :1].expand(-1, 3, -1))),
        (ValueError, "contiguous in its last dimension", dict(q=q.transpose(0, 2).contiguous().transpose(0, 2))),
        (ValueError, "positive", dict(scale=0.0)),
        (ValueError, "backend", dict(backend="cuda")),
        (TypeError, "causal must be a bool", dict(causal=1)),
        (ValueError, "dense", dict(q=q[None], k=k[None], v=v[None])),
        (ValueError, "share one device", dict(k=k.to("meta"))),
        (TypeError, "deterministic must be a bool", dict(deterministic=None)),
        (ValueError, "deterministic=False", dict(bwd_config=BackwardConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, "atomic"))),
    ]
    for exc, message, change in cases:
        with pytest.raises(exc, match=message):
            _bad(device, **change)()
    with pytest.raises(TypeError, match="backend='torch'"):  # a dtype the kernels do not take
        flash_attention(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)), True, cu, backend="triton")
    wide = torch.zeros(16, 2, 96, dtype=BF16, device=device)
    with pytest.raises(ValueError, match="head dims"):
        flash_attention(wide, wide, wide, backend="triton")
    if device.type == "cpu":  # the kernels on the CPU need the interpreter
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            flash_attention(q, k, v, True, cu, backend="triton")
