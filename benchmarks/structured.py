"""The `structured` workload (WORKLOADS.md): the throughput set unconstrained and with every request under
a JSON schema, in one process; batch-1 latency unconstrained and constrained; the schema's compile time
(cold and cached) and the TTFT of a constrained request against an unconstrained one.

    python -m benchmarks.structured [--model dummy:llama-3.2-1b] [--num-prompts 256] [--repeats 3] [--out-dir DIR]
    python -m benchmarks.structured --model dummy:tiny --device cpu --num-prompts 8 --max-output 32  # a CPU check

Prints one table and writes benchmarks/results/structured_<device>.json. With `--repeats R`, each pair
(unconstrained, constrained) runs R times in the same process; the table and the JSON report the pair
whose ratio is the median, and the JSON every pair (`runs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from tinyvllm.bench.offline import add_common_cli_args
from tinyvllm.bench.report import device_tag, print_table, write_json
from tinyvllm.bench.workloads import Workload, latency_workload, throughput_workload
from tinyvllm.engine.args import engine_args_from_cli
from tinyvllm.llm import LLM
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "array",
    # The workload's schema is unbounded so that, as unconstrained with ignore_eos, each request runs to its
    # max_tokens. Random weights close the array after a few items; at least 200 items (more than any
    # max_tokens can hold) keeps them writing, so both runs produce the same tokens and the ratio is per token.
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "word": {"type": "string", "maxLength": 8}},
        "required": ["id", "word"],
    },
}


def _params(w: Workload, structured: StructuredOutputsParams | None, cap: int | None) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=w.temperature,
            max_tokens=m if cap is None else min(m, cap),
            ignore_eos=True,
            structured_outputs=structured,
        )
        for m in w.max_tokens
    ]


def _prompts(w: Workload, vocab_size: int) -> list[dict]:
    return [{"prompt_token_ids": [t % vocab_size for t in p]} for p in w.prompts]


def _generate(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> dict[str, Any]:
    # Every run starts from an empty prefix cache: the runs share their prompts, so a later run would
    # otherwise skip the prefills an earlier one computed (a bias towards whichever kind runs second).
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (a request still holds blocks)")
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[o.outputs[0].finish_reason] = reasons.get(o.outputs[0].finish_reason, 0) + 1
    valid = None
    if params[0].structured_outputs is not None:  # the constrained outputs that completed must parse
        done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
        valid = all(isinstance(json.loads(t), list) for t in done) if done else None
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "ttft_median_s": statistics.median(ttfts),
        "finish_reasons": reasons,
        "completed_outputs_parse": valid,
    }


def _compile_times(llm: LLM, repeats: int = 5) -> dict[str, float]:
    """Seconds to compile the schema: cold (a schema text never seen, so nothing is cached) and cached."""
    manager = llm.llm_engine.structured
    cold = []
    for i in range(repeats):
        schema = dict(SCHEMA, description=f"cold compile {i} {time.time_ns()}")  # a new text, the same grammar
        start = time.perf_counter()
        manager.validate(StructuredOutputsParams(json=schema))
        cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        manager.validate(StructuredOutputsParams(json=SCHEMA))
    cached = (time.perf_counter() - start) / repeats
    return {"cold_median_s": statistics.median(cold), "cached_s": cached}


def _ttft_pair(llm: LLM, prompt: dict, repeats: int = 5) -> dict[str, float]:
    """Median time from `generate` to the first token of one request alone: unconstrained, under the
    cached schema, and under a schema compiled for each request (a fresh text: its cold compile counts)."""

    def ttft(structured: StructuredOutputsParams | None) -> float:
        # From the call, not from the request's arrival: LLM.generate compiles before it queues.
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, structured_outputs=structured)
        start = time.monotonic()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return out.metrics.first_token_time - start

    plain = [ttft(None) for _ in range(repeats)]
    cached = [ttft(StructuredOutputsParams(json=SCHEMA)) for _ in range(repeats)]
    cold = [
        ttft(StructuredOutputsParams(json=dict(SCHEMA, description=f"ttft {i} {time.time_ns()}")))
        for i in range(repeats)
    ]
    return {
        "unconstrained_s": statistics.median(plain),
        "constrained_cached_s": statistics.median(cached),
        "constrained_cold_s": statistics.median(cold),
    }


def _pairs(repeats: int, plain_run, constrained_run) -> tuple[dict, dict, list[dict]]:
    """`repeats` pairs of (unconstrained, constrained) runs, alternating; returns the pair whose ratio is
    the median (the lower middle one for an even count) and every pair's tok/s and ratio."""
    pairs = [(plain_run(), constrained_run()) for _ in range(repeats)]
    runs = [
        {
            "unconstrained": p["output_tokens_per_s"],
            "constrained": c["output_tokens_per_s"],
            "ratio": c["output_tokens_per_s"] / p["output_tokens_per_s"],
        }
        for p, c in pairs
    ]
    order = sorted(range(repeats), key=lambda i: runs[i]["ratio"])
    plain, constrained = pairs[order[(repeats - 1) // 2]]
    return plain, constrained, runs


def run(ns: argparse.Namespace) -> dict[str, Any]:
    args = engine_args_from_cli(ns).replace(model=str(resolve_model(ns.model)))
    llm = LLM(**vars(args))
    llm.llm_engine.schedule_in_launch = ns.schedule_in_launch
    llm.llm_engine.prepare_in_launch = ns.prepare_in_launch
    vocab = llm.llm_engine.model_config.vocab_size
    schema = StructuredOutputsParams(json=SCHEMA)
    compile_times = _compile_times(llm)  # first: the cold figure must not find the schema cached
    llm.llm_engine.structured.wait_for_workers(120)  # grammar workers (if any) up: the steady state timed

    tw = throughput_workload(ns.num_prompts)
    prompts = _prompts(tw, vocab)
    head = Workload(tw.prompts[:16], [4] * min(16, len(tw.prompts)), tw.temperature)  # warm-up, both ways
    llm.generate(_prompts(head, vocab), _params(head, None, None), use_tqdm=False)
    llm.generate(_prompts(head, vocab), _params(head, schema, None), use_tqdm=False)
    plain, constrained, tp_runs = _pairs(
        ns.repeats,
        lambda: _generate(llm, prompts, _params(tw, None, ns.max_output)),
        lambda: _generate(llm, prompts, _params(tw, schema, ns.max_output)),
    )

    lw = latency_workload(output_len=ns.latency_output)
    lprompt = _prompts(lw, vocab)
    llm.generate(lprompt, _params(lw, schema, 8), use_tqdm=False)
    lat_plain, lat_constrained, lat_runs = _pairs(
        ns.repeats,
        lambda: _generate(llm, lprompt, _params(lw, None, None)),
        lambda: _generate(llm, lprompt, _params(lw, schema, None)),
    )
    ttft = _ttft_pair(llm, lprompt[0])

    rows = [
        ("throughput unconstrained", f"{plain['output_tokens_per_s']:.0f}", "1.00"),
        (
            "throughput under the schema",
            f"{constrained['output_tokens_per_s']:.0f}",
            f"{constrained['output_tokens_per_s'] / plain['output_tokens_per_s']:.2f}",
        ),
        ("batch-1 decode unconstrained", f"{lat_plain['output_tokens_per_s']:.1f}", "1.00"),
        (
            "batch-1 decode under the schema",
            f"{lat_constrained['output_tokens_per_s']:.1f}",
            f"{lat_constrained['output_tokens_per_s'] / lat_plain['output_tokens_per_s']:.2f}",
        ),
    ]
    title = f"structured: {len(tw.prompts)} requests ({ns.model})"
    if ns.repeats > 1:
        title += f", the median-ratio pair of {ns.repeats}"
        rows += [
            ("ratios, throughput", "", " ".join(f"{r['ratio']:.2f}" for r in tp_runs)),
            ("ratios, batch-1", "", " ".join(f"{r['ratio']:.2f}" for r in lat_runs)),
        ]
    print_table(title, rows, ("", "output tok/s", "ratio"))
    print_table(
        "schema compile and TTFT (ms)",
        [
            ("compile, cold", f"{compile_times['cold_median_s'] * 1e3:.2f}"),
            ("compile, cached", f"{compile_times['cached_s'] * 1e3:.3f}"),
            ("TTFT unconstrained", f"{ttft['unconstrained_s'] * 1e3:.2f}"),
            ("TTFT constrained, schema cached", f"{ttft['constrained_cached_s'] * 1e3:.2f}"),
            ("TTFT constrained, schema compiled for it", f"{ttft['constrained_cold_s'] * 1e3:.2f}"),
        ],
        ("", "ms"),
    )
    result = {
        "workload": "structured",
        "model": ns.model,
        "schema": SCHEMA,
        "throughput": {"unconstrained": plain, "constrained": constrained, "runs": tp_runs},
        "latency": {"unconstrained": lat_plain, "constrained": lat_constrained, "runs": lat_runs},
        "compile": compile_times,
        "ttft": ttft,
        "engine_args": vars(args),
        "schedule_in_launch": ns.schedule_in_launch,
        "prepare_in_launch": ns.prepare_in_launch,
    }
    tag = "cpu" if llm.llm_engine.device.type == "cpu" else device_tag()
    write_json(ns.name or f"structured_{tag}", result, ns.out_dir)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-output", type=int, default=None, help="cap each request's max_tokens (CPU checks)")
    p.add_argument("--latency-output", type=int, default=512, help="output tokens of the batch-1 runs")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs of each kind, in one process (median)")
    p.add_argument(
        "--schedule-in-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a constrained step schedules the next one while it waits for its mask (LLMEngine.schedule_in_launch)",
    )
    p.add_argument(
        "--prepare-in-launch",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="... and packs that step's inputs there too (LLMEngine.prepare_in_launch)",
    )
    run(p.parse_args())


if __name__ == "__main__":
    main()
