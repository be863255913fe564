"""Delta outputs: merging consecutive deltas gives the cumulative output, also through the wire format."""

from __future__ import annotations

import pickle

import pytest

from tests.helpers import assert_equal_up_to_rounding
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.entrypoints.deltas import CompletionDelta, Delta, OutputAccumulator, encode_outputs, merge_deltas
from tinyvllm.outputs import CompletionOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

from .conftest import ENGINE_DEFAULTS

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))


def _fields(o: CompletionOutput) -> tuple:
    return o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason


def _run_both(engine: LLMEngine, params: SamplingParams, prompt: str) -> tuple[list, list]:
    """The same seeded request twice, CUMULATIVE and DELTA, stepped together: each one's outputs.

    They are two rows of the same batches, which a matrix product may round differently (and the second
    may find the first's prompt blocks cached): their logprobs are equal up to rounding only."""
    engine.add_request("cum", prompt, params)
    engine.add_request("delta", prompt, params.replace(output_kind=DELTA))
    cumulative, deltas = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            (cumulative if out.request_id == "cum" else deltas).append(out)
    return cumulative, deltas


@pytest.mark.parametrize("case", ["plain", "n2-logprobs", "stop-string"])
def test_merged_deltas_equal_the_cumulative_output(engine, case):
    prompt = "The quick brown fox"
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    if case == "n2-logprobs":
        params = params.replace(n=2, logprobs=3)
    if case == "stop-string":  # greedy text of the tiny model: a few odd bytes, then a repeated character
        prompt, params = "The", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        text = _run_both(engine, params, prompt)[0][-1].outputs[0].text
        start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
        params = params.replace(stop=[text[start : start + 2]])
    cumulative, deltas = _run_both(engine, params, prompt)
    assert len(cumulative) == len(deltas) > 1 and deltas[-1].finished
    if case == "stop-string":
        assert cumulative[-1].outputs[0].finish_reason == "stop"
    for k in range(len(deltas)):  # every prefix of the deltas merges into that step's cumulative output
        for merged in (
            merge_deltas(deltas[: k + 1]),
            merge_deltas(
                pickle.loads(pickle.dumps(encode_outputs(deltas[: k + 1]))),
                prompt=prompt,
                prompt_token_ids=cumulative[k].prompt_token_ids,
            ),
        ):
            want = cumulative[k]
            assert merged.finished == want.finished and merged.prompt_token_ids == want.prompt_token_ids
            assert_equal_up_to_rounding([_fields(o) for o in merged.outputs], [_fields(o) for o in want.outputs])


def test_merging_keeps_the_latest_finish_and_concatenates_in_order():
    def delta(text: str, ids: list[int], finish: str | None = None, stop: str | None = None) -> Delta:
        return Delta("r", finish is not None, [CompletionDelta(0, text, ids, None, None, finish, stop)])

    out = (
        OutputAccumulator("r", prompt_token_ids=[1, 2])
        .extend([delta("ab", [7]), delta("", [8]), delta("c", [9], "stop", "x")])
        .output()
    )
    assert out.finished and out.request_id == "r" and out.prompt_token_ids == [1, 2]
    assert _fields(out.outputs[0]) == (0, "abc", [7, 8, 9], None, None, "stop", "x")
