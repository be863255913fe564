"""A served engine in its own process (the server's default topology) with grammar workers: the workers
start as subprocesses of the engine's process on the first constrained request, a burst of constrained
requests comes back valid, and no worker outlives the server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_DEFAULTS, MODEL_NAME, start_server
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.mp_client import MPAsyncLLMEngine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "bc"]}}},
    "required": ["id"],
    "additionalProperties": False,
}


def _grammar_workers(parent: int) -> set[int]:
    """Pids of the grammar worker processes whose parent is process `parent`."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and b"tinyvllm.structured.grammar_worker" in cmdline:
                pids.add(int(entry.name))
    return pids


def _until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_served_engine_with_grammar_workers(model_dir):
    args = EngineArgs(model=str(model_dir), **{**ENGINE_DEFAULTS, "max_num_seqs": 32}, structured_outputs_workers=2)
    engine = MPAsyncLLMEngine(args).start(timeout=120)
    live = start_server(engine)
    core = engine._proc.pid  # the engine's process, the workers' parent
    workers: set[int] = set()
    try:

        def ask(i: int) -> dict:
            body = {
                "model": MODEL_NAME,
                "prompt": f"record {i}:",
                "max_tokens": 48,
                "seed": i,
                "temperature": 1.0,
                "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
            }
            r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        ask(0)  # builds the engine's grammar manager, which starts the workers
        assert _until(lambda: len(_grammar_workers(core)) == 2, 60), "two grammar workers"
        workers = _grammar_workers(core)
        time.sleep(3)  # their start-up (imports, the vocabulary) before the burst
        with ThreadPoolExecutor(24) as pool:
            choices = list(pool.map(ask, range(1, 25)))
        done = [c for c in choices if c["finish_reason"] == "stop"]
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)
        for c in done:
            jsonschema.validate(json.loads(c["text"]), SCHEMA)
        assert done, "some outputs complete within 48 tokens"
    finally:
        live.stop()
    assert workers and _until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 30), (
        "the workers exit with the server"
    )
