"""The SSE fast path: chunks built from templates are byte-identical to `sse(dict)`, and merged
RequestDeltas carry what OutputAccumulator would."""

from __future__ import annotations

import pytest

from tinyvllm.engine.messages import CompletionDelta, OutputAccumulator, RequestDelta, merge_deltas
from tinyvllm.entrypoints.serving import ChunkFormat, chat_choice_json, completion_choice_json, json_str, sse
from tinyvllm.outputs import Logprob

TEXTS = ["", "hello", ' "quoted" \\ back', "naïve ☃ \u2028 \x00 \t\n", "\ud800 lone"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("ending", [(None, None), ("length", None), ("stop", "</s>"), ("stop", 7)])
def test_chunks_match_sse_of_the_dict(include_usage, text, ending):
    head = {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m\u00e9"}
    extra = {"usage": None} if include_usage else {}
    fmt = ChunkFormat(head, include_usage)
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]}
    for logprobs in (None, lp):
        choice = {"index": 3, "text": text, "logprobs": logprobs, "finish_reason": ending[0], "stop_reason": ending[1]}
        assert fmt.chunk(completion_choice_json(3, text, logprobs, *ending)) == sse(
            {**head, "choices": [choice], **extra}
        )
        delta = {"content": text} if text else {}
        choice = {
            "index": 3,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": ending[0],
            "stop_reason": ending[1],
        }
        assert fmt.chunk(chat_choice_json(3, text, logprobs, *ending)) == sse({**head, "choices": [choice], **extra})


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS[1:])
@pytest.mark.parametrize("index", [0, 3, 12])
def test_text_chunks_match_the_general_chunks(include_usage, text, index):
    fmt = ChunkFormat({"id": "x-1", "object": "o", "created": 1, "model": "m\u00e9"}, include_usage)
    head, tail = fmt.text_chunk(index, chat=False)
    assert head + json_str(text) + tail == fmt.chunk(completion_choice_json(index, text, None, None, None))
    head, tail = fmt.text_chunk(index, chat=True)
    assert head + json_str(text) + tail == fmt.chunk(chat_choice_json(index, text, None, None, None))


def _delta(finished, completions, error=None, cached=None) -> RequestDelta:
    return RequestDelta("r", finished, [CompletionDelta(*c) for c in completions], error, cached)


def test_merge_deltas_matches_the_accumulator():
    lp = {1: Logprob(-0.1, 1)}
    deltas = [
        _delta(False, [(1, "b", [5], None, -1.0, None, None), (0, "a", [4], [lp], -0.5, None, None)], cached=3),
        _delta(False, [(0, "c", [6], [lp], -0.7, None, None)]),
        _delta(True, [(0, "", [7], [lp], -0.9, "stop", 7), (1, "d", [8], None, -2.0, "length", None)]),
    ]
    for k in range(1, len(deltas) + 1):
        merged = merge_deltas(deltas[:k])
        want = OutputAccumulator("r").extend(deltas[:k]).output()
        assert merged.request_id == "r" and merged.finished == want.finished
        assert merged.num_cached_tokens == want.num_cached_tokens
        got = [
            (c.index, c.text, list(c.token_ids), c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
            for c in merged.completions
        ]
        assert got == [
            (o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason)
            for o in want.outputs
        ]


def test_merge_deltas_one_completion():
    lp = {1: Logprob(-0.1, 1)}
    deltas = [
        _delta(False, [(0, "a", [4], None, None, None, None)], cached=3),
        _delta(False, [(0, "b", [5, 6], [lp, lp], -0.5, None, None)]),
        _delta(True, [(0, "", [7], [lp], -0.9, "stop", 7)], error="oops"),
    ]
    assert merge_deltas(deltas) == _delta(True, [(0, "ab", [4, 5, 6, 7], [lp, lp, lp], -0.9, "stop", 7)], "oops", 3)


def test_observe_many_equals_repeated_observe():
    from prometheus_client import CollectorRegistry, Histogram

    from tinyvllm.entrypoints.metrics import observe_many

    registry = CollectorRegistry()
    a = Histogram("a", "a", buckets=[0.01, 0.1, 1.0], registry=registry)
    b = Histogram("b", "b", buckets=[0.01, 0.1, 1.0], registry=registry)
    for value, count in [(0.005, 3), (0.05, 1), (0.5, 4), (5.0, 2)]:
        observe_many(a, value, count)
        for _ in range(count):
            b.observe(value)
    samples = {m.name: [(s.name[1:], s.labels, s.value) for s in m.samples] for m in registry.collect()}
    assert [(n, lab, round(v, 9)) for n, lab, v in samples["a"] if n != "_created"] == [
        (n, lab, round(v, 9)) for n, lab, v in samples["b"] if n != "_created"
    ]
