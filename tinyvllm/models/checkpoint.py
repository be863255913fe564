"""Random-weight Hugging Face checkpoints of the presets (:mod:`tinyvllm.models.presets`).

No real weights can be downloaded; tests, benchmarks and GPU runs use checkpoints written here,
laid out exactly as the Hugging Face hub's (config.json, generation_config.json, model.safetensors or
shards + index, tokenizer files), so that transformers' own class of the family
(``AutoModelForCausalLM.from_pretrained(dir)``) loads them as the correctness oracle.

* :func:`write_dummy_checkpoint`: random weights, generated and streamed tensor by tensor.
* :func:`resolve_model`: a model directory, ``"demo"`` (the small trained model shipped in
  ``tinyvllm/models/demo``), or ``"dummy:<preset>"`` written once into a cache.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tinyvllm.models.dummy_tokenizer import generation_token_ids, write_dummy_tokenizer
from tinyvllm.models.presets import PRESETS, check_config, config_dtype, make_config, weight_shapes
from tinyvllm.models.safetensors_writer import SafetensorsWriter, tensor_nbytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NORM_NOISE_STD = 0.1  # norm weights are 1 + N(0, 0.1): skipping one changes the output
BIAS_STD = 0.1  # biases ~ N(0, 0.1): as large as a projection's output, so dropping one shows
_CHUNK_ELEMENTS = 1 << 24  # random numbers generated per step (64 MiB of float32)
_PROGRESS_MIN_BYTES = 256 << 20


def random_weight_chunks(
    name: str, shape: tuple[int, ...], *, seed: int, init_std: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The dummy weight ``name`` as row chunks: N(0, init_std), 1 + N(0, 0.1) for norms, N(0, 0.1) for
    biases.

    Deterministic: a generator seeded from (seed, name) draws float32 rows in fixed-size
    steps, cast to ``dtype``; a weight's values do not depend on the other weights.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    is_norm = name.endswith("norm.weight")
    is_bias = name.endswith(".bias")
    row = 1 if len(shape) == 1 else shape[1]
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row)
    for start in range(0, shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, shape[0] - start)
        x = torch.randn((rows, *shape[1:]), generator=gen)
        if is_norm:
            x = x.mul_(NORM_NOISE_STD).add_(1.0)
        elif is_bias:
            x = x.mul_(BIAS_STD)
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
    """Write a random-weight checkpoint in Hugging Face format; return ``out_dir``.

    Files: config.json, generation_config.json (bos, eos list, the family's instruct sampling
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
    write_dummy_tokenizer(out_dir, config)
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


# Sampling defaults of each family's instruct checkpoints' generation_config.json (Mistral v0.1 is a base
# model and has none).
_SAMPLING_DEFAULTS = {
    "llama": {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
    "qwen3": {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
    "qwen2": {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "mistral": {},
}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the family's token ids (Qwen's instruct checkpoints add <|endoftext|> to
    <|im_end|> in the EOS list) and its sampling defaults."""
    model_type = config.get("model_type", "llama")
    return {**generation_token_ids(config["vocab_size"], model_type), **_SAMPLING_DEFAULTS.get(model_type, {})}


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
