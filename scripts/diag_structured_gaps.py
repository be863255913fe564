"""Where a constrained decode step leaves the device idle: CUDA events around the step's enqueues.

A graph decode step enqueues, in order: its inputs and forward (`load_inputs` / `replay*`), then, for a
step with constrained rows, the bitmask fill on the host and the sampling. An event recorded on the
stream right after an enqueue completes when that work does; one recorded right before the next enqueue
completes at its host record time if the device is idle by then. So the elapsed time between the two is
the device's idle time between those two pieces of work (about 0 while the device is still busy):

    fill idle = forward enqueued  -> sampling enqueued     (the host fills the mask after the forward ran)
    host gap  = step N finished enqueuing -> step N+1's first enqueue (the host builds and launches N+1)

Runs the `throughput` set unconstrained, then under the `structured` workload's schema, and prints the
medians over the decode steps of at least `--min-rows` rows (each run from an empty prefix cache), and
the host times: `host_build_ms` from `launch` to the step's first enqueue, `host_fill_ms` from the
forward's enqueue to the sampling's. `--prepare-in-launch`: the engine packs the next step inside a
constrained step's launch.

    python scripts/diag_structured_gaps.py [--model dummy:llama-3.2-1b] [--num-prompts 256] [--out F.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.structured import SCHEMA, _params, _prompts
from tinyvllm import LLM
from tinyvllm.bench.workloads import throughput_workload
from tinyvllm.sampling_params import StructuredOutputsParams

_FIRST_ENQUEUES = ("load_inputs", "replay_io", "replay_io_hidden", "replay", "hidden_states")


def _unwrap(runner) -> None:
    for obj in (runner.graphs, runner.executor, runner, runner.sampler):
        for name in (*_FIRST_ENQUEUES, "launch", "_step_bitmask", "sample"):
            if obj is not None and name in vars(obj):
                delattr(obj, name)


class _Probe:
    """Wraps a runner's graph-step methods with events (CUDA) and host clocks."""

    def __init__(self, runner) -> None:
        self.cuda = runner.device.type == "cuda"
        self.steps: list[dict] = []
        self.cur: dict | None = None
        for obj in (runner.graphs, runner.executor):  # a step's first enqueue: a graph's or the eager forward
            for name in _FIRST_ENQUEUES:
                if obj is not None and hasattr(obj, name):
                    setattr(obj, name, self._first_enqueue(getattr(obj, name)))
        runner.launch = self._around_launch(runner.launch)
        runner._step_bitmask = self._around_fill(runner._step_bitmask)
        runner.sampler.sample = self._before(runner.sampler.sample, "sample")

    def _mark(self, key: str) -> None:
        if self.cur is None or key in self.cur:
            return
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.cur[key] = (time.perf_counter(), ev)

    def _first_enqueue(self, fn):
        def wrapped(*a, **k):
            self._mark("start")
            return fn(*a, **k)

        return wrapped

    def _around_launch(self, fn):
        def wrapped(sched, structured=None, before_mask=None):
            self.cur = {"rows": len(sched.sequences), "decode": sched.num_batched_tokens == len(sched.sequences)}
            self._mark("launch")
            out = fn(sched, structured, before_mask)
            self._mark("end")
            self.steps.append(self.cur)
            self.cur = None
            return out

        return wrapped

    def _around_fill(self, fn):
        def wrapped(*a, **k):
            self._mark("forward")
            return fn(*a, **k)

        return wrapped

    def _before(self, fn, key):
        def wrapped(*a, **k):
            self._mark(key)
            return fn(*a, **k)

        return wrapped

    def summary(self, min_rows: int) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        steps = [s for s in self.steps if s["rows"] >= min_rows and s["decode"] and "start" in s]
        out: dict[str, list[float]] = {k: [] for k in ("host_build_ms", "host_fill_ms", "step_ms")}
        if self.cuda:
            out.update(fill_idle_ms=[], host_gap_ms=[])
        for prev, s in itertools.pairwise(steps):
            out["host_build_ms"].append((s["start"][0] - s["launch"][0]) * 1e3)
            if "sample" in s and "forward" in s:
                out["host_fill_ms"].append((s["sample"][0] - s["forward"][0]) * 1e3)
            if not self.cuda:
                continue
            out["step_ms"].append(prev["start"][1].elapsed_time(s["start"][1]))
            out["host_gap_ms"].append(prev["end"][1].elapsed_time(s["start"][1]))
            if "sample" in s and "forward" in s:
                out["fill_idle_ms"].append(s["forward"][1].elapsed_time(s["sample"][1]))
        med = {k: (statistics.median(v) if v else None) for k, v in out.items()}
        med["sums_ms"] = {k: sum(v) for k, v in out.items()}
        med["steps"] = len(steps)
        return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--min-rows", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prepare-in-launch", action=argparse.BooleanOptionalAction, default=False)
    ns = ap.parse_args()
    llm = LLM(model=ns.model, device=ns.device, graph_capture="eager")  # no capture inside a timed run
    engine = llm.llm_engine
    engine.prepare_in_launch = ns.prepare_in_launch
    schema = StructuredOutputsParams(json=SCHEMA)
    engine.structured.wait_for_workers(120)
    w = throughput_workload(ns.num_prompts)
    prompts = _prompts(w, engine.model_config.vocab_size)
    llm.generate(prompts[:16], _params(w, schema, 4)[:16], use_tqdm=False)  # warm-up, both ways
    llm.generate(prompts[:16], _params(w, None, 4)[:16], use_tqdm=False)
    result = {}
    for label, structured in (("unconstrained", None), ("constrained", schema)):
        llm.reset_prefix_cache()
        probe = _Probe(engine.runner)
        t = time.perf_counter()
        outs = llm.generate(prompts, _params(w, structured, ns.max_output), use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[label] = {"output_tokens_per_s": tokens / seconds, **probe.summary(ns.min_rows)}
        _unwrap(engine.runner)
    print(json.dumps(result, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
