"""A tensor-parallel worker that dies or hangs mid-generation: `step()` raises WorkerDiedError within a
bounded time (the issue's bound: 30 s) instead of hanging, every later step raises it at once, and
shutdown leaves no worker process behind. Impossible configurations are ValueErrors before any process
starts."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ModelConfig, ParallelConfig
from tinyvllm.distributed.driver import WorkerDiedError
from tinyvllm.engine.llm_engine import check_tensor_parallel
from tinyvllm.models.checkpoint import write_dummy_checkpoint
from tinyvllm.models.presets import PRESETS, make_config

DETECT_BOUND_S = 30.0  # the bound on noticing a dead worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, dtype="float32")
    return path


def run_until_failure(llm: LLM, hit_worker, delay_s: float) -> float:
    """Step a batch of long requests; `delay_s` after the steps start, `hit_worker(pid)` from another thread.
    Returns the seconds from the hit until step() raised WorkerDiedError."""
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(None, [1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=10_000, ignore_eos=True))
    engine.step()
    (proc,) = engine.runner.workers.values()
    hit_at = []

    def hit():
        hit_at.append(time.monotonic())
        hit_worker(proc.pid)

    timer = threading.Timer(delay_s, hit)
    timer.start()
    with pytest.raises(WorkerDiedError) as err:
        deadline = time.monotonic() + delay_s + 2 * DETECT_BOUND_S
        while time.monotonic() < deadline:
            engine.step()
    timer.join()
    elapsed = time.monotonic() - hit_at[0]
    with pytest.raises(WorkerDiedError):  # the engine stays failed
        engine.step()
    return elapsed, err.value, proc


def test_killed_worker_fails_the_step_and_leaves_no_process(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        elapsed, err, proc = run_until_failure(llm, lambda pid: os.kill(pid, signal.SIGKILL), delay_s=0.5)
        assert elapsed <= DETECT_BOUND_S
        assert "rank 1" in str(err) and "SIGKILL" in str(err)
    finally:
        llm.llm_engine.shutdown()
    assert proc.poll() == -signal.SIGKILL


def test_hung_worker_fails_the_step_after_the_timeout(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2, distributed_timeout_s=3.0)
    try:
        elapsed, err, proc = run_until_failure(llm, lambda pid: os.kill(pid, signal.SIGSTOP), delay_s=0.5)
        assert elapsed <= DETECT_BOUND_S
        assert "stopped answering" in str(err)
    finally:
        llm.llm_engine.shutdown()
    assert proc.poll() is not None, "shutdown left the hung worker running"


def test_idle_engine_notices_a_dead_worker(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        llm.llm_engine.check_health()
        (proc,) = llm.llm_engine.runner.workers.values()
        proc.kill()
        proc.wait()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.llm_engine.check_health()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "overrides, tp, match",
    [
        ({}, 3, "num_attention_heads"),  # 4 heads over 3 ranks
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2, "num_key_value_heads"),
        ({"intermediate_size": 130}, 4, "intermediate_size"),
        ({"vocab_size": 514}, 4, "vocab_size"),
    ],
)
def test_model_that_does_not_split_is_a_value_error(overrides, tp, match):
    config = ModelConfig.from_dict({**PRESETS["tiny"], **overrides})
    with pytest.raises(ValueError, match=match):
        ParallelConfig(tensor_parallel_size=tp).check_model(config)


def test_kv_heads_fewer_than_ranks_split_by_replication():
    config = ModelConfig.from_dict({**PRESETS["tiny"], "num_key_value_heads": 1})  # 4 q heads, 1 KV head
    ParallelConfig(tensor_parallel_size=4).check_model(config)  # each rank: one q head, the KV head


def test_impossible_configs_raise_before_any_process_starts(model_dir, monkeypatch):
    import tinyvllm.distributed.driver as driver

    def no_spawn(*a, **k):
        raise AssertionError("a worker was started for an impossible configuration")

    monkeypatch.setattr(driver, "spawn_worker", no_spawn)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=3, nnodes=2, master_port=29999)
    with pytest.raises(ValueError, match="master-port"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29999)
    with pytest.raises(ValueError, match="headless"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29999)
    with pytest.raises(ValueError, match="FP8"):
        LLM(model=str(model_dir), device="cpu", tensor_parallel_size=2, quantization="fp8")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer GPUs than ranks")
def test_more_ranks_than_gpus_is_a_value_error():
    config = ModelConfig.from_dict(PRESETS["tiny"])
    with pytest.raises(ValueError, match="GPUs on this machine"):
        check_tensor_parallel(ParallelConfig(tensor_parallel_size=2), config, torch.device("cuda"), None)
