"""Issue #34: run-to-run reproducibility, batch invariance, and what batch invariance costs.

    python -m benchmarks.determinism                      # the H200 run: dummy:llama-3.2-1b, bf16
    python -m benchmarks.determinism --model dummy:tiny --dtype float32 --num-prompts 3 --max-tokens 8 \\
        --batch-size 12 --throughput-prompts 4 --cap 48 --latency-output-len 32   # a CPU smoke run

(a) reproducibility (tinyvllm/bench/determinism.py): the prompts, one request at a time, greedy and
    seeded, through two fresh default engines and once more after other traffic (prefix caching off, as
    the issue measures); then with `batch_invariant=True`, each prompt alone vs inside a
    `--batch-size`-request batch. Prints identical counts and first divergences.
(b) cost: the `latency` workload (batch 1, 128 in, 512 out, greedy) and the `throughput` workload (256
    requests), each `--iters` times (the median reported, every run kept), per variant (`--variants`:
    default, batch_invariant, no_megakernel; also fp8_kv, fp8, fp8_both), in one process, as tokens/s
    and as ratios to the default.
    For "today's build" run `--part cost --variants default` on the commit before the change (the
    script only needs the LLM API there).

`--cap N` cuts every workload prompt and output to at most N tokens (a CPU smoke run; not for numbers).
Writes benchmarks/results/determinism_<gpu>.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from benchmarks.common import output_paths, print_table, write_json
from tinyvllm.bench import determinism as det
from tinyvllm.bench.workloads import Workload, latency_workload, throughput_workload
from tinyvllm.llm import LLM
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.sampling_params import SamplingParams

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "batch_invariant": {"batch_invariant": True},
    "no_megakernel": {"decode_megakernel": False},
    # not determinism: other engine settings whose cost is measured the same way (issue #36)
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8": {"quantization": "fp8"},
    "fp8_both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def _engine(ns: argparse.Namespace, **kw: Any) -> LLM:
    extra = {"kv_cache_memory_bytes": ns.kv_bytes} if ns.kv_bytes else {}
    return LLM(model=str(resolve_model(ns.model)), dtype=ns.dtype, device=ns.device, **extra, **kw)


def _collect() -> None:
    """Free the engines the caller has dropped (an LLM holds its weights and KV cache until collected)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reproducibility(ns: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for kind in ("greedy", "seeded"):
        first = _engine(ns, enable_prefix_caching=False)
        ps = det.prompts(ns.num_prompts, first.llm_engine.model_config.vocab_size)
        a = det.run_alone(first, ps, kind, ns.max_tokens)
        del first
        _collect()
        second = _engine(ns, enable_prefix_caching=False)
        b = det.run_alone(second, ps, kind, ns.max_tokens)
        det.other_traffic(second, ns.traffic, ns.max_tokens)
        c = det.run_alone(second, ps, kind, ns.max_tokens)
        del second
        _collect()
        inv = _engine(ns, batch_invariant=True)
        alone = det.run_alone(inv, ps, kind, ns.max_tokens)
        batched = det.run_in_batch(inv, ps, kind, ns.max_tokens, ns.batch_size)
        del inv
        _collect()
        out[kind] = {
            "default: fresh engine vs fresh engine": det.compare(a, b).as_dict(),
            "default: fresh engine vs after other traffic": det.compare(a, c).as_dict(),
            f"batch_invariant: alone vs in a {ns.batch_size}-request batch": det.compare(alone, batched).as_dict(),
        }
    rows = [
        {"kind": kind, "check": check, "same": f"{r['identical']}/{r['total']}", "first": _first(r)}
        for kind, checks in out.items()
        for check, r in checks.items()
    ]
    print_table(
        f"reproducibility: {ns.num_prompts} prompts x {ns.max_tokens} tokens ({ns.model}, {ns.dtype})",
        rows,
        [("kind", "", "s"), ("check", "check", "s"), ("same", "identical", "s"), ("first", "first divergence", "s")],
    )
    return out


def _first(r: dict) -> str:
    return ", ".join(f"#{d['request']}@{d['step']}" for d in r["first_divergence"]) or "-"


def _cap(w: Workload, cap: int | None) -> Workload:
    if not cap:
        return w
    return Workload([p[:cap] for p in w.prompts], [min(m, cap) for m in w.max_tokens], w.temperature)


def _inputs(w: Workload, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [t % vocab for t in p]} for p in w.prompts]


