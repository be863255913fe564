"""The batch-invariant ops: a row's bits do not depend on the rows around it, on the chunk it sits in, or on
whether it is a prefill or a decode row; and they compute the reference's function (float64 references).

The torch form (kernels/batch_invariant.py) runs everywhere; the Triton form needs CUDA or
TRITON_INTERPRET=1 (the `device` fixture).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_helpers import assert_close, make_paged_cache

from tinyvllm.kernels import batch_invariant, get_ops, reference
from tinyvllm.kernels import invariant_matmul as im
from tinyvllm.kernels.invariant_matmul import matmul_fwd

F32, BF16 = torch.float32, torch.bfloat16


def _rows_alone_equal_batched(linear, x, w, b=None) -> None:
    """Row t of linear(x) is bit-identical to linear(x[t : t + 1]) for every row t."""
    batched = linear(x, w, b)
    for t in range(x.shape[0]):
        alone = linear(x[t : t + 1], w, b)
        assert torch.equal(batched[t : t + 1], alone), (x.shape[0], t)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_invariant_matmul_rows_do_not_depend_on_m(dtype, device):
    """Row i of A @ Wᵀ equals A[i : i + 1] @ Wᵀ bitwise for M across the tile edge (BLOCK_M = 64), with
    and without a bias; and the product is the float64 product rounded."""
    gen = torch.Generator(device=device).manual_seed(0)
    K, N = 96, 160  # K not a multiple of BLOCK_K, N not of BLOCK_N
    w = torch.randn(N, K, generator=gen, device=device).to(dtype)
    bias = torch.randn(N, generator=gen, device=device).to(dtype)
    x_all = torch.randn(70, K, generator=gen, device=device).to(dtype)
    for M in (1, 3, 17, 64, 70):
        x = x_all[:M]
        _rows_alone_equal_batched(matmul_fwd, x, w)
        batched = matmul_fwd(x, w, bias)
        for t in (0, M // 2, M - 1):  # the bias path, at a few rows
            assert torch.equal(batched[t : t + 1], matmul_fwd(x[t : t + 1], w, bias))
        ref = (x.double() @ w.double().T + bias.double()).to(dtype)
        assert_close(batched, ref, dtype)


def test_tile_table_lookup():
    """pick_config: the first rule with M ≤ max_m and N ≤ max_n; float32 always FLOAT32_CONFIG; a custom
    table is used as given; every rule's config shares BLOCK_K and stays on wgmma."""
    table = im.TILE_TABLE
    for M, N in [(1, 2048), (64, 2048), (65, 2048), (64, 128256), (200, 16384), (5000, 2048), (10**6, 10**6)]:
        want = next(r.config for r in table if r.max_m >= M and r.max_n >= N)
        assert im.pick_config(M, N, BF16) == want
        assert im.pick_config(M, N, torch.float16) == want
        assert im.pick_config(M, N, F32) == im.FLOAT32_CONFIG
    assert im.pick_config(1, 2048, BF16).block_n <= 32  # decode: narrow column tiles, many programs
    assert im.pick_config(8192, 2048, BF16).block_m == 128  # prefill: wide tiles
    assert len({c.block_k for c in im.all_configs()}) == 1
    one = (im.TileRule(im.ANY, im.ANY, im.DEFAULT_CONFIG),)
    assert im.pick_config(1, 2048, BF16, one) == im.DEFAULT_CONFIG
    with pytest.raises(ValueError, match="block_k"):
        im.check_table((im.TileRule(im.ANY, im.ANY, im.MatmulConfig(64, 64, 32, 4, 3)),))
    with pytest.raises(ValueError, match="block_m"):
        im.check_config(im.MatmulConfig(32, 64, 64, 4, 3))  # mma.sync, another sum
    with pytest.raises(ValueError, match="num_warps"):
        im.check_config(im.MatmulConfig(64, 64, 64, 2, 3))
    with pytest.raises(ValueError, match="last rule"):
        im.check_table((im.TileRule(64, im.ANY, im.DEFAULT_CONFIG),))
    with pytest.raises(ValueError, match="block_k"):
        matmul_fwd(torch.zeros(1, 8), torch.zeros(8, 8), config=im.MatmulConfig(64, 64, 32, 4, 3))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_every_config_computes_the_product(dtype, device):
    """Every config of the table and of the sweep's candidates computes the float64 product (rounded,
    within the dtype's tolerance), with a bias, at a K that is not a multiple of BLOCK_K and an N that is
    not a multiple of BLOCK_N; and under each config row t has the same bits for every M. (That the bits
    also agree across configs is the tensor cores' property, not the interpreter's, whose dot is numpy's
    matmul: tests/gpu/test_invariant_matmul_gpu.py checks it on the GPU.)"""
    gen = torch.Generator(device=device).manual_seed(3)
    K, N = 136, 72
    w = torch.randn(N, K, generator=gen, device=device).to(dtype)
    bias = torch.randn(N, generator=gen, device=device).to(dtype)
    x = torch.randn(130, K, generator=gen, device=device).to(dtype)
    ref = (x.double() @ w.double().T + bias.double()).to(dtype)
    for config in im.all_configs():
        full = matmul_fwd(x, w, bias, config=config)
        assert_close(full, ref, dtype)
        for M in (1, 3, 65):
            assert torch.equal(matmul_fwd(x[:M], w, bias, config=config), full[:M]), (config, M)


