"""`tinyvllm bench startup`: process start → first token, split by phase, with a cold and a warm Triton cache.

Each measurement is a fresh Python process (this module run as a script) that imports tinyvllm, builds
`LLM(...)` with the engine flags given, and generates the first token of one request; the engine's own
record of its start-up phases (`LLMEngine.startup_times`, engine/startup_timing.py) gives the split:

    import            interpreter start to `from tinyvllm import LLM` done (torch, triton, tinyvllm)
    config_tokenizer … engine_state   the engine's phases (engine/startup_timing.py)
    llm_other         the rest of `LLM(...)` (argument checks, the wrapper's own state)
    first_step        `generate` of one prompt with max_tokens=1: the first step's kernels run
                      (and, on a cold cache, compile) for the first time
    ready             process start to `LLM(...)` returned (import + the engine's phases + the rest)
    first_token       process start to the first token

then the same process decodes `--decode-tokens` more tokens of that request (`decode_s`), which with lazy
graph capture captures the batch-1 bucket (`graph_captures`: bucket, warm-up and capture seconds of the
graphs captured after `ready`).

The first process runs with TRITON_CACHE_DIR set to a fresh empty directory (cold: every kernel variant
compiles), the next ones with the same directory (warm: every variant loads from the cache). Kernel
compilation has no phase of its own: it happens inside the phases whose kernels first launch, so the
table's last column, cold − warm per phase, is what compiling costs there. `new_cache_entries` counts
the kernel variants each process added to the cache (0 under TRITON_INTERPRET, which compiles nothing).
The checkpoint (for `dummy:<preset>`, written once) is resolved before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "start-up time, process start to first token, by phase, with a cold and a warm Triton cache"
DEFAULT_MODEL = "dummy:llama-3.2-1b"

# The rows of the table, in the order they happen.
ENGINE_PHASES = (
    "config_tokenizer",
    "device_init",
    "kernels_import",
    "model_init",
    "weights_read",
    "weights",
    "derived_weights",
    "sampler_init",
    "memory_profile",
    "scheduler",
    "kv_allocation",
    "graph_warmup",
    "graph_capture",
    "engine_state",
    "gc_freeze",
)
PHASES = ("import", *ENGINE_PHASES, "llm_other", "first_step")
TOTALS = ("ready", "first_token")


def default_name(model: str, tag: str) -> str:
    """startup_<gpu> for the default model, startup_<preset or directory name>_<gpu> for another."""
    if model == DEFAULT_MODEL:
        return f"startup_{tag}"
    return f"startup_{model.removeprefix('dummy:').rstrip('/').split('/')[-1]}_{tag}"


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from tinyvllm.engine.args import add_engine_cli_args

    add_engine_cli_args(p)
    p.set_defaults(model=DEFAULT_MODEL, dtype="bfloat16")
    p.add_argument("--warm-runs", type=int, default=2, help="processes after the cold one, on its cache")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of the first request")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the first one")
    p.add_argument(
        "--triton-cache-dir",
        default=None,
        help="the cache the processes share (must be empty for a cold first run; default: a fresh temp dir)",
    )
    p.add_argument(
        "--compile-bytecode",
        default=None,
        metavar="DIR",
        help="compile the packages the engine imports into DIR and run the processes with "
        "PYTHONPYCACHEPREFIX=DIR: what `pip install` gives, on images that ship no bytecode and set "
        "PYTHONDONTWRITEBYTECODE (default: run with whatever bytecode is installed)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one process may take")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default=None, help="JSON file name without .json (default: startup[_<preset>]_<gpu>)")


def run(ns: argparse.Namespace) -> int:
    run_startup(ns)
    return 0


def _cache_entries(cache_dir: Path) -> int:
    return sum(1 for _ in cache_dir.iterdir()) if cache_dir.is_dir() else 0


def measure_once(
    engine_args: dict[str, Any],
    cache_dir: Path,
    prompt_len: int,
    decode_tokens: int,
    timeout: float,
    env_extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One fresh process (`_child`) with TRITON_CACHE_DIR=`cache_dir` (and `env_extra`): its phases
    (seconds), totals, graph captures and the cache entries it added."""
    with tempfile.TemporaryDirectory(prefix="tinyvllm_startup_") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "result.json"
        spec.write_text(
            json.dumps({"engine_args": engine_args, "prompt_len": prompt_len, "decode_tokens": decode_tokens})
        )
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), **(env_extra or {}))
        before = _cache_entries(cache_dir)
        spawn = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "tinyvllm.bench.startup", str(spawn), str(spec), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the start-up process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    result["new_cache_entries"] = _cache_entries(cache_dir) - before
    return result