def _warm(llm: LLM, w: Workload) -> None:
    """Compile every kernel variant the timed run will meet (see bench/offline.py `_warm_up`)."""
    head = Workload(w.prompts[:16], [4] * min(16, len(w.prompts)), w.temperature)
    sp = [SamplingParams(temperature=w.temperature, max_tokens=m, ignore_eos=True) for m in head.max_tokens]
    llm.generate(_inputs(head, llm.llm_engine.model_config.vocab_size), sp, use_tqdm=False)


def cost(ns: argparse.Namespace) -> dict:
    lat_w = _cap(latency_workload(128, ns.latency_output_len), ns.cap)
    thr_w = _cap(throughput_workload(ns.throughput_prompts), ns.cap)
    results: dict[str, dict] = {}
    for name in ns.variants:
        # graphs captured up front, as the offline benches do: the timed runs are steady state
        llm = _engine(ns, graph_capture="eager", **VARIANTS[name])
        vocab = llm.llm_engine.model_config.vocab_size
        _warm(llm, lat_w)
        sp = SamplingParams(temperature=0.0, max_tokens=lat_w.max_tokens[0], ignore_eos=True)
        rates = []
        for _ in range(ns.iters):
            (o,) = llm.generate(_inputs(lat_w, vocab), sp, use_tqdm=False)
            m = o.metrics
            rates.append((len(o.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
        _warm(llm, thr_w)
        sps = [SamplingParams(temperature=thr_w.temperature, max_tokens=m, ignore_eos=True) for m in thr_w.max_tokens]
        runs = []
        for _ in range(ns.iters):
            start = time.perf_counter()
            outs = llm.generate(_inputs(thr_w, vocab), sps, use_tqdm=False)
            seconds = time.perf_counter() - start
            runs.append((sum(len(o.outputs[0].token_ids) for o in outs) / seconds, seconds))
            del outs
        runs.sort()
        results[name] = {
            "latency_decode_tokens_per_s": statistics.median(rates),
            "latency_runs": rates,
            "throughput_output_tokens_per_s": runs[len(runs) // 2][0],  # the median run
            "throughput_seconds": runs[len(runs) // 2][1],
            "throughput_runs": [r for r, _ in runs],
        }
        del llm
        _collect()
    base = results.get("default")
    rows = []
    for name, r in results.items():
        row = {"variant": name, "lat": r["latency_decode_tokens_per_s"], "thr": r["throughput_output_tokens_per_s"]}
        if base:
            row["lat_ratio"] = r["latency_decode_tokens_per_s"] / base["latency_decode_tokens_per_s"]
            row["thr_ratio"] = r["throughput_output_tokens_per_s"] / base["throughput_output_tokens_per_s"]
        rows.append(row)
    print_table(
        f"cost: latency (batch 1, decode tok/s) and throughput ({len(thr_w.prompts)} requests, output tok/s)",
        rows,
        [
            ("variant", "", "s"),
            ("lat", "latency tok/s", ".0f"),
            ("lat_ratio", "vs default", ".3f"),
            ("thr", "throughput tok/s", ".0f"),
            ("thr_ratio", "vs default", ".3f"),
        ],
    )
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-bytes", type=int, default=None, help="KV cache bytes (default: the engine's sizing)")
    p.add_argument("--part", choices=["repro", "cost", "all"], default="all")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--traffic", type=int, default=64, help="requests of other traffic between runs")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--latency-output-len", type=int, default=512)
    p.add_argument("--throughput-prompts", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cap", type=int, default=None, help="cut workload prompts and outputs to this many tokens")
    p.add_argument("--out-dir", default=None)
    ns = p.parse_args(argv)
    result: dict[str, Any] = {"args": vars(ns)}
    if ns.part in ("repro", "all"):
        result["reproducibility"] = reproducibility(ns)
    if ns.part in ("cost", "all"):
        result["cost"] = cost(ns)
    json_path, _ = output_paths(ns.out_dir, "determinism")
    write_json(json_path, result)


if __name__ == "__main__":
    main()
