"""Lazy decode-graph capture (engine/cuda_graphs.py, `graph_capture="lazy"`) on the CPU.

A CPU has no CUDA graphs, so `CpuGraphs` (tests/cpu_graphs.py) stands in for them: "capture" runs the
bucket's warm-up step over the arena exactly as the CUDA capture does (the run that must not write any
KV cache slot once traffic has filled the arena) and marks its graphs captured; "replay" runs the
captured step's function eagerly and may only replay captured graphs. What is checked, against an
all-eager engine (no graphs) on the same prompts:

- scheduling: a decode step whose bucket has no graph runs eagerly, the engine captures that bucket
  before its next step (reading the in-flight step first), and every later step of the bucket replays;
  nothing else is captured while requests run; an idle engine captures the rest largest first.
- correctness: the same greedy tokens and (up to rounding) logprobs, including a request that is mid-way
  through its decode, with its inputs in the arena, while another bucket is captured.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cpu_graphs import install_cpu_graphs
from tests.helpers import assert_equal_up_to_rounding, assert_greedy_is_decided
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.cuda_graphs import graph_batch_sizes
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

CPU = torch.device("cpu")
MAX_NUM_SEQS = 8


def _log_eager_steps(runner, events: list) -> None:
    """Log ("eager", rows) for each decode-only step the runner runs without a graph."""
    launch = runner.launch

    def logging_launch(sched, *args, **kwargs):
        decode_only = sched.num_batched_tokens == len(sched.sequences)
        if decode_only and runner._graph_bucket(sched) is None:
            events.append(("eager", len(sched.sequences)))
        return launch(sched, *args, **kwargs)

    runner.launch = logging_launch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lazy_graphs")
    # weights large enough that greedy decoding does not repeat one token (a capture that rewrote a
    # cache slot with a neighbouring step's token would then change nothing)
    write_dummy_checkpoint(path, make_config("tiny"), seed=5, init_std=0.5, dtype="float32")
    return path


def _llm(model_dir, graphs: bool, sample_in_graph: bool = False) -> tuple[LLM, list]:
    """A CPU engine (torch kernels) with async scheduling (decode inputs are the previous step's ids, on
    the device); with `graphs`, lazily captured `CpuGraphs` over buckets 1, 2, 4, 8 and their event log.
    `sample_in_graph`: the graphs end with the greedy/Gumbel sampling kernel (Triton, interpreted), which
    writes each step's ids into `last_sampled` (the runner's sampler still picks the tokens)."""
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        kernel_backend="torch",
        max_model_len=64,
        block_size=4,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32,
        async_scheduling=True,
    )
    events: list = []
    if graphs:
        runner = llm.llm_engine.runner
        assert runner.config.graph_capture == "lazy"  # the engine's default
        sizes = graph_batch_sizes(MAX_NUM_SEQS)
        assert sizes == [1, 2, 4, 8]
        install_cpu_graphs(runner, max_seq_len=64, events=events, sample_in_graph=sample_in_graph)
        _log_eager_steps(runner, events)
    return llm, events


PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
ALONE = [3, 14, 15, 92, 65]
TRIO = [[9, 8, 7], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]
LATE = [[41, 42, 43, 44, 45, 46, 47]]


def _result(out) -> tuple[list[int], list[dict[int, float]]]:
    """A finished request's token ids and its top-2 logprobs per step, as plain floats."""
    c = out.outputs[0]
    return c.token_ids, [{tok: lp.logprob for tok, lp in step.items()} for step in c.logprobs]


