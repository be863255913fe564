"""Issue #38's table: batch-1 and batch-N decode tok/s with their floors for every preset size, beside
transformers, in one run.

    python -m benchmarks.sizes [--presets llama-3.2-1b ...] [--batches 1 8] [--output-len 256] [--baseline hf]
        [--engine-args "--rows-megakernel"] [--name NAME] [--out-dir DIR]

Each (preset, batch) is one `tinyvllm bench latency` process (so each model's memory is freed before the
next), random weights (`dummy:<preset>`), 128 prompt tokens, greedy; its result JSON carries the floor
(every weight read once plus each row's K/V, at the copy bandwidth measured in that process) and the
fraction. With `--baseline hf` transformers runs the same rows in the same process (its own model copy,
fewer output tokens: `--baseline-output-len`). Prints one table and writes sizes_<gpu>.json with every
row (and each run's own JSON beside it), or NAME.json. The presets: Llama 3.x's three sizes and Qwen3's
four (with transformers, all of them take more than one 10-minute device call: run them in two with
--presets and --name).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from tinyvllm.bench.report import device_tag, print_table, write_json

PRESETS = ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
COLUMNS = [
    ("preset", "preset", ""),
    ("batch", "rows", "d"),
    ("tok_s", "tok/s", ".0f"),
    ("floor_tok_s", "floor", ".0f"),
    ("of_floor", "of floor", ".2f"),
    ("hf_tok_s", "transformers", ".1f"),
    ("speedup", "× transformers", ".0f"),
    ("ttft_ms", "TTFT ms", ".1f"),
]


def run_one(preset: str, batch: int, ns: argparse.Namespace, out_dir: Path) -> dict:
    """One `tinyvllm bench latency` process; its JSON's figures as a table row (`error` if it failed)."""
    name = f"sizes_{preset}_b{batch}_{device_tag()}"
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "bench", "latency", "--model", f"dummy:{preset}"]
    cmd += ["--batch-size", str(batch), "--output-len", str(ns.output_len), "--name", name, "--out-dir", str(out_dir)]
    if ns.baseline:
        cmd += ["--baseline", ns.baseline, "--baseline-output-len", str(ns.baseline_output_len)]
    cmd += shlex.split(ns.engine_args)
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, timeout=ns.timeout)
    path = out_dir / f"{name}.json"
    if proc.returncode != 0 or not path.is_file():
        return {"preset": preset, "batch": batch, "error": f"exit {proc.returncode}"}
    d = json.loads(path.read_text())
    ours, hf = d["ours"]["decode_tokens_per_s"], (d.get("hf") or {}).get("decode_tokens_per_s")
    floor = (d.get("floor") or {}).get("decode_tokens_per_s")  # none on the CPU (no measured ceilings)
    return {
        "preset": preset,
        "batch": batch,
        "tok_s": ours,
        "floor_tok_s": floor,
        "of_floor": d["of_floor"],
        "hf_tok_s": hf,
        "speedup": ours / hf if hf else None,
        "ttft_ms": d["ours"]["ttft_s"] * 1e3,
        "git": d["environment"].get("git"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--baseline", choices=["hf"], default=None)
    ap.add_argument("--baseline-output-len", type=int, default=32)
    ap.add_argument("--engine-args", default="", help="extra engine flags for every run, one string")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results")
    ap.add_argument("--name", default=None, help="the table's JSON name (default sizes_<gpu>)")
    ns = ap.parse_args()
    out_dir = Path(ns.out_dir) if ns.out_dir else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [run_one(p, b, ns, out_dir) for p in ns.presets for b in ns.batches]
    cells = [tuple("-" if r.get(k) is None else format(r[k], f) for k, _, f in COLUMNS) for r in rows]
    header = tuple(h for _, h, _ in COLUMNS)
    print_table(f"decode by model size ({device_tag()}, engine args: {ns.engine_args or 'defaults'})", cells, header)
    write_json(ns.name or f"sizes_{device_tag()}", {"engine_args": ns.engine_args, "rows": rows}, str(out_dir))


if __name__ == "__main__":
    main()