def run_startup(ns: argparse.Namespace) -> dict[str, Any]:
    from tinyvllm.bench.report import print_table, write_json
    from tinyvllm.engine.args import engine_args_from_cli
    from tinyvllm.models.checkpoint import resolve_model

    if ns.warm_runs < 1:
        raise ValueError(f"--warm-runs must be at least 1 (the warm figures), got {ns.warm_runs}")
    args = engine_args_from_cli(ns).replace(model=str(resolve_model(ns.model)))
    owned = None
    if ns.triton_cache_dir is None:
        owned = tempfile.TemporaryDirectory(prefix="tinyvllm_triton_cache_")
        cache_dir = Path(owned.name)
    else:
        cache_dir = Path(ns.triton_cache_dir)
        if _cache_entries(cache_dir):
            print(f"warning: {cache_dir} is not empty: the first run is not cold")
    env_extra = {}
    if ns.compile_bytecode is not None:
        env_extra["PYTHONPYCACHEPREFIX"] = str(Path(ns.compile_bytecode).resolve())
        _compile_engine_bytecode(Path(env_extra["PYTHONPYCACHEPREFIX"]), ns.timeout)
    try:
        runs = [measure_once(vars(args), cache_dir, ns.prompt_len, ns.decode_tokens, ns.timeout, env_extra)]
        if env_extra and runs[0]["modules_from_source"]:  # what the probe missed, for the warm runs
            from tinyvllm.bench.bytecode import compile_packages, package_dirs

            compile_packages(Path(env_extra["PYTHONPYCACHEPREFIX"]), package_dirs(runs[0]["modules_from_source"]))
        runs += [
            measure_once(vars(args), cache_dir, ns.prompt_len, ns.decode_tokens, ns.timeout, env_extra)
            for _ in range(ns.warm_runs)
        ]
        for r in runs:  # the count, and a few names
            names = r["modules_from_source"]
            r["modules_from_source"], r["modules_from_source_sample"] = len(names), names[:20]
    finally:
        if owned is not None:
            owned.cleanup()
    cold, warm = runs[0], runs[1:]
    keys = (*PHASES, *TOTALS)
    warm_median = {k: statistics.median(r["seconds"][k] for r in warm) for k in keys}
    rows = [
        (k, f"{cold['seconds'][k]:.3f}", f"{warm_median[k]:.3f}", f"{cold['seconds'][k] - warm_median[k]:+.3f}")
        for k in keys
    ]
    decode_warm = statistics.median(r["decode_s"] for r in warm)
    rows.append(
        (
            f"then {ns.decode_tokens} decode tokens",
            f"{cold['decode_s']:.3f}",
            f"{decode_warm:.3f}",
            f"{cold['decode_s'] - decode_warm:+.3f}",
        )
    )
    rows.append(("new Triton cache entries", str(cold["new_cache_entries"]), str(warm[0]["new_cache_entries"]), ""))
    rows.append(
        ("modules compiled from source", str(cold["modules_from_source"]), str(warm[0]["modules_from_source"]), "")
    )
    device = cold["device"]
    print_table(
        f"startup: {ns.model} on {device}, graph_capture={args.graph_capture}"
        f"{', enforce_eager' if args.enforce_eager else ''} (seconds; warm: median of {len(warm)})",
        rows,
        ("phase", "cold cache", "warm cache", "cold - warm (compiling)"),
    )
    for name, r in (("cold", cold), ("warm", warm[0])):
        caps = ", ".join(f"{b}: {w:.2f}+{c:.2f} s" for b, w, c in r["graph_captures"])
        print(
            f"{name}: graphs captured in the first {ns.decode_tokens} decode tokens (bucket: warm-up+capture): {caps}"
        )
    result = {
        "workload": "startup",
        "model": ns.model,
        "device": device,
        "cold": cold,
        "warm": warm,
        "warm_median": warm_median,
        "bytecode": {"pycache_prefix": env_extra.get("PYTHONPYCACHEPREFIX")},  # None: as installed
        "engine_args": vars(args),
    }
    tag = "cpu" if device == "cpu" else _gpu_tag()
    write_json(ns.name or default_name(ns.model, tag), result, Path(ns.out_dir))
    return result


