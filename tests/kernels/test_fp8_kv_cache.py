"""The FP8 KV cache (float8_e4m3fn, per-tensor K and V scales) in the Triton kernels against the torch
reference: the write kernel bit for bit (division, clamp to ±448, round to nearest even), and prefill,
paged decode (split and cascade) attention reading FP8 caches against `reference` in float64 with the
scales applied to the dequantized keys and values. Under the CPU interpreter float8 loads, stores and
conversions of exactly representable values work, but float32 → e4m3 rounding loses the carry into the
next binade and out-of-range values wrap, so the kernels clamp and (under the interpreter only) round in
float32 first (kernels/fp8_convert.py); `test_conversion_*` checks that rounding bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import assert_close, make_paged_cache, packed_queries

from tests.quantization.fp8_reference import e4m3_grid, round_e4m3
from tinyvllm.kernels import reference
from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd
from tinyvllm.kernels.fp8_convert import to_e4m3
from tinyvllm.kernels.kv_cache import write_kv_cache
from tinyvllm.kernels.launch import upcast_dot
from tinyvllm.kernels.prefill_attention import PrefillConfig, prefill_attention_fwd

FP8 = torch.float8_e4m3fn
F32, BF16 = torch.float32, torch.bfloat16
K_SCALE, V_SCALE = 0.37, 2.5  # K cache values ~ N(0, 1/0.37²), V's ~ N(0, 1/2.5²): both well inside ±448


@triton.jit
def _convert_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, to_e4m3(x, EMULATE), mask=offs < n)


def test_conversion_matches_torch_and_hand_rounding(device):
    """to_e4m3 on every e4m3 value, every midpoint between neighbours (ties: to even), points just off the
    midpoints, subnormals and values past ±448 (saturate), and random values of all magnitudes."""
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.tensor([449, 480, 1e4, 3e38])])
    rand = torch.randn(4000, generator=torch.Generator().manual_seed(0)).double() * 10.0 ** torch.randint(
        -4, 3, (4000,)
    )
    x = torch.cat([special, -special, rand]).float()
    y = torch.empty(x.shape, dtype=FP8, device=device)
    xd = x.to(device)
    _convert_kernel[(triton.cdiv(len(x), 1024),)](xd, y, len(x), BLOCK=1024, EMULATE=upcast_dot(device))
    assert torch.equal(y.cpu().double(), round_e4m3(x))
    assert torch.equal(y.cpu().view(torch.uint8), x.clamp(-448, 448).to(FP8).view(torch.uint8))


def test_reference_write_is_e4m3_rounding():
    """reference.write_kv_cache into an FP8 cache = the float64 hand rounding of K / k_scale (saturating)."""
    gen = torch.Generator().manual_seed(0)
    T, Hk, D, bs = 9, 2, 16, 4
    k = torch.randn(T, Hk, D, generator=gen) * 300  # past 448 · K_SCALE: saturates
    k[0, 0, :4] = torch.tensor([0.0, 1e-5, -1e4, 448 * K_SCALE])
    v = torch.randn(T, Hk, D, generator=gen)
    k_cache = torch.zeros(3, Hk, bs, D, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    reference.write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    stored = k_cache.permute(0, 2, 1, 3).reshape(-1, Hk, D)[:T].double()
    expected = round_e4m3(k.double() / torch.tensor(K_SCALE, dtype=torch.float32).double())
    # the reference divides in float32: compare against the float64 rounding of that float32 quotient
    expected32 = round_e4m3((k / K_SCALE).double())
    assert torch.equal(stored, expected32)
    assert (stored.abs().max() == 448) and (expected - expected32).abs().max() <= 32  # saturation, one ulp apart
    v_stored = v_cache.permute(0, 2, 1, 3).reshape(-1, Hk, D)[:T].double()
    assert torch.equal(v_stored, round_e4m3((v / V_SCALE).double()))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_kernel_matches_reference(dtype, device):
    gen = torch.Generator(device=device).manual_seed(1)
    T, Hk, D, bs, nb = 11, 3, 32, 4, 6
    qkv = torch.randn(T, 2 * Hk + 1, D, generator=gen, device=device) * 100
    k, v = qkv[:, :Hk].to(dtype), qkv[:, Hk + 1 :].to(dtype)  # strided views, as the model's
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(2))[:T].to(device)
    slots[3] = -1  # a padded row writes nothing
    caches = [torch.full((nb, Hk, bs, D), float("nan"), device=device).to(FP8) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots, k_scale=K_SCALE, v_scale=V_SCALE)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots, k_scale=K_SCALE, v_scale=V_SCALE)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    assert caches[0].float().abs().nan_to_num().max() == 448  # values past 448·k_scale saturated


def fp8_paged_cache(contexts, hk, d, block_size, device, gen, **kw):
    """FP8 caches holding e4m3(K / K_SCALE), e4m3(V / V_SCALE) of N(0, 1) keys and values (NaN elsewhere)."""
    total = sum(contexts)
    kv = torch.randn(2, total, hk, d, generator=gen, device=device)
    kv[0] /= K_SCALE
    kv[1] /= V_SCALE
    k_cache, v_cache, tables = make_paged_cache(contexts, hk, d, block_size, F32, device, gen, kv=kv, **kw)
    return k_cache.to(FP8), v_cache.to(FP8), tables


DECODE_CASES = [  # dtype, block_size, Hq, Hk, D, num_splits, share_prefix blocks, prefix_len (cascade)
    (F32, 16, 8, 2, 32, 1, 0, None),
    (BF16, 3, 8, 2, 64, 3, 0, None),
    (BF16, 16, 4, 4, 32, None, 0, None),
    (BF16, 16, 8, 2, 32, 2, 4, 64),  # cascade: the shared prefix once, the rest per sequence
]


@pytest.mark.parametrize("dtype,block_size,hq,hk,d,splits,shared,prefix", DECODE_CASES)
def test_decode_reads_fp8_cache(dtype, block_size, hq, hk, d, splits, shared, prefix, device):
    gen = torch.Generator(device=device).manual_seed(3)
    contexts = [70, 65, 97] if shared else [37, 1, 0, 100, 16]
    k_cache, v_cache, tables = fp8_paged_cache(contexts, hk, d, block_size, device, gen, share_prefix=shared)
    q = torch.randn(len(contexts), hq, d, generator=gen, device=device).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    cfg = DecodeConfig(64 if prefix is not None else 16, 4, 2, 4, 1)
    p = None if prefix is None else torch.tensor([prefix], dtype=torch.int32, device=device)
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    out = decode_attention_fwd(
        q, k_cache, v_cache, lens, tables, d**-0.5, max(contexts), config=cfg, num_splits=splits, prefix_len=p, **scales
    )
    ref = reference.decode_attention(q.double(), k_cache, v_cache, lens, tables, d**-0.5, **scales)
    assert_close(out, ref, dtype)
    # the scales matter: without them the result is far off
    unscaled = reference.decode_attention(q.double(), k_cache, v_cache, lens, tables, d**-0.5)
    assert (out.double() - unscaled).norm() > 0.5 * unscaled.norm()


@pytest.mark.parametrize("dtype,block_size", [(F32, 5), (BF16, 16)])
def test_prefill_reads_fp8_cache(dtype, block_size, device):
    gen = torch.Generator(device=device).manual_seed(5)
    layout = [(13, 13), (7, 40), (1, 1), (33, 50)]
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = fp8_paged_cache(list(seq_lens), 2, 32, block_size, device, gen)
    q, cu = packed_queries(list(q_lens), 4, 32, dtype, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE}
    out, lse = prefill_attention_fwd(
        q,
        k_cache,
        v_cache,
        cu,
        sl,
        tables,
        32**-0.5,
        max(q_lens),
        config=PrefillConfig(16, 16, 4, 1),
        return_lse=True,
        **scales,
    )
    ref = reference.prefill_attention(q.double(), k_cache, v_cache, cu, sl, tables, 32**-0.5, **scales)
    assert_close(out, ref, dtype)
    # the logsumexp is that of the dequantized keys: log Σ exp(scale · q · K_SCALE · k_fp8)
    s, row = 1, cu[1].item() + 6  # sequence 1's last row: position 39 sees keys 0..39
    k = reference.gather_kv(k_cache, tables[s], 40).double() * K_SCALE  # [40, Hk, D]
    scores = torch.einsum("hd,khd->hk", q[row].double(), k.repeat_interleave(2, dim=1)) * 32**-0.5
    assert torch.allclose(lse[:, row].double(), torch.logsumexp(scores, -1), rtol=1e-3, atol=1e-3)


def test_rejects_bad_scales(device):
    cache = torch.zeros(2, 2, 4, 16, device=device).to(FP8)
    q = torch.zeros(1, 2, 16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention_fwd(q, cache, cache, one, one[None], 0.25, k_scale=0.0)
    with pytest.raises(ValueError, match="scales must be positive"):
        write_kv_cache(q, q, cache, cache, one.long(), v_scale=-1.0)
