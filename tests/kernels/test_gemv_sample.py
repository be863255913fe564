"""gemv_sample_fwd (kernels/gemv.py): the LM head with the greedy/Gumbel sampler as its epilogue must give
the logits `fused_gemv` gives and, for every row, the token `sample_greedy_or_gumbel` draws from those
logits with the same temperature and seed: greedy and tempered rows mixed in one batch, ties across
programs (the lower index wins), vocabularies over more than one of the sampler's 2,048-index noise tiles,
the FMA and tl.dot paths, and launch after launch (the epilogue's keys and counter reset themselves)."""
from __future__ import annotations

import pytest
import torch

from tinyvllm.kernels.gemv import EMPTY_KEY, GemvConfig, _sample_state, fused_gemv_fwd, gemv_sample_fwd
from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

FMA = GemvConfig(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2, use_dot=False)
DOT = GemvConfig(block_n=64, block_k=32, split_k=1, num_warps=4, num_stages=2, use_dot=True)


def lm_head(N: int, K: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(N, K, generator=gen, device=device) / K ** 0.5).to(dtype)
    if N > 2100:
        w[2100] = w[17]  # equal logits at 17 and 2100 (different programs, different noise tiles)
    return w


def check(x, w, temperature, seeds, cfg):
    ids = torch.full((x.shape[0] + 2,), -5, dtype=torch.int64, device=x.device)
    logits = gemv_sample_fwd(x, w, temperature, seeds, ids, config=cfg)
    expected_logits = fused_gemv_fwd(x, w, config=cfg)
    assert torch.equal(logits, expected_logits)
    expected = sample_greedy_or_gumbel(logits, temperature, seeds)
    assert ids[:x.shape[0]].tolist() == expected.tolist()
    assert ids[x.shape[0]:].tolist() == [-5, -5]  # rows past M untouched
    keys, count = _sample_state(x.device)
    assert (keys == EMPTY_KEY.value).all() and int(count) == 0  # ready for the next launch
    return logits, ids[:x.shape[0]]


@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tokens_equal_the_unfused_sampler(dtype, cfg, device):
    N, K = 2200, 48  # two noise tiles, the second partial; N not a multiple of either block
    w = lm_head(N, K, dtype, device, seed=1)
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(5, K, generator=gen, device=device).to(dtype)
    x[1] = 0  # every logit 0: greedy must take index 0
    temperature = torch.tensor([0.0, 0.0, 0.8, 1.5, 0.0], device=device)
    seeds = torch.tensor([3, 4, 5, 6, 7], device=device)
    logits, ids = check(x, w, temperature, seeds, cfg)
    assert ids[1] == 0
    greedy = logits.float().argmax(-1)  # torch's argmax: the first maximum
    assert ids[0] == greedy[0] and ids[4] == greedy[4]


@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_ties_across_programs_take_the_lower_index(cfg, device):
    N, K = 2200, 48
    w = lm_head(N, K, torch.float32, device, seed=3)
    x = w[17:18].clone() * 4  # row 17 (and its copy at 2100) score highest
    temperature = torch.zeros(1, device=device)
    _, ids = check(x, w, temperature, torch.zeros(1, dtype=torch.int64, device=device), cfg)
    assert ids.tolist() == [17]


def test_relaunches_and_every_batch_size(device):
    N, K = 2100, 32
    w = lm_head(N, K, torch.bfloat16, device, seed=4)
    for M in (1, 3, 16, 2):  # growing and shrinking batches on the same keys
        gen = torch.Generator(device=device).manual_seed(M)
        x = torch.randn(M, K, generator=gen, device=device).to(torch.bfloat16)
        temperature = torch.rand(M, generator=gen, device=device) * (torch.arange(M, device=device) % 2)
        seeds = torch.arange(M, device=device) * 1000 + 1
        check(x, w, temperature, seeds, None)


def test_tempered_rows_follow_their_seed(device):
    """Same logits, 64 seeds: the draws spread over the high-probability tokens (not all the argmax),
    and each seed's token is the unfused sampler's."""
    N, K = 300, 16
    w = lm_head(N, K, torch.float32, device, seed=5) * 0.2
    x = torch.ones(16, K, device=device)
    tokens = set()
    for s in range(4):
        seeds = torch.arange(16, device=device) + 16 * s
        _, ids = check(x, w, torch.ones(16, device=device), seeds, DOT)
        tokens.update(ids.tolist())
    assert len(tokens) > 8


def test_argument_errors(device):
    w = torch.randn(40, 8, device=device)
    x = torch.randn(2, 8, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="temperature"):
        gemv_sample_fwd(x, w, torch.zeros(2, dtype=torch.float64, device=device), seeds, ids)
    with pytest.raises(ValueError, match="out_ids"):
        gemv_sample_fwd(x, w, torch.zeros(2, device=device), seeds, ids[:1])
    with pytest.raises(ValueError, match="rows"):
        gemv_sample_fwd(torch.randn(17, 8, device=device), w, torch.zeros(17, device=device),
                        torch.zeros(17, dtype=torch.int64, device=device), torch.zeros(17, dtype=torch.int64,
                                                                                       device=device))
