"""Tensor parallelism on the CPU (gloo, two ranks, float32) against the same model on one rank.

Every family's greedy tokens under TP=2 equal TP=1's, token for token, in a regime that batches four
requests, chunks their prompts (16-token budget) and preempts them (18 blocks of 7 tokens for ~250
tokens of work); the checkpoints include one with fewer KV heads than ranks (replicated KV heads) and
an untied LM head. Greedy choices of both runs are checked to be clear of near-ties first, so exact
equality is a fair test although the all-reduces sum in another order. Seeded sampling gives the same
ids too. Each rank's weights are checked against the slices of the checkpoint's tensors it should hold.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors import safe_open

from tests.helpers import LOGPROB_ATOL, assert_equal_up_to_rounding, assert_greedy_is_decided
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ModelConfig
from tinyvllm.distributed.group import TPGroup
from tinyvllm.distributed.shard import ModelShard
from tinyvllm.kernels import get_ops
from tinyvllm.models.checkpoint import write_dummy_checkpoint
from tinyvllm.models.loader import build_model
from tinyvllm.models.presets import make_config

INIT_STD = 0.1  # a confident random model: near-ties between its two best tokens are rare
MAX_NEW = 12
LENGTHS = [5, 29, 47, 83]
# batched, chunked (16-token steps) and preempted (126 slots for ~250 tokens of work)
REGIME = dict(block_size=7, num_gpu_blocks_override=18, max_model_len=112, max_num_batched_tokens=16)
CHECKPOINTS = {
    "llama": ("tiny", {}),
    "llama-1kv-untied": ("tiny", {"num_key_value_heads": 1, "tie_word_embeddings": False}),
    "qwen3": ("tiny-qwen3", {}),
    "qwen2": ("tiny-qwen2", {}),
    "mistral": ("tiny-mistral", {}),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def write_checkpoint(tmp_path_factory, name: str):
    preset, overrides = CHECKPOINTS[name]
    config = make_config(preset, **overrides)
    path = tmp_path_factory.mktemp(name)
    write_dummy_checkpoint(path, config, seed=7, init_std=INIT_STD, dtype="float32")
    return path, config


def make_prompts(vocab: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab - 256) for _ in range(n)]} for n in LENGTHS]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def as_tuples(steps) -> list:
    """Logprob entries (msgspec Structs) as (logprob, rank, text) tuples, for assert_equal_up_to_rounding."""
    return [None if s is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in s.items()} for s in steps]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_greedy_equals_tp1(tmp_path_factory, name):
    path, config = write_checkpoint(tmp_path_factory, name)
    prompts = make_prompts(config["vocab_size"])
    one = LLM(model=str(path), device="cpu", dtype="float32", **REGIME)
    assert_greedy_is_decided(one, prompts, MAX_NEW)
    want = token_ids(one, prompts, GREEDY)
    two = LLM(model=str(path), device="cpu", dtype="float32", tensor_parallel_size=2, **REGIME)
    try:
        assert two.llm_engine.runner.runner.shard.num_kv_heads == max(1, config["num_key_value_heads"] // 2)
        assert token_ids(two, prompts, GREEDY) == want
        metrics = two.get_metrics()
        assert metrics["num_preemptions"] > 0, "the regime was meant to force preemption"
        assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"], "blocks leaked"
        if name == "llama":  # seeded sampling: the same ids as one rank's; logprobs from the gathered logits
            seeded = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=MAX_NEW) for i in range(len(prompts))]
            assert token_ids(two, prompts, seeded) == token_ids(one, prompts, seeded)
            scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
            got, want = (
                [
                    (as_tuples(o.prompt_logprobs), as_tuples(o.outputs[0].logprobs))
                    for o in llm.generate(prompts, scored, use_tqdm=False)
                ]
                for llm in (two, one)
            )
            assert_equal_up_to_rounding(got, want, atol=LOGPROB_ATOL)
    finally:
        two.llm_engine.shutdown()
    workers = two.llm_engine.runner.workers.values()
    assert all(p.poll() is not None for p in workers), "a worker outlived shutdown"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_slices(tmp_path_factory, rank):
    """Rank r's parameters are exactly the checkpoint slices distributed/shard.py assigns it: its q heads
    and its (replicated) KV head in QKV, its columns of o_proj and down_proj, its rows of gate/up, its
    vocabulary rows of the embedding and the untied LM head."""
    path, cfg = write_checkpoint(tmp_path_factory, "llama-1kv-untied")
    config = ModelConfig.from_dict(cfg)
    shard = ModelShard.for_rank(config, rank, 2)
    group = TPGroup(rank, 2, device_group=None, cpu_group=None)  # loading runs no collective
    model = build_model(
        config,
        get_ops("torch"),
        model_dir=path,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_positions=64,
        shard=shard,
        group=group,
    )
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        hf = {name: f.get_tensor(name) for name in list(f.keys())}  # safe_open cannot be iterated
    d, f_half, v_half = config.head_dim, config.intermediate_size // 2, config.vocab_size // 2
    heads = slice(rank * 2 * d, (rank + 1) * 2 * d)  # 4 q heads over 2 ranks; 1 KV head on both
    layer, prefix = model.layers[1], "model.layers.1"
    want_qkv = torch.cat(
        [
            hf[f"{prefix}.self_attn.q_proj.weight"][heads],
            hf[f"{prefix}.self_attn.k_proj.weight"],
            hf[f"{prefix}.self_attn.v_proj.weight"],
        ]
    )
    assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
    assert torch.equal(layer.self_attn.o_proj.weight, hf[f"{prefix}.self_attn.o_proj.weight"][:, heads])
    cols = slice(rank * f_half, (rank + 1) * f_half)
    want_gate_up = torch.cat([hf[f"{prefix}.mlp.gate_proj.weight"][cols], hf[f"{prefix}.mlp.up_proj.weight"][cols]])
    assert torch.equal(layer.mlp.gate_up_proj.weight, want_gate_up)
    assert torch.equal(layer.mlp.down_proj.weight, hf[f"{prefix}.mlp.down_proj.weight"][:, cols])
    rows = slice(rank * v_half, (rank + 1) * v_half)
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"][rows])
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"][rows])
    assert torch.equal(layer.input_layernorm.weight, hf[f"{prefix}.input_layernorm.weight"])
    assert layer.self_attn.o_proj.reduce_group is group and layer.self_attn.qkv_proj.reduce_group is None
