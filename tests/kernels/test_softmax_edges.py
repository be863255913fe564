"""Softmax edge cases through the attention kernels, with K crafted so that scale·q·k_j equals a chosen
score row s: q = e₀, k_j = (s_j / scale)·e₀. Decode sees the whole row; the prefill rows of a chunk
ending at the row's end see its prefixes (the last row sees all of it).

Rows: tiny-vllm's stress rows (ordinary; all maxima tied; one spike of 50 among 0.001s; all
negative) at length 16 and at a few thousand keys; scores near 1e4, whose exponentials overflow
float32 unless the running max is subtracted first; and zero-length decode rows."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import TOL, assert_close, make_paged_cache

from tinyvllm.kernels import reference
from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd
from tinyvllm.kernels.prefill_attention import PrefillConfig, prefill_attention_fwd

D, HQ, HK = 16, 4, 2
SCALE = D**-0.5


def score_row(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "ordinary":
        return torch.randn(n, generator=gen, dtype=torch.float64)
    if kind == "all_tied":
        return torch.full((n,), 3.0, dtype=torch.float64)
    if kind == "some_tied":
        s = torch.randn(n, generator=gen, dtype=torch.float64)
        s[torch.randperm(n, generator=gen)[:4]] = s.max() + 1
        return s
    if kind == "spike":
        s = torch.full((n,), 0.001, dtype=torch.float64)
        s[torch.randint(0, n, (1,), generator=gen)] = 50.0
        return s
    if kind == "all_negative":
        return -(torch.rand(n, generator=gen, dtype=torch.float64) * 100 + 1)
    if kind == "overflow":  # exp(1e4) is inf in float32: only max-subtraction keeps this finite
        return 1e4 + 3 * torch.randn(n, generator=gen, dtype=torch.float64)
    raise ValueError(kind)


def crafted(kind, n, dtype, device, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = score_row(kind, n, gen)
    kv = torch.zeros(2, n, HK, D, dtype=torch.float64)
    kv[0, :, :, 0] = (s / SCALE)[:, None]
    kv[1] = torch.randn(n, HK, D, generator=gen, dtype=torch.float64)
    k_cache, v_cache, tables = make_paged_cache(
        [n], HK, D, block_size, dtype, device, torch.Generator(device=device).manual_seed(seed), kv=kv
    )
    return k_cache, v_cache, tables


def tolerance(kind, dtype):
    # Scores near 1e4 carry an absolute float32 rounding error of ~1e4·2⁻²⁴·log2(e) ≈ 1e-3 once scaled
    # (before the max is subtracted), which exp turns into ~1e-3 relative error in the weights.
    return max(TOL[dtype], 3e-3) if kind == "overflow" else TOL[dtype]


KINDS = ["ordinary", "all_tied", "some_tied", "spike", "all_negative", "overflow"]
LONG_KINDS = ["ordinary", "spike", "all_negative", "overflow"]  # ties are about the pattern, not length
DECODE_ROWS = [(k, 16) for k in KINDS] + [(k, 3000) for k in LONG_KINDS]
PREFILL_ROWS = [(k, 16) for k in KINDS] + [(k, 2000) for k in LONG_KINDS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind,n", DECODE_ROWS)
def test_decode_rows(kind, n, dtype, device):
    k_cache, v_cache, tables = crafted(kind, n, dtype, device)
    q = torch.zeros(1, HQ, D, dtype=dtype, device=device)
    q[..., 0] = 1
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    out = decode_attention_fwd(q, k_cache, v_cache, sl, tables, SCALE, n, config=DecodeConfig(64, 4, 2, 4, 1))
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, SCALE)
    assert_close(out, ref, dtype, factor=tolerance(kind, dtype) / TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind,n", PREFILL_ROWS)
def test_prefill_rows(kind, n, dtype, device):
    k_cache, v_cache, tables = crafted(kind, n, dtype, device, block_size=3, seed=1)
    q_len = 16 if n == 16 else 5
    q = torch.zeros(q_len, HQ, D, dtype=dtype, device=device)
    q[..., 0] = 1
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    out, _ = prefill_attention_fwd(
        q, k_cache, v_cache, cu, sl, tables, SCALE, q_len, config=PrefillConfig(16, 64, 4, 2)
    )
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, SCALE)
    assert_close(out, ref, dtype, factor=tolerance(kind, dtype) / TOL[dtype])


def test_all_tied_is_the_mean(device):
    """Equal scores: every key weighs 1/n, so the output is the plain mean of V."""
    n = 40
    k_cache, v_cache, tables = crafted("all_tied", n, torch.float32, device)
    q = torch.zeros(1, HQ, D, device=device)
    q[..., 0] = 1
    sl = torch.tensor([n], dtype=torch.int32, device=device)
    out = decode_attention_fwd(q, k_cache, v_cache, sl, tables, SCALE, n)
    mean = reference.gather_kv(v_cache, tables[0], n).double().mean(0)  # [HK, D]
    assert torch.allclose(out[0].double(), mean.repeat_interleave(HQ // HK, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("splits", [1, 4])
def test_zero_length_rows_are_zero_not_nan(splits, device):
    k_cache, v_cache, tables = crafted("ordinary", 20, torch.float32, device)
    q = torch.randn(3, HQ, D, device=device)
    tables = tables.expand(3, -1).contiguous()
    sl = torch.tensor([0, 20, 0], dtype=torch.int32, device=device)
    out = decode_attention_fwd(q, k_cache, v_cache, sl, tables, SCALE, 20, num_splits=splits)
    assert torch.isfinite(out).all()
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, SCALE)
    assert_close(out, ref, torch.float32)
