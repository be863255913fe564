"""Issue #34's checks, shared by benchmarks/determinism.py and tests/gpu/test_determinism_gpu.py.

A request's *fingerprint* is its token ids, its cumulative logprob and every returned (token, logprob,
rank): two runs are identical when the fingerprints are equal (==, bits). The checks:
  * run to run: the same prompts, one request at a time, through two fresh engines and once more through
    the second after other traffic (default settings; prefix caching off, as the issue measures: a
    prefix-cache hit changes how a prompt is computed, which only `batch_invariant` makes harmless);
  * batch invariance: with `batch_invariant=True`, each prompt alone vs inside a large batch of others.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinyvllm.llm import LLM
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

Fingerprint = tuple[list[int], float | None, list[list[tuple[int, float, int | None]]]]


def fingerprint(out: RequestOutput) -> Fingerprint:
    """The first completion's token ids, cumulative logprob and sorted (token, logprob, rank) per step."""
    o = out.outputs[0]
    steps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in (o.logprobs or [])]
    return list(o.token_ids), o.cumulative_logprob, steps


def prompts(num: int, vocab_size: int, seed: int = 0, min_len: int = 24, max_len: int = 160) -> list[list[int]]:
    """`num` random prompts of min_len..max_len ids in [0, min(vocab, 10000))."""
    rng = random.Random(seed)
    top = min(vocab_size, 10000) - 1
    return [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def params(kind: str, index: int, max_tokens: int, logprobs: int = 2) -> SamplingParams:
    """ "greedy" (temperature 0) or "seeded" (temperature 0.8, top_p 0.95, seed = 1000 + index), with
    logprobs, ignoring EOS so every run produces max_tokens tokens."""
    if kind == "greedy":
        sampling: dict[str, Any] = {"temperature": 0.0}
    elif kind == "seeded":
        sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + index}
    else:
        raise ValueError(f"kind must be 'greedy' or 'seeded', got {kind!r}")
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True, **sampling)


def run_alone(llm: LLM, ps: Sequence[list[int]], kind: str, max_tokens: int) -> list[Fingerprint]:
    """Each prompt as its own generate call (batch 1: the megakernel's path where it is on)."""
    return [
        fingerprint(llm.generate([{"prompt_token_ids": p}], params(kind, i, max_tokens), use_tqdm=False)[0])
        for i, p in enumerate(ps)
    ]


def run_in_batch(
    llm: LLM, ps: Sequence[list[int]], kind: str, max_tokens: int, batch_size: int, seed: int = 1
) -> list[Fingerprint]:
    """The prompts inside one generate call of `batch_size` requests: the others are random prompts with
    random lengths of output (temperature 0.6, unseeded), the prompts at random places among them."""
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(seed)
    others = prompts(max(0, batch_size - len(ps)), vocab, seed=seed)
    slots = sorted(rng.sample(range(len(others) + len(ps)), len(ps)))
    inputs: list[dict] = []
    sps: list[SamplingParams] = []
    it = iter(others)
    mine = dict(zip(slots, range(len(ps))))
    for j in range(len(others) + len(ps)):
        if j in mine:
            i = mine[j]
            inputs.append({"prompt_token_ids": ps[i]})
            sps.append(params(kind, i, max_tokens))
        else:
            inputs.append({"prompt_token_ids": next(it)})
            sps.append(SamplingParams(temperature=0.6, max_tokens=rng.randint(4, 2 * max_tokens), ignore_eos=True))
    outs = llm.generate(inputs, sps, use_tqdm=False)
    return [fingerprint(outs[j]) for j in slots]


def other_traffic(llm: LLM, num: int, max_tokens: int, seed: int = 2) -> None:
    """A batch of unrelated requests (so that the engine's caches, graphs and sampler have moved on)."""
    vocab = llm.llm_engine.model_config.vocab_size
    sp = SamplingParams(temperature=0.7, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts(num, vocab, seed=seed)], sp, use_tqdm=False)


@dataclass
class Comparison:
    """How many of the runs' requests are identical, and where each other one first differs."""

    identical: int
    total: int
    first_divergence: list[dict]  # per differing request: index, first differing token step, what differs

    def as_dict(self) -> dict:
        return {"identical": self.identical, "total": self.total, "first_divergence": self.first_divergence}


def compare(a: Sequence[Fingerprint], b: Sequence[Fingerprint]) -> Comparison:
    """Request by request: identical fingerprints, else the first step whose token or logprobs differ."""
    diverged = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x == y:
            continue
        step = next(
            (
                s
                for s in range(max(len(x[0]), len(y[0])))
                if x[0][s : s + 1] != y[0][s : s + 1] or x[2][s : s + 1] != y[2][s : s + 1]
            ),
            None,
        )
        tokens_differ = x[0] != y[0]
        diverged.append({"request": i, "step": step, "tokens_differ": tokens_differ})
    return Comparison(len(a) - len(diverged), len(a), diverged)
