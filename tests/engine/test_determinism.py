"""Issue #34 on the CPU: with `batch_invariant=True` a request's tokens and logprobs are the same bits alone
and inside any batch, under any chunk budget and with or without prefix-cache hits; and an engine gives
the same bits run after run.

The property test draws batches of requests (greedy and seeded sampling, with logprobs; prompts that
share prefixes, so later ones hit the prefix cache) and a chunk budget, runs the batch on an engine with
prefix caching and chunked prefill, and each request alone on an engine without prefix caching whose
budget never chunks: every token id, logprob and cumulative logprob must be identical (==, not close).
The default CPU path is not batch-invariant (torch's CPU product blocks rows by M, so a row's logits
change in the last bits with the batch); benchmarks/determinism.py reports how often that shows.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyvllm import LLM, SamplingParams
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

VOCAB = 512  # the tiny preset's
PREFIXES = [[(17 * i + 5) % 500 for i in range(n)] for n in (9, 14)]  # shared prompt prefixes (block_size 4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_det")
    write_dummy_checkpoint(path, make_config("tiny"), seed=11, init_std=0.1, dtype="float32")
    return path


class Engines:
    """One reference engine (no prefix cache, no chunking) and one batch engine per chunk budget."""

    def __init__(self, model_dir) -> None:
        self.model_dir = str(model_dir)
        self.alone = self._make(budget=256, caching=False)
        self.batched: dict[int, LLM] = {}

    def _make(self, budget: int, caching: bool) -> LLM:
        return LLM(
            model=self.model_dir,
            device="cpu",
            batch_invariant=True,
            block_size=4,
            max_model_len=128,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
        )

    def batch(self, budget: int) -> LLM:
        if budget not in self.batched:
            self.batched[budget] = self._make(budget, caching=True)
        return self.batched[budget]


@pytest.fixture(scope="module")
def engines(model_dir):
    return Engines(model_dir)


def _fingerprint(out):
    """A completion's tokens, cumulative logprob and every (token, logprob, rank): compared with ==."""
    o = out.outputs[0]
    lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in (o.logprobs or [])]
    return o.token_ids, o.cumulative_logprob, lps


request = st.fixed_dictionaries(
    {
        "prefix": st.sampled_from([None, 0, 1]),
        "suffix": st.lists(st.integers(0, VOCAB - 3), min_size=1, max_size=11),
        "seed": st.one_of(st.none(), st.integers(0, 2**31 - 1)),  # None: greedy
        "logprobs": st.integers(0, 3),
        "max_tokens": st.integers(1, 7),
    }
)


def _make(r: dict) -> tuple[list[int], SamplingParams]:
    prompt = (PREFIXES[r["prefix"]] if r["prefix"] is not None else []) + r["suffix"]
    sampling = {"temperature": 0.0} if r["seed"] is None else {"temperature": 0.9, "top_p": 0.95, "seed": r["seed"]}
    params = SamplingParams(max_tokens=r["max_tokens"], logprobs=r["logprobs"], ignore_eos=True, **sampling)
    return prompt, params


@settings(
    max_examples=8,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(request, min_size=2, max_size=5), budget=st.sampled_from([5, 8, 16, 64]))
def test_batch_invariant_requests_alone_equal_batched(engines, batch, budget):
    reqs = [_make(r) for r in batch]
    alone = [_fingerprint(engines.alone.generate([p], sp, use_tqdm=False)[0]) for p, sp in reqs]
    outs = engines.batch(budget).generate(
        [{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False
    )
    for i, (out, want) in enumerate(zip(outs, alone)):
        assert _fingerprint(out) == want, (i, budget, reqs[i])


def test_batch_invariant_is_a_cli_flag():
    """`--batch-invariant` is generated from EngineArgs and reaches the runner's typed config."""
    import argparse

    from tinyvllm.engine.args import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    args = engine_args_from_cli(parser.parse_args(["--batch-invariant"]))
    assert args.batch_invariant and args.runner_config("cpu").batch_invariant
    assert not engine_args_from_cli(parser.parse_args([])).runner_config("cpu").batch_invariant


def test_triton_batch_invariant_engine_alone_equals_batched(model_dir):
    """The Triton ops table's batch-invariant form (CUDA's; here under the interpreter) in the engine: a
    greedy and a seeded request with logprobs, alone and in a batch with a chunk budget of 6 tokens and a
    prefix-cache hit, give the same bits."""
    kw = dict(model=str(model_dir), device="cpu", kernel_backend="triton", batch_invariant=True, block_size=4)
    alone_llm = LLM(**kw, max_model_len=64, enable_prefix_caching=False)
    batch_llm = LLM(**kw, max_model_len=64, max_num_batched_tokens=6)
    prompts = [PREFIXES[0] + [3, 4], PREFIXES[0] + [7], [9, 8, 7, 6, 5, 4, 3]]
    params = [
        SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=4, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    alone = [
        _fingerprint(alone_llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0])
        for p, sp in zip(prompts, params)
    ]
    outs = batch_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [_fingerprint(o) for o in outs] == alone


@pytest.mark.parametrize("fp8", [{"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}], ids=["fp8_kv", "fp8_weights"])
def test_batch_invariant_refuses_fp8(model_dir, fp8):
    """The batch-invariant ops have no FP8 form: asking for both is an error before anything runs."""
    with pytest.raises(ValueError, match="batch_invariant=True runs bf16/float32"):
        LLM(model=str(model_dir), device="cpu", max_model_len=64, batch_invariant=True, **fp8)
