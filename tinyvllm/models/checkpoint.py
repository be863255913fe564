"""Llama 3.x presets and random-weight Hugging Face checkpoints.

No real weights can be downloaded; tests, benchmarks and GPU runs use checkpoints written here,
laid out exactly as Meta's on the Hugging Face hub (config.json, generation_config.json,
model.safetensors or shards + index, tokenizer files), so that ``transformers``'
``LlamaForCausalLM.from_pretrained(dir)`` loads them as the correctness oracle.

* :data:`PRESETS`, :func:`make_config`, :func:`num_parameters`: HF ``config.json`` dicts.
* :func:`write_dummy_checkpoint`: random weights, generated and streamed tensor by tensor.
* :func:`resolve_model`: a model directory, ``"demo"`` (the small trained model shipped in
  ``tinyvllm/models/demo``), or ``"dummy:<preset>"`` written once into a cache.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tinyvllm.models.dummy_tokenizer import MIN_VOCAB_SIZE, special_token_ids, write_tokenizer_files
from tinyvllm.models.safetensors_writer import SafetensorsWriter, tensor_nbytes


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
}
"""HF config.json dicts by name; read-only (:func:`make_config` returns copies to modify)."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NORM_NOISE_STD = 0.1  # norm weights are 1 + N(0, 0.1): skipping one changes the output
_CHUNK_ELEMENTS = 1 << 24  # random numbers generated per step (64 MiB of float32)
_PROGRESS_MIN_BYTES = 256 << 20


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
        for key, value in special_token_ids(overrides["vocab_size"]).items():
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
    """Raise ValueError unless ``config`` is a Llama config this module can write."""
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
        raise ValueError("attention_bias / mlp_bias are not supported (Llama 3 has no biases)")
    if config_dtype(config) not in DTYPES:
        raise ValueError(f"torch_dtype must be one of {sorted(DTYPES)}, got {config_dtype(config)!r}")
    if config["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + 256 special tokens), got {config['vocab_size']}"
        )
    layout = special_token_ids(config["vocab_size"])
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
    """(HF name, shape) of every weight, in checkpoint order (lm_head only when untied).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` as in transformers.
    """
    v, h, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q_dim, h)),
            (p + "self_attn.k_proj.weight", (kv_dim, h)),
            (p + "self_attn.v_proj.weight", (kv_dim, h)),
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


def random_weight_chunks(
    name: str, shape: tuple[int, ...], *, seed: int, init_std: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The dummy weight ``name`` as row chunks: N(0, init_std), or 1 + N(0, 0.1) for norms.

    Deterministic: a generator seeded from (seed, name) draws float32 rows in fixed-size
    steps, cast to ``dtype``; a weight's values do not depend on the other weights.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    is_norm = len(shape) == 1
    row = 1 if is_norm else shape[1]
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row)
    for start in range(0, shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, shape[0] - start)
        x = torch.randn((rows, *shape[1:]), generator=gen)
        if is_norm:
            x = x.mul_(NORM_NOISE_STD).add_(1.0)
        else:
            x = x.mul_(init_std)
        yield x.to(dtype)


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Group consecutive tensor indices into shards of at most ``max_shard_bytes`` (a bigger
    tensor gets a shard of its own), as transformers' ``save_pretrained`` does."""
    shards: list[list[int]] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(index)
        used += size
    return shards


def write_dummy_checkpoint(
    out_dir: str | Path,
    config: str | dict[str, Any],
    *,
    seed: int = 0,
    dtype: str | None = None,
    init_std: float = 0.02,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool | None = None,
) -> Path:
    """Write a random-weight Llama checkpoint in Hugging Face format; return ``out_dir``.

    Files: config.json, generation_config.json (bos, eos list, Llama 3.x Instruct's sampling
    defaults), model.safetensors — or ``model-0000i-of-0000N.safetensors`` shards plus
    model.safetensors.index.json when the weights exceed ``max_shard_bytes`` — and the tokenizer
    of :mod:`tinyvllm.models.dummy_tokenizer` (tokenizer.json, tokenizer_config.json with the
    chat template, special_tokens_map.json).

    Weights are generated one chunk at a time and streamed to disk (peak memory ~ one chunk, not
    the model); see :func:`random_weight_chunks`. The same (config, seed) gives the same bytes.

    Args:
        out_dir: a new or empty directory.
        config: a preset name or a config.json dict (see :func:`make_config`).
        seed: weight seed.
        dtype: "float32", "float16" or "bfloat16"; default the config's ``torch_dtype``.
        init_std: standard deviation of the matrices.
        max_shard_bytes: largest shard file.
        progress: show a tqdm bar; default only for checkpoints over 256 MiB.

    Raises:
        ValueError: unknown preset or dtype, invalid config, non-empty ``out_dir``.
    """
    config = _config_to_write(config, dtype)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty; write a checkpoint into a new or empty directory")
    out_dir.mkdir(parents=True, exist_ok=True)

    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    write_tokenizer_files(out_dir, config["vocab_size"], config["max_position_embeddings"])
    _write_weights(out_dir, config, seed=seed, init_std=init_std, max_shard_bytes=max_shard_bytes, progress=progress)
    return out_dir


