"""Sliding-window attention (`window=W`: the query at position p sees keys max(0, p − W + 1)..p).

The torch reference is checked against transformers' own mask function (`sliding_window_causal_mask_function`)
on a dense float64 softmax; the Triton prefill, split-KV decode and cascade kernels against the float64
reference, with windows smaller than, equal to and larger than the context, off the block and tile grids,
chunks starting mid-context, GQA, and split counts from one to more than the window's tiles.

Blocks the KV cache may have freed (every key in them below the window of the sequence's lowest query,
see core.kv_cache_manager) are simulated: their block-table entries point at a NaN block, so a kernel
that reads a single key below the window returns NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_helpers import assert_close, free_below_window, make_paged_cache, packed_queries
from transformers.masking_utils import sliding_window_causal_mask_function

from tinyvllm.kernels import get_ops, reference
from tinyvllm.kernels.decode_attention import DecodeConfig, decode_attention_fwd, num_splits_for
from tinyvllm.kernels.prefill_attention import PrefillConfig, prefill_attention_fwd

F32, BF16 = torch.float32, torch.bfloat16

# (q_len, seq_len): a whole prompt, a chunk deep in its context, a one-token prompt, an empty chunk, a long
# chunk after a prefix hit, one row deep in its context.
LAYOUT = [(13, 13), (7, 40), (1, 1), (0, 9), (33, 50), (1, 20)]


def test_reference_matches_transformers_mask():
    """reference.prefill_attention's window is transformers' sliding-window causal mask: a dense float64
    softmax masked with `sliding_window_causal_mask_function(W)` evaluated at every (query, key) pair."""
    gen = torch.Generator().manual_seed(0)
    hq, hk, d, bs = 4, 2, 16, 3
    contexts = [(11, 11), (5, 23), (1, 9)]
    q_lens, seq_lens = zip(*contexts)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), hk, d, bs, torch.float64, torch.device("cpu"), gen)
    q, cu = packed_queries(list(q_lens), hq, d, torch.float64, torch.device("cpu"), gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    for window in (1, 4, 7, 11, 40):
        mask_fn = sliding_window_causal_mask_function(window)
        out = reference.prefill_attention(q, k_cache, v_cache, cu, sl, tables, 0.3, window=window)
        for s, (q_len, seq_len) in enumerate(contexts):
            k = reference.gather_kv(k_cache, tables[s], seq_len).repeat_interleave(hq // hk, dim=1)
            v = reference.gather_kv(v_cache, tables[s], seq_len).repeat_interleave(hq // hk, dim=1)
            for i in range(q_len):
                p = seq_len - q_len + i
                allowed = mask_fn(torch.tensor(0), torch.tensor(0), torch.tensor(p), torch.arange(seq_len))
                scores = torch.einsum("hd,khd->hk", q[cu[s] + i], k) * 0.3
                probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
                expect = torch.einsum("hk,khd->hd", probs, v)
                torch.testing.assert_close(out[cu[s] + i], expect, rtol=1e-12, atol=1e-12)
        # the decode form: one query at the last position of each context
        qd = q[cu[1:] - 1]
        out_d = reference.decode_attention(qd, k_cache, v_cache, sl, tables, 0.3, window=window)
        torch.testing.assert_close(out_d, out[cu[1:] - 1], rtol=1e-12, atol=1e-12)


def test_triton_prefill_matches_hand_computed_softmax(device):
    """One sequence, window 3, block size 2, a chunk of 5 queries at positions 4..8: each output row is
    the softmax over exactly its 3 keys, written out by hand."""
    gen = torch.Generator(device=device).manual_seed(5)
    k_cache, v_cache, tables = make_paged_cache([9], 1, 16, 2, F32, device, gen)
    q, cu = packed_queries([5], 2, 16, F32, device, gen)
    sl = torch.tensor([9], dtype=torch.int32, device=device)
    free_below_window(tables, [4], 3, 2)  # block 0 (keys 0, 1) is below every query's window
    out, _ = prefill_attention_fwd(
        q, k_cache, v_cache, cu, sl, tables, 0.25, 5, window=3, config=PrefillConfig(16, 16, 4, 2)
    )
    for i, p in enumerate(range(4, 9)):
        for h in range(2):
            keys = [p - 2, p - 1, p]
            kk = torch.stack([k_cache[tables[0, j // 2], 0, j % 2] for j in keys]).double()
            vv = torch.stack([v_cache[tables[0, j // 2], 0, j % 2] for j in keys]).double()
            w = torch.exp((kk @ q[i, h].double()) * 0.25)
            expect = (w[:, None] * vv).sum(0) / w.sum()
            torch.testing.assert_close(out[i, h].double(), expect, rtol=1e-5, atol=1e-6)


PREFILL_CASES = [  # dtype, block_size, Hq, Hk, D, (BLOCK_M, BLOCK_N), window
    (F32, 3, 4, 2, 16, (16, 16), 5),  # window smaller than a tile, off the block grid
    (F32, 16, 8, 2, 32, (16, 32), 20),  # two pages per tile
    (F32, 32, 4, 1, 32, (16, 16), 17),  # pages hold whole tiles (one table entry per tile)
    (F32, 5, 4, 4, 16, (32, 16), 1),  # each row sees only itself
    (BF16, 4, 8, 2, 16, (16, 16), 37),
    (BF16, 7, 4, 2, 64, (32, 32), 50),  # equal to the longest context
    (F32, 16, 4, 2, 16, (16, 16), 1000),  # larger than every context
]


@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,tiles,window",
    PREFILL_CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-m{c[5][0]}n{c[5][1]}-w{c[6]}" for c in PREFILL_CASES],
)
def test_prefill_window_matches_reference(dtype, block_size, hq, hk, d, tiles, window, device):
    gen = torch.Generator(device=device).manual_seed(window)
    q_lens, seq_lens = zip(*LAYOUT)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), hk, d, block_size, dtype, device, gen)
    q, cu = packed_queries(list(q_lens), hq, d, dtype, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    free_below_window(tables, [s - n for n, s in LAYOUT], window, block_size)
    cfg = PrefillConfig(tiles[0], tiles[1], 4, 2)
    out, lse = prefill_attention_fwd(
        q, k_cache, v_cache, cu, sl, tables, d**-0.5, max(q_lens), window=window, config=cfg, return_lse=True
    )
    ref = reference.prefill_attention(
        q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, d**-0.5, window=window
    )
    assert_close(out, ref, dtype)
    assert torch.isfinite(lse[:, : int(cu[-1])]).all()


def test_prefill_window_past_the_context_is_the_causal_kernel(device):
    """A window no query can exceed takes the windowed code path but must give the causal kernel's bits."""
    gen = torch.Generator(device=device).manual_seed(3)
    q_lens, seq_lens = zip(*LAYOUT)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), 2, 16, 3, F32, device, gen)
    q, cu = packed_queries(list(q_lens), 4, 16, F32, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cfg = PrefillConfig(16, 16, 4, 2)
    causal, _ = prefill_attention_fwd(q, k_cache, v_cache, cu, sl, tables, 0.25, 33, config=cfg)
    wide, _ = prefill_attention_fwd(q, k_cache, v_cache, cu, sl, tables, 0.25, 33, window=50, config=cfg)
    rows = int(cu[-1])
    assert torch.equal(causal[:rows], wide[:rows])


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_prefill_window_random_layouts(data, device):
    n = data.draw(st.integers(1, 3))
    layout = []
    for _ in range(n):
        q_len = data.draw(st.integers(0, 40))
        layout.append((q_len, q_len + data.draw(st.integers(0, 40))))
    if all(q == 0 for q, _ in layout):
        layout[0] = (1, layout[0][1] + 1)
    block_size = data.draw(st.sampled_from([1, 3, 8, 16]))
    window = data.draw(st.integers(1, 90))
    tiles = data.draw(st.sampled_from([(16, 16), (32, 16), (16, 32)]))
    gen = torch.Generator(device=device).manual_seed(data.draw(st.integers(0, 2**16)))
    q_lens, seq_lens = zip(*layout)
    k_cache, v_cache, tables = make_paged_cache(list(seq_lens), 2, 16, block_size, F32, device, gen)
    q, cu = packed_queries(list(q_lens), 4, 16, F32, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    free_below_window(tables, [s - n for n, s in layout], window, block_size)
    cfg = PrefillConfig(*tiles, 4, 2)
    out, _ = prefill_attention_fwd(q, k_cache, v_cache, cu, sl, tables, 0.25, max(q_lens), window=window, config=cfg)
    ref = reference.prefill_attention(
        q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, 0.25, window=window
    )
    assert_close(out, ref, F32)


CONTEXTS = [37, 1, 0, 100, 16, 65]  # a zero-length (padded) row among ordinary ones

DECODE_CASES = [  # dtype, block_size, Hq, Hk, D, BLOCK_N, num_splits (None: the heuristic), window
    (F32, 3, 8, 4, 32, 16, 1, 5),  # one split: no merge
    (F32, 16, 8, 2, 32, 32, 3, 20),
    (F32, 5, 4, 2, 16, 16, 12, 17),  # more splits than the window's tiles: empty splits
    (F32, 32, 4, 1, 16, 16, 2, 40),  # pages hold whole tiles
    (F32, 16, 4, 4, 16, 16, None, 1),
    (BF16, 4, 8, 2, 16, 16, 4, 64),
    (F32, 16, 4, 2, 16, 16, 2, 100),  # equal to the longest context
]


def decode_case(dtype, block_size, hq, hk, d, contexts, device, seed, **kw):
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache, v_cache, tables = make_paged_cache(contexts, hk, d, block_size, dtype, device, gen, **kw)
    q = torch.randn(len(contexts), hq + 3, d, generator=gen, device=device).to(dtype)[:, 1 : hq + 1]
    sl = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, sl, tables


@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,block_n,splits,window",
    DECODE_CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-n{c[5]}-s{c[6]}-w{c[7]}" for c in DECODE_CASES],
)
def test_decode_window_matches_reference(dtype, block_size, hq, hk, d, block_n, splits, window, device):
    q, k_cache, v_cache, sl, tables = decode_case(dtype, block_size, hq, hk, d, CONTEXTS, device, window)
    free_below_window(tables, [max(c - 1, 0) for c in CONTEXTS], window, block_size)
    cfg = DecodeConfig(block_n, 4, 2, 4, 1)
    out = decode_attention_fwd(
        q, k_cache, v_cache, sl, tables, d**-0.5, max(CONTEXTS), config=cfg, num_splits=splits, window=window
    )
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, d**-0.5, window=window)
    assert_close(out, ref, dtype)
    assert torch.all(out[CONTEXTS.index(0)] == 0), "a zero-length row must output zeros"


