"""Paged split-KV decode vs `reference.decode_attention` (float64): scattered and shared blocks, block
sizes 1/3/16/32, GQA 1/2/4/8, head dims 16..256, zero-length rows, and split counts from one (no
merge) to more splits than tiles (empty splits)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close, make_paged_cache

from tinyvllm.kernels import get_ops, reference
from tinyvllm.kernels.decode_attention import DEFAULT_CONFIG, DecodeConfig, decode_attention_fwd, num_splits_for

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CONTEXTS = [37, 1, 0, 100, 16, 65]  # a zero-length (padded) row among ordinary ones

CASES = [  # dtype, block_size, Hq, Hk, D, BLOCK_N, num_splits (None: the heuristic)
    (F32, 1, 4, 4, 16, 16, None),
    (F32, 3, 8, 4, 32, 16, 1),
    (F32, 16, 8, 2, 64, 32, 3),
    (F32, 5, 16, 2, 128, 16, 50),  # more splits than tiles: empty splits
    (BF16, 1, 32, 4, 64, 32, None),
    (BF16, 3, 4, 4, 128, 16, 4),
    (BF16, 16, 8, 2, 16, 16, 2),  # pages hold whole tiles
    (BF16, 32, 8, 1, 32, 16, None),
    (F16, 16, 8, 4, 64, 64, 1),
    (F32, 16, 4, 2, 256, 16, 2),
]


def run_case(dtype, block_size, hq, hk, d, block_n, splits, contexts, device, seed=0, **kw):
    gen = torch.Generator(device=device).manual_seed(seed)
    k_cache, v_cache, tables = make_paged_cache(contexts, hk, d, block_size, dtype, device, gen, **kw)
    wide = torch.randn(len(contexts), hq + 5, d, generator=gen, device=device).to(dtype)
    q = wide[:, 2 : hq + 2]  # strided, as the model's view of the fused qkv output
    sl = torch.tensor(contexts, dtype=torch.int32, device=device)
    cfg = DecodeConfig(block_n, 4, 2, 4, 1)
    out = decode_attention_fwd(q, k_cache, v_cache, sl, tables, d**-0.5, max(contexts), config=cfg, num_splits=splits)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, d**-0.5)
    return out, ref


@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,block_n,splits",
    CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-d{c[4]}-n{c[5]}-s{c[6]}" for c in CASES],
)
def test_decode_matches_reference(dtype, block_size, hq, hk, d, block_n, splits, device):
    out, ref = run_case(dtype, block_size, hq, hk, d, block_n, splits, CONTEXTS, device)
    assert_close(out, ref, dtype)
    assert torch.all(out[CONTEXTS.index(0)] == 0), "a zero-length row must output zeros"


def test_shared_prefix_blocks(device):
    out, ref = run_case(BF16, 4, 8, 2, 32, 16, None, [40, 33, 21], device, seed=1, share_prefix=5)
    assert_close(out, ref, BF16)


def test_all_rows_empty(device):
    out, _ = run_case(F32, 16, 4, 2, 32, 16, 3, [0, 0], device)
    assert torch.all(out == 0)


def test_ops_table_without_hint(device):
    """As the model calls it, with no max_seq_len hint (planned from the block table's width)."""
    gen = torch.Generator(device=device).manual_seed(2)
    contexts = [300, 17, 129]
    k_cache, v_cache, tables = make_paged_cache(contexts, 2, 64, 16, BF16, device, gen)
    q = torch.randn(3, 8, 64, generator=gen, device=device).to(BF16)
    sl = torch.tensor(contexts, dtype=torch.int32, device=device)
    out = get_ops("triton").decode_attention(q, k_cache, v_cache, sl, tables, 0.125)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, 0.125)
    assert_close(out, ref, BF16)


