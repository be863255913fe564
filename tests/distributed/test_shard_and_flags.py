"""The shard arithmetic on hand-computed cases, and the parallel flags as the CLI spells them."""

from __future__ import annotations

import argparse

from tinyvllm.config import ModelConfig
from tinyvllm.distributed.shard import ModelShard
from tinyvllm.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli
from tinyvllm.models.presets import PRESETS


def test_shards_of_llama_8b_over_4_and_of_replicated_kv_heads():
    config = ModelConfig.from_dict(PRESETS["llama-3.1-8b"])  # 32 q heads, 8 KV heads, F 14336, V 128256
    s = ModelShard.for_rank(config, 3, 4)
    assert (s.num_heads, s.head_start, s.num_kv_heads, s.kv_head_start) == (8, 24, 2, 6)
    assert (s.intermediate_size, s.intermediate_start) == (3584, 10752)
    assert (s.vocab_size, s.vocab_start) == (32064, 96192)
    # 12 q heads, 2 KV heads (groups of 6) over 4 ranks: 3 q heads each, KV head 0 on ranks 0-1, 1 on 2-3
    qwen = ModelConfig.from_dict({**PRESETS["qwen2.5-1.5b"], "vocab_size": 151936})
    shards = [ModelShard.for_rank(qwen, r, 4) for r in range(4)]
    assert [(x.head_start, x.num_heads) for x in shards] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert [(x.kv_head_start, x.num_kv_heads) for x in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for x in shards:  # every rank's q heads read the KV head it holds
        assert x.head_start // qwen.num_queries_per_kv == (x.head_start + x.num_heads - 1) // 6 == x.kv_head_start


def test_parallel_flags_in_torchrun_spelling():
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    argv = ["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    args = engine_args_from_cli(parser.parse_args(argv))
    assert (args.tensor_parallel_size, args.nnodes, args.node_rank) == (4, 2, 1)
    parallel = args.parallel_config()
    assert (parallel.master_addr, parallel.master_port, list(parallel.node_ranks)) == ("10.0.0.1", 29500, [2, 3])
    long_form = engine_args_from_cli(parser.parse_args(["--tensor-parallel-size", "2"]))
    assert long_form.tensor_parallel_size == 2 and EngineArgs().tensor_parallel_size == 1
