"""The demo model trained through our FlashAttention kernels against SDPA (issue #39's training check).

Three runs of `scripts/train_demo_model.py` on the same data and schedule: SDPA from seed 0, our kernels
(`--attention tinyvllm`) from seed 0, and SDPA from seed 1. Same seed means the same initial weights,
batches and dropout masks, so the first two differ only by the attention's arithmetic; the third gives
the spread that a change of seed alone causes, the noise to compare that difference with. Reported per
run: steps, wall seconds, tokens/s, best validation loss; per pair, over the steps both curves logged: the
largest and the mean |Δ train loss|, and |Δ best validation loss|.

    python -m benchmarks.bench_training                                   # GPU: the shipped recipe, one run each
    python -m benchmarks.bench_training --train-args "--device cpu --max-steps 6 --epochs 1 --layers 2 \
        --hidden-size 64 --intermediate-size 128 --heads 4 --kv-heads 2 --head-dim 16 --seq-len 64 --batch-size 2"

Writes training_attention_<gpu or cpu>.json and .png (the three training curves).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import output_paths, plot_lines, write_json

REPO = Path(__file__).resolve().parents[1]
RUNS = (("sdpa, seed 0", "sdpa", 0), ("tinyvllm, seed 0", "tinyvllm", 0), ("sdpa, seed 1", "sdpa", 1))
DEFAULT_TRAIN_ARGS = "--epochs 8 --max-minutes 4"


def train(attention: str, seed: int, out: Path, train_args: list[str]) -> dict:
    """One training run into `out`; its training_log.json. $OUT is unset for the child, so that the
    script does not also pack the model into a device call's output folder."""
    cmd = [sys.executable, str(REPO / "scripts" / "train_demo_model.py"), "--attention", attention]
    cmd += ["--seed", str(seed), "--out", str(out), *train_args]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    return json.loads((out / "training_log.json").read_text())


def chosen_run(log: dict) -> dict:
    """The run the training script kept (one per --epochs entry)."""
    return log["runs"][log["chosen_run"]]


def summary(log: dict) -> dict:
    run = chosen_run(log)
    return {
        "steps": run["steps"],
        "seconds": run["seconds"],
        "tokens_per_second": run["tokens_per_second"],
        "best_val_loss": run["best_val_loss"],
        "final_train_loss": run["train_curve"][-1]["train_loss"] if run["train_curve"] else None,
    }


def compare(a: dict, b: dict) -> dict:
    """Two runs' training curves over the steps both logged: max and mean |Δ train loss|, and |Δ best
    validation loss|."""
    ca = {p["step"]: p["train_loss"] for p in chosen_run(a)["train_curve"]}
    cb = {p["step"]: p["train_loss"] for p in chosen_run(b)["train_curve"]}
    common = sorted(set(ca) & set(cb))
    diffs = [abs(ca[s] - cb[s]) for s in common]
    return {
        "common_steps": len(common),
        "max_abs_train_loss_diff": max(diffs) if diffs else None,
        "mean_abs_train_loss_diff": sum(diffs) / len(diffs) if diffs else None,
        "best_val_loss_diff": abs(chosen_run(a)["best_val_loss"] - chosen_run(b)["best_val_loss"]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-args", default=DEFAULT_TRAIN_ARGS, help="arguments for every training run")
    ap.add_argument("--out-dir", default=None, help="where the JSON and plot go (default benchmarks/results)")
    ap.add_argument("--name", default="training_attention")
    ns = ap.parse_args(argv)
    train_args = shlex.split(ns.train_args)
    logs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, attention, seed in RUNS:
            logs[label] = train(attention, seed, Path(tmp) / f"{attention}-{seed}", train_args)
    ours, ref, other_seed = (logs[label] for label, _, _ in RUNS)
    result = {
        "train_args": train_args,
        "environment": ref["environment"],
        "runs": {label: summary(log) for label, log in logs.items()},
        "ours_vs_sdpa_same_seed": compare(ours, ref),
        "sdpa_seed_1_vs_seed_0": compare(other_seed, ref),
    }
    print(f"\ndemo model training, {ref['environment'].get('device')}")
    print(f"{'run':<18} {'steps':>6} {'seconds':>8} {'tok/s':>10} {'best val loss':>14}")
    for label, s in result["runs"].items():
        rate, val = s["tokens_per_second"], s["best_val_loss"]
        print(f"{label:<18} {s['steps']:>6} {s['seconds']:>8.1f} {rate:>10.0f} {val:>14.4f}")
    for key in ("ours_vs_sdpa_same_seed", "sdpa_seed_1_vs_seed_0"):
        c = result[key]
        print(
            f"{key}: |Δ train loss| max {c['max_abs_train_loss_diff']:.4f}, mean {c['mean_abs_train_loss_diff']:.4f} "
            f"over {c['common_steps']} points; |Δ best val loss| {c['best_val_loss_diff']:.4f}"
        )
    json_path, png_path = output_paths(ns.out_dir, ns.name)
    write_json(json_path, result)
    curves = {}
    for label, log in logs.items():
        points = chosen_run(log)["train_curve"]
        curves[label] = ([p["step"] for p in points], [p["train_loss"] for p in points])
    plot_lines(png_path, [("demo model: training loss", "step", "train loss (nats)", curves)], logx=False)
    return result


if __name__ == "__main__":
    main()
