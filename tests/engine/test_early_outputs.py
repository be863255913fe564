"""`core_step(early)`: with async scheduling, a step with constrained rows processes the in-flight step
inside its own launch and hands those outputs to `early` there (LLMEngine.step runs the output
processing in that window). The outputs must be those of the same engine without the hand-off."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

pytest.importorskip("xgrammar")

SCHEMA = {"type": "array", "minItems": 3, "maxItems": 6, "items": {"type": "integer", "minimum": 0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-early")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


def _requests():
    prompts = [f"item {i}:" for i in range(6)]
    params = [
        SamplingParams(temperature=1.0, seed=10 + i, max_tokens=24, structured_outputs=SO(json=SCHEMA))
        if i % 2 == 0
        else SamplingParams(temperature=0.8, seed=10 + i, max_tokens=12 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


def _run(model_dir, monkeypatch, hand_off: bool):
    calls = []
    core_step = LLMEngine.core_step

    def spy(self, early=None):
        if not hand_off:
            return core_step(self)  # the outputs all come back from core_step

        def counted(outputs):
            calls.append(len(outputs))
            early(outputs)

        return core_step(self, counted if early is not None else None)

    monkeypatch.setattr(LLMEngine, "core_step", spy)
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=6, async_scheduling=True)
    prompts, params = _requests()
    steps = []  # every step's RequestOutputs, by request: the stream a caller of step() sees
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.llm_engine.add_request(str(i), prompt, p)
    while llm.llm_engine.has_unfinished_requests():
        steps.append(llm.llm_engine.step())
    monkeypatch.undo()
    return steps, calls


def test_early_outputs_are_the_outputs_without_the_hand_off(model_dir, monkeypatch):
    with_early, calls = _run(model_dir, monkeypatch, hand_off=True)
    without, _ = _run(model_dir, monkeypatch, hand_off=False)
    assert calls and sum(calls) > 0, "no step handed outputs over early: the test does not exercise the path"

    def final(steps):
        last = {}
        for outs in steps:
            for o in outs:
                last[o.request_id] = o
        return last

    a, b = final(with_early), final(without)
    assert a.keys() == b.keys() == {str(i) for i in range(6)}
    for rid in a:
        assert a[rid].finished and b[rid].finished
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids
        assert a[rid].outputs[0].text == b[rid].outputs[0].text
        assert a[rid].outputs[0].finish_reason == b[rid].outputs[0].finish_reason
    # every step's outputs reach the caller of that step in both ways: the same request ids per step
    assert [sorted(o.request_id for o in outs) for outs in with_early] == [
        sorted(o.request_id for o in outs) for outs in without
    ]
