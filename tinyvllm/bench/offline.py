"""`tinyvllm bench latency | throughput | shared-prefix`: ours beside the anchor and the floor, one run.

Each prints a table (ours, Hugging Face transformers when `--baseline hf`, their ratio, the hardware
floor from the ceilings measured at the start of the run) and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from tinyvllm.bench.report import device_tag, print_table, write_json
from tinyvllm.bench.roofline import Ceilings, ModelCosts, latency_floor, measure_ceilings, throughput_floor
from tinyvllm.bench.workloads import Workload, latency_workload, shared_prefix_workload, throughput_workload
from tinyvllm.engine.args import EngineArgs, engine_args_from_cli
from tinyvllm.engine.step_timing import format_summary, summarize
from tinyvllm.llm import LLM
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams


def _free(*objs: Any) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _engine_args(ns: argparse.Namespace, **changes: Any) -> EngineArgs:
    return engine_args_from_cli(ns).replace(model=str(resolve_model(ns.model)), **changes)


def _params(w: Workload) -> list[SamplingParams]:
    return [SamplingParams(temperature=w.temperature, max_tokens=m, ignore_eos=True, **w.filters) for m in w.max_tokens]


def _costs(llm: LLM) -> ModelCosts:
    """The roofline's counts for the engine's model as it stores it (FP8 weights, FP8 KV cache)."""
    engine = llm.llm_engine
    return ModelCosts.of(
        engine.model_config,
        fp8_weights=engine.quantization is not None,
        fp8_kv_cache=engine.runner.kv_cache_dtype.itemsize == 1,
    )


def _token_ids(prompts: list[list[int]], vocab_size: int) -> list[list[int]]:
    """Workload token ids (drawn from [0, 10000]), folded into small test vocabularies."""
    return [[t % vocab_size for t in p] for p in prompts]


def _prompts(w: Workload, vocab_size: int) -> list[dict]:
    """The workload's prompts as engine inputs (`_token_ids`)."""
    return [{"prompt_token_ids": p} for p in _token_ids(w.prompts, vocab_size)]


