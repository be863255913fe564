"""The benchmarks' model-dependent parts for every family: the roofline's weight bytes against the
parameters of the model itself, and the transformers anchor's class."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.bench.roofline import ModelCosts
from tinyvllm.config import ModelConfig
from tinyvllm.kernels import get_ops
from tinyvllm.models.decoder import CausalLM
from tinyvllm.models.presets import PRESETS, make_config


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "qwen2.5-1.5b", "mistral-7b", "llama-3.2-1b"])
def test_weight_bytes_are_what_a_decode_step_reads(preset):
    """W = every parameter of the model as built (biases and q/k norms included), once, except an untied
    embedding table, of which a decode step reads one row; a tied table is the LM head and counts once."""
    config = ModelConfig.from_dict(PRESETS[preset])
    with torch.device("meta"):
        model = CausalLM(config, get_ops("torch"), max_positions=16, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())  # a tied table is one parameter
    untied_embedding = 0 if config.tie_word_embeddings else model.embed_tokens.weight.numel()
    assert ModelCosts.of(config).weight_bytes == 2 * (params - untied_embedding)
    assert config.tie_word_embeddings == (model.lm_head is None)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-qwen2", "tiny-mistral"])
def test_hf_anchor_loads_the_family_class(preset, tmp_path):
    pytest.importorskip("transformers")
    from tinyvllm.bench.hf_baseline import load_hf
    from tinyvllm.models.checkpoint import write_dummy_checkpoint

    config = make_config(preset)
    write_dummy_checkpoint(tmp_path, config, seed=0)
    model = load_hf(tmp_path, torch.device("cpu"), torch.float32)
    assert type(model).__name__ == config["architectures"][0]


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen2.5-1.5b", "llama-3.2-1b"])
def test_fp8_weight_bytes_are_the_fp8_model_as_built(preset):
    """With FP8 weights, W is the bytes of the FP8 model's own tensors as built (one-byte projections,
    their float32 row scales, the rest in bf16), less an untied embedding table; an FP8 KV cache halves κ."""
    from tinyvllm.quantization.config import QuantizationConfig

    config = ModelConfig.from_dict(PRESETS[preset])
    with torch.device("meta"):
        model = CausalLM(config, get_ops("torch"), max_positions=16, dtype=torch.bfloat16, quant=QuantizationConfig())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    untied_embedding = 0 if config.tie_word_embeddings else 2 * model.embed_tokens.weight.numel()
    costs = ModelCosts.of(config, fp8_weights=True, fp8_kv_cache=True)
    assert costs.weight_bytes == nbytes - untied_embedding
    assert 2 * costs.kv_bytes_per_token == ModelCosts.of(config).kv_bytes_per_token
