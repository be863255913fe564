"""Helpers shared by the tests.

Comparing what two computations produced
----------------------------------------
Two runs of the same request compute the same float32 sums in another order whenever anything around them
differs: another engine, a prefix-cache hit that chunks the prompt differently, another batch shape,
another row of one matrix product (torch's CPU matmul rounds a row differently at some row counts and
thread counts), another kernel backend, transformers. Their logits then differ in the last bits, so

* floats (logprobs, cumulative logprobs, logits) of two such runs are compared within a tolerance
  (:data:`LOGPROB_ATOL`, :data:`OUTPUTS_ATOL`, :func:`assert_equal_up_to_rounding`);
* greedy token ids are compared exactly only where no choice is close enough to a tie for rounding to
  decide it (:data:`GREEDY_MARGIN`, :func:`assert_greedy_is_decided`, :func:`hf_greedy`);
* seeded samples are compared exactly: the exponential race (engine/sampler.py) changes its pick only when
  the two largest ``p_i / q_i`` of a row are within rounding of each other, relative ~1e-6, i.e. about one
  draw in a million, far rarer than anything else that could fail these tests.

Only runs that repeat the very same kernel calls on the same shapes (two engines built alike and fed the
same requests in the same order) give the same bits, and the tests that rely on it say so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch

# One logprob computed twice with another summation order. A logit of the test models (|logit| ≲ 20, where a
# float32 ulp is ≤ 2e-6) moves by a few ulp, by up to ~2e-5 against transformers for the widest test model
# (hidden size 512, 3 layers), and a logprob by at most twice its largest logit's move. 1e-4 covers that;
# a real error is far larger (the logprob of another position, or after temperature or penalties, is off by
# more than 1e-2).
LOGPROB_ATOL = 1e-4
# Outputs hold cumulative logprobs too: sums of up to 200 logprobs (the largest max_tokens of the tests that
# compare them) on the tiny test model, each off by a few ulp of its logits (< 5e-6), so less than 1e-3 even
# when all the errors share a sign.
OUTPUTS_ATOL = 1e-3
# The smallest gap between the two largest logits at which a greedy choice is decided whatever the rounding:
# two float32 computations of the test models' logits differ by up to ~2e-5 (see LOGPROB_ATOL), which closes
# a gap by at most 4e-5 (both logits moving towards each other), so a gap of 1e-4 stays open.
GREEDY_MARGIN = 1e-4


def record_cascade_prefixes(builder) -> list[int | None]:
    """Wrap a StepInputBuilder's `build` so that every step appends its cascade prefix length (None
    when the step uses no cascade attention) to the returned list."""
    used: list[int | None] = []
    build = builder.build

    def recording_build(*args, **kwargs):
        inputs = build(*args, **kwargs)
        # The host value: on a graph step the device's is written only after `build` returns.
        used.append(inputs.prefix_len or None)
        return inputs

    builder.build = recording_build
    return used


def assert_equal_up_to_rounding(got, want, atol: float = OUTPUTS_ATOL) -> None:
    """Assert ``got == want``, except that their floats may differ by ``atol``.

    Args:
        got: Nested tuples, lists, dicts and dataclasses (outputs, deltas, logprob dicts).
        want: The same structure. Everything but floats (token ids, texts, ranks, finish reasons,
            dict keys) must be equal.
        atol: Absolute tolerance for each float.
    """
    mismatch = _first_mismatch(got, want, atol, "")
    assert mismatch is None, mismatch


def _first_mismatch(got, want, atol: float, path: str) -> str | None:
    if isinstance(got, float) and isinstance(want, float):
        if math.isclose(got, want, rel_tol=0.0, abs_tol=atol):
            return None
        return f"at {path or 'top'}: {got!r} != {want!r} (tolerance {atol})"
    containers = (dict, list, tuple)
    if (isinstance(got, containers) or dataclasses.is_dataclass(got)) and type(got) is not type(want):
        return f"at {path or 'top'}: {got!r} != {want!r}"
    if dataclasses.is_dataclass(got):
        pairs = [(f".{f.name}", getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(got)]
    elif isinstance(got, dict):
        if got.keys() != want.keys():
            return f"at {path or 'top'}: keys {sorted(got)} != {sorted(want)}"
        pairs = [(f"[{k!r}]", got[k], want[k]) for k in got]
    elif isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return f"at {path or 'top'}: length {len(got)} != {len(want)}: {got!r} != {want!r}"
        pairs = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(got, want))]
    else:
        return None if got == want else f"at {path or 'top'}: {got!r} != {want!r}"
    for key, a, b in pairs:
        mismatch = _first_mismatch(a, b, atol, path + key)
        if mismatch is not None:
            return mismatch
    return None


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """The gap between the largest and the second largest value of each row of ``logits`` [..., V]."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def assert_greedy_is_decided(llm, prompts: Sequence, max_tokens: int) -> None:
    """Assert that no greedy choice of these requests is within :data:`GREEDY_MARGIN` of a tie.

    Generates them greedily with ``logprobs=2`` (the two most likely tokens of each step), so that
    a test may then compare the greedy tokens of two computations exactly.

    Args:
        llm: An ``LLM`` of the model under test (any kernel backend: the margin dwarfs their rounding).
        prompts: Prompts in any form ``LLM.generate`` takes.
        max_tokens: The number of tokens the compared runs generate.
    """
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for out in llm.generate(list(prompts), params, use_tqdm=False):
        _assert_decided(out.prompt_token_ids, _logprob_gaps(out.outputs[0].logprobs))


def _logprob_gaps(logprobs: Iterable[dict]) -> list[float]:
    gaps = []
    for step in logprobs:
        first, second = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
        gaps.append(first - second)
    return gaps


def _assert_decided(prompt, gaps: Sequence[float]) -> None:
    close = [(i, gap) for i, gap in enumerate(gaps) if gap < GREEDY_MARGIN]
    assert not close, (
        f"greedy steps (step, top-2 gap) {close} of prompt {prompt!r} are near-ties that float32 rounding may "
        f"decide either way: compare other prompts"
    )


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    """Transformers' own greedy generate of one prompt alone, EOS disabled.

    Returns:
        The generated token ids, which a test may compare with ours exactly.

    Raises:
        AssertionError: A step's two largest logits are within :data:`GREEDY_MARGIN` of each other
            (see :func:`assert_greedy_is_decided`).
    """
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        repetition_penalty=1.0,  # generation_config.json's (Qwen2.5: 1.05) would bend transformers' argmax
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    _assert_decided(prompt, [float(top2_gaps(logits[0])) for logits in out.logits])
    return out.sequences[0, len(prompt) :].tolist()
