"""Data parallelism without processes: the router's choices on given loads, the placement of cores on
GPUs, the stats the cores add up to, and the configurations refused before anything starts."""

from __future__ import annotations

import pytest

from tinyvllm import LLM
from tinyvllm.config import ParallelConfig
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.dp_client import CorePlacement, aggregate_stats, plan_cores
from tinyvllm.engine.dp_router import Router
from tinyvllm.entrypoints.cli import main

BLOCK = 4


def test_router_picks_the_least_loaded_core_taking_turns_among_equals():
    router = Router(num_cores=3, block_size=BLOCK)
    assert router.choose([5, 2, 7]) == 1
    assert router.choose([3, 3, 1]) == 2
    assert [router.choose([0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert router.choose([4, 1, 1]) == 1
    assert router.choose([4, 1, 1]) == 2
    assert router.choose([1, 0, 3]) == 1


def test_router_spreads_a_burst_evenly():
    """Each choice raises that core's load by one (as the client counts its adds at once)."""
    router = Router(num_cores=4, block_size=BLOCK)
    loads = [0, 0, 0, 0]
    for _ in range(64):
        loads[router.choose(loads)] += 1
    assert loads == [16, 16, 16, 16]


def test_router_sends_a_shared_first_block_to_its_core_within_the_margin():
    router = Router(num_cores=2, block_size=BLOCK, affinity_margin=2)
    prompt = [7, 8, 9, 10, 11]
    key = router.affinity_key(prompt)
    assert key == router.affinity_key([7, 8, 9, 10, 99, 100])  # only the first block counts
    assert key != router.affinity_key([7, 8, 9, 11, 11])
    assert router.choose([3, 1], key) == 1  # first seen: the least loaded, remembered
    assert router.choose([0, 1], key) == 1  # home within 2 of the least
    assert router.choose([0, 2], key) == 1
    assert router.choose([0, 3], key) == 0  # home 3 busier than the least: load wins ...
    assert router.choose([5, 6], key) == 1  # ... but the home stays
    assert router.choose([0, 3], None) == 0


def test_router_has_no_affinity_for_a_prompt_shorter_than_a_block():
    router = Router(num_cores=2, block_size=BLOCK)
    assert router.affinity_key([1, 2, 3]) is None
    assert router.affinity_key([]) is None


def test_router_forgets_the_least_recently_routed_prefix_first():
    router = Router(num_cores=2, block_size=1, affinity_margin=10, max_prefixes=2)
    a, b, c = (router.affinity_key([t]) for t in (1, 2, 3))
    assert router.choose([0, 1], a) == 0
    assert router.choose([1, 0], b) == 1
    assert router.choose([1, 0], a) == 0  # a is used again: b is now the oldest
    assert router.choose([0, 1], c) == 0  # a third prefix: b is forgotten
    assert router.choose([0, 1], b) == 0  # b: the least loaded, no longer core 1; a is forgotten
    assert router.choose([1, 0], c) == 0  # c is remembered
    assert router.choose([1, 0], a) == 1  # a is not


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError):
        Router(num_cores=0, block_size=BLOCK)
    with pytest.raises(ValueError, match="expected 2 loads"):
        Router(num_cores=2, block_size=BLOCK).choose([1, 2, 3])


def test_cores_get_consecutive_gpus():
    plan = plan_cores("cuda", data_parallel_size=2, tensor_parallel_size=2, cuda_device_count=4, visible_devices="")
    assert plan == [
        CorePlacement(0, "cuda", {"CUDA_VISIBLE_DEVICES": "0,1"}),
        CorePlacement(1, "cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}),
    ]
    plan = plan_cores("auto", 3, 1, cuda_device_count=4, visible_devices="4,5, 6,7")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan] == ["4", "5", "6"]
    assert plan_cores("auto", 2, 1, cuda_device_count=0) == [CorePlacement(0, "cpu", {}), CorePlacement(1, "cpu", {})]
    assert plan_cores("cpu", 2) == [CorePlacement(0, "cpu", {}), CorePlacement(1, "cpu", {})]


@pytest.mark.parametrize(
    "device, dp, tp, gpus, message",
    [
        ("cuda", 2, 2, 3, "needs 4 GPUs, but 3 are visible"),
        ("auto", 3, 1, 2, "needs 3 GPUs, but 2 are visible"),
        ("cuda:1", 2, 1, 4, "each core takes GPUs of its own"),
        ("cuda", 2, 1, 0, "no GPU is visible"),
        ("cpu", 0, 1, 0, "must be at least 1"),
    ],
)
def test_impossible_placements_are_value_errors(device, dp, tp, gpus, message):
    with pytest.raises(ValueError, match=message):
        plan_cores(device, dp, tp, cuda_device_count=gpus, visible_devices="")


def test_aggregate_stats_sums_counts_and_weights_the_cache_usage():
    a = {"num_requests_running": 3, "kv_cache_usage": 0.5, "num_kv_blocks": 100, "generation_tokens": 40}
    b = {"num_requests_running": 1, "kv_cache_usage": 0.2, "num_kv_blocks": 300, "generation_tokens": 2}
    total = aggregate_stats([a, b])
    assert total["num_requests_running"] == 4 and total["generation_tokens"] == 42 and total["num_kv_blocks"] == 400
    assert total["kv_cache_usage"] == pytest.approx((50 + 60) / 400)


@pytest.mark.parametrize("dp", [0, -1, 1.5, True])
def test_data_parallel_size_must_be_a_positive_integer(dp):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        ParallelConfig(data_parallel_size=dp)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineArgs(data_parallel_size=dp).parallel_config()


def test_llm_refuses_data_parallel_with_a_pointer_to_serve():
    with pytest.raises(ValueError, match="tinyvllm serve -dp N"):
        LLM("dummy:tiny", device="cpu", data_parallel_size=2)


def test_serve_refuses_impossible_parallel_flags_before_starting(capsys):
    assert main(["serve", "dummy:tiny", "--device", "cpu", "-dp", "0"]) == 2
    assert "data_parallel_size must be a positive integer" in capsys.readouterr().err
    assert main(["serve", "dummy:tiny", "--device", "cpu", "--data-parallel-size", "2", "--engine-in-thread"]) == 2
    assert "drop --engine-in-thread" in capsys.readouterr().err
    assert main(["serve", "dummy:tiny", "--device", "cuda:1", "-dp", "2"]) == 2
    assert "each core takes GPUs of its own" in capsys.readouterr().err
