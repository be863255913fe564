"""Presets: Hugging Face ``config.json`` dicts of the supported families at their published shapes.

No real weights can be downloaded; tests, benchmarks and GPU runs write random-weight checkpoints from
these dicts (:mod:`tinyvllm.models.checkpoint`), laid out exactly as the hub's, so that transformers'
own classes load them as the correctness oracle.

* :data:`PRESETS`: name → config.json dict (Llama 3.x, Qwen3, Qwen2.5, Mistral, and small test shapes).
* :func:`make_config`: a preset with overrides; :func:`check_config`: what the dummy writer accepts.
* :func:`weight_shapes`, :func:`num_parameters`: the checkpoint's tensors, by family.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from tinyvllm.models.dummy_tokenizer import MIN_VOCAB_SIZE, special_token_ids

DTYPE_NAMES = ("float32", "float16", "bfloat16")


def _llama3(**fields: Any) -> dict[str, Any]:
    """A config.json as Meta's Llama 3.x Instruct checkpoints have it, with ``fields`` set."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "head_dim": None,
        "hidden_act": "silu",
        "hidden_size": None,
        "initializer_range": 0.02,
        "intermediate_size": None,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": None,
        "num_hidden_layers": None,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    }
    assert set(fields) <= set(config), set(fields) - set(config)
    config.update(fields)
    return config


