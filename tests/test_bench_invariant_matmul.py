"""benchmarks/kernels/bench_invariant_matmul.py --smoke: the sweep runs end to end on the CPU interpreter
and writes its JSON (every candidate's product right and with the first candidate's bits, a suggestion
per bucket)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_sweep_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/kernels/bench_invariant_matmul.py"),
            "--smoke",
            "--out-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "invariant_matmul_cpu.json").read_text())
    rows = data["rows"]
    assert {(r["proj"], r["M"]) for r in rows} == {(p, m) for p in ("a", "b") for m in (1, 5, 70)}
    for r in rows:
        assert r["same_bits"], r
        assert r["err_vs_cublas"] < 1e-2, r  # bf16 products, one rounding each
        assert r["t_us"] > 0 and r["cublas_us"] > 0
    assert sum(r["table"] for r in rows) == 6  # the table's choice timed once per case
    assert data["suggested"] and all(s["best_us"] > 0 for s in data["suggested"])
    assert "Best candidate per" in proc.stdout
