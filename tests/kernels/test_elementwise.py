"""rms_norm, add_rms_norm, rope, write_kv_cache and silu_and_mul vs the reference: odd widths, strided
views as the model passes them, float16/bfloat16/float32/float64."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close, rel_err

from tinyvllm.config import RopeScaling
from tinyvllm.kernels import reference, triton_ops
from tinyvllm.models.rope import cos_sin_table

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
IDS = ["f32", "bf16", "f16", "f64"]


def randn(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H", [(1, 8), (7, 37), (3, 2048)])
def test_rms_norm(T, H, dtype, device):
    gen = torch.Generator(device=device).manual_seed(T * H)
    wide = randn(T, H + 5, dtype=dtype, device=device, gen=gen) * 3
    x = wide[:, 2 : H + 2]  # a strided row view
    w = randn(H, dtype=dtype, device=device, gen=gen)
    out = triton_ops.rms_norm(x, w, 1e-5)
    ref = reference.rms_norm(x.double(), w.double(), 1e-5) if dtype != torch.float64 else None
    ref_same = reference.rms_norm(x, w, 1e-5)
    assert out.dtype == ref_same.dtype and out.shape == ref_same.shape
    assert_close(out, ref_same if ref is None else ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_add_rms_norm(dtype, device):
    gen = torch.Generator(device=device).manual_seed(5)
    x = randn(9, 50, dtype=dtype, device=device, gen=gen)
    r = randn(9, 50, dtype=dtype, device=device, gen=gen) * 10
    w = randn(50, dtype=dtype, device=device, gen=gen)
    x0, r0 = x.clone(), r.clone()
    out, new_r = triton_ops.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_r = reference.add_rms_norm(x, r, w, 1e-6)
    assert_close(new_r, ref_r, dtype)
    assert_close(out, ref_out, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"


def test_rms_norm_float32_weight_on_bf16(device):
    """torch's promotion: a float32 weight times a bf16 normalised row gives float32."""
    gen = torch.Generator(device=device).manual_seed(6)
    x = randn(4, 64, dtype=torch.bfloat16, device=device, gen=gen)
    w = randn(64, dtype=torch.float32, device=device, gen=gen)
    out, ref = triton_ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 16), (6, 2, 64), (8, 1, 128)])