def _qwen(model_type: str, **fields: Any) -> dict[str, Any]:
    """A config.json as Qwen's Qwen2.5 (``qwen2``) or Qwen3 (``qwen3``) checkpoints have it."""
    config = {
        "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": None,
        "initializer_range": 0.02,
        "intermediate_size": None,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": model_type,
        "num_attention_heads": None,
        "num_hidden_layers": None,
        "num_key_value_heads": None,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    if model_type == "qwen3":
        config.update(attention_bias=False, head_dim=128, max_position_embeddings=40960)
    assert set(fields) <= set(config), set(fields) - set(config)
    config.update(fields)
    return config


def _mistral(**fields: Any) -> dict[str, Any]:
    """A config.json as Mistral-7B-v0.1's: a 4,096-token sliding window on every layer."""
    config = {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    }
    assert set(fields) <= set(config), set(fields) - set(config)
    config.update(fields)
    return config


PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": _llama3(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        head_dim=64,
    ),
    "llama-3.2-3b": _llama3(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
    ),
    "llama-3.1-8b": _llama3(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
        rope_scaling={
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    # Test/demo model. Its RoPE (theta 1e4, head_dim 16, original length 256) puts frequencies in
    # all three llama3 bands: kept (wavelength < 64), smoothed (64..256) and divided by 8 (> 256).
    "tiny": _llama3(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rope_scaling={
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 256,
            "rope_type": "llama3",
        },
        torch_dtype="float32",
        **special_token_ids(512),
    ),
    "qwen3-0.6b": _qwen(
        "qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
    "qwen3-1.7b": _qwen(
        "qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
    "qwen3-4b": _qwen(
        "qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_window_layers=36,
    ),
    "qwen3-8b": _qwen(
        "qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_window_layers=36,
        tie_word_embeddings=False,
    ),
    "qwen2.5-1.5b": _qwen(
        "qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_window_layers=21,
        sliding_window=32768,
    ),
    "qwen2.5-7b": _qwen(
        "qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        sliding_window=131072,
        tie_word_embeddings=False,
        vocab_size=152064,
    ),
    "mistral-7b": _mistral(),
    # Small test shapes of each family. tiny-qwen3: query width (4 × 32) ≠ hidden (64), as in Qwen3-0.6B.
    "tiny-qwen3": _qwen(
        "qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        torch_dtype="float32",
        **special_token_ids(512, "qwen3"),
    ),
    # tiny-qwen2: biases, and a window on layer 1 only (use_sliding_window, max_window_layers 1).
    "tiny-qwen2": _qwen(
        "qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        use_sliding_window=True,
        sliding_window=40,
        max_window_layers=1,
        torch_dtype="float32",
        **special_token_ids(512, "qwen2"),
    ),
    # tiny-mistral: a window of 40 keys on every layer, a multiple of neither block size nor tile.
    "tiny-mistral": _mistral(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=40,
        torch_dtype="float32",
        **special_token_ids(512, "mistral"),
    ),
}
"""HF config.json dicts by name; read-only (:func:`make_config` returns copies to modify)."""


def make_config(base: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """A copy of ``PRESETS[base]`` with ``overrides`` (config.json keys) applied.

    Derived fields follow unless overridden too: ``vocab_size`` moves ``bos_token_id`` and
    ``eos_token_id`` to the top-of-vocab special-token layout; ``hidden_size`` or
    ``num_attention_heads`` recomputes ``head_dim = hidden_size // num_attention_heads``.

    Raises:
        ValueError: unknown preset or key, or an inconsistent config (see :func:`check_config`).
    """
    if base not in PRESETS:
        raise ValueError(f"unknown preset {base!r}; presets: {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[base])
    unknown = set(overrides) - set(config)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(config)}")
    if "vocab_size" in overrides:
        for key, value in special_token_ids(overrides["vocab_size"], config.get("model_type", "llama")).items():
            config[key] = overrides.get(key, value)
    if ("hidden_size" in overrides or "num_attention_heads" in overrides) and "head_dim" not in overrides:
        overrides = {
            **overrides,
            "head_dim": overrides.get("hidden_size", config["hidden_size"])
            // overrides.get("num_attention_heads", config["num_attention_heads"]),
        }
    config.update(copy.deepcopy(overrides))
    check_config(config)
    return config


def check_config(config: dict[str, Any]) -> None:
    """Raise ValueError unless ``config`` is a config the dummy writer can write.

    The bos/eos ids must be where the family's dummy tokenizer puts its special tokens (at the full
    vocabulary, the family's own ids: Qwen's 151643/151645, Mistral's 1/2)."""
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    )
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise ValueError(f"config lacks {missing}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias are not supported (no family we serve has them)")
    if config_dtype(config) not in DTYPE_NAMES:
        raise ValueError(f"torch_dtype must be one of {sorted(DTYPE_NAMES)}, got {config_dtype(config)!r}")
    if config.get("model_type", "llama") == "llama" and config["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + 256 special tokens), got {config['vocab_size']}"
        )
    layout = special_token_ids(config["vocab_size"], config.get("model_type", "llama"))
    got = {k: config[k] for k in layout}
    if got != layout:
        raise ValueError(
            f"bos/eos ids {got} do not match the tokenizer's special-token layout {layout}; "
            "build the config with make_config(vocab_size=...)"
        )


def config_dtype(config: dict[str, Any]) -> str | None:
    """The weights' dtype name: ``torch_dtype`` (Meta's files), or ``dtype`` (transformers 5's)."""
    return config.get("torch_dtype") or config.get("dtype")


def weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every weight, in checkpoint order (lm_head only when untied; q/k/v biases for
    Qwen2, q/k norms for Qwen3).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` as in transformers.
    """
    v, h, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    qkv_bias = config.get("model_type") == "qwen2"
    qk_norm = config.get("model_type") == "qwen3"
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q_dim, h)),
            (p + "self_attn.k_proj.weight", (kv_dim, h)),
            (p + "self_attn.v_proj.weight", (kv_dim, h)),
        ]
        if qkv_bias:
            shapes += [
                (p + "self_attn.q_proj.bias", (q_dim,)),
                (p + "self_attn.k_proj.bias", (kv_dim,)),
                (p + "self_attn.v_proj.bias", (kv_dim,)),
            ]
        if qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
        shapes += [
            (p + "self_attn.o_proj.weight", (h, q_dim)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (v, h)))
    return shapes


def num_parameters(config: dict[str, Any]) -> int:
    """Parameter count of the model (tied embeddings counted once)."""
    return sum(math.prod(shape) for _, shape in weight_shapes(config))
