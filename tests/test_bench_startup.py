"""`tinyvllm bench startup` on the CPU: fresh processes, every phase, cold and warm (tinyvllm/bench/startup.py).

Independent checks: the processes' wall clock (process start to `LLM(...)` returned, read outside the
engine) must cover the engine's own phase record, the weights phase must grow with the checkpoint's size,
and the JSON must carry every phase of every run."""

from __future__ import annotations

import json

from tinyvllm.bench.startup import ENGINE_PHASES, PHASES, TOTALS
from tinyvllm.entrypoints.cli import build_parser, extra_subcommands
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint


def _run(model_dir, out_dir, name: str, *extra: str) -> dict:
    ns = build_parser(extra_subcommands()).parse_args(
        [
            "bench",
            "startup",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--warm-runs",
            "1",
            "--prompt-len",
            "8",
            "--decode-tokens",
            "2",
            "--max-model-len",
            "64",
            "--out-dir",
            str(out_dir),
            "--name",
            name,
            *extra,
        ]
    )
    assert ns.func(ns) == 0
    return json.loads((out_dir / f"{name}.json").read_text())


def test_bench_startup_reports_every_phase_cold_and_warm(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    write_dummy_checkpoint(small, make_config("tiny"), seed=0, dtype="float32")
    # 8 layers of hidden 1024 instead of 2 of 64: ~320 MB of float32 weights instead of ~0.4 MB
    write_dummy_checkpoint(
        big, make_config("tiny", hidden_size=1024, intermediate_size=2048, num_hidden_layers=8), seed=0, dtype="float32"
    )
    result = _run(small, tmp_path, "small", "--compile-bytecode", str(tmp_path / "pyc"))
    assert result["workload"] == "startup" and result["device"] == "cpu"
    runs = [result["cold"], *result["warm"]]
    assert len(runs) == 2
    for run in runs:
        seconds = run["seconds"]
        assert set(seconds) == set(PHASES) | set(TOTALS)
        assert all(v >= 0 for k, v in seconds.items() if k != "llm_other"), seconds
        assert seconds["import"] > 0 and seconds["weights"] > 0 and seconds["first_step"] > 0
        engine = sum(seconds[k] for k in ENGINE_PHASES)
        # the wall clock outside the engine covers the engine's own record (up to float rounding)
        assert seconds["ready"] >= seconds["import"] + engine - 1e-6
        assert abs(seconds["first_token"] - sum(seconds[k] for k in PHASES)) < 1e-6
        assert seconds["first_token"] > seconds["ready"]
        assert run["graph_captures"] == []  # no CUDA graphs on the CPU
        assert run["new_cache_entries"] == 0  # the interpreter compiles nothing
        assert run["decode_s"] > 0
    # every module the warm process imported was read as bytecode from the tree the bench compiled
    assert result["bytecode"]["pycache_prefix"] == str((tmp_path / "pyc").resolve())
    assert result["warm"][0]["modules_from_source"] == 0, result["warm"][0]["modules_from_source_sample"]
    big_result = _run(big, tmp_path, "big")
    assert big_result["cold"]["seconds"]["weights"] > result["cold"]["seconds"]["weights"]


def test_result_names_carry_the_model_unless_it_is_the_default():
    from tinyvllm.bench.startup import DEFAULT_MODEL, default_name

    assert default_name(DEFAULT_MODEL, "h200") == "startup_h200"
    assert default_name("dummy:llama-3.1-8b", "h200") == "startup_llama-3.1-8b_h200"
    assert default_name("/models/Qwen3-8B/", "h100") == "startup_Qwen3-8B_h100"


def test_modules_from_source_sees_a_prefix_without_bytecode_and_compile_packages_fills_it(tmp_path):
    """A process whose PYTHONPYCACHEPREFIX names an empty tree compiles `email.mime.text` from source;
    after `compile_packages` writes the `email` package there, it reads it as bytecode."""
    import os
    import subprocess
    import sys

    from tinyvllm.bench.bytecode import compile_packages, package_dirs

    prefix = tmp_path / "pyc"
    probe = (
        "import json, email.mime.text; from tinyvllm.bench.bytecode import modules_from_source; "
        "print(json.dumps(modules_from_source()))"
    )
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(prefix), PYTHONDONTWRITEBYTECODE="1")

    def from_source() -> list[str]:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    assert "email.mime.text" in from_source()
    assert compile_packages(prefix, package_dirs(["email.mime.text"])) == 0
    assert "email.mime.text" not in from_source()