def test_decode_window_past_the_context_is_the_causal_kernel(device):
    q, k_cache, v_cache, sl, tables = decode_case(F32, 3, 8, 2, 16, CONTEXTS, device, 6)
    cfg = DecodeConfig(16, 4, 2, 4, 1)
    causal = decode_attention_fwd(q, k_cache, v_cache, sl, tables, 0.25, 100, config=cfg, num_splits=3)
    wide = decode_attention_fwd(q, k_cache, v_cache, sl, tables, 0.25, 100, config=cfg, num_splits=3, window=100)
    assert torch.equal(causal, wide)


def test_ops_tables_take_the_window(device):
    """As the model calls them: both ops tables, keyword `window`, no launch hints."""
    q_lens, seq_lens = [20, 1], [70, 33]
    gen = torch.Generator(device=device).manual_seed(7)
    k_cache, v_cache, tables = make_paged_cache(seq_lens, 2, 32, 16, BF16, device, gen)
    q, cu = packed_queries(q_lens, 4, 32, BF16, device, gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    free_below_window(tables, [50, 32], 24, 16)
    for name in ("torch", "triton"):
        ops = get_ops(name)
        out = ops.prefill_attention(q, k_cache, v_cache, cu, sl, tables, 0.2, window=24)
        ref = reference.prefill_attention(
            q.double(), k_cache.double(), v_cache.double(), cu, sl, tables, 0.2, window=24
        )
        assert_close(out, ref, BF16)
        qd = q[cu[1:] - 1]
        out = ops.decode_attention(qd, k_cache, v_cache, sl, tables, 0.2, window=24)
        ref = reference.decode_attention(qd.double(), k_cache.double(), v_cache.double(), sl, tables, 0.2, window=24)
        assert_close(out, ref, BF16)


def test_split_heuristic_sizes_for_the_window():
    """Batch 1 at 32k with a 4k window: the splits share the window's tiles, not the context's, and none
    of them is empty (each split of a sequence covers ⌈keys/splits⌉ tiles from the window's first tile)."""
    splits = num_splits_for(1, 8, 32768, 132, window=4096)
    tiles = -(-(4096 + 63) // 64)
    assert splits <= tiles and 8 * splits >= 2 * 132
    assert (splits - 1) * -(-tiles // splits) < tiles
    assert num_splits_for(1, 8, 300, 132, window=4096) == num_splits_for(1, 8, 300, 132)


CASCADE_CASES = [  # dtype, block_size, Hq, Hk, D, shared blocks, prefix_len, num_splits, contexts, window
    (F32, 16, 8, 2, 32, 4, 64, None, [130, 70, 65, 200, 97], 50),  # some windows start inside the prefix
    (F32, 16, 8, 2, 32, 4, 64, 3, [130, 70, 65, 200, 97], 100),
    (F32, 8, 6, 2, 32, 17, 128, 2, [140, 137, 300], 7),  # the prefix lies below every window
    (BF16, 8, 6, 2, 32, 17, 128, 2, [140, 137, 300], 150),
    (F32, 16, 8, 2, 32, 4, 64, 2, [130, 70, 65], 1000),  # the window covers everything
]


@pytest.mark.parametrize("prefix_splits,prefix_stages", [(1, 0), (2, 0), (2, 5)], ids=["ps1", "ps2", "ps2-st5"])
@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,shared,prefix_len,splits,contexts,window",
    CASCADE_CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-P{c[6]}-s{c[7]}-w{c[9]}" for c in CASCADE_CASES],
)
def test_cascade_window_matches_reference(
    dtype, block_size, hq, hk, d, shared, prefix_len, splits, contexts, window, prefix_splits, prefix_stages, device
):
    """Cascade attention with a window: each row reads only the prefix keys inside its own window, and
    the shared blocks that every row's window has left hold NaN (freed and reused); with the prefix's
    tiles split over two programs per chunk too (the masked and unmasked tiles cut between them), also
    with the prefix loop pipelined 5 deep (prefix_stages)."""
    gen = torch.Generator(device=device).manual_seed(4)
    k_cache, v_cache, tables = make_paged_cache(contexts, hk, d, block_size, dtype, device, gen, share_prefix=shared)
    # A shared block goes back to the pool only when every sequence holding it has freed it.
    gone = min(max(0, c - window) // block_size for c in contexts)
    k_cache[tables[0, :gone].long()] = float("nan")
    v_cache[tables[0, :gone].long()] = float("nan")
    for s, c in enumerate(contexts):  # a sequence's own blocks below its window: freed
        own = max(0, c - window) // block_size
        if own > shared:
            k_cache[tables[s, shared:own].long()] = float("nan")
            v_cache[tables[s, shared:own].long()] = float("nan")
    tables = torch.cat([tables, tables[:1]])  # a padded row: any table, length 0
    lens = torch.tensor([*contexts, 0], dtype=torch.int32, device=device)
    q = torch.randn(len(contexts) + 1, hq, d, generator=gen, device=device).to(dtype)
    p = torch.tensor([prefix_len], dtype=torch.int32, device=device)
    cfg = DecodeConfig(64, 4, 2, 4, 1, prefix_splits=prefix_splits, prefix_stages=prefix_stages)
    out = decode_attention_fwd(
        q,
        k_cache,
        v_cache,
        lens,
        tables,
        d**-0.5,
        max(contexts),
        config=cfg,
        num_splits=splits,
        prefix_len=p,
        window=window,
    )
    ref = reference.decode_attention(
        q.double(), k_cache.double(), v_cache.double(), lens, tables, d**-0.5, window=window
    )
    assert_close(out, ref, dtype)
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-3, ValueError), (True, TypeError), (2.5, TypeError)])
def test_rejects_bad_windows(bad, exc, device):
    q = torch.zeros(2, 2, 16, device=device)
    cache = torch.zeros(2, 1, 4, 16, device=device)
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    sl = torch.tensor([2], dtype=torch.int32, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    for ops in (reference, get_ops("triton")):
        with pytest.raises(exc, match="window"):
            ops.prefill_attention(q, cache, cache, cu, sl, bt, 0.1, window=bad)
        with pytest.raises(exc, match="window"):
            ops.decode_attention(q[:1], cache, cache, sl, bt, 0.1, window=bad)
