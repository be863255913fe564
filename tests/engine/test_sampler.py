"""Sampler: greedy, seeds, filters, penalties, min_tokens and logprobs against independent references.

Distribution tests draw N rows of one hand-built distribution in one batch and compare
the counts with the reference distribution (a float64 computation written here, by
descending sort and running sums, independently of the sampler's thresholds):
excluded tokens must never appear, and Pearson's chi-square statistic over the allowed
tokens must stay below its 0.999 quantile for K - 1 degrees of freedom (a sampler right
by construction fails this 1 time in 1000 per fixed seed; the seeds are fixed, so the
test is deterministic).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tinyvllm.sampling.sampler import Sampler, apply_penalties, apply_top_k_top_p
from tinyvllm.sampling.tensors import SamplingRow, SamplingTensors, make_generator
from tinyvllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Upper 0.999 quantiles of chi-square with df = 1..7 degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

# A hand-built distribution over 8 tokens, placed at shuffled vocabulary positions so that
# the sorted order differs from the index order.
BASE_PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.08, 0.04, 0.02, 0.01], dtype=torch.float64)
PERM = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
PROBS = torch.empty(8, dtype=torch.float64).scatter_(0, PERM, BASE_PROBS)  # PROBS[PERM[i]] = BASE_PROBS[i]


def sample(rows, logits, seed=0):
    tensors = SamplingTensors.from_rows(rows, logits.shape[1], logits.device)
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    return Sampler()(logits, tensors, gen)


def reference_distribution(probs, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """float64: temperature, then top-k, top-p (smallest prefix of the descending order whose
    mass reaches top_p), min-p, renormalised."""
    p = probs ** (1.0 / temperature)
    p = p / p.sum()
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    keep = order[:top_k] if top_k > 0 else order
    mass = sum(float(p[i]) for i in keep)
    kept, running = [], 0.0
    for i in keep:
        kept.append(i)
        running += float(p[i]) / mass
        if running >= top_p:
            break
    pmax = float(p[kept[0]])
    kept = [i for i in kept if float(p[i]) >= min_p * pmax]
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


def assert_matches_distribution(samples, expected, vocab_size):
    counts = torch.bincount(samples, minlength=vocab_size).double()
    n = counts.sum()
    excluded = expected == 0
    assert counts[excluded].sum() == 0, f"excluded tokens drawn: {counts[excluded]}"
    allowed = ~excluded
    exp_counts = expected[allowed] * n
    chi2 = float(((counts[allowed] - exp_counts) ** 2 / exp_counts).sum())
    df = int(allowed.sum()) - 1
    if df == 0:
        return
    assert chi2 < CHI2_999[df], f"chi2={chi2:.2f} for df={df}; counts {counts.tolist()}, expected {exp_counts.tolist()}"


# ------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(7, 1000).to(dtype)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], []) for _ in range(7)]
    out = sample(rows, logits)
    expected = logits.double().argmax(dim=-1)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_are_argmax_and_input_untouched():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=5)] * 3
    rows = [SamplingRow(p, [], []) for p in params]
    out = sample(rows, logits).sampled_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    assert torch.equal(logits, before)


def test_non_contiguous_logits():
    torch.manual_seed(4)
    logits = torch.randn(30, 5).t()  # [5, 30], not contiguous
    p = SamplingParams(temperature=0.0, presence_penalty=1.0, min_tokens=2)
    rows = [SamplingRow(p, [], [int(logits[i].argmax())], min_tokens_banned_ids=frozenset({0})) for i in range(5)]
    out = sample(rows, logits).sampled_token_ids
    ref = logits.clone()
    for i in range(5):
        ref[i, int(logits[i].argmax())] -= 1.0
        ref[i, 0] = float("-inf")
    assert torch.equal(out, ref.argmax(-1))


# ------------------------------------------------------------------------- seeds


def seeded_run(position, batch_size, seed, steps=12, vocab=64):
    """Sample `steps` tokens for one seeded request placed at `position` among others."""
    gen = make_generator(seed, CPU)
    others_gen = make_generator(1234, CPU)
    request = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    logits_gen = torch.Generator().manual_seed(99)
    tokens = []
    for _ in range(steps):
        row_logits = torch.randn(vocab, generator=logits_gen)  # the request's own logits
        logits = torch.randn(batch_size, vocab)  # unrelated rows, fresh each call
        logits[position] = row_logits
        rows = []
        for i in range(batch_size):
            if i == position:
                rows.append(SamplingRow(request, [], tokens[:], gen))
            elif i % 2:
                rows.append(SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [], others_gen))
            else:
                rows.append(SamplingRow(SamplingParams(temperature=1.3, top_k=10), [], []))
        tensors = SamplingTensors.from_rows(rows, vocab, CPU)
        out = Sampler()(logits, tensors, torch.Generator().manual_seed(int(torch.randint(0, 10**6, ()))))
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_seeded_request_reproduces_across_batches_and_positions():
    alone = seeded_run(position=0, batch_size=1, seed=42)
    assert seeded_run(position=0, batch_size=1, seed=42) == alone
    assert seeded_run(position=3, batch_size=5, seed=42) == alone
    assert seeded_run(position=0, batch_size=8, seed=42) == alone
    assert seeded_run(position=0, batch_size=1, seed=43) != alone  # the seed matters


def test_batch_generator_makes_unseeded_rows_reproducible():
    torch.manual_seed(2)
    logits = torch.randn(32, 100)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range(32)]
    a = sample(rows, logits, seed=5).sampled_token_ids
    b = sample(rows, logits, seed=5).sampled_token_ids
    c = sample(rows, logits, seed=6).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------- filters and temperature

N_DRAWS = 20000


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(temperature=2.0),
        dict(temperature=0.5),
        dict(top_k=3),
        dict(top_k=1),
        dict(top_p=0.7),
        dict(top_p=0.05),
        dict(min_p=0.2),
        dict(top_k=4, top_p=0.6),
        dict(temperature=0.5, top_p=0.7),  # temperature first: keeps 2 tokens, not 3
        dict(temperature=2.0, top_k=6, min_p=0.3),
        dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
    ],
    ids=repr,
)
def test_filters_match_reference_distribution(kwargs):
    logits = PROBS.log().float().expand(N_DRAWS, -1).contiguous()
    rows = [SamplingRow(SamplingParams(**kwargs), [], [])] * N_DRAWS
    out = sample(rows, logits, seed=11).sampled_token_ids
    assert_matches_distribution(out, reference_distribution(PROBS, **kwargs), vocab_size=8)


def test_rows_with_different_filters_in_one_batch():
    configs = [dict(top_k=2), dict(top_p=0.7), dict(min_p=0.2), dict(temperature=0.5)]
    n = 8000
    rows, logits = [], []
    for cfg in configs:
        rows += [SamplingRow(SamplingParams(**cfg), [], [])] * n
    logits = PROBS.log().float().expand(len(rows), -1).contiguous()
    out = sample(rows, logits, seed=3).sampled_token_ids
    for j, cfg in enumerate(configs):
        assert_matches_distribution(out[j * n : (j + 1) * n], reference_distribution(PROBS, **cfg), vocab_size=8)


def test_temperature_sharpens_and_flattens():
    """The exact check is above (chi-square); here the direction, on a two-token case."""
    logits = torch.tensor([[1.0, 0.0]]).expand(N_DRAWS, -1).contiguous()
    for t in (0.25, 1.0, 4.0):
        rows = [SamplingRow(SamplingParams(temperature=t), [], [])] * N_DRAWS
        freq = sample(rows, logits, seed=4).sampled_token_ids.float().mean().item()
        expected = 1.0 / (1.0 + math.exp(1.0 / t))  # P(token 1) = sigmoid(-1/t)
        assert abs(freq - expected) < 4 * math.sqrt(expected * (1 - expected) / N_DRAWS)


def reference_keep_mask(logits, top_k, top_p):
    """float64 top-k then top-p mask, one row at a time, by descending order."""
    masks = []
    for row, k, p in zip(logits.double(), top_k, top_p):
        order = row.argsort(descending=True)
        if 0 < k < row.numel():
            order = order[:k]
        probs = torch.softmax(row[order], dim=0)
        n_keep = int((probs.cumsum(0) < p).sum()) + 1  # smallest prefix reaching p
        mask = torch.zeros(row.numel(), dtype=torch.bool)
        mask[order[: min(n_keep, order.numel())]] = True
        masks.append(mask)
    return torch.stack(masks)


@pytest.mark.parametrize(
    "vocab, top_k, top_p",
    [
        (300, [5, 300, 17, 1], None),  # top-k alone, topk fast path (300 = off)
        (3000, [1500, 2, 3000, 1100], None),  # top-k alone, k above the fast-path limit: sort
        (300, None, [0.5, 1.0, 0.9, 0.01]),
        (300, [40, 300, 7, 100], [0.8, 0.3, 1.0, 0.95]),
    ],
)
def test_top_k_top_p_mask_equals_float64_reference(vocab, top_k, top_p):
    torch.manual_seed(vocab)
    logits = torch.randn(4, vocab) * 3
    k = torch.tensor(top_k) if top_k is not None else None
    p = torch.tensor(top_p, dtype=torch.float32) if top_p is not None else None
    max_k = max((x for x in top_k if x < vocab), default=0) if top_k is not None else 0
    work = logits.clone()
    apply_top_k_top_p(work, k, p, max_k)
    ref = reference_keep_mask(logits, top_k or [0] * 4, top_p or [1.0] * 4)
    kept = work != float("-inf")
    assert torch.equal(kept, ref)
    assert torch.equal(work[kept], logits[kept])  # kept logits are untouched


# ------------------------------------------------------------------------- penalties


def test_penalties_equal_hand_computation():
    # prompt [1, 2], output [2, 3, 3]; repetition 2, frequency 0.5, presence 0.25.
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, -0.5, 3.0], [1.0, 2.0, -1.0, 0.5, -0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [SamplingRow(p, [1, 2], [2, 3, 3]), SamplingRow(SamplingParams(), [1, 2], [2, 3, 3])]
    tensors = SamplingTensors.from_rows(rows, 6, CPU)
    out = apply_penalties(logits.clone(), tensors)
    # token 1: prompt only, 2.0 > 0 -> 2.0 / 2 = 1.0 (no frequency/presence: not in output)
    # token 2: -1.0 <= 0 -> -2.0; output count 1 -> -2.0 - 0.5 - 0.25 = -2.75
    # token 3: 0.5 -> 0.25; output count 2 -> 0.25 - 1.0 - 0.25 = -1.0
    # tokens 0, 4, 5 never seen: unchanged. Row 1 has neutral penalties: unchanged.
    expected = torch.tensor([[1.0, 1.0, -2.75, -1.0, -0.5, 3.0], [1.0, 2.0, -1.0, 0.5, -0.5, 3.0]])
    assert torch.equal(out, expected)


def test_penalty_rows_as_arrays_equal_lists():
    import array

    import numpy as np

    torch.manual_seed(5)
    logits = torch.randn(3, 20)
    p = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=-0.4)
    prompts, outputs = [[1, 2, 2], [], [19]], [[2, 5, 5, 5], [0], []]
    as_lists = [SamplingRow(p, pr, out) for pr, out in zip(prompts, outputs)]
    as_arrays = [
        SamplingRow(p, array.array("q", pr), np.array(out, dtype=np.int64)) for pr, out in zip(prompts, outputs)
    ]
    a = apply_penalties(logits.clone(), SamplingTensors.from_rows(as_lists, 20, CPU))
    b = apply_penalties(logits.clone(), SamplingTensors.from_rows(as_arrays, 20, CPU))
    assert torch.equal(a, b) and not torch.equal(a, logits)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SamplingTensors.from_rows([SamplingRow(p, array.array("q", [20]), [])], 20, CPU)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 4.0, 0.0, 0.0, 0.0, 3.0]])
    plain = sample([SamplingRow(SamplingParams(temperature=0.0), [1], [])], logits).sampled_token_ids
    penalised = sample(
        [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1], [])], logits
    ).sampled_token_ids
    assert plain.tolist() == [1] and penalised.tolist() == [5]  # 4.0 / 2 = 2.0 < 3.0


def test_frequency_penalty_counts_in_long_output():
    logits = torch.zeros(1, 4)
    rows = [SamplingRow(SamplingParams(frequency_penalty=0.5), [], [3] * 7 + [1])]
    out = apply_penalties(logits.clone(), SamplingTensors.from_rows(rows, 4, CPU))
    assert torch.equal(out, torch.tensor([[0.0, -0.5, 0.0, -3.5]]))


# ------------------------------------------------------------------------- min_tokens

EOS = 3


@pytest.mark.parametrize("n_output, banned", [(0, True), (2, True), (3, False), (5, False)])
def test_min_tokens_bans_eos_until_reached(n_output, banned):
    logits = torch.tensor([[0.0, 1.0, 2.0, 10.0, 0.5]])  # EOS overwhelmingly likely
    p = SamplingParams(temperature=0.0, min_tokens=3)
    row = SamplingRow(p, [0], [1] * n_output, min_tokens_banned_ids=frozenset({EOS}))
    token = sample([row], logits).sampled_token_ids.item()
    assert (token != EOS) if banned else (token == EOS)


def test_min_tokens_bans_stop_ids_in_random_rows_only_for_their_row():
    n = 4000
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0]]).expand(2 * n, -1).contiguous()
    p = SamplingParams(min_tokens=2)
    ban = frozenset({EOS, 4})
    rows = [SamplingRow(p, [], [], min_tokens_banned_ids=ban)] * n + [SamplingRow(p, [], [1, 1])] * n
    out = sample(rows, logits, seed=8).sampled_token_ids
    assert not torch.isin(out[:n], torch.tensor([EOS, 4])).any()
    expected = reference_distribution(torch.tensor([1.0, math.e, math.e**2, 0.0, 0.0], dtype=torch.float64))
    assert_matches_distribution(out[:n], expected, vocab_size=5)
    assert torch.isin(out[n:], torch.tensor([EOS, 4])).float().mean() > 0.5  # not banned there


# ------------------------------------------------------------------------- logprobs


def test_logprobs_and_ranks_equal_float64_reference():
    torch.manual_seed(3)
    V = 40
    logits = (torch.randn(5, V) * 2).to(torch.bfloat16)  # bf16: ties exist, ranks must handle them
    params = [
        SamplingParams(logprobs=3, temperature=0.0),
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.5, repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(logprobs=5, top_k=10),
        SamplingParams(logprobs=2, temperature=2.0),
    ]
    rows = [SamplingRow(p, [0, 1, 2], [5, 6]) for p in params]
    out = sample(rows, logits, seed=1)
    lp = out.logprobs
    assert lp is not None and lp.logprob_token_ids.shape == (5, 6) and lp.logprobs.shape == (5, 6)
    ref = torch.log_softmax(logits.double(), dim=-1)  # raw: no penalty, no temperature
    sampled = out.sampled_token_ids
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    for i in range(5):
        ref_sampled = ref[i, sampled[i]]
        assert lp.selected_token_ranks[i].item() == 1 + int((ref[i] > ref_sampled).sum())
        torch.testing.assert_close(lp.logprobs[i].double(), ref[i, lp.logprob_token_ids[i]], atol=1e-5, rtol=0)
        top_ref = ref[i].topk(5).values
        torch.testing.assert_close(lp.logprobs[i, 1:].double(), top_ref, atol=1e-5, rtol=0)
    assert lp.selected_token_ranks[0].item() == 1  # greedy without penalty: the top token
    lists = lp.to_lists([p.logprobs for p in params])
    assert lists[1] is None and len(lists[2][0]) == 1 and len(lists[3][0]) == 6 and len(lists[4][1]) == 3
    assert lists[0][0][0] == sampled[0].item() and lists[0][2] == 1


# ------------------------------------------------------------------------- contract


def test_from_rows_builds_only_what_is_used():
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3])] * 3
    t = SamplingTensors.from_rows(rows, 10, CPU)
    assert t.all_greedy and not t.all_random
    for name in ("is_greedy", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "frequency_penalty", "prompt_mask", "output_counts", "min_tokens_ban"):  # fmt: skip
        assert getattr(t, name) is None, name
    t = SamplingTensors.from_rows([SamplingRow(SamplingParams(top_k=10), [], [])], 10, CPU)
    assert t.top_k is None and t.all_random and t.temperature is not None  # top_k >= V is no filter


def test_bad_rows_raise_value_errors():
    with pytest.raises(ValueError, match="generator"):
        SamplingTensors.from_rows([SamplingRow(SamplingParams(seed=1), [], [])], 10, CPU)
    with pytest.raises(ValueError, match="output_token_ids"):
        SamplingTensors.from_rows([SamplingRow(SamplingParams(presence_penalty=1.0), [], [10])], 10, CPU)
    with pytest.raises(ValueError, match="min_tokens_banned_ids"):
        row = SamplingRow(SamplingParams(min_tokens=1), [], [], min_tokens_banned_ids=frozenset({12}))
        SamplingTensors.from_rows([row], 10, CPU)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingTensors.from_rows([SamplingRow(SamplingParams(logprobs=11), [], [])], 10, CPU)
    with pytest.raises(ValueError, match="empty"):
        SamplingTensors.from_rows([], 10, CPU)
    t = SamplingTensors.from_rows([SamplingRow(SamplingParams(), [], [])] * 2, 10, CPU)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(2, 11), t)


# ------------------------------------------------------------------------- extreme scales


def test_huge_temperature_samples_uniformly_over_the_tokens_not_banned():
    """T = 1e308 does not fit float32; the limit of softmax(l / T) as T grows is uniform over the tokens
    whose logit is finite. Tokens 0 and 5 are banned by min_tokens (-inf): before the clamp they became
    NaN (-inf / inf). The logits differ by e^15, so a finite small T would be far from uniform."""
    n = 6000
    logits = torch.tensor([[0.0, 10.0, -5.0, 3.0, 1.0, 8.0]]).expand(n, -1).contiguous()
    p = SamplingParams(temperature=1e308, min_tokens=5)
    rows = [SamplingRow(p, [], [], min_tokens_banned_ids=frozenset({0, 5}))] * n
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sample(rows, logits, seed=5).sampled_token_ids
    expected = torch.tensor([0, 1, 1, 1, 1, 0], dtype=torch.float64) / 4
    assert_matches_distribution(out, expected, vocab_size=6)


@pytest.mark.parametrize(
    "penalty, expected",
    [
        # Seen tokens 0 (logit 2), 1 (-1) and 2 (0); token 3 (logit 3) is unseen.
        (1e308, [2e-20, -1e20, 0.0, 3.0]),  # positive / 1e20, negative * 1e20, zero stays 0 (not 0 * inf)
        (1e-300, [2e20, -1e-20, 0.0, 3.0]),  # positive / 1e-20 (not / 0)
    ],
)
def test_extreme_repetition_penalty_is_computed_at_its_float32_bound(penalty, expected):
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0]])
    rows = [SamplingRow(SamplingParams(repetition_penalty=penalty), [0, 2], [1])]
    out = apply_penalties(logits.clone(), SamplingTensors.from_rows(rows, 4, CPU))
    assert torch.equal(out, torch.tensor([expected], dtype=torch.float32))


def test_tiny_repetition_penalty_draws_the_largest_seen_token():
    """r -> 0 sends the seen positive logits to +inf in proportion: l = 2 beats l = 1 with probability 1.
    With r = 1e-300 as float32 (0) both were inf and the softmax NaN (whose argmax is token 0)."""
    n = 500
    logits = torch.tensor([[1.0, 2.0, 0.0, 3.0]]).expand(n, -1).contiguous()
    rows = [SamplingRow(SamplingParams(repetition_penalty=1e-300), [0, 1], [])] * n
    out = sample(rows, logits, seed=2).sampled_token_ids
    assert out.tolist() == [1] * n
