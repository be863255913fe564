"""benchmarks/structured.py on the CPU: the whole bench with `--repeats 3` at a tiny scale writes its JSON
(every pair's ratio, the reported pair the median one, every completed constrained output parsed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("xgrammar")


def test_structured_bench_repeats(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "benchmarks.structured", "--model", "dummy:tiny", "--device", "cpu"]
    cmd += ["--num-prompts", "6", "--max-output", "8", "--latency-output", "8", "--repeats", "3"]
    proc = subprocess.run(
        [*cmd, "--out-dir", str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "structured_cpu.json").read_text())
    for kind in ("throughput", "latency"):
        runs = data[kind]["runs"]
        assert len(runs) == 3
        for r in runs:
            assert r["ratio"] == pytest.approx(r["constrained"] / r["unconstrained"])
        reported = data[kind]["constrained"]["output_tokens_per_s"] / data[kind]["unconstrained"]["output_tokens_per_s"]
        assert reported == pytest.approx(sorted(r["ratio"] for r in runs)[1])
    assert data["throughput"]["constrained"]["completed_outputs_parse"] in (True, None)
    assert data["compile"]["cold_median_s"] > 0 and data["ttft"]["constrained_cached_s"] > 0
