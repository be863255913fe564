"""`tinyvllm bench serve`: the workload is docs/workloads.md's, and a short run against the live server works."""

from __future__ import annotations

import json
import random

import pytest

from tinyvllm.entrypoints.bench_serve import throughput_workload
from tinyvllm.entrypoints.cli import main


def test_workload_is_the_throughput_set():
    work = throughput_workload()
    assert len(work) == 256 and sum(m for _, m in work) == 133_966  # docs/workloads.md's output-token count
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    assert [p for p, _ in work] == prompts
    assert throughput_workload(3) == work[:3]


def test_short_run_against_the_live_server(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "6",
            "--input-len",
            "5:20",
            "--output-len",
            "4:12",
            "--max-token-id",
            "500",
            "--request-rate",
            "50",
            "inf",
            "--result-file",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and [r["request_rate"] for r in report["runs"]] == [50.0, "inf"]
    want = sum(m for _, m in throughput_workload(6, (5, 20), (4, 12), 500))
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["output_tokens"] == want
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] and run["tpot_ms"]["mean"] > 0
    finite, infinite = report["runs"]
    assert 0 < finite["last_arrival_s"] < finite["duration_s"]
    assert finite["arrival_bound_output_throughput"] == pytest.approx(want / finite["last_arrival_s"])
    assert finite["arrival_bound_output_throughput"] >= finite["output_throughput"]
    assert infinite["last_arrival_s"] == 0 and infinite["arrival_bound_output_throughput"] is None
    out = capsys.readouterr().out
    assert "TTFT p99" in out and "bound tok/s" in out


def test_failures_are_counted(server, tmp_path):
    out = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "2",
            "--input-len",
            "5:20",
            "--output-len",
            "4:12",
            "--max-token-id",
            "100000",
            "--no-warmup",
            "--result-file",
            str(out),
        ]
    )
    run = json.loads(out.read_text())["runs"][0]
    assert rc == 3 and run["failed"] == 2 and "HTTP 400" in run["errors"][0]
