"""Host cost of streamed outputs, split between the engine core and the API side, on this CPU.

`tinyvllm serve` streams DELTA outputs: its engine core works in token ids and sends EngineCoreOutputs
(msgpack); the API process runs the output processing (detokenization, stop strings). This measures,
for one batch-`B` decode step with the model runner stubbed out as in bench_host_step.py (step-input
packing kept, random sampled ids):

(a) the engine core's host ms per step: `engine.core_step()` and encoding its EngineCoreOutputs
    message (what the core process does per step); beside it, the same step with the output
    processing in the engine's own process (`engine.step()`: text and RequestOutputs, as the
    offline LLM runs it), and, as the floor, FINAL_ONLY requests (no per-step outputs at all);
(b) the API side's ms per step for the core's outputs: decoding the message, the output processing
    of every request (`process_outputs` over RequestStates) and the per-stream merge
    (`OutputAccumulator`, as RequestStream does).

    python -m benchmarks.bench_frontend --batch 64 256 --steps 200 [--repeat 3] [--stop STR ...]

Writes frontend_<gpu or cpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.bench_host_step import stubbed_engine
from benchmarks.common import output_paths, write_json
from tinyvllm.engine.messages import EngineCoreOutputs, OutputAccumulator, encoder, output_decoder
from tinyvllm.engine.output_processor import RequestState, process_outputs
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def _release_all() -> None:
    """Free the engines no longer referenced: each engine's constructor freezes everything alive into
    gc's permanent generation (earlier engines' reference cycles included), so a run building many
    engines would otherwise keep every KV cache."""
    gc.unfreeze()
    gc.collect()


def core_step_ms(
    batch: int, steps: int, params: SamplingParams, in_process: bool = False
) -> tuple[float, float, list[bytes]]:
    """(ms of the step alone, ms of step + encoding the message, the messages of every timed step).
    The step is `engine.core_step()`, or with `in_process` `engine.step()` (no message then)."""
    engine, _ = stubbed_engine(batch, params)
    step_s = total_s = 0.0
    messages = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step() if in_process else engine.core_step()
        t1 = time.perf_counter()
        if not in_process:
            messages.append(encoder.encode(EngineCoreOutputs(outputs, [], engine.get_metrics(), time.monotonic())))
        t2 = time.perf_counter()
        step_s += t1 - t0
        total_s += t2 - t0
    del engine, outputs
    _release_all()
    return step_s / steps * 1e3, total_s / steps * 1e3, messages


def best_core_runs(
    batch: int, steps: int, repeat: int, configs: dict[str, tuple[SamplingParams, bool]]
) -> dict[str, tuple[float, float, list]]:
    """`core_step_ms(batch, steps, params, in_process)` of each named (params, in_process), `repeat`
    times in rounds (so a busy spell of the machine hits every configuration alike): each one's
    fastest run."""
    best: dict[str, tuple[float, float, list]] = {}
    for _ in range(repeat):
        for name, (params, in_process) in configs.items():
            run = core_step_ms(batch, steps, params, in_process)
            if name not in best or run[1] < best[name][1]:
                best[name] = run
    return best


def api_side_ms(batch: int, params: SamplingParams, messages: list[bytes]) -> tuple[float, float, float]:
    """(ms per step decoding the core's message, ms per step of the output processing, ms per step of
    the merge) for the messages a core running `params` sent."""
    engine, prompts = stubbed_engine(batch, params)  # for its tokenizer and the same prompts
    states = {rid: RequestState(rid, params, engine.tokenizer, None, ids, 0.0) for rid, ids in prompts.items()}
    del engine
    _release_all()
    decode_s = process_s = merge_s = 0.0
    for message in messages:
        t0 = time.perf_counter()
        outputs = output_decoder.decode(message).outputs
        t1 = time.perf_counter()
        processed = list(process_outputs([states[o.request_id] for o in outputs], outputs))
        t2 = time.perf_counter()
        for state, delta in processed:  # one DELTA RequestStream output per request and step
            OutputAccumulator(delta.request_id, None, state.prompt_token_ids, 0.0).extend([delta]).output()
        t3 = time.perf_counter()
        decode_s += t1 - t0
        process_s += t2 - t1
        merge_s += t3 - t2
    n = len(messages)
    return decode_s / n * 1e3, process_s / n * 1e3, merge_s / n * 1e3


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'batch':>5} | {'core: core_step + encode':>28} | {'core FINAL_ONLY':>15} | {'in process: step()':>18} | "
        f"{'API decode':>10} | {'API detok+stop':>14} | {'API merge':>9} | {'API total':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} | {r['core_step_ms']:6.3f} step {r['core_ms']:6.3f} all "
            f"({r['core_over_final_only']:.2f}x) | {r['core_ms_final_only']:11.3f} all | "
            f"{r['in_process_step_ms']:18.3f} | {r['api_decode_ms']:10.3f} | "
            f"{r['api_process_ms']:14.3f} | {r['api_merge_ms']:9.3f} | {r['api_ms']:9.3f}"
        )
    print("ms per decode step; 'all' = the step + encoding its EngineCoreOutputs message")


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
    rows = []
    for batch in ns.batch:
        server = SamplingParams(
            temperature=0.6,
            max_tokens=ns.steps + 100,
            ignore_eos=True,
            stop=ns.stop,
            output_kind=RequestOutputKind.DELTA,
        )  # what serving.py asks for
        runs = best_core_runs(
            batch,
            ns.steps,
            ns.repeat,
            {
                "core": (server, False),
                "in_process": (server, True),
                # the floor: no per-step outputs at all
                "final_only": (server.replace(output_kind=RequestOutputKind.FINAL_ONLY, stop=[]), False),
            },
        )
        (core_step, core_all, messages), (in_process, _, _) = runs["core"], runs["in_process"]
        final_step, final_all, _ = runs["final_only"]
        decode, process, merge = api_side_ms(batch, server, messages)
        rows.append(
            {
                "batch": batch,
                "steps": ns.steps,
                "repeat": ns.repeat,
                "stop": ns.stop,
                "core_step_ms": core_step,
                "core_ms": core_all,
                "core_over_final_only": core_all / final_all,
                "core_step_ms_final_only": final_step,
                "core_ms_final_only": final_all,
                "in_process_step_ms": in_process,
                "api_decode_ms": decode,
                "api_process_ms": process,
                "api_merge_ms": merge,
                "api_ms": decode + process + merge,
            }
        )
    print_rows(rows)
    json_path, _ = output_paths(ns.out_dir, "frontend")
    write_json(json_path, {"rows": rows, "model": "dummy:tiny", "device": "cpu (runner stubbed)"})


if __name__ == "__main__":
    main()