def _steps(llm: LLM, prompts: list[list[int]], max_tokens: list[int] | None = None):
    """Add the prompts and step the engine to the end; (token ids, logprobs) per request, in order."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        params = PARAMS if max_tokens is None else PARAMS.replace(max_tokens=max_tokens[i])
        engine.add_request(f"r{i}-{len(p)}", {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(out)
    return [done[k] for k in sorted(done, key=lambda k: int(k[1 : k.index("-")]))]


def _join_midway(llm: LLM) -> list:
    """Request A decodes alone (batch-1 graph steps) and request B joins while A still runs: A's inputs
    are in the arena when bucket 2 is captured."""
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": ALONE}, PARAMS.replace(max_tokens=12))
    done = {}
    for _ in range(5):  # A's prefill and a few decode steps
        for out in engine.step():
            assert not out.finished
    engine.add_request("b", {"prompt_token_ids": LATE[0]}, PARAMS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(out)
    return [done["a"], done["b"]]


def test_lazy_capture_schedule_and_tokens_equal_eager(model_dir):
    eager, _ = _llm(model_dir, graphs=False)
    assert eager.llm_engine.runner.graphs is None
    assert_greedy_is_decided(eager, [{"prompt_token_ids": p} for p in [ALONE, *TRIO, *LATE]], 12)
    lazy, events = _llm(model_dir, graphs=True)
    graphs = lazy.llm_engine.runner.graphs
    engine = lazy.llm_engine

    # ready with no graph; an idle engine has capture work
    assert graphs.captured == set() and engine.has_idle_work()

    # 1. one request: its first decode step runs eagerly, bucket 1 is captured, every later step replays
    got = _steps(lazy, [ALONE])
    assert_equal_up_to_rounding(got, _steps(eager, [ALONE]))
    assert events == [("eager", 1), ("capture", 1)] + [("replay", 1)] * 4, events
    events.clear()

    # 2. three at once, finishing at different lengths: buckets 4 and 2 are captured after one eager step
    # each; bucket 1 replays at once; nothing is captured that no step needed
    lengths = [3, 5, 7]
    got = _steps(lazy, TRIO, lengths)
    assert_equal_up_to_rounding(got, _steps(eager, TRIO, lengths))
    assert events[:2] == [("eager", 3), ("capture", 4)], events
    assert ("capture", 2) in events and events[events.index(("capture", 2)) - 1] == ("eager", 2)
    assert [e for e in events if e[0] == "eager"] == [("eager", 3), ("eager", 2)]
    assert graphs.captured == {1, 2, 4} and graphs.wanted == []
    assert events[-1] == ("replay", 1)

    # 3. idle: the rest, largest first, one per call; then no idle work is left
    assert engine.has_idle_work()
    engine.do_idle_work()
    assert events[-1] == ("capture", 8) and graphs.captured == {1, 2, 4, 8}
    assert not engine.has_idle_work()
    engine.do_idle_work()
    assert events[-1] == ("capture", 8)

    # 4. everything captured: no decode step runs eagerly, the tokens are still the eager engine's
    events.clear()
    got = _steps(lazy, [ALONE, *TRIO], [6, 3, 5, 7])
    assert_equal_up_to_rounding(got, _steps(eager, [ALONE, *TRIO], [6, 3, 5, 7]))
    assert events and all(kind == "replay" for kind, _ in events), events


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the in-graph sampler needs the interpreter")
def test_capture_midway_keeps_running_requests_exact(model_dir):
    """Bucket 2 is captured while request A, which has run batch-1 graph steps, still decodes: the arena
    still holds A's last graph step (its slot, its placeholder source), and the in-graph sampler has since
    overwritten the id that source points at. The capture's warm-up run over a stale arena would write
    K/V of that other id into A's slot; it must not touch A's KV cache."""
    eager, _ = _llm(model_dir, graphs=False)
    want = _join_midway(eager)
    lazy, events = _llm(model_dir, graphs=True, sample_in_graph=True)
    got = _join_midway(lazy)
    assert_equal_up_to_rounding(got, want)
    captures = [b for kind, b in events if kind == "capture"]
    assert captures == [1, 2], events
    at = events.index(("capture", 2))
    assert ("replay", 1) in events[:at] and ("replay", 2) in events[at:]


def test_lazy_runner_config_flag():
    """`graph_capture` reaches the runner's config from the engine's flags, and rejects other values."""
    from tinyvllm.engine.args import EngineArgs

    assert EngineArgs().runner_config("cuda").graph_capture == "lazy"
    assert EngineArgs(graph_capture="eager").runner_config("cuda").graph_capture == "eager"
    with pytest.raises(ValueError, match="graph_capture"):
        EngineArgs(graph_capture="sometimes").runner_config("cuda")


def test_engine_core_captures_one_bucket_per_idle_iteration(model_dir):
    """The serving loop (engine/core.py) with no request polls for commands without blocking while buckets
    are left, capturing one per iteration, largest first, and blocks for commands once none is left."""
    from tinyvllm.engine.core import EngineCore
    from tinyvllm.engine.messages import Shutdown

    llm, events = _llm(model_dir, graphs=True)
    polls: list[bool] = []

    def recv(block: bool):
        polls.append(block)
        return [Shutdown()] if block else []

    EngineCore(llm.llm_engine).run(recv, lambda outputs: None)
    assert polls == [False] * 4 + [True]
    assert events == [("capture", 8), ("capture", 4), ("capture", 2), ("capture", 1)]
