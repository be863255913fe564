"""Parsing `quantization_config` (compressed-tensors, quant_method fp8) and the errors a user sees for
what tinyvllm does not support: each names the offending field."""

from __future__ import annotations

import copy

import pytest

from tinyvllm.config import ModelConfig
from tinyvllm.models.presets import make_config
from tinyvllm.quantization.config import QuantizationConfig, parse_quantization_config, resolve_quantization


def ct_config(weights: str = "channel", acts: str = "token", dynamic: bool = True, kv: bool = False) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (FP8 / FP8_DYNAMIC schemes)."""
    raw = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": weights,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": acts,
                    "symmetric": True,
                    "dynamic": dynamic,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    if kv:
        raw["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    return raw


def test_fp8_dynamic_per_channel():
    q = parse_quantization_config(ct_config())
    assert q == QuantizationConfig("channel", "token", True, ("lm_head",), checkpoint_quantized=True)
    assert q.is_ignored("lm_head") and not q.is_ignored("model.layers.0.mlp.down_proj")


def test_fp8_static_per_tensor_with_kv_scales():
    q = parse_quantization_config(ct_config("tensor", "tensor", dynamic=False, kv=True))
    assert (q.weight_strategy, q.activation_strategy, q.activation_dynamic, q.kv_cache_scales) == (
        "tensor",
        "tensor",
        False,
        True,
    )


def test_regex_ignore():
    raw = ct_config()
    raw["ignore"] = ["lm_head", "re:.*layers\\.1\\..*"]
    q = parse_quantization_config(raw)
    assert q.is_ignored("model.layers.1.self_attn.q_proj") and not q.is_ignored("model.layers.11.self_attn.q_proj")


def test_quant_method_fp8():
    q = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert (q.weight_strategy, q.activation_strategy, q.activation_dynamic) == ("tensor", "tensor", False)


def test_resolve():
    assert resolve_quantization(None, None) is None
    assert resolve_quantization("fp8", None) == QuantizationConfig()  # quantize at load
    ckpt = parse_quantization_config(ct_config("tensor"))
    assert resolve_quantization("fp8", ckpt) is ckpt and resolve_quantization(None, ckpt) is ckpt
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        resolve_quantization("int8", None)


def _edit(path: str, value) -> dict:
    raw = ct_config()
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return raw


ERRORS = [
    (_edit("config_groups.group_0.weights.num_bits", 4), "weights.num_bits 4"),  # int4 / fp4
    (_edit("config_groups.group_0.weights.type", "int"), "weights.type 'int'"),
    (_edit("config_groups.group_0.weights.group_size", 128), "weights.group_size 128"),
    (_edit("config_groups.group_0.weights.strategy", "group"), "weights.strategy 'group'"),
    (_edit("config_groups.group_0.weights.symmetric", False), "weights.symmetric false"),
    (_edit("config_groups.group_0.input_activations", None), "input_activations is missing"),
    (_edit("config_groups.group_0.input_activations.strategy", "group"), "input_activations.strategy 'group'"),
    (_edit("config_groups.group_0.targets", ["Attention"]), "targets"),
    (_edit("format", "pack-quantized"), "format 'pack-quantized'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme 'weird'"),
]


@pytest.mark.parametrize("raw,message", ERRORS, ids=[m for _, m in ERRORS])
def test_unsupported_is_a_clear_error(raw, message):
    with pytest.raises(ValueError, match="quantization_config") as e:
        parse_quantization_config(raw)
    assert message in str(e.value)


def test_model_config_reads_it():
    cfg = make_config("tiny")
    assert ModelConfig.from_dict(cfg).quantization is None
    cfg = copy.deepcopy(cfg)
    cfg["quantization_config"] = ct_config()
    assert ModelConfig.from_dict(cfg).quantization == parse_quantization_config(ct_config())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        ModelConfig.from_dict(cfg)
