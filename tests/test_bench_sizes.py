"""benchmarks/sizes.py: issue #38's table, once on the CPU at the toy preset (one `tinyvllm bench latency`
process per row), and its default presets against the model registry."""

from __future__ import annotations

import json
import sys

from benchmarks import sizes
from tinyvllm.models.presets import PRESETS


def test_default_presets_are_llama_and_every_qwen3_size():
    assert all(p in PRESETS for p in sizes.PRESETS)
    assert {p for p in PRESETS if p.startswith("qwen3-")} <= set(sizes.PRESETS)
    assert {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"} <= set(sizes.PRESETS)


def test_table_rows_come_from_each_run_json(tmp_path, monkeypatch):
    argv = ["sizes", "--presets", "tiny", "--batches", "1", "2", "--output-len", "4"]
    monkeypatch.setattr(sys, "argv", [*argv, "--name", "table", "--out-dir", str(tmp_path)])
    sizes.main()
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert [(r["preset"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    for r in rows:
        assert "error" not in r, r
        own = json.loads(next(tmp_path.glob(f"sizes_tiny_b{r['batch']}_*.json")).read_text())
        assert r["tok_s"] == own["ours"]["decode_tokens_per_s"] > 0
        assert r["of_floor"] == own["of_floor"]  # None on the CPU: no measured ceilings