def test_rope_in_place_on_fused_qkv_views(hq, hk, d, dtype, device):
    gen = torch.Generator(device=device).manual_seed(hq * d)
    T = 11
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    cos_sin = cos_sin_table(d, 500000.0, scaling, 40000, device=device)
    qkv = randn(T, (hq + 2 * hk) * d, dtype=dtype, device=device, gen=gen)
    q = qkv[:, : hq * d].reshape(T, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].reshape(T, hk, d)
    assert not q.is_contiguous() and q.data_ptr() == qkv.data_ptr()
    positions = torch.randint(0, 40000, (T,), generator=gen, device=device)
    ref_q, ref_k = reference.rope(q.clone(), k.clone(), positions, cos_sin)
    v_before = qkv[:, (hq + hk) * d :].clone()
    out_q, out_k = triton_ops.rope(q, k, positions, cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(q, ref_q, dtype)
    assert_close(k, ref_k, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "v must be untouched"


# A cache in the model's dtype for every dtype; an FP8 cache for the 16- and 32-bit models it serves.
CACHES = [(dt, "same") for dt in DTYPES] + [(dt, "fp8") for dt in DTYPES if dt != torch.float64]


@pytest.mark.parametrize("dtype,cache", CACHES, ids=[f"{i}-{c}" for (dt, c), i in zip(CACHES, IDS + IDS[:3])])
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 16), (6, 3, 64), (8, 1, 128)])
def test_rope_write_kv_is_rope_then_the_cache_write(hq, hk, d, dtype, cache, device):
    """The fused op on views of one fused qkv row block: q and k rotated in place, the rotated K and V in
    their slots (none for a padded row), bit for bit as the two Triton kernels one after the other. Against
    the reference's two ops: V's slots bit for bit, q, k and K's slots close (the rotation's float
    arithmetic; in an FP8 cache two K's a rounding apart land at most one e4m3 step, 2⁻³ relative, apart,
    and rarely: 2⁻⁴ bounds the whole tensor's relative error)."""
    gen = torch.Generator(device=device).manual_seed(hq * d + hk)
    T, bs, nb = 9, 4, 7
    cos_sin = cos_sin_table(d, 500000.0, None, 4096, device=device)
    qkv = randn(T, (hq + 2 * hk) * d, dtype=dtype, device=device, gen=gen) * 4
    positions = torch.randint(0, 4096, (T,), generator=gen, device=device)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(hk))[:T]
    slots[4] = -1  # a padded row: rotated, but nothing written
    slots = slots.to(device)
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
    scales = {"k_scale": 0.37, "v_scale": 1.9} if cache == "fp8" else {}

    def views(t):
        return (
            t[:, : hq * d].reshape(T, hq, d),
            t[:, hq * d : (hq + hk) * d].reshape(T, hk, d),
            t[:, (hq + hk) * d :].reshape(T, hk, d),
        )

    def empty_caches():
        return [torch.zeros(nb, hk, bs, d, device=device).to(cache_dtype) for _ in range(2)]

    runs = {}
    for name in ("fused", "two kernels", "reference"):
        t = qkv.clone()
        q, k, v = views(t)
        kc, vc = empty_caches()
        if name == "fused":
            out_q, out_k = triton_ops.rope_write_kv(q, k, v, positions, cos_sin, kc, vc, slots, **scales)
            assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        elif name == "two kernels":
            triton_ops.rope(q, k, positions, cos_sin)
            triton_ops.write_kv_cache(k, v, kc, vc, slots, **scales)
        else:
            reference.rope_write_kv(q, k, v, positions, cos_sin, kc, vc, slots, **scales)
        runs[name] = (t, kc, vc)
    for a, b in zip(runs["fused"], runs["two kernels"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    t, kc, vc = runs["fused"]
    rt, rkc, rvc = runs["reference"]
    assert_close(t, rt, dtype)
    assert torch.equal(t[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :]), "v must be untouched"
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    written = written.to(device)
    slots_of = lambda c: c.permute(0, 2, 1, 3).reshape(nb * bs, hk, d)  # noqa: E731
    for ours in (kc, vc):
        assert not slots_of(ours)[~written].float().any(), "wrote a slot it should not have"
    assert torch.equal(slots_of(vc)[written].view(torch.uint8), slots_of(rvc)[written].view(torch.uint8))
    k_ours, k_ref = slots_of(kc)[written].float(), slots_of(rkc)[written].float()
    if cache == "fp8":
        assert rel_err(k_ours, k_ref) <= 2**-4
    else:
        assert_close(k_ours, k_ref, dtype)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_write_kv_cache(block_size, dtype, device):
    gen = torch.Generator(device=device).manual_seed(block_size)
    T, hk, d, num_blocks = 13, 2, 32, 17
    qkv = randn(T, (4 + 2 * hk) * d, dtype=dtype, device=device, gen=gen)
    k = qkv[:, 4 * d : (4 + hk) * d].reshape(T, hk, d)
    v = qkv[:, (4 + hk) * d :].reshape(T, hk, d)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))[:T]
    slots[[2, 7]] = -1  # padded rows write nothing
    slots = slots.to(device)
    caches = [torch.full((num_blocks, hk, block_size, d), float("nan"), dtype=dtype, device=device) for _ in range(4)]
    triton_ops.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), ref.isnan()), "wrote a slot it should not have, or missed one"
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(1, 2), (5, 74), (2, 3, 2 * 1500)])
def test_silu_and_mul(shape, dtype, device):
    gen = torch.Generator(device=device).manual_seed(shape[-1])
    x = randn(*shape, dtype=dtype, device=device, gen=gen) * 4
    out = triton_ops.silu_and_mul(x)
    ref = reference.silu_and_mul(x.double() if dtype != torch.float64 else x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    assert_close(out, ref, dtype)


def test_empty_inputs(device):
    x = torch.zeros(0, 16, device=device)
    assert triton_ops.rms_norm(x, torch.ones(16, device=device), 1e-5).shape == (0, 16)
    assert triton_ops.silu_and_mul(x).shape == (0, 8)
