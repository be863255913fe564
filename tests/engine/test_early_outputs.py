"""What a step with constrained rows does inside its own launch under async scheduling (LLMEngine's
`before_mask`): it processes the in-flight step there and hands those outputs to `core_step(early)`
(LLMEngine.step runs the output processing in that window), and with `schedule_in_launch` it schedules
the next step there too. Neither may change a token: the outputs must be those of the same engine doing
both after the launch, also with preemption, an abort in between and requests added in between."""

from __future__ import annotations

import json

import pytest

from tests.cpu_graphs import install_cpu_graphs
from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.model_runner import ModelRunner
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

pytest.importorskip("xgrammar")

SCHEMA = {"type": "array", "minItems": 3, "maxItems": 6, "items": {"type": "integer", "minimum": 0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-early")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=1.0, seed=10 + i, max_tokens=24, structured_outputs=SO(json=SCHEMA))
    return SamplingParams(temperature=0.8, seed=10 + i, max_tokens=12 + i, ignore_eos=True)


def _run(
    model_dir,
    monkeypatch,
    hand_off=True,
    schedule_in_launch=True,
    blocks=None,
    abort_at=None,
    late_at=None,
    abort_late_at=None,
    workers=None,
    graphs=False,
    prepare_in_launch=False,
    packs=None,
):
    """Requests 0-5 (even ones constrained) through LLMEngine.step; `abort_at`: abort request 1 after that
    many steps; `late_at`: add requests 6 and 7 after that many steps, `abort_late_at`: abort request 6 after
    that many; `workers`: grammar worker processes (the next step is scheduled while they accept);
    `graphs`: decode steps through CpuGraphs (the graph steps' input arenas); `packs`: a list that gets,
    for each call of ModelRunner.prepare, whether it packed the next step.
    Returns (every step's outputs, the sizes of the early hand-offs, the number of steps scheduled inside
    a launch, the engine, the number of those scheduled while the workers accepted)."""
    calls = []
    early_schedules = []
    core_step = LLMEngine.core_step
    process_early = LLMEngine._process_in_flight_early

    def spy(self, early=None):
        if not hand_off or early is None:
            return core_step(self)  # the outputs all come back from core_step

        def counted(outputs):
            calls.append(len(outputs))
            early(outputs)

        return core_step(self, counted)

    def counting_process_early(self):
        before = self._scheduled_early
        process_early(self)
        early_schedules.append(before is None and self._scheduled_early is not None)

    schedule_early = LLMEngine._schedule_early
    during_accept = []

    def counting_schedule_early(self):
        before = self._scheduled_early
        schedule_early(self)
        during_accept.append(self._in_launch and before is None and self._scheduled_early is not None)

    if packs is not None:
        prepare = ModelRunner.prepare

        def counting_prepare(self, sched):
            prepare(self, sched)
            packs.append(self._packed is not None)

        monkeypatch.setattr(ModelRunner, "prepare", counting_prepare)
    monkeypatch.setattr(LLMEngine, "core_step", spy)
    monkeypatch.setattr(LLMEngine, "_process_in_flight_early", counting_process_early)
    monkeypatch.setattr(LLMEngine, "_schedule_early", counting_schedule_early)
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        max_model_len=64 if blocks else 128,
        max_num_seqs=8,
        async_scheduling=True,
        num_gpu_blocks_override=blocks,
        structured_outputs_workers=workers,
    )
    engine = llm.llm_engine
    if workers:
        assert engine.structured.wait_for_workers(120), "grammar workers did not start"
        engine.structured.worker_min_sequences = 1  # every constrained sequence on a worker
    engine.schedule_in_launch = schedule_in_launch
    engine.prepare_in_launch = prepare_in_launch
    if graphs:
        install_cpu_graphs(engine.runner, max_seq_len=64 if blocks else 128, events=[])
    for i in range(6):
        engine.add_request(str(i), f"item {i}:", _params(i))
    steps = []  # every step's RequestOutputs: the stream a caller of step() sees
    while engine.has_unfinished_requests():
        if abort_at is not None and len(steps) == abort_at:
            engine.abort_request("1")
        if abort_late_at is not None and len(steps) == abort_late_at:
            engine.abort_request("6")
        if late_at is not None and len(steps) == late_at:
            for i in (6, 7):
                engine.add_request(str(i), f"late {i}:", _params(i))
        steps.append(engine.step())
    monkeypatch.undo()
    if workers:
        engine.shutdown()
    return steps, calls, sum(early_schedules), engine, sum(during_accept)


def _final(steps):
    last = {}
    for outs in steps:
        for o in outs:
            last[o.request_id] = o
    return last


def _same_outputs(a, b, ids):
    a, b = _final(a), _final(b)
    assert set(ids) <= a.keys() and set(ids) <= b.keys()
    for rid in ids:
        assert a[rid].finished and b[rid].finished
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids, rid
        assert a[rid].outputs[0].text == b[rid].outputs[0].text
        assert a[rid].outputs[0].finish_reason == b[rid].outputs[0].finish_reason
    for rid in ids:  # the constrained ones that completed parse
        if int(rid) % 2 == 0 and a[rid].outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(a[rid].outputs[0].text), list)


