"""Host cost of streamed outputs, split between the engine core and the API side, on this CPU.

`tinyvllm serve` streams DELTA outputs. Its engine core runs server requests as token ids only
(`output_processor.core_params`), and the API process detokenizes and matches stop strings. This
measures, for one batch-`B` decode step with the model runner stubbed out as in bench_host_step.py
(step-input packing kept, random sampled ids):

(a) the engine core's host ms per step: the step, its Deltas and pickling the "out" message (what
    the core process does per step), for the server's params with detokenization left in the core
    ("before" in the JSON: DELTA, detokenize) and as the core gets them ("after": core_params, token
    ids only), the latter both through `encode_outputs(engine.step())` (RequestOutputs built, then
    converted) and through `engine.step_deltas()` ("fast": the core's path, Delta tuples built
    directly); and, as the floor, FINAL_ONLY token ids (no per-step outputs at all);
(b) the API side's ms per step for the token-id Deltas: `RequestProcessor.process` of every request
    (detokenize, stop strings) and the per-stream merge (`OutputAccumulator`, as RequestStream does).

    python -m benchmarks.bench_frontend --batch 64 256 --steps 200 [--repeat 3] [--stop STR ...]

Writes frontend_<gpu or cpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time

import torch

from benchmarks.bench_host_step import stubbed_engine
from benchmarks.common import output_paths, write_json
from tinyvllm.entrypoints.deltas import OutputAccumulator, encode_outputs
from tinyvllm.entrypoints.output_processor import RequestProcessor, core_params
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def _release_all() -> None:
    """Free the engines no longer referenced: each engine's constructor freezes everything alive into
    gc's permanent generation (earlier engines' reference cycles included), so a run building many
    engines would otherwise keep every KV cache."""
    gc.unfreeze()
    gc.collect()


def core_step_ms(
    batch: int, steps: int, params: SamplingParams, fast: bool = False
) -> tuple[float, float, list[list[tuple]]]:
    """(ms of the step alone, ms of step + Deltas + pickle, the Deltas of every timed step). The step
    is `engine.step()` then `encode_outputs`, or with `fast` `engine.step_deltas()` (Deltas included)."""
    engine, _ = stubbed_engine(batch, params)
    step_s = total_s = 0.0
    all_deltas = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step_deltas() if fast else engine.step()
        t1 = time.perf_counter()
        deltas = outputs if fast else encode_outputs(outputs)
        pickle.dumps(
            ("out", [], deltas, dict(engine.get_metrics()), time.monotonic()), protocol=pickle.HIGHEST_PROTOCOL
        )
        t2 = time.perf_counter()
        step_s += t1 - t0
        total_s += t2 - t0
        all_deltas.append(deltas)
    del engine, outputs
    _release_all()
    return step_s / steps * 1e3, total_s / steps * 1e3, all_deltas


def best_core_runs(
    batch: int, steps: int, repeat: int, configs: dict[str, tuple[SamplingParams, bool]]
) -> dict[str, tuple[float, float, list]]:
    """`core_step_ms(batch, steps, params, fast)` of each named (params, fast), `repeat` times in
    rounds (so a busy spell of the machine hits every configuration alike): each one's fastest run."""
    best: dict[str, tuple[float, float, list]] = {}
    for _ in range(repeat):
        for name, (params, fast) in configs.items():
            run = core_step_ms(batch, steps, params, fast)
            if name not in best or run[1] < best[name][1]:
                best[name] = run
    return best


def api_side_ms(batch: int, params: SamplingParams, steps_deltas: list[list[tuple]]) -> tuple[float, float]:
    """(ms per step of RequestProcessor.process over the step's Deltas, ms per step of the merge),
    for the token-id Deltas a core running core_params(params) sent."""
    engine, prompts = stubbed_engine(batch, params)  # for its tokenizer and the same prompts
    processors = {rid: RequestProcessor(engine.tokenizer, params) for rid in prompts}
    del engine
    _release_all()
    process_s = merge_s = 0.0
    for deltas in steps_deltas:
        t0 = time.perf_counter()
        processed = [processors[d[0]].process(d, prompts[d[0]])[0] for d in deltas]
        t1 = time.perf_counter()
        for d in processed:  # one DELTA RequestStream output per request and step
            OutputAccumulator(d[0], None, prompts[d[0]], 0.0).extend([d]).output()
        t2 = time.perf_counter()
        process_s += t1 - t0
        merge_s += t2 - t1
    n = len(steps_deltas)
    return process_s / n * 1e3, merge_s / n * 1e3


def measure_batch(batch: int, steps: int, repeat: int, stop: list[str]) -> dict:
    server = SamplingParams(
        temperature=0.6, max_tokens=steps + 100, ignore_eos=True, stop=stop, output_kind=RequestOutputKind.DELTA
    )  # what serving.py asks for
    token_ids = core_params(server)
    runs = best_core_runs(
        batch,
        steps,
        repeat,
        {
            "before": (server, False),
            "after": (token_ids, False),
            "fast": (token_ids, True),
            "final_only": (token_ids.replace(output_kind=RequestOutputKind.FINAL_ONLY), False),  # the floor
        },
    )
    (before_step, before_core, _), (after_step, after_core, deltas) = runs["before"], runs["after"]
    (fast_step, fast_core, fast_deltas), (final_step, final_core, _) = runs["fast"], runs["final_only"]
    assert fast_deltas == deltas, "step_deltas() differs from encode_outputs(step())"
    process, merge = api_side_ms(batch, server, deltas)
    return {
        "batch": batch,
        "steps": steps,
        "repeat": repeat,
        "stop": stop,
        "core_step_ms_before": before_step,
        "core_ms_before": before_core,
        "core_step_ms_after": after_step,
        "core_ms_after": after_core,
        "core_step_ms_fast": fast_step,
        "core_ms_fast": fast_core,
        "core_fast_over_final_only": fast_core / final_core,
        "core_step_ms_final_only": final_step,
        "core_ms_final_only": final_core,
        "api_process_ms": process,
        "api_merge_ms": merge,
        "api_ms": process + merge,
    }


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'batch':>5} | {'core, detok in core':>25} | {'core token ids, step()':>22} | "
        f"{'core token ids, step_deltas()':>29} | {'core FINAL_ONLY':>15} | "
        f"{'API detok+stop':>14} | {'API merge':>9} | {'API total':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} | {r['core_step_ms_before']:8.3f} step {r['core_ms_before']:7.3f} all | "
            f"{r['core_step_ms_after']:6.3f} step {r['core_ms_after']:6.3f} all | "
            f"{r['core_ms_fast']:6.3f} all ({r['core_fast_over_final_only']:.2f}x floor) | "
            f"{r['core_ms_final_only']:11.3f} all | "
            f"{r['api_process_ms']:14.3f} | {r['api_merge_ms']:9.3f} | {r['api_ms']:9.3f}"
        )
    print(
        "ms per decode step; 'all' = the step + its Deltas (encode_outputs, or step_deltas' own) + pickling the message"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--stop", nargs="*", default=[], help="stop strings of every request (none by default)")
    p.add_argument(
        "--repeat", type=int, default=3, help="runs of each core configuration, interleaved; the fastest is reported"
    )
    p.add_argument("--out-dir", default="benchmarks/results")
    ns = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure_batch(batch, ns.steps, ns.repeat, ns.stop) for batch in ns.batch]
    print_rows(rows)
    json_path, _ = output_paths(ns.out_dir, "frontend")
    write_json(json_path, {"rows": rows, "model": "dummy:tiny", "device": "cpu (runner stubbed)"})


if __name__ == "__main__":
    main()
