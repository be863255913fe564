"""The pruned LM head (kernels/lm_head_bounds.py): its id equals the full product's fused sampler's
(gemv.py `sampling=`), token for token, greedy and Gumbel rows, float32 and bf16, with pass-1 blocks
smaller and larger than the product's; pass 1's bounds contain every logit (checked against the full
product's logits); exact ties keep the lowest index; it keeps few rows when the logits spread as random
weights spread them (the int8 copy itself: test_int8_rows.py)."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels.gemv import GemvConfig, GemvSampling, fused_gemv_fwd
from tinyvllm.kernels.int8_rows import QuantizedRows, quantize_rows
from tinyvllm.kernels.lm_head_bounds import BoundsConfig, sample_pruned, score_bounds

N, K = 2100, 64  # one noise tile of 2,048 and part of a second; blocks that do not divide N
PRODUCT = GemvConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1, use_dot=False)
CONFIGS = [("blocks_8", BoundsConfig(8, 16, 4, 1, 3)), ("blocks_64", BoundsConfig(64, 8, 4, 1, 2))]


def _case(device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, K, generator=gen, device=device).to(dtype)
    w = (torch.randn(N, K, generator=gen, device=device) / 2).to(dtype)
    return x, w


def _ids(x, w, temperature, seed, rows=None, cfg=None, product=PRODUCT):
    dev = x.device
    t = torch.tensor([temperature], dtype=torch.float32, device=dev)
    s = torch.tensor([seed], dtype=torch.int64, device=dev)
    ids = torch.full((1,), -1, dtype=torch.int64, device=dev)
    if rows is None:
        fused_gemv_fwd(x, w, config=product, sampling=GemvSampling(t, s, ids))
    else:
        sample_pruned(x, w, rows, GemvSampling(t, s, ids), cfg, product)
    return ids.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bounds_contain_the_logits(dtype, device):
    x, w = _case(device, dtype, 1)
    cfg = BoundsConfig(16, 8, 4, 1, 2)
    t = torch.zeros(1, device=device)
    s = torch.zeros(1, dtype=torch.int64, device=device)
    hi, lo_max, hi_max, block_n = score_bounds(x, quantize_rows(w), t, s, cfg)  # greedy: score = logit
    logits = fused_gemv_fwd(x, w, config=PRODUCT)[0].float()
    assert torch.all(hi >= logits)
    blocks = torch.nn.functional.pad(logits, (0, lo_max.numel() * block_n - N), value=float("-inf"))
    assert torch.all(lo_max <= blocks.view(-1, block_n).amax(dim=1))
    assert torch.equal(
        hi_max,
        torch.nn.functional.pad(hi, (0, lo_max.numel() * block_n - N), value=float("-inf"))
        .view(-1, block_n)
        .amax(dim=1),
    )
    kept = int((hi >= lo_max.max()).sum())
    assert 1 <= kept <= 20, kept  # random rows of 64: the bounds are ~0.05 logit standard deviations wide


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_pruned_ids_equal_the_full_product(dtype, device):
    x, w = _case(device, dtype, 10)
    rows = quantize_rows(w)
    for temperature, seed in ((0.0, 0), (0.7, 3), (1.9, 11)):
        want = _ids(x, w, temperature, seed)
        for name, cfg in CONFIGS:
            assert _ids(x, w, temperature, seed, rows, cfg) == want, (name, temperature)


def test_exact_ties_keep_the_lowest_index(device):
    x, w = _case(device, torch.bfloat16, 4)
    top = int(fused_gemv_fwd(x, w, config=PRODUCT)[0].float().argmax())
    w[N - 1] = w[top]
    w[2] = w[top]  # the same row three times, in three blocks: the full product's sampler picks index 2
    rows = quantize_rows(w)
    assert _ids(x, w, 0.0, 0) == 2
    for _, cfg in CONFIGS:
        assert _ids(x, w, 0.0, 0, rows, cfg) == 2


def test_a_zero_input_ties_every_row(device):
    """h = 0: every logit is 0, every bound too; nothing is dropped, and the id is the full product's."""
    x, w = _case(device, torch.bfloat16, 5)
    x.zero_()
    rows = quantize_rows(w)
    for temperature in (0.0, 1.0):
        assert _ids(x, w, temperature, 9, rows, CONFIGS[1][1]) == _ids(x, w, temperature, 9)


def test_pruned_sampling_refuses_what_it_cannot_do(device):
    x, w = _case(device, torch.float32, 6)
    rows = quantize_rows(w)
    t = torch.zeros(2, device=device)
    s = torch.zeros(2, dtype=torch.int64, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"sampling.temperature must be \[1\]"):
        sample_pruned(x, w, rows, GemvSampling(t, s, ids))
    with pytest.raises(ValueError, match="do not match"):
        sample_pruned(x, w[:100], rows, GemvSampling(t[:1], s[:1], ids[:1]))
    bad = QuantizedRows(rows.packed.float(), rows.scale, rows.slack)
    with pytest.raises(ValueError, match="int32"):
        score_bounds(x, bad, t[:1], s[:1])