def _compile_engine_bytecode(prefix: Path, timeout: float) -> None:
    """Compile into `prefix` every package (standard library included: a prefix tree replaces the
    `__pycache__` directories) that a process importing the engine and its kernels loads."""
    from tinyvllm.bench.bytecode import compile_packages, package_dirs

    probe = subprocess.run(
        [sys.executable, "-m", "tinyvllm.bench.startup", "--import-probe"],
        env=dict(os.environ, PYTHONPYCACHEPREFIX=str(prefix)),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    failed = compile_packages(prefix, package_dirs(json.loads(probe.stdout)))
    if failed:
        print(f"note: {failed} package paths had files that do not compile (left to import from source)")


def _import_probe() -> None:
    """Import what the engine imports (its kernels where Triton is installed) and print the module names."""
    import importlib

    for name in ("tinyvllm.llm", "tinyvllm.engine.llm_engine", "tinyvllm.engine.model_runner"):
        importlib.import_module(name)
    with contextlib.suppress(ImportError):
        importlib.import_module("tinyvllm.kernels.triton_ops")
    print(json.dumps(sorted(sys.modules)))


def _gpu_tag() -> str:
    from tinyvllm.bench.report import device_tag

    return device_tag()


# ---------------------------------------------------------------------------------------------- the process
def _child(spawn_time: float, spec_path: str, out_path: str) -> None:
    """Runs in the fresh process: import, build, first token, a short decode; writes the timings."""
    from tinyvllm import LLM, SamplingParams

    imported = time.time()
    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(**spec["engine_args"])
    ready = time.time()
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    captured_at_ready = 0 if graphs is None else len(graphs.capture_log)
    vocab = engine.model_config.vocab_size
    prompt = {"prompt_token_ids": [(7 * i + 3) % vocab for i in range(spec["prompt_len"])]}
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first_token = time.time()
    assert len(first[0].outputs[0].token_ids) == 1
    decode = SamplingParams(temperature=0.0, max_tokens=1 + spec["decode_tokens"], ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt, decode, use_tqdm=False)
    decode_s = time.perf_counter() - start
    seconds = {"import": imported - spawn_time, **engine.startup_times}
    seconds["llm_other"] = (ready - imported) - sum(engine.startup_times.values())
    seconds["first_step"] = first_token - ready
    seconds["ready"] = ready - spawn_time
    seconds["first_token"] = first_token - spawn_time
    from tinyvllm.bench.bytecode import modules_from_source

    from_source = modules_from_source()
    result = {
        "seconds": {k: seconds.get(k, 0.0) for k in (*PHASES, *TOTALS)},
        # modules this process compiled from source for want of cached bytecode
        "modules_from_source": from_source,
        "decode_s": decode_s,
        # (bucket, warm-up s, capture s) of the graphs captured after `ready` (lazy capture)
        "graph_captures": [] if graphs is None else [list(c) for c in graphs.capture_log[captured_at_ready:]],
        "device": str(engine.device),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--import-probe"]:
        _import_probe()
    else:
        _child(float(sys.argv[1]), sys.argv[2], sys.argv[3])
