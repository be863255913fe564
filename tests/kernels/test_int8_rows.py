"""The pruned LM head's int8 copy (kernels/int8_rows.py): the packing is lossless, the Triton kernel gives
the torch reference's scales and bytes bit for bit and a slack that covers the copy's error measured
independently in float64, ties round to even as torch.round does, and bad weights are refused."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels.int8_rows import (
    ROUNDING_SLACK,
    pack_rows,
    quantize_rows,
    quantize_rows_reference,
    unpack_rows,
)


def test_packing_is_lossless_and_word_c_holds_columns_c_plus_j_quarters(device):
    q = torch.randint(-127, 128, (5, 16), dtype=torch.int8, device=device)
    packed = pack_rows(q)
    assert torch.equal(unpack_rows(packed), q)
    # byte j of word c is column c + j·K/4, stored as q + 128 (hand-computed for one word)
    u = [int(q[2, c]) + 128 for c in (1, 5, 9, 13)]
    expect = u[0] | u[1] << 8 | u[2] << 16 | u[3] << 24
    assert int(packed[2, 1]) & 0xFFFFFFFF == expect


def _weight(device, dtype, N, K, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(N, K, generator=gen, device=device) / 3).to(dtype)
    w[N // 2] = 0  # a zero row: scale 0, bytes 128, slack 0
    return w


def _covers(w, rows):
    """slack ≥ ‖w − s q‖ + ROUNDING_SLACK ‖w‖, every norm recomputed in float64 from the unpacked bytes."""
    q = unpack_rows(rows.packed).double()
    err = (w.double() - rows.scale.double()[:, None] * q).norm(dim=1)
    assert torch.all(rows.slack.double() >= err + ROUNDING_SLACK * w.double().norm(dim=1))
    K = w.shape[1]
    assert torch.all(err <= 0.5 * rows.scale.double() * K**0.5 * (1 + 1e-6))  # round to nearest: ≤ half a step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize(("N", "K"), [(37, 64), (9, 2100)], ids=["small", "ragged_words"])
def test_kernel_matches_the_reference_and_its_slack_covers_the_error(device, dtype, N, K):
    w = _weight(device, dtype, N, K, seed=N + K)
    ref = quantize_rows_reference(w, chunk_rows=5)  # chunks that do not divide N
    got = quantize_rows(w, block_rows=4, block_c=32)  # rows and words that do not divide the blocks
    assert torch.equal(got.packed, ref.packed)
    assert torch.equal(got.scale, ref.scale)
    torch.testing.assert_close(got.slack, ref.slack, rtol=1e-6, atol=0)  # float64 sums in another order
    _covers(w, got)
    _covers(w, ref)
    z = N // 2
    assert got.scale[z] == 0 and got.slack[z] == 0 and not unpack_rows(got.packed)[z].any()


def test_ties_round_to_even_as_torch_round_does(device):
    # amax 127 gives scale 1 exactly, so w / s lands on the half-integers themselves
    row = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 126.5], device=device)
    w = row[None, :].to(torch.bfloat16)
    got = unpack_rows(quantize_rows(w).packed)[0].tolist()
    assert got == [127, 2, -4, 0, 0, 2, -126, 126]
    assert torch.equal(quantize_rows(w).packed, quantize_rows_reference(w).packed)


def test_bad_weights_are_refused(device):
    w = torch.randn(4, 62, device=device)
    for fn in (quantize_rows, quantize_rows_reference):
        with pytest.raises(ValueError, match="multiple of 4"):
            fn(w)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(torch.randn(64, 8, device=device).t())
