"""Parity with the oracle: Hugging Face transformers' LlamaForCausalLM on the same random-weight files.

Greedy `LLM.generate` over a batch must equal transformers' greedy `generate` of each prompt alone,
token for token, under every scheduling regime (preemption, chunked prefill, odd block sizes), and
teacher-forced logits must agree within float32 rounding. Token for token is a fair demand because
`hf_greedy` (tests/helpers.py) checks that rounding decides none of transformers' choices.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import GREEDY_MARGIN, hf_greedy, top2_gaps
from tinyvllm import LLM, SamplingParams
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

transformers = pytest.importorskip("transformers")

# init_std 0.1 instead of HF's 0.02 makes the random model confident enough (logit spread of
# order 1) that near-ties between its two most likely tokens are rare.
INIT_STD = 0.1
MAX_NEW = 24

CONFIGS = {
    # GQA ratio 1, head dim 16, tied, llama3 rope scaling
    "mha_d16_tied_llama3": dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=64),
    # GQA ratio 4, head dim 32, untied, no rope scaling
    "gqa4_d32_untied_norope": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=256,
        tie_word_embeddings=False,
        rope_scaling=None,
        rope_theta=500000.0,
    ),
    # GQA ratio 8, head dim 64, tied, llama3 scaling, 3 layers
    "gqa8_d64_tied_llama3": dict(
        num_attention_heads=8, num_key_value_heads=1, hidden_size=512, intermediate_size=256, num_hidden_layers=3
    ),
    # GQA ratio 2, head dim 16, untied, llama3 scaling, other vocab size
    "gqa2_d16_untied_vocab1000": dict(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=64, tie_word_embeddings=False, vocab_size=1000
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = make_config("tiny", **CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    write_dummy_checkpoint(path, config, seed=1234, init_std=INIT_STD, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return path, hf.eval(), config


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 256) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [5, 17, 33, 48, 64]


@pytest.fixture(scope="module")
def expected(checkpoint):
    _, hf, config = checkpoint
    prompts = make_prompts(config["vocab_size"], LENGTHS)
    return prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def run_ours(path, prompts, **engine_kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(path), device="cpu", dtype="float32", **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize(
    "regime",
    [
        dict(),  # everything fits, one prefill step for the whole batch
        dict(block_size=1),
        dict(block_size=7),  # divides none of the prompt lengths
        dict(max_num_batched_tokens=16),  # every prompt but the first is chunked
        dict(num_gpu_blocks_override=12, block_size=8, max_model_len=96),  # 96 slots for 5 requests: preemption
        dict(max_num_seqs=2, enable_prefix_caching=False),
    ],
)
def test_greedy_generate_matches_transformers(checkpoint, expected, regime):
    path, _, _ = checkpoint
    prompts, want = expected
    got, llm = run_ours(path, prompts, **regime)
    assert got == want
    metrics = llm.get_metrics()
    if "num_gpu_blocks_override" in regime:
        assert metrics["num_preemptions"] > 0, "the regime was meant to force preemption"
    assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"], "blocks leaked"


@torch.no_grad()
def test_teacher_forced_logits_match(checkpoint):
    """Logits at every position of prompt+continuation, our model fed in chunks through the paged
    cache, against one HF forward. float32 on both sides: the relative error is rounding (~1e-6);
    1e-4 leaves room for different summation orders over up to 512-wide dot products. The argmax is
    compared once no position's two largest logits are within GREEDY_MARGIN, where rounding could decide."""
    path, hf, config = checkpoint
    (prompt,) = make_prompts(config["vocab_size"], [70], seed=3)
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4)
    engine = llm.llm_engine
    ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = teacher_forced_logits(engine, prompt, chunks=[30, 1, 25, 14])
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, rel
    assert top2_gaps(ref).min() > GREEDY_MARGIN
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_batch_composition_does_not_change_greedy_output(checkpoint, expected):
    """The same prompt alone and inside a batch, with other requests arriving in between."""
    path, _, _ = checkpoint
    prompts, want = expected
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_num_batched_tokens=32)
    engine = llm.llm_engine
    finished = {}
    engine.add_request("first", {"prompt_token_ids": prompts[3]}, GREEDY)
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for i, p in enumerate(prompts):
        engine.add_request(f"late{i}", {"prompt_token_ids": p}, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["first"].outputs[0].token_ids == want[3]
    for i in range(len(prompts)):
        assert finished[f"late{i}"].outputs[0].token_ids == want[i]


def test_prefix_caching_changes_no_token(checkpoint):
    """Prompts that share prefixes (a common header, repeats, a prompt that extends another), greedy:
    caching on equals caching off equals transformers, also with a cache so small that cached blocks are
    evicted and requests preempted."""
    path, hf, config = checkpoint
    rng = random.Random(5)
    vocab = config["vocab_size"] - 256
    header = [rng.randrange(vocab) for _ in range(21)]
    prompts = [header + [rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 19)]
    prompts += [list(prompts[1]), prompts[2] + [rng.randrange(vocab) for _ in range(6)], header[:9]]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for name, kwargs in {
        "off": dict(enable_prefix_caching=False),
        "on": dict(),
        "on_tight": dict(num_gpu_blocks_override=16, max_model_len=64, max_num_batched_tokens=24),
    }.items():
        llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
        # Two rounds: the second finds the first's blocks in the cache (or evicted, when tight).
        outs = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        outs2 = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        results[name] = (outs, outs2, llm.get_metrics())
    for name, (outs, outs2, m) in results.items():
        assert outs == want and outs2 == want, name
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"], name
    assert results["off"][2]["prefix_cache_hit_tokens"] == 0
    assert results["on"][2]["prefix_cache_hit_tokens"] > 0
    tight = results["on_tight"][2]
    assert tight["prefix_cache_hit_tokens"] > 0 and tight["prefix_cache_evicted_blocks"] > 0
    assert tight["num_preemptions"] > 0