def _masks(logits: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Allowed-token sets [N] bool that move the draw away from where the unmasked logits put it."""
    gen = torch.Generator().manual_seed(seed)
    order = logits.argsort(descending=True)
    half = torch.rand(N, generator=gen) < 0.5
    no_top = torch.ones(N, dtype=torch.bool)
    no_top[order[:64]] = False  # the unmasked favourites gone: the threshold falls, more blocks are kept
    few = torch.zeros(N, dtype=torch.bool)
    few[order[-5:]] = True  # only five of the least likely tokens, in different blocks
    one = torch.zeros(N, dtype=torch.bool)
    one[N - 1] = True  # the last token, in the partial last block
    return {"half": half, "no_top": no_top, "few": few, "one": one}


def _packed(allowed: torch.Tensor, device) -> torch.Tensor:
    from tinyvllm.sampling.bitmask import pack_bitmask

    return torch.from_numpy(pack_bitmask(allowed[None].numpy())).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_masked_pruned_ids_equal_the_masked_full_sampler(dtype, device):
    """Under a bitmask the pruned head draws the id that the fused sampler draws from the full product's
    logits under the same bitmask; greedy rows also equal the masked argmax computed by torch."""
    from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

    x, w = _case(device, dtype, 12)
    rows = quantize_rows(w)
    logits = fused_gemv_fwd(x, w, config=PRODUCT)
    for k, (name, allowed) in enumerate(_masks(logits[0].float().cpu(), 3).items()):
        bitmask = _packed(allowed, device)
        cfg_name, cfg = CONFIGS[k % 2]  # the two block sizes in turn: the interpreter is slow
        for temperature, seed in ((0.0, 0), (1.7, 21)):
            t = torch.tensor([temperature], dtype=torch.float32, device=device)
            s = torch.tensor([seed], dtype=torch.int64, device=device)
            want = int(sample_greedy_or_gumbel(logits, t, s, bitmask=bitmask)[0])
            assert allowed[want], (name, temperature)
            if temperature == 0.0:
                masked = logits[0].float().cpu().masked_fill(~allowed, float("-inf"))
                assert want == int(masked.argmax()), name
            ids = torch.full((1,), -1, dtype=torch.int64, device=device)
            sample_pruned(x, w, rows, GemvSampling(t, s, ids), cfg, PRODUCT, bitmask=bitmask)
            assert int(ids[0]) == want, (name, cfg_name, temperature)


def test_masked_bounds_drop_exactly_the_disallowed_rows(device):
    x, w = _case(device, torch.bfloat16, 13)
    rows = quantize_rows(w)
    cfg = BoundsConfig(16, 8, 4, 1, 2)
    t = torch.zeros(1, device=device)
    s = torch.zeros(1, dtype=torch.int64, device=device)
    allowed = torch.rand(N, generator=torch.Generator().manual_seed(2)) < 0.3
    hi, _, _, _ = score_bounds(x, rows, t, s, cfg)
    hi_m, lo_max_m, hi_max_m, block_n = score_bounds(x, rows, t, s, cfg, bitmask=_packed(allowed, device))
    hi, hi_m = hi.cpu(), hi_m.cpu()
    assert torch.equal(hi_m[allowed], hi[allowed]) and torch.all(hi_m[~allowed] == float("-inf"))
    pad = lo_max_m.numel() * block_n - N
    blocks = torch.nn.functional.pad(hi_m, (0, pad), value=float("-inf")).view(-1, block_n)
    assert torch.equal(hi_max_m.cpu(), blocks.amax(dim=1))
    logits = fused_gemv_fwd(x, w, config=PRODUCT)[0].float().cpu().masked_fill(~allowed, float("-inf"))
    assert float(lo_max_m.max()) <= float(logits.max())  # some allowed row reaches the threshold


def test_masked_pruned_sampling_checks_the_bitmask(device):
    x, w = _case(device, torch.float32, 6)
    rows = quantize_rows(w)
    t = torch.zeros(1, device=device)
    s = torch.zeros(1, dtype=torch.int64, device=device)
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    for bad in (torch.zeros(1, 10, dtype=torch.int32), torch.zeros(1, (N + 31) // 32, dtype=torch.int64)):
        with pytest.raises(ValueError, match="bitmask must be"):
            sample_pruned(x, w, rows, GemvSampling(t, s, ids), bitmask=bad.to(device))