def _config_to_write(config: str | dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """A checked copy of the preset or config.json dict ``config``, its dtype set to ``dtype`` if given."""
    config = make_config(config) if isinstance(config, str) else copy.deepcopy(config)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        config["torch_dtype"] = dtype
        config.pop("dtype", None)
    check_config(config)
    return config


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the config's bos and eos ids, and Llama 3.x Instruct's sampling defaults."""
    return {
        "bos_token_id": config["bos_token_id"],
        "do_sample": True,
        "eos_token_id": config["eos_token_id"],
        "temperature": 0.6,
        "top_p": 0.9,
    }


def _write_weights(
    out_dir: Path, config: dict[str, Any], *, seed: int, init_std: float, max_shard_bytes: int, progress: bool | None
) -> None:
    torch_dtype = DTYPES[config_dtype(config)]
    shapes = weight_shapes(config)
    sizes = [tensor_nbytes(shape, torch_dtype) for _, shape in shapes]
    shards = _plan_shards(sizes, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    show = progress if progress is not None else sum(sizes) > _PROGRESS_MIN_BYTES
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="dummy weights", disable=not show) as bar:
        for file_name, indices in zip(names, shards):
            specs = [(shapes[k][0], shapes[k][1], torch_dtype) for k in indices]
            with SafetensorsWriter(out_dir / file_name, specs, {"format": "pt"}) as writer:
                for k in indices:
                    name, shape = shapes[k]
                    writer.write(
                        name, random_weight_chunks(name, shape, seed=seed, init_std=init_std, dtype=torch_dtype)
                    )
                    bar.update(sizes[k])
    if len(shards) > 1:
        weight_map = {shapes[k][0]: file_name for file_name, indices in zip(names, shards) for k in indices}
        _write_json(
            out_dir / "model.safetensors.index.json", {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        )


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


DEMO_MODEL = "demo"
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"
"""The demo model: a small Llama trained on the Python documentation by ``scripts/train_demo_model.py``,
package data of tinyvllm (see its README.md, the model card)."""


def demo_model_available() -> bool:
    """Whether this installation has the demo model's files (config.json and weights)."""
    return (DEMO_MODEL_DIR / "config.json").is_file() and (DEMO_MODEL_DIR / "model.safetensors").is_file()


def default_cache_dir() -> Path:
    """Where ``dummy:<preset>`` checkpoints live: ``$TINYVLLM_CACHE/dummy`` if that variable is
    set, else ``~/.cache/tinyvllm/dummy``."""
    root = os.environ.get("TINYVLLM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "tinyvllm") / "dummy"


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory for ``model``.

    * a directory: returned as is (it must hold config.json);
    * ``"demo"``: :data:`DEMO_MODEL_DIR`, the trained model shipped with the package;
    * ``"dummy:<preset>"``: ``cache_dir/<preset>`` (default :func:`default_cache_dir`), written
      with :func:`write_dummy_checkpoint` (seed 0) on first use. It is written into a temporary
      sibling directory and renamed into place, so an interrupted write never leaves a partial
      checkpoint, and concurrent writers keep the first complete one.

    Raises:
        ValueError: an unknown preset, a directory without config.json, ``"demo"`` in an installation
            without its weights, or anything else (this engine downloads nothing).
    """
    if model == DEMO_MODEL:
        if not demo_model_available():
            raise ValueError(
                f"the demo model's files are not in this installation ({DEMO_MODEL_DIR}); "
                "train them with scripts/train_demo_model.py, or pass a model directory"
            )
        return DEMO_MODEL_DIR
    if model.startswith("dummy:"):
        preset = model[len("dummy:") :]
        if preset not in PRESETS:
            raise ValueError(f"unknown dummy preset {preset!r}; presets: {', '.join(sorted(PRESETS))}")
        target = Path(cache_dir if cache_dir is not None else default_cache_dir()) / preset
        if not (target / "config.json").is_file():
            _write_atomically(target, preset)
        return target
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; pass a Hugging Face model directory")
        return path
    raise ValueError(
        f"{model!r} is neither a local model directory, {DEMO_MODEL!r}, nor 'dummy:<preset>' "
        f"({', '.join(sorted(PRESETS))}); nothing is downloaded"
    )


def _write_atomically(target: Path, preset: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}.tmp-", dir=target.parent))
    try:
        write_dummy_checkpoint(tmp, preset)
        try:
            tmp.rename(target)  # atomic; fails if another writer already put a checkpoint there
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
