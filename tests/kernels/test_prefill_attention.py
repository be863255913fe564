"""FlashAttention-2 prefill over the paged cache vs `reference.prefill_attention` (float64), on small odd
shapes: chunks starting mid-context, lengths off the tile grid, scattered blocks of sizes 1/3/5/16/32,
GQA 1/2/4/8, head dims 16..256, and tile configs small enough to give many tiles per sequence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_helpers import assert_close, make_paged_cache, packed_queries

from tinyvllm.kernels import get_ops, reference
from tinyvllm.kernels.prefill_attention import PrefillConfig, prefill_attention_fwd

# (q_len, seq_len) per sequence: a whole prompt off the tile grid, a chunk in mid-context, a one-token
# prompt, an empty chunk, a long chunk after a prefix-cache hit, a single row deep in its context.
LAYOUT = [(13, 13), (7, 40), (1, 1), (0, 9), (33, 50), (1, 20)]

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [  # dtype, block_size, Hq, Hk, D, (BLOCK_M, BLOCK_N)
    (F32, 1, 4, 4, 16, (16, 16)),
    (F32, 3, 4, 2, 32, (32, 16)),
    (F32, 16, 8, 2, 64, (16, 32)),
    (F32, 5, 8, 1, 128, (16, 16)),
    (BF16, 1, 8, 1, 64, (16, 16)),
    (BF16, 3, 4, 4, 128, (32, 16)),
    (BF16, 16, 4, 2, 16, (16, 16)),  # pages hold whole tiles: one table entry per tile
    (BF16, 32, 8, 2, 32, (16, 16)),  # two tiles per page
    (BF16, 16, 8, 2, 32, (16, 32)),  # two pages per tile
    (F16, 3, 8, 4, 64, (32, 32)),
    (F32, 16, 4, 2, 256, (16, 16)),
]


def run_case(dtype, block_size, hq, hk, d, cfg, layout, device, seed=0, return_lse=False, **kw):
    gen = torch.Generator(device=device).manual_seed(seed)
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), hk, d, block_size, dtype, device, gen, **kw)
    q, cu = packed_queries(list(q_lens), hq, d, dtype, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = d**-0.5
    out, lse = prefill_attention_fwd(
        q, k_cache, v_cache, cu, sl, tables, scale, max(q_lens), return_lse=return_lse, config=cfg
    )
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, scale)
    return out, ref, lse, (q, k_cache, v_cache, cu, sl, tables, scale)


@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,tiles",
    CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-d{c[4]}-m{c[5][0]}n{c[5][1]}" for c in CASES],
)
def test_prefill_matches_reference(dtype, block_size, hq, hk, d, tiles, device):
    cfg = PrefillConfig(tiles[0], tiles[1], 4, 2)
    out, ref, _, _ = run_case(dtype, block_size, hq, hk, d, cfg, LAYOUT, device)
    assert_close(out, ref, dtype)


def test_default_config_and_ops_table(device):
    """The wrapper as the model calls it (default tiles, no max_seqlen_q hint), int64 metadata."""
    gen = torch.Generator(device=device).manual_seed(1)
    layout = [(150, 150), (70, 300), (1, 77)]
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), 2, 64, 16, BF16, device, gen)
    q, cu = packed_queries(list(q_lens), 8, 64, BF16, device, gen)
    sl = torch.tensor(seq_lens, device=device)
    ops = get_ops("triton")
    out = ops.prefill_attention(q, k_cache, v_cache, cu.long(), sl, tables.long(), 0.125)
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, 0.125)
    assert_close(out, ref, BF16)


def test_shared_prefix_blocks(device):
    """Sequences reading the same physical blocks (prefix-cache hits)."""
    out, ref, _, _ = run_case(
        BF16, 4, 4, 2, 32, PrefillConfig(16, 16, 4, 2), [(20, 20), (9, 25), (16, 40)], device, seed=2, share_prefix=3
    )
    assert_close(out, ref, BF16)


def test_logsumexp_output(device):
    out, ref, lse, (q, k_cache, _v_cache, cu, sl, tables, scale) = run_case(
        F32, 3, 4, 2, 32, PrefillConfig(16, 16, 4, 2), LAYOUT, device, seed=3, return_lse=True
    )
    assert_close(out, ref, F32)
    expect = torch.full_like(lse, float("nan"), dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for s, length in enumerate(sl.tolist()):
        lo, hi = cu[s].item(), cu[s + 1].item()
        if hi == lo:
            continue
        k = reference.gather_kv(k_cache, tables[s], length).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * scale
        pos = torch.arange(length - (hi - lo), length, device=device)
        scores = scores.masked_fill(torch.arange(length, device=device)[None, :] > pos[:, None], -math.inf)
        expect[:, lo:hi] = torch.logsumexp(scores, dim=-1)
    assert torch.allclose(lse.double(), expect, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_layouts(data, device):
    """Fresh random layouts, block sizes and tiles each example."""
    n = data.draw(st.integers(1, 4))
    layout = []
    for _ in range(n):
        q_len = data.draw(st.integers(0, 40))
        layout.append((q_len, q_len + data.draw(st.integers(0, 40))))
    if all(q == 0 for q, _ in layout):
        layout[0] = (1, layout[0][1] + 1)
    block_size = data.draw(st.sampled_from([1, 2, 3, 7, 8, 16]))
    hk, group = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 2, 4]))
    tiles = data.draw(st.sampled_from([(16, 16), (32, 16), (16, 32)]))
    dtype = data.draw(st.sampled_from([F32, BF16]))
    out, ref, _, _ = run_case(
        dtype,
        block_size,
        hk * group,
        hk,
        16,
        PrefillConfig(*tiles, 4, 2),
        layout,
        device,
        seed=data.draw(st.integers(0, 2**16)),
    )
    assert_close(out, ref, dtype)


def test_rejects_bad_arguments(device):
    q = torch.zeros(4, 4, 24, device=device)
    cache = torch.zeros(2, 2, 16, 24, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    sl = torch.tensor([4], dtype=torch.int32, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention_fwd(q, cache, cache, cu, sl, bt, 0.1)
    with pytest.raises(TypeError):
        prefill_attention_fwd(q.double()[..., :16], cache[..., :16].double(), cache[..., :16].double(), cu, sl, bt, 0.1)
