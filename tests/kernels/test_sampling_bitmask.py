"""The token bitmask (structured outputs) in the fused greedy/Gumbel kernel and in the torch sampler.

References: xgrammar's own CPU `apply_token_bitmask_inplace` for the packed layout, torch's argmax of
the masked logits for greedy rows, and the unmasked kernel over logits with the disallowed tokens set to
-inf for sampled rows (the same Philox noise per index, so the same draw)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyvllm.kernels.sampling import sample_greedy_or_gumbel
from tinyvllm.sampling.bitmask import apply_bitmask_, pack_bitmask, unpack_bitmask
from tinyvllm.sampling.sampler import Sampler
from tinyvllm.sampling.tensors import SamplingRow, SamplingTensors
from tinyvllm.sampling_params import SamplingParams

xgr = pytest.importorskip("xgrammar")


def random_allowed(rows: int, vocab: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    allowed = rng.random((rows, vocab)) < density
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True  # at least one token per row
    return allowed


@pytest.mark.parametrize("vocab", [31, 32, 33, 1000, 4103])
def test_packed_layout_matches_xgrammar(vocab):
    allowed = random_allowed(3, vocab, 0.3, vocab)
    packed = torch.from_numpy(pack_bitmask(allowed))
    assert packed.dtype == torch.int32 and packed.shape == (3, (vocab + 31) // 32)
    assert torch.equal(unpack_bitmask(packed, vocab), torch.from_numpy(allowed))
    logits = torch.randn(3, vocab)
    ours = apply_bitmask_(logits.clone(), packed)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, packed)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("vocab", [1000, 4103, 5000])
def test_fused_kernel_greedy_and_gumbel_under_a_bitmask(device, vocab):
    rows = 6
    torch.manual_seed(vocab)
    logits = torch.randn(rows, vocab, device=device) * 3
    allowed = random_allowed(rows, vocab, 0.05, vocab + 1)
    allowed[5] = True  # an unconstrained row in the same batch: all ones
    bitmask = torch.from_numpy(pack_bitmask(allowed)).to(device)
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.3, 0.9], device=device)
    seeds = torch.arange(rows, device=device, dtype=torch.int64) * 7919 + 3
    masked = apply_bitmask_(logits.clone().float(), bitmask)
    for splits in (1, 3):
        ids = sample_greedy_or_gumbel(logits, temperature, seeds, splits=splits, bitmask=bitmask).cpu()
        reference = sample_greedy_or_gumbel(masked, temperature, seeds, splits=splits).cpu()
        assert ids.tolist() == reference.tolist()
        assert ids[:2].tolist() == masked[:2].argmax(-1).cpu().tolist()
        assert all(allowed[r, ids[r]] for r in range(rows))
        # the all-ones row samples exactly what it samples without a bitmask
        alone = sample_greedy_or_gumbel(logits[5:], temperature[5:], seeds[5:], splits=splits).cpu()
        assert ids[5] == alone[0]


def test_fused_kernel_rejects_a_misshapen_bitmask(device):
    logits = torch.randn(2, 100, device=device)
    bad = torch.zeros(2, 3, dtype=torch.int32, device=device)  # needs 4 words
    with pytest.raises(ValueError, match="bitmask"):
        sample_greedy_or_gumbel(logits, torch.zeros(2, device=device), torch.zeros(2, dtype=torch.int64), bitmask=bad)


def test_full_sampler_applies_the_bitmask_before_penalties_and_filters():
    vocab, rows = 300, 4
    torch.manual_seed(1)
    logits = torch.randn(rows, vocab) * 2
    allowed = random_allowed(rows, vocab, 0.1, 5)
    bitmask = torch.from_numpy(pack_bitmask(allowed))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.5),
    ]
    sampling_rows = [
        SamplingRow(
            params=p, prompt_token_ids=[1, 2], output_token_ids=[3], generator=None, min_tokens_banned_ids=frozenset()
        )
        for p in params
    ]
    tensors = SamplingTensors.from_rows(sampling_rows, vocab, torch.device("cpu"))
    for seed in range(20):
        out = Sampler()(logits, tensors, torch.Generator().manual_seed(seed), bitmask)
        ids = out.sampled_token_ids.tolist()
        assert all(allowed[r, ids[r]] for r in range(rows))
    masked = logits.clone().masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert ids[0] == masked[0].argmax().item()
    # Greedy with a repetition penalty: penalties apply to the masked logits.
    penalised = masked[1].clone()
    for t in (1, 2, 3):
        penalised[t] = penalised[t] / 1.5 if penalised[t] > 0 else penalised[t] * 1.5
    assert ids[1] == penalised.argmax().item()