def test_early_outputs_are_the_outputs_without_the_hand_off(model_dir, monkeypatch):
    with_early, calls, *_ = _run(model_dir, monkeypatch, hand_off=True)
    without, *_ = _run(model_dir, monkeypatch, hand_off=False)
    assert calls and sum(calls) > 0, "no step handed outputs over early: the test does not exercise the path"
    _same_outputs(with_early, without, [str(i) for i in range(6)])
    # every step's outputs reach the caller of that step in both ways: the same request ids per step
    assert [sorted(o.request_id for o in outs) for outs in with_early] == [
        sorted(o.request_id for o in outs) for outs in without
    ]


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(blocks=6),  # few blocks: preemptions while steps are scheduled inside launches
        dict(abort_at=4),  # an abort of a request the next step was already scheduled for
        dict(late_at=3),  # requests added after the next step was scheduled
        dict(late_at=3, abort_late_at=4),  # a new request aborted after a step was scheduled for it
        dict(workers=2, blocks=6),  # scheduled while the workers accept: before grammars complete
    ],
    ids=["plain", "preemption", "abort", "late", "late-abort", "workers"],
)
def test_scheduling_inside_the_launch_changes_no_token(model_dir, monkeypatch, case):
    aborted = {"1"} if "abort_at" in case else {"6"} if "abort_late_at" in case else set()
    ids = [str(i) for i in range(8 if "late_at" in case else 6) if str(i) not in aborted]
    early, _, n_early, engine, n_accept = _run(model_dir, monkeypatch, schedule_in_launch=True, **case)
    late, _, n_late, ref_engine, _ = _run(model_dir, monkeypatch, schedule_in_launch=False, **case)
    assert n_early > 0 and n_late == 0, "the test must exercise the schedule inside the launch (and only there)"
    assert (n_accept > 0) == ("workers" in case), "with workers the schedule runs while they accept"
    if "blocks" in case:
        assert engine.scheduler.num_preemptions > 0 and ref_engine.scheduler.num_preemptions > 0
    _same_outputs(early, late, ids)
    if "abort_at" in case:
        # the aborted request's last output before the abort is the same both ways, and unfinished
        a, b = _final(early)["1"], _final(late)["1"]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and not a.finished and not b.finished
    for e in (engine, ref_engine):  # nothing held after the run: every block back in the pool
        assert e.scheduler.kv_cache.pool.num_free_blocks == e.scheduler.kv_cache.pool.num_blocks


@pytest.mark.parametrize(
    "case",
    [dict(), dict(blocks=6), dict(abort_at=4), dict(late_at=3, abort_late_at=4), dict(workers=2, blocks=6)],
    ids=["plain", "preemption", "abort", "late-abort", "workers"],
)
def test_packing_the_next_graph_step_inside_the_launch_changes_no_token(model_dir, monkeypatch, case):
    """Decode steps through graph input arenas (CpuGraphs): the next step packed inside the launch
    (ModelRunner.prepare, with the launching step's row index for its placeholders) gives every token of
    the engine that packs each step at its own launch."""
    aborted = {"1"} if "abort_at" in case else {"6"} if "abort_late_at" in case else set()
    ids = [str(i) for i in range(8 if "late_at" in case else 6) if str(i) not in aborted]
    packs, no_packs = [], []
    packed, *_ = _run(model_dir, monkeypatch, graphs=True, prepare_in_launch=True, packs=packs, **case)
    unpacked, *_ = _run(model_dir, monkeypatch, graphs=True, prepare_in_launch=False, packs=no_packs, **case)
    assert sum(packs) > 0 and not no_packs, "the test must exercise the packing inside the launch (and only there)"
    _same_outputs(packed, unpacked, ids)
