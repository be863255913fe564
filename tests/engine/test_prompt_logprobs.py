"""prompt_logprobs (vLLM's semantics) against transformers' own model on the same random-weight checkpoint:
each prompt token's logprob is log_softmax of transformers' float32 logits at the position before it
(within 1e-5), its rank and the top-k are transformers' (ties aside), the first entry is None; the same
under chunked prefill, after a prefix-cache hit was possible, under preemption, beside requests that do
not ask (whose outputs do not change), and for n > 1 (scored once). The slicing that bounds the logits
held at once is checked on its own against a float64 reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.helpers import LOGPROB_ATOL, assert_equal_up_to_rounding
from tinyvllm import LLM, SamplingParams
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.sampling.prompt_logprobs import score_rows

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # the bound against transformers, float32
TIE = 1e-5  # two logprobs closer than this may be ordered either way by rounding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_plp")
    # init_std 0.1: a confident model (logit spread of order 1), so ranks and top-k mean something
    write_dummy_checkpoint(path, make_config("tiny"), seed=11, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """prompt ids -> transformers' float32 log_softmax over the prompt's positions [L, V]."""
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf.eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in lengths]


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(model=str(model_dir), device="cpu", dtype="float32", **kwargs)


def as_tuples(entries):
    """Logprob dicts (msgspec Structs) as dicts of (logprob, rank, text) tuples, for
    assert_equal_up_to_rounding."""
    return [None if e is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in entries]


def check_against_hf(prompt_logprobs, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """One request's prompt logprobs against transformers' log_softmax `ref` [L, V] of its prompt `ids`."""
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row, tok = prompt_logprobs[i], ref[i - 1], ids[i]
        assert tok in entry
        assert math.isclose(entry[tok].logprob, row[tok].item(), abs_tol=ATOL), (i, entry[tok], row[tok].item())
        # its rank: 1 + the tokens strictly more likely, unless a token is within rounding of it
        near = ((row - row[tok]).abs() < TIE).sum().item() - 1
        want_rank = int((row > row[tok]).sum().item()) + 1
        assert entry[tok].rank == want_rank or near > 0, (i, entry[tok].rank, want_rank)
        # the rest is the top-k (the prompt token among them when it is one of the k most likely)
        assert len(entry) in (k, k + 1)
        top = [t for t in entry if t != tok or len(entry) == k]
        top.sort(key=lambda t: -entry[t].logprob)
        assert sorted(entry[t].rank for t in top if t != tok) == [r + 1 for r in range(k) if top[r] != tok]
        values, want_ids = row.topk(k) if k else (row[:0], row[:0].long())
        for r, t in enumerate(top):
            assert math.isclose(entry[t].logprob, row[t].item(), abs_tol=ATOL)
            if t != want_ids[r].item():  # another id at this rank: only a tie with it allows that
                assert abs(values[r].item() - row[t].item()) < TIE, (i, r, t, want_ids[r].item())
        assert all(lp.decoded_token is not None for lp in entry.values())


def test_matches_transformers_under_chunked_prefill(model_dir, hf_logprobs):
    """Prompts of 2 to 70 tokens, scored over chunks of at most 16 tokens (several steps each), batched
    together: every entry is transformers' log_softmax, rank and top-3."""
    llm = make_llm(model_dir, max_num_batched_tokens=16)
    ps = prompts([2, 9, 16, 17, 40, 70])
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for p, out in zip(ps, outs):
        check_against_hf(out.prompt_logprobs, p, hf_logprobs(p), 3)


def test_k0_first_entry_none_and_one_token_prompt(model_dir, hf_logprobs):
    """prompt_logprobs=0: each entry holds the prompt token alone; a one-token prompt gives [None]."""
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    ps = prompts([1, 25], seed=3)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    one, long = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert one.prompt_logprobs == [None]
    assert all(len(e) == 1 and next(iter(e)) == t for e, t in zip(long.prompt_logprobs[1:], ps[1][1:]))
    check_against_hf(long.prompt_logprobs, ps[1], hf_logprobs(ps[1]), 0)


def test_requests_that_do_not_ask_are_unchanged(model_dir):
    """Requests without prompt_logprobs, batched with one that asks (chunked, async scheduling too),
    generate what they generate alone; theirs carry no prompt logprobs."""
    ps = prompts([30, 12, 45], seed=5)
    plain = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    asking = plain.replace(prompt_logprobs=4)
    for async_scheduling in (False, True):
        llm = make_llm(model_dir, max_num_batched_tokens=24, async_scheduling=async_scheduling)
        alone = llm.generate([{"prompt_token_ids": p} for p in ps], plain, use_tqdm=False)
        mixed = llm.generate([{"prompt_token_ids": p} for p in ps], [plain, asking, plain], use_tqdm=False)
        for i in (0, 2):
            assert mixed[i].prompt_logprobs is None
            assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
            assert_equal_up_to_rounding(
                as_tuples(mixed[i].outputs[0].logprobs), as_tuples(alone[i].outputs[0].logprobs), LOGPROB_ATOL
            )
        assert mixed[1].outputs[0].token_ids == alone[1].outputs[0].token_ids
        assert len(mixed[1].prompt_logprobs) == len(ps[1])