def test_split_heuristic_fills_the_gpu():
    """Batch 1 at 32k on 132 SMs, 8 KV heads: enough splits for several programs per SM, none empty."""
    splits = num_splits_for(1, 8, 32768, 132)
    assert 8 * splits >= 2 * 132
    tiles = 32768 // DEFAULT_CONFIG.block_n
    assert (splits - 1) * -(-tiles // splits) < tiles  # the last split has work
    assert num_splits_for(256, 8, 512, 132) == 1  # a big batch needs no split


CASCADE_CASES = [  # dtype, block_size, Hq, Hk, D, shared blocks, prefix_len, num_splits, contexts
    (F32, 16, 8, 2, 64, 4, 64, None, [130, 70, 65, 200, 97]),
    (BF16, 16, 8, 2, 64, 4, 64, 3, [130, 70, 65, 200, 97]),
    (F32, 8, 6, 2, 32, 17, 128, 2, [140, 137, 300]),  # group 3: padded to 4 rows per sequence
    (BF16, 16, 32, 8, 64, 8, 64, None, [129, 200, 140] * 7),  # 21 sequences: two chunks of 16
    (F32, 16, 8, 2, 64, 4, 0, None, [130, 70, 65]),  # nothing shared
]


@pytest.mark.parametrize(
    "prefix_splits,prefix_stages,prefix_stream",
    [(1, 0, False), (3, 0, False), (4, 5, False), (4, 0, True)],
    ids=["ps1", "ps3", "ps4-st5", "ps4-stream"],
)
@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,shared,prefix_len,splits,contexts",
    CASCADE_CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-P{c[6]}-s{c[7]}" for c in CASCADE_CASES],
)
def test_cascade_matches_reference(
    dtype,
    block_size,
    hq,
    hk,
    d,
    shared,
    prefix_len,
    splits,
    contexts,
    prefix_splits,
    prefix_stages,
    prefix_stream,
    device,
):
    """Cascade attention (the shared prefix attended once per chunk of sequences, the rest per sequence,
    merged by logsumexp) equals the float64 reference, with a padded zero-length row appended (as a CUDA
    graph's padding is) that must output zeros; with the prefix's tiles split over 3 programs per chunk
    too (one range empty at 2 tiles, none at 1), and over 4 with the prefix loop pipelined 5 deep
    (prefix_stages: the compiled loop differs, the interpreter runs the same arithmetic); with the prefix
    on a stream of its own where there are streams (prefix_stream: on the CPU the prefix still runs, on
    the current stream; tests/kernels/test_gpu_shapes.py checks the fork on CUDA)."""
    gen = torch.Generator(device=device).manual_seed(4)
    k_cache, v_cache, tables = make_paged_cache(contexts, hk, d, block_size, dtype, device, gen, share_prefix=shared)
    tables = torch.cat([tables, tables[:1]])  # the padded row: any table, length 0
    lens = torch.tensor([*contexts, 0], dtype=torch.int32, device=device)
    q = torch.randn(len(contexts) + 1, hq, d, generator=gen, device=device).to(dtype)
    cfg = DecodeConfig(
        64, 4, 2, 4, 1, prefix_splits=prefix_splits, prefix_stages=prefix_stages, prefix_stream=prefix_stream
    )
    p = torch.tensor([prefix_len], dtype=torch.int32, device=device)
    out = decode_attention_fwd(
        q, k_cache, v_cache, lens, tables, d**-0.5, max(contexts), config=cfg, num_splits=splits, prefix_len=p
    )
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), lens, tables, d**-0.5)
    assert_close(out, ref, dtype)
    assert torch.all(out[-1] == 0)


FOLD_CASES = [  # dtype, block_size, Hq, Hk, D, BLOCK_N, num_splits
    (F32, 3, 8, 4, 32, 16, 3),
    (F32, 5, 16, 2, 128, 16, 50),  # more splits than tiles: empty splits; merged in blocks of 16 splits
    (BF16, 16, 32, 8, 64, 32, 7),
    (BF16, 16, 24, 8, 64, 16, 2),  # groups of 3
]


@pytest.mark.parametrize(
    "dtype,block_size,hq,hk,d,block_n,splits",
    FOLD_CASES,
    ids=[f"{str(c[0])[6:]}-bs{c[1]}-g{c[2] // c[3]}-d{c[4]}-s{c[6]}" for c in FOLD_CASES],
)
def test_folded_merge_gives_the_merge_kernels_bits(dtype, block_size, hq, hk, d, block_n, splits, device):
    """`fold_merge`: the last split of each (sequence, KV head) merges in split order with the merge
    kernel's arithmetic, so the output equals the two-launch path's bit for bit (and the reference); the
    tickets are zero again after each launch, so a second launch (a graph replay) gives the same."""
    from tinyvllm.kernels import decode_attention as da

    gen = torch.Generator(device=device).manual_seed(5)
    k_cache, v_cache, tables = make_paged_cache(CONTEXTS, hk, d, block_size, dtype, device, gen)
    q = torch.randn(len(CONTEXTS), hq, d, generator=gen, device=device).to(dtype)
    sl = torch.tensor(CONTEXTS, dtype=torch.int32, device=device)
    plain = DecodeConfig(block_n, 4, 2, 4, 1)
    args = (q, k_cache, v_cache, sl, tables, d**-0.5, max(CONTEXTS))
    want = decode_attention_fwd(*args, config=plain, num_splits=splits)
    got = decode_attention_fwd(*args, config=plain._replace(fold_merge=True), num_splits=splits)
    assert torch.equal(got, want)
    assert int(da._TICKETS[q.device].abs().sum()) == 0
    again = decode_attention_fwd(*args, config=plain._replace(fold_merge=True), num_splits=splits)
    assert torch.equal(again, want)
    ref = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), sl, tables, d**-0.5)
    assert_close(got, ref, dtype)
