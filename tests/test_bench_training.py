"""benchmarks/bench_training.py: the comparison of training runs, on hand-written logs, and the whole bench
once on the CPU at a toy size (three runs of scripts/train_demo_model.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_training import compare, main, summary


def log(curve: list[tuple[int, float]], best_val: float, chosen: int = 1) -> dict:
    """A training_log.json with the curve in run `chosen` (the other run is a decoy)."""
    run = {
        "steps": curve[-1][0],
        "seconds": 2.0,
        "tokens_per_second": 100.0,
        "best_val_loss": best_val,
        "train_curve": [{"step": s, "train_loss": v} for s, v in curve],
    }
    decoy = {**run, "best_val_loss": 99.0, "train_curve": [{"step": 1, "train_loss": 99.0}]}
    return {"runs": [decoy, run] if chosen == 1 else [run, decoy], "chosen_run": chosen}


def test_compare_uses_the_chosen_runs_over_their_common_steps():
    a = log([(10, 5.0), (20, 4.0), (30, 3.5)], best_val=3.6)
    b = log([(10, 5.5), (20, 3.9), (40, 1.0)], best_val=3.4, chosen=0)
    got = compare(a, b)
    assert got["common_steps"] == 2  # steps 10 and 20; 30 and 40 are each in one curve only
    assert got["max_abs_train_loss_diff"] == pytest.approx(0.5)
    assert got["mean_abs_train_loss_diff"] == pytest.approx(0.3)
    assert got["best_val_loss_diff"] == pytest.approx(0.2)
    assert summary(a)["final_train_loss"] == 3.5 and summary(b)["steps"] == 40


def test_same_seed_runs_agree_and_another_seed_does_not(tmp_path, monkeypatch):
    """On the CPU `--attention tinyvllm` runs the torch reference attention (without TRITON_INTERPRET, which
    would interpret our kernels: minutes a step; their gradients are tested in tests/kernels), so the
    same-seed runs differ only by rounding; a different seed (initial weights, batches) moves the curve."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    train = (
        "--device cpu --max-steps 6 --epochs 1 --layers 2 --hidden-size 64 --intermediate-size 128 --heads 4 "
        "--kv-heads 2 --head-dim 16 --seq-len 64 --batch-size 2 --vocab-size 512"
    )
    result = main(["--train-args", train, "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "training_attention_cpu.json").read_text())["runs"] == result["runs"]
    same, other = result["ours_vs_sdpa_same_seed"], result["sdpa_seed_1_vs_seed_0"]
    assert same["common_steps"] >= 1 and same["common_steps"] == other["common_steps"]
    assert same["max_abs_train_loss_diff"] < 1e-4 and same["best_val_loss_diff"] < 1e-4
    assert other["best_val_loss_diff"] > 1e-3
