"""Every family against its own transformers class on the same random-weight files (float32).

Qwen3 (per-head q/k RMSNorm, query width ≠ hidden), Qwen2 (q/k/v biases, a sliding window on some
layers only) and Mistral (a sliding window on every layer): greedy `LLM.generate` over a batch equals
transformers' greedy `generate` of each prompt alone, token for token, under scheduling regimes that
chunk prompts across the window's edge, preempt, and use block sizes that do not divide the window
(40 keys in the tiny presets); teacher-forced logits agree to float32 rounding. Prompts and generations
run past the window, so a window applied wrongly (or not at all) changes the tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import GREEDY_MARGIN, hf_greedy, top2_gaps
from tinyvllm import LLM, SamplingParams
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.config import ModelConfig
from tinyvllm.models.checkpoint import write_dummy_checkpoint
from tinyvllm.models.presets import PRESETS, make_config

transformers = pytest.importorskip("transformers")

INIT_STD = 0.1  # a confident random model: near-ties between its two best tokens are rare
MAX_NEW = 20
LENGTHS = [5, 29, 47, 83]  # below, around and past twice the window of 40
FAMILIES = ("tiny-qwen3", "tiny-qwen2", "tiny-mistral")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    config = make_config(request.param)
    path = tmp_path_factory.mktemp(request.param)
    write_dummy_checkpoint(path, config, seed=99, init_std=INIT_STD, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == config["architectures"][0]
    return path, hf.eval(), config


def make_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def expected(checkpoint):
    _, hf, config = checkpoint
    prompts = make_prompts(config["vocab_size"], LENGTHS)
    return prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize(
    "regime",
    [
        dict(),
        dict(block_size=16, max_num_batched_tokens=24),  # chunks of 24 cross the window's edge mid-chunk
        # 126 slots for 4 requests needing 244 (or, under a window of 40, up to 9 blocks each): preemption
        dict(block_size=7, num_gpu_blocks_override=18, max_model_len=112, max_num_batched_tokens=16),
    ],
    ids=["plain", "chunked", "preempted_bs7"],
)
def test_greedy_generate_matches_transformers(checkpoint, expected, regime):
    path, _, _ = checkpoint
    prompts, want = expected
    llm = LLM(model=str(path), device="cpu", dtype="float32", **regime)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    metrics = llm.get_metrics()
    if "num_gpu_blocks_override" in regime:
        assert metrics["num_preemptions"] > 0, "the regime was meant to force preemption"
    assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"], "blocks leaked"


@torch.no_grad()
def test_teacher_forced_logits_match(checkpoint):
    """Logits at every position of a 90-token prompt fed in chunks through the paged cache, against one
    transformers forward; the relative error is float32 rounding."""
    path, hf, config = checkpoint
    (prompt,) = make_prompts(config["vocab_size"], [90], seed=3)
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4)
    ref = hf(torch.tensor([prompt])).logits[0].float()
    ours = teacher_forced_logits(llm.llm_engine, prompt, chunks=[30, 1, 25, 34])
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, rel
    assert top2_gaps(ref).min() > GREEDY_MARGIN
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_family_fields_read_as_transformers_reads_them():
    qwen3 = ModelConfig.from_dict(PRESETS["qwen3-0.6b"])
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.q_size) == (True, False, 128, 2048)
    assert qwen3.hidden_size == 1024 and qwen3.rope_theta == 1e6 and qwen3.tie_word_embeddings
    assert not qwen3.has_sliding_window
    qwen25 = ModelConfig.from_dict(PRESETS["qwen2.5-1.5b"])
    assert qwen25.qkv_bias and not qwen25.qk_norm
    assert not qwen25.has_sliding_window  # sliding_window is set, use_sliding_window is false
    mistral = ModelConfig.from_dict(PRESETS["mistral-7b"])
    assert mistral.all_layers_sliding and mistral.attention_window(31) == 4096
    no_window = ModelConfig.from_dict({**PRESETS["mistral-7b"], "sliding_window": None})
    assert no_window.attention_window(0) is None and not no_window.has_sliding_window
    tiny_qwen2 = ModelConfig.from_dict(PRESETS["tiny-qwen2"])
    assert [tiny_qwen2.attention_window(i) for i in range(2)] == [None, 40]
    for preset in FAMILIES:  # transformers' own reading of the same dicts
        ours = ModelConfig.from_dict(PRESETS[preset])
        theirs = transformers.AutoConfig.for_model(**PRESETS[preset])
        types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers  # Mistral
        windows = [theirs.sliding_window if t == "sliding_attention" else None for t in types]
        assert [ours.attention_window(i) for i in range(ours.num_hidden_layers)] == windows


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
        ({"architectures": None, "model_type": "phi3"}, "unsupported architecture"),
        ({"attention_bias": True}, "attention_bias=true for LlamaForCausalLM"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "unsupported layer_types ['chunked_attention']"),
    ],
)
def test_unsupported_options_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=r"supports|unsupported") as err:
        ModelConfig.from_dict({**PRESETS["tiny"], **overrides})
    assert message in str(err.value)
    if "architecture" in message:
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            assert arch in str(err.value)


def test_qwen3_attention_bias_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_bias=true for Qwen3ForCausalLM"):
        ModelConfig.from_dict({**PRESETS["tiny-qwen3"], "attention_bias": True})


def test_sliding_window_model_runs_past_its_cache(tmp_path):
    """Every tiny-mistral layer slides (W = 40), so the engine releases blocks that left the window: a
    300-token prompt generates on a cache of 20 blocks × 4 slots (80 tokens), equal to transformers."""
    config = make_config("tiny-mistral")
    write_dummy_checkpoint(tmp_path, config, seed=7, init_std=INIT_STD, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    (prompt,) = make_prompts(config["vocab_size"], [300], seed=11)
    llm = LLM(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=20,
        max_num_batched_tokens=16,
        max_model_len=400,
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf.eval(), prompt, MAX_NEW)
    metrics = llm.get_metrics()
    assert metrics["num_free_kv_blocks"] == metrics["num_kv_blocks"] == 20
