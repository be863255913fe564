"""Where the host time of a batch-1 decode step's launch goes (GPU; the `latency` workload).

Wraps the pieces of `ModelRunner.launch` (input building, graph replay, sampling plan, sampling) with
wall-clock timers, runs one 128-in / 512-out greedy request twice (warm-up, measured), and prints the
mean milliseconds of each piece per decode step, beside the engine's own step timing. A piece whose
time approaches the device step blocks on the device somewhere inside it.

    python scripts/diag_launch.py [--model dummy:llama-3.2-1b] [--sync-debug]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.step_timing import format_summary, summarize


def timed(totals: dict[str, list[float]], name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[name].append(time.perf_counter() - t0)
        return out

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--sync-debug", action="store_true", help="torch.cuda.set_sync_debug_mode('warn') too")
    ns = ap.parse_args()
    llm = LLM(model=ns.model, dtype="bfloat16")
    engine = llm.llm_engine
    runner = engine.runner
    totals: dict[str, list[float]] = collections.defaultdict(list)
    runner.builder.build = timed(totals, "builder.build", runner.builder.build)
    if runner.graphs is not None:
        runner.graphs.replay = timed(totals, "graphs.replay", runner.graphs.replay)
    runner.sampler.plan = timed(totals, "sampler.plan", runner.sampler.plan)
    runner.sampler.sample = timed(totals, "sampler.sample", runner.sampler.sample)
    runner.launch = timed(totals, "launch (all)", runner.launch)
    vocab = engine.model_config.vocab_size
    prompt = {"prompt_token_ids": [(1000 + i) % vocab for i in range(128)]}
    params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    for label in ("warm-up", "measured"):
        totals.clear()
        engine.step_timer.reset(keep_log=True)
        if label == "measured" and ns.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
    print(f"measured run: {wall * 1e3:.1f} ms for 512 tokens ({512 / wall:.0f} tok/s)")
    print(format_summary(summarize(engine.step_timer.log)))
    for name, ts in totals.items():
        print(f"  {name:16s} {len(ts):4d} calls  mean {1e3 * sum(ts) / len(ts):7.3f} ms  max {1e3 * max(ts):7.3f} ms")


if __name__ == "__main__":
    main()