def _warm_up(llm: LLM, w: Workload | None = None) -> None:
    """One short request (docs/workloads.md: one warm-up request first), then, when a workload is given, its
    first 16 prompts with 4 output tokens each, sampled as the workload samples (its filters: the
    truncating sampler's kernels): Triton compiles a kernel variant the first time it meets
    a new specialisation (tile config, split count, arguments divisible by 16), and a fresh machine
    otherwise pays seconds of compilation inside the timed run (measured on the H200: 14.0k vs 42.3k
    output tokens/s for the throughput workload, cold vs warm Triton cache)."""
    llm.generate(
        {"prompt_token_ids": list(range(1, 65))}, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    if w is not None:
        vocab = llm.llm_engine.model_config.vocab_size
        head = Workload(w.prompts[:16], [4] * min(16, len(w.prompts)), w.temperature, w.filters)
        llm.generate(_prompts(head, vocab), _params(head), use_tqdm=False)


def triton_compiles() -> dict[str, int]:
    """Kernel variants Triton has compiled in this process so far, per tinyvllm kernel (empty where this
    Triton version hides its cache). A timed run must not compile: the benches report the difference."""
    import importlib
    import pkgutil

    import triton

    import tinyvllm.kernels as package

    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                n = sum(
                    len(c[0])
                    for c in getattr(obj, "device_caches", {}).values()
                    if isinstance(c, tuple) and isinstance(c[0], dict)
                )
                if n:
                    counts[f"{info.name}.{name}"] = n
    return counts


def compiled_since(before: dict[str, int]) -> dict[str, int]:
    """Per kernel, the variants compiled since `before` (a triton_compiles() snapshot)."""
    return {k: n - before.get(k, 0) for k, n in triton_compiles().items() if n > before.get(k, 0)}


def _ceilings(device: torch.device) -> Ceilings | None:
    return measure_ceilings(device) if device.type == "cuda" else None


def _tag(ns: argparse.Namespace) -> str:
    """The machine's part of the default result names: `<workload>_<tag>.json`, e.g. latency_h200.json."""
    return device_tag() if torch.cuda.is_available() and ns.device != "cpu" else "cpu"


def _profile(ns: argparse.Namespace, llm: LLM, w: Workload, device: torch.device, png: str) -> dict | None:
    """With --profile on CUDA: where a decode step's time goes (see tinyvllm.bench.profile)."""
    if not (ns.profile and device.type == "cuda"):
        return None
    from tinyvllm.bench.profile import profile_steps

    return profile_steps(llm, w, ns.out_dir, png_name=png)


def _timed_generate(
    llm: LLM, prompts: list[dict], params: Any, use_tqdm: bool = False
) -> tuple[list[RequestOutput], float, dict[str, int], dict[str, Any]]:
    """llm.generate timed: (outputs, seconds, Triton kernels compiled meanwhile, where the engine
    steps' time went: tinyvllm.engine.step_timing.summarize)."""
    timer = llm.llm_engine.step_timer
    timer.reset(keep_log=True)
    compiled = triton_compiles()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    compiled = compiled_since(compiled)
    steps = summarize(timer.log)
    timer.reset(keep_log=False)
    print(format_summary(steps))
    return outs, elapsed, compiled, steps


def _ttft(out: RequestOutput) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


# ---------------------------------------------------------------------------------------------- latency
def _decode_rate(outs: list[RequestOutput]) -> float:
    """Decode tokens of every row per second: the tokens after each row's first, over the span from the
    first row's first token to the last row's end (rows of one batch decode in the same steps)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    span = max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)
    return tokens / span


def run_latency(ns: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    ceil = _ceilings(device)
    batch = ns.batch_size
    if batch < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch}")
    w = latency_workload(ns.input_len, ns.output_len, batch_size=batch)
    model_dir = resolve_model(ns.model)
    hf = None
    if ns.baseline == "hf":
        from tinyvllm.bench.hf_baseline import hf_latency, load_hf

        model = load_hf(model_dir, device)
        hf = hf_latency(model, _token_ids(w.prompts, model.config.vocab_size), ns.baseline_output_len, device)
        _free(model)
    llm = LLM(**vars(_engine_args(ns)))
    _warm_up(llm)
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    runs = []
    for _ in range(ns.iters):
        outs, _, _, steps = _timed_generate(llm, _prompts(w, llm.llm_engine.model_config.vocab_size), params)
        runs.append(
            {
                "ttft_s": max(_ttft(o) for o in outs),
                "decode_tokens_per_s": _decode_rate(outs),
                "e2e_s": max(o.metrics.finished_time - o.metrics.arrival_time for o in outs),
            }
        )
    ours = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    costs = _costs(llm)
    floor = latency_floor(costs, ns.input_len, ns.output_len, ceil, batch) if ceil else None
    rows = [("tinyvllm", f"{ours['decode_tokens_per_s']:.0f}", f"{ours['ttft_s'] * 1e3:.1f}")]
    if hf:
        rows.append(("transformers", f"{hf['decode_tokens_per_s']:.1f}", f"{hf['ttft_s'] * 1e3:.1f}"))
        rows.append(("ratio ours/hf", f"{ours['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.1f}x", ""))
    if floor:
        rows.append(
            ("floor (weights/bandwidth)", f"{floor['decode_tokens_per_s']:.0f}", f"{floor['ttft_s'] * 1e3:.2f}")
        )
        rows.append(("ours / floor", f"{ours['decode_tokens_per_s'] / floor['decode_tokens_per_s']:.2f}", ""))
    print_table(
        f"latency: batch {batch}, {ns.input_len} in, {ns.output_len} out, greedy ({ns.model})",
        rows,
        ("", "decode tok/s", "TTFT ms"),
    )
    png = f"latency_step_breakdown{'' if batch == 1 else f'_b{batch}'}_{_tag(ns)}.png"
    profile = _profile(ns, llm, w, device, png)
    result = {
        "workload": "latency",
        "model": ns.model,
        "batch_size": batch,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "ours": ours,
        "runs": runs,
        "steps_last_run": steps,
        "hf": hf,
        "floor": floor,
        "of_floor": ours["decode_tokens_per_s"] / floor["decode_tokens_per_s"] if floor else None,
        "ceilings": ceil.__dict__ if ceil else None,
        "profile": profile,
        "engine_args": vars(_engine_args(ns)),
    }
    default_name = f"latency_{_tag(ns)}" if batch == 1 else f"latency_b{batch}_{_tag(ns)}"
    write_json(ns.name or default_name, result, ns.out_dir)
    return result


# ---------------------------------------------------------------------------------------------- throughput
def run_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    ceil = _ceilings(device)
    w = throughput_workload(ns.num_prompts)
    filters = {k: v for k, v in (("top_p", ns.top_p), ("top_k", ns.top_k), ("min_p", ns.min_p)) if v is not None}
    w = Workload(w.prompts, w.max_tokens, w.temperature, filters)
    model_dir = resolve_model(ns.model)
    hf = None
    if ns.baseline == "hf":
        from tinyvllm.bench.hf_baseline import hf_static_batch, load_hf

        model = load_hf(model_dir, device)
        k = min(ns.baseline_requests, len(w.prompts))
        hf = hf_static_batch(
            model, _token_ids(w.prompts[:k], model.config.vocab_size), w.max_tokens[:k], w.temperature, device
        )
        _free(model)
    llm = LLM(**vars(_engine_args(ns)))
    _warm_up(llm, w)
    outs, elapsed, compiled, steps = _timed_generate(
        llm, _prompts(w, llm.llm_engine.model_config.vocab_size), _params(w), use_tqdm=True
    )
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == w.num_output_tokens, (produced, w.num_output_tokens)
    ours = {
        "seconds": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + sum(map(len, w.prompts))) / elapsed,
        "num_preemptions": llm.get_metrics()["num_preemptions"],
        "triton_compiles_in_timed_run": compiled,
        "steps": steps,
    }
    costs = _costs(llm)
    floor = throughput_floor(costs, [len(p) for p in w.prompts], w.max_tokens, ceil) if ceil else None
    rows = [("tinyvllm", f"{ours['output_tokens_per_s']:.0f}", f"{elapsed:.2f}")]
    if hf:
        rows.append(
            (
                f"transformers ({hf['num_requests']} req, static batch)",
                f"{hf['output_tokens_per_s']:.0f}",
                f"{hf['seconds']:.2f}",
            )
        )
        rows.append(("ratio ours/hf", f"{ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.1f}x", ""))
    if floor:
        rows.append(("floor", f"{floor['output_tokens_per_s']:.0f}", f"{floor['seconds']:.2f}"))
        rows.append(("ours / floor", f"{ours['output_tokens_per_s'] / floor['output_tokens_per_s']:.2f}", ""))
    print_table(
        f"throughput: {len(w.prompts)} requests, {produced} output tokens ({ns.model})",
        rows,
        ("", "output tok/s", "seconds"),
    )
    if compiled:
        print(f"warning: Triton compiled kernel variants inside the timed run: {compiled}")
    profile = _profile(ns, llm, w, device, f"throughput_step_breakdown_{_tag(ns)}.png")
    result = {
        "workload": "throughput",
        "model": ns.model,
        "sampling": {"temperature": w.temperature, **w.filters},
        "ours": ours,
        "hf": hf,
        "floor": floor,
        "ceilings": ceil.__dict__ if ceil else None,
        "profile": profile,
        "engine_args": vars(_engine_args(ns)),
    }
    write_json(ns.name or f"throughput_{_tag(ns)}", result, ns.out_dir)
    return result


# ---------------------------------------------------------------------------------------------- shared prefix
def run_shared_prefix(ns: argparse.Namespace) -> dict[str, Any]:
    w = shared_prefix_workload(ns.num_prompts)
    results = {}
    for caching in (False, True):
        llm = LLM(**vars(_engine_args(ns, enable_prefix_caching=caching)))
        _warm_up(llm, shared_prefix_workload(16, seed=1))  # other tokens: nothing of the timed run is cached
        before = llm.get_metrics()
        outs, elapsed, compiled, steps = _timed_generate(
            llm, _prompts(w, llm.llm_engine.model_config.vocab_size), _params(w)
        )
        ttfts = [_ttft(o) for o in outs]
        m = llm.get_metrics()
        results["on" if caching else "off"] = {
            "seconds": elapsed,
            "mean_ttft_s": statistics.fmean(ttfts),
            "p50_ttft_s": statistics.median(ttfts),
            "prefix_cache_hit_tokens": m["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
            "prefix_cache_queried_tokens": m["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"],
            "triton_compiles_in_timed_run": compiled,
            "steps": steps,
        }
        if caching:
            device = torch.device("cuda" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
            results["on"]["profile"] = _profile(ns, llm, w, device, f"shared_prefix_step_breakdown_{_tag(ns)}.png")
        del llm, outs  # free this engine's KV cache before the next one sizes its own
        _free()
    on, off = results["on"], results["off"]
    rows = [
        (
            k,
            f"{v['seconds']:.2f}",
            f"{v['mean_ttft_s'] * 1e3:.0f}",
            f"{v['p50_ttft_s'] * 1e3:.0f}",
            f"{v['prefix_cache_hit_tokens']}/{v['prefix_cache_queried_tokens']}",
            str(sum(v["triton_compiles_in_timed_run"].values())),
        )
        for k, v in results.items()
    ]
    rows.append(
        (
            "off / on",
            f"{off['seconds'] / on['seconds']:.1f}x",
            f"{off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x",
            f"{off['p50_ttft_s'] / on['p50_ttft_s']:.1f}x",
            "",
            "",
        )
    )
    print_table(
        f"shared-prefix: {len(w.prompts)} requests, 1024-token shared prefix + 64, 128 out ({ns.model})",
        rows,
        ("prefix caching", "seconds", "mean TTFT ms", "p50 TTFT ms", "hit/queried tokens", "Triton compiles (timed)"),
    )
    result = {
        "workload": "shared-prefix",
        "model": ns.model,
        **results,
        "speedup_total": off["seconds"] / on["seconds"],
        "speedup_mean_ttft": off["mean_ttft_s"] / on["mean_ttft_s"],
    }
    write_json(ns.name or f"shared_prefix_{_tag(ns)}", result, ns.out_dir)
    return result


# ---------------------------------------------------------------------------------------------- CLI
def add_common_cli_args(p: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM's names) plus the baseline and output options every offline bench shares."""
    from tinyvllm.engine.args import add_engine_cli_args

    add_engine_cli_args(p)
    # eager graph capture: every decode bucket has its graph before the timed run (steady state)
    p.set_defaults(model="dummy:llama-3.2-1b", dtype="bfloat16", graph_capture="eager")
    p.add_argument(
        "--baseline",
        choices=["none", "hf"],
        default="none",
        help="also run Hugging Face transformers' generate on the same weights",
    )
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument(
        "--name", default=None, help="JSON file name without .json (default: <workload>_<gpu>, e.g. latency_h200)"
    )