def test_prefix_cache_is_not_read_for_them(model_dir, hf_logprobs):
    """With prefix caching on, a request that asks after another warmed the cache with its prefix reads
    nothing from it (num_cached_tokens 0) and gets what an engine without caching gives, bit for bit;
    a request that does not ask hits the cache."""
    prefix = prompts([48], seed=7)[0]
    warm, asked = [*prefix, 1, 2, 3], [*prefix, 4, 5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    plain = params.replace(prompt_logprobs=None)
    cached = make_llm(model_dir, max_num_batched_tokens=32, enable_prefix_caching=True, block_size=16)
    cached.generate({"prompt_token_ids": warm}, plain, use_tqdm=False)
    hit = cached.generate({"prompt_token_ids": asked}, plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 48  # the cache holds the prefix: a request that does not ask hits it
    got = cached.generate({"prompt_token_ids": asked}, params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0
    uncached = make_llm(model_dir, max_num_batched_tokens=32, enable_prefix_caching=False, block_size=16)
    want = uncached.generate({"prompt_token_ids": asked}, params, use_tqdm=False)[0]
    assert got.prompt_logprobs == want.prompt_logprobs
    check_against_hf(got.prompt_logprobs, asked, hf_logprobs(asked), 2)


def test_preemption_keeps_them_whole(model_dir, hf_logprobs):
    """A KV cache too small for the batch preempts requests part-way; their prompt logprobs are still
    one entry per prompt token, transformers' values."""
    llm = make_llm(model_dir, num_gpu_blocks_override=12, block_size=8, max_model_len=96, max_num_batched_tokens=32)
    ps = prompts([40, 33, 29, 37], seed=9)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert llm.llm_engine.get_metrics()["num_preemptions"] > 0, "the cache was meant to force preemption"
    for p, out in zip(ps, outs):
        check_against_hf(out.prompt_logprobs, p, hf_logprobs(p), 1)


def test_n_completions_share_one_scoring(model_dir):
    """n = 3 completions carry the same prompt logprobs as n = 1, and the prompt is scored once."""
    llm = make_llm(model_dir, max_num_batched_tokens=64, enable_prefix_caching=True, block_size=16)
    runner = llm.llm_engine.runner
    scored: list[int] = []
    score = runner._score_prompts

    def counting(*args):
        result = score(*args)
        if result is not None:
            scored.append(sum(len(s.targets) for s in result.spans))
        return result

    runner._score_prompts = counting
    p = prompts([37], seed=13)[0]
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=4, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and sum(scored) == len(p) - 1
    single = llm.generate({"prompt_token_ids": p}, params.replace(n=1), use_tqdm=False)[0]
    assert_equal_up_to_rounding(as_tuples(out.prompt_logprobs), as_tuples(single.prompt_logprobs), LOGPROB_ATOL)


def test_bad_values_are_value_errors(model_dir):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("hi", SamplingParams(prompt_logprobs=513), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_slices_bound_the_logits_held_and_match_float64():
    """score_rows never asks the LM head for more than max_rows rows at once, and its logprobs, ranks and
    top-k equal a float64 log_softmax over all rows at once."""
    gen = torch.Generator().manual_seed(0)
    T, H, V, k = 23, 16, 50, 4
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    rows = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 17, 22])
    targets = torch.randint(0, V, (len(rows),), generator=gen)
    asked: list[int] = []

    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        asked.append(h.shape[0])
        return h @ weight.T

    got = score_rows(hidden, rows, targets, k, logits_fn, max_rows=5)
    assert asked == [5, 5, 2]
    ref = torch.log_softmax(hidden[rows].double() @ weight.T.double(), dim=-1)
    chosen = ref.gather(1, targets[:, None])
    torch.testing.assert_close(got.token_logprobs.double(), chosen[:, 0], atol=1e-5, rtol=0)
    assert got.ranks.tolist() == ((ref > chosen).sum(-1) + 1).tolist()
    values, ids = ref.topk(k, dim=-1)
    assert got.top_ids.tolist() == ids.tolist()
    torch.testing.assert_close(got.top_logprobs.double(), values, atol=1e-5, rtol=0)
