"""Host-side cost of one engine step, the device work stubbed out.

At large batch the engine's Python (schedule, step-input packing, token bookkeeping, outputs) can be as
long as the GPU's step; this measures it on whatever CPU runs it. The model runner's `launch` is replaced
by the real step-input packing plus random sampled ids, so what is timed is everything the host does
per step except the kernel launches themselves.

    python -m benchmarks.bench_host_step --batch 256 --steps 200 [--profile]

Writes host_step_<gpu or cpu>.json (the machine whose CPU ran it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from benchmarks.common import output_paths, write_json
from tinyvllm.core.outputs import ModelRunnerOutput
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


class _Handle:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def result(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids=self.ids)


def stub_runner(engine: LLMEngine, vocab: int) -> None:
    """Replace the device work of `engine.runner.launch` with random ids; keep the input packing."""
    runner = engine.runner
    rng = random.Random(0)

    def launch(sched, structured=None, before_mask=None):  # no constrained rows here: before_mask is unused
        runner.builder.build(sched, prev_sample_index={s.request_id: i for i, s in enumerate(sched.sequences)})
        return _Handle([rng.randrange(vocab) for s in sched.sequences if s.sample])

    runner.launch = launch


def stubbed_engine(batch: int, params: SamplingParams, seed: int = 0) -> tuple[LLMEngine, dict[str, list[int]]]:
    """A CPU engine (tiny dummy model) with the runner stubbed and `batch` requests of 100-1,024 random
    prompt tokens past their prefill and 5 decode steps; returns it and the prompts by request id."""
    args = EngineArgs(
        model="dummy:tiny",
        device="cpu",
        kernel_backend="torch",
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        kv_cache_memory_bytes=1 << 30,
        async_scheduling=True,
    )
    engine = LLMEngine(args)
    vocab = engine.model_config.vocab_size
    stub_runner(engine, vocab)
    rng = random.Random(seed)
    prompts = {}
    for i in range(batch):
        prompts[str(i)] = [rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
        engine.add_request(str(i), prompts[str(i)], params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values())
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    return engine, prompts


def run(batch: int, steps: int, output_kind: RequestOutputKind, profile: bool) -> dict:
    params = SamplingParams(temperature=0.6, max_tokens=steps + 100, ignore_eos=True, output_kind=output_kind)
    engine, _ = stubbed_engine(batch, params)
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
    per_step_ms = (time.perf_counter() - start) / steps * 1e3
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {"batch": batch, "steps": steps, "output_kind": output_kind.name, "host_ms_per_step": per_step_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out-dir", default="benchmarks/results")
    ns = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        for b in ns.batch:
            r = run(b, ns.steps, kind, ns.profile)
            rows.append(r)
            print(
                f"{kind.name:11s} batch {b:4d}: {r['host_ms_per_step']:.3f} ms per step "
                f"({r['host_ms_per_step'] / b * 1e3:.1f} us per request)"
            )
    json_path, _ = output_paths(ns.out_dir, "host_step")
    write_json(json_path, {"rows": rows})


if __name__ == "__main__":
    main()