def test_grouped_launch_order_covers_every_tile(device):
    """More row tiles than a launch group (GROUP_M) and a partial last group: every output tile is written
    once (torch.empty is NaN-poisoned in these tests) and holds its product."""
    gen = torch.Generator(device=device).manual_seed(4)
    config = im.MatmulConfig(64, 16, 64, 4, 2)
    M = 64 * (im.GROUP_M + 2) + 5  # two groups, the second of 3 row tiles, the last one partial
    x = torch.randn(M, 24, generator=gen, device=device)
    w = torch.randn(40, 24, generator=gen, device=device)
    out = matmul_fwd(x, w, config=config)
    assert_close(out, x.double() @ w.double().T, F32)


def test_torch_invariant_linear_rows_do_not_depend_on_m():
    """The CPU form: row t of `batch_invariant.linear` is the same bits in every batch (here against the
    float64 product too)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(384, 256, generator=gen)
    x = torch.randn(67, 256, generator=gen)
    _rows_alone_equal_batched(batch_invariant.linear, x, w)
    ref = x.double() @ w.double().T
    assert_close(batch_invariant.linear(x, w), ref, F32)


def _attention_cases(ops, dtype, device, window=None):
    """One sequence of L keys in a scattered paged cache; every row's attention computed (a) as one prefill
    chunk, (b) in chunks cut at several places, (c) as a decode row, and (d) as a row of a decode batch
    with other, longer sequences. Returns {row: [outputs]} and the float64 reference rows."""
    gen = torch.Generator(device=device).manual_seed(2)
    hq, hk, d, bs = 4, 2, 32, 16
    L = 75
    k_cache, v_cache, tables = make_paged_cache([L, 90, 40], hk, d, bs, dtype, device, gen)
    q = torch.randn(L, hq, d, generator=gen, device=device).to(dtype)
    scale = d**-0.5
    i32 = dict(dtype=torch.int32, device=device)
    seen: dict[int, list[torch.Tensor]] = {p: [] for p in range(L)}
    for cuts in ([0, L], [0, 5, 37, 38, L], [0, 16, 64, L], [0, 23, 70, L]):
        for lo, hi in itertools.pairwise(cuts):
            cu = torch.tensor([0, hi - lo], **i32)
            out = ops.prefill_attention(
                q[lo:hi], k_cache, v_cache, cu, torch.tensor([hi], **i32), tables[:1], scale, hi - lo, window=window
            )
            for p in range(lo, hi):
                seen[p].append(out[p - lo])
    for p in (0, 15, 16, 47, L - 1):  # decode rows, alone and in a batch (with a padded, empty row)
        lens = torch.tensor([p + 1], **i32)
        seen[p].append(ops.decode_attention(q[p : p + 1], k_cache, v_cache, lens, tables[:1], scale, window=window)[0])
        qb = torch.stack([torch.randn(hq, d, generator=gen, device=device).to(dtype), q[p], q[p]])
        lens = torch.tensor([90, p + 1, 0], **i32)
        tb = tables[[1, 0, 2]]
        out = ops.decode_attention(qb, k_cache, v_cache, lens, tb, scale, window=window)
        seen[p].append(out[1])
        assert not out[2].any()
    cu = torch.tensor([0, L], **i32)
    ref = reference.prefill_attention(
        q.double(), k_cache.double(), v_cache.double(), cu, torch.tensor([L], **i32), tables[:1], scale, window=window
    )
    return seen, ref


def _check_attention(ops, dtype, device, window=None):
    seen, ref = _attention_cases(ops, dtype, device, window)
    for p, outs in seen.items():
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), p
    assert_close(torch.stack([outs[0] for outs in seen.values()]), ref, dtype)


@pytest.mark.parametrize("window", [None, 20])
def test_torch_invariant_attention_same_bits_in_every_chunk_and_decode(window):
    _check_attention(get_ops("torch", batch_invariant=True), F32, torch.device("cpu"), window)


@pytest.mark.parametrize("dtype,window", [(F32, None), (BF16, None), (F32, 20)])
def test_triton_invariant_attention_same_bits_in_every_chunk_and_decode(dtype, window, device):
    _check_attention(get_ops("triton", batch_invariant=True), dtype, device, window)
