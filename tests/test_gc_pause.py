"""The collector paused during start-up (tinyvllm/gc_pause.py): restored afterwards, frozen where asked,
no automatic collection while an engine is built, and `from tinyvllm import LLM` leaves it enabled."""

from __future__ import annotations

import gc
import subprocess
import sys

from tinyvllm import LLM
from tinyvllm.gc_pause import gc_paused
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint


def test_gc_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off and leaves it off
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # disabled by the caller: stays disabled
    finally:
        gc.enable()


def test_gc_paused_restores_the_collector_when_the_block_raises():
    try:
        with gc_paused():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.isenabled()


def test_gc_paused_freeze_moves_the_block_s_objects_out_of_the_collector():
    before = gc.get_freeze_count()
    try:
        with gc_paused(freeze=True):
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()


def test_collections_inside_gc_paused_are_explicit_only():
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        with gc_paused():
            _ = [[i] for i in range(50_000)]  # far past the youngest generation's threshold (700)
            assert seen == []
            gc.collect()
            assert seen == [2]
    finally:
        gc.callbacks.remove(record)


def test_engine_start_up_runs_no_automatic_collection(tmp_path):
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=0, dtype="float32")
    generations = []

    def record(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64)
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()  # the engine's start-up froze the test process's heap
    assert gc.isenabled()
    assert generations == [2]  # the engine's own full collection before its freeze, nothing automatic
    out = llm.generate([[1, 2, 3]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_importing_llm_leaves_the_collector_enabled_and_frozen():
    code = (
        "import gc; from tinyvllm import LLM; "
        "assert gc.isenabled(), 'collector left off'; "
        "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
