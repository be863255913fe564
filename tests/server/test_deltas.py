"""Delta outputs: merging consecutive deltas gives the cumulative output; the core's messages survive
the msgpack wire format."""

from __future__ import annotations

import math

import pytest

from tests.helpers import assert_equal_up_to_rounding
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.messages import (
    AddReply,
    CompletionDelta,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    OutputAccumulator,
    RequestDelta,
    RequestTimes,
    encoder,
    output_decoder,
)
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

from .conftest import ENGINE_DEFAULTS

DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))


def _fields(o: CompletionOutput) -> tuple:
    return o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason


def _as_delta(out: RequestOutput) -> RequestDelta:
    completions = [CompletionDelta(*_fields(o)) for o in out.outputs]
    return RequestDelta(out.request_id, out.finished, completions, out.error, out.num_cached_tokens)


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
    stop = None
    if case == "stop-string":  # greedy text of the tiny model: a few odd bytes, then a repeated character
        prompt, params = "The", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        text = _run_both(engine, params, prompt)[0][-1].outputs[0].text
        start = next(i for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
        stop = text[start : start + 2]
        params = params.replace(stop=[stop])
    cumulative, deltas = _run_both(engine, params, prompt)
    assert len(cumulative) == len(deltas) > 1 and deltas[-1].finished
    for k in range(len(deltas)):  # every prefix of the deltas merges into that step's cumulative output
        merged = OutputAccumulator("cum", prompt, deltas[k].prompt_token_ids).extend(map(_as_delta, deltas[: k + 1]))
        merged = merged.output()
        want = cumulative[k]
        assert merged.finished == want.finished and merged.prompt_token_ids == want.prompt_token_ids
        assert_equal_up_to_rounding([_fields(o) for o in merged.outputs], [_fields(o) for o in want.outputs])
    # The finished output against the tokenizer: the text is the decoded ids (cut at the stop string).
    decode = engine.tokenizer.decode
    for o in cumulative[-1].outputs:
        full = decode(o.token_ids)
        if stop is None:
            assert o.text == full and o.finish_reason == "length" and len(o.token_ids) == 24
        else:
            assert o.finish_reason == "stop" and o.stop_reason == stop
            assert o.text == full[: full.index(stop)] and stop not in decode(o.token_ids[:-1])
        if params.logprobs is not None:
            assert len(o.logprobs) == len(o.token_ids)
            total = sum(entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs))
            assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)


def test_merging_keeps_the_latest_finish_and_concatenates_in_order():
    def delta(text: str, ids: list[int], finish: str | None = None, stop: str | None = None) -> RequestDelta:
        return RequestDelta("r", finish is not None, [CompletionDelta(0, text, ids, None, None, finish, stop)])

    out = (
        OutputAccumulator("r", prompt_token_ids=[1, 2])
        .extend([delta("ab", [7]), delta("", [8]), delta("c", [9], "stop", "x")])
        .output()
    )
    assert out.finished and out.request_id == "r" and out.prompt_token_ids == [1, 2]
    assert _fields(out.outputs[0]) == (0, "abc", [7, 8, 9], None, None, "stop", "x")


def test_core_messages_round_trip_through_msgpack():
    """Every field of the core's messages comes back equal: token ids, logprobs (int keys, Logprob
    values), int and str stop reasons, times, errors, replies, stats of ints and floats."""
    lp = [{5: Logprob(-0.25, 1, "a"), 9: Logprob(-1.5, 2, None)}, {7: Logprob(-0.5)}]
    outputs = [
        EngineCoreOutput("r0", [5, 7], 16),
        EngineCoreOutput("r1", [3], 0, 1, "stop", 3, -0.75, lp, RequestTimes(1.0, 2.5, 3.25)),
        EngineCoreOutput("r2", [], None, 0, "stop", "</s>", times=RequestTimes(None, 2.0)),
        EngineCoreOutput("r3", [], finish_reason="error", error="prompt too long"),
    ]
    message = EngineCoreOutputs(
        outputs,
        [AddReply("a"), AddReply("b", 503, "overloaded"), AddReply("c", prompt_token_ids=[1, 2])],
        {"num_requests_running": 3, "kv_cache_usage": 0.5},
        123.5,
    )
    back = output_decoder.decode(encoder.encode(message))
    assert back == message
    assert back.stats["num_requests_running"].__class__ is int and back.outputs[1].stop_reason == 3
    assert output_decoder.decode(encoder.encode(EngineDead("boom"))) == EngineDead("boom")
