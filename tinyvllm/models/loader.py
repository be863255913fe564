"""Build the decoder and fill it from a Hugging Face checkpoint (safetensors), or with random weights.

The name map is explicit: every Hugging Face tensor name maps to one of our parameters and, for the
fused projections, the rows it fills. Anything missing, unexpected or mis-shaped is an error that names
the tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tinyvllm.config import ModelConfig
from tinyvllm.kernels import Ops
from tinyvllm.models.decoder import CausalLM

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Tensors that some checkpoints carry and that hold nothing we need.
_PROGRESS_MIN_BYTES = 512 << 20  # a progress bar only for checkpoints that take a while
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [start, start + rows) of parameter `param`."""

    param: str
    start: int | None = None  # None: the whole parameter
    rows: int | None = None


def weight_name_map(config: ModelConfig) -> dict[str, Target]:
    """Hugging Face tensor name → our parameter (and row range, for the fused QKV and gate/up)."""
    q, kv, f = config.q_size, config.kv_size, config.intermediate_size
    names = {"model.embed_tokens.weight": Target("embed_tokens.weight"), "model.norm.weight": Target("norm.weight")}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = Target("lm_head.weight")
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        names.update(
            {
                f"{hf}.self_attn.q_proj.weight": Target(f"{ours}.self_attn.qkv_proj.weight", 0, q),
                f"{hf}.self_attn.k_proj.weight": Target(f"{ours}.self_attn.qkv_proj.weight", q, kv),
                f"{hf}.self_attn.v_proj.weight": Target(f"{ours}.self_attn.qkv_proj.weight", q + kv, kv),
                f"{hf}.self_attn.o_proj.weight": Target(f"{ours}.self_attn.o_proj.weight"),
                f"{hf}.mlp.gate_proj.weight": Target(f"{ours}.mlp.gate_up_proj.weight", 0, f),
                f"{hf}.mlp.up_proj.weight": Target(f"{ours}.mlp.gate_up_proj.weight", f, f),
                f"{hf}.mlp.down_proj.weight": Target(f"{ours}.mlp.down_proj.weight"),
                f"{hf}.input_layernorm.weight": Target(f"{ours}.input_layernorm.weight"),
                f"{hf}.post_attention_layernorm.weight": Target(f"{ours}.post_attention_layernorm.weight"),
            }
        )
        if config.qkv_bias:
            names.update(
                {
                    f"{hf}.self_attn.q_proj.bias": Target(f"{ours}.self_attn.qkv_proj.bias", 0, q),
                    f"{hf}.self_attn.k_proj.bias": Target(f"{ours}.self_attn.qkv_proj.bias", q, kv),
                    f"{hf}.self_attn.v_proj.bias": Target(f"{ours}.self_attn.qkv_proj.bias", q + kv, kv),
                }
            )
        if config.qk_norm:
            names[f"{hf}.self_attn.q_norm.weight"] = Target(f"{ours}.self_attn.q_norm.weight")
            names[f"{hf}.self_attn.k_norm.weight"] = Target(f"{ours}.self_attn.k_norm.weight")
    return names


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: from the shard index if there is one, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir} (only the safetensors format is supported)")
    return files


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in list(f.keys()):  # safe_open has keys() but cannot be iterated
                yield name, path, f.get_tensor(name)


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str | Path, show_progress: bool = False) -> None:
    """Copy every checkpoint tensor into its place (converting dtype, moving to the model's device)."""
    model_dir = Path(model_dir)
    config: ModelConfig = model.config
    targets = weight_name_map(config)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    files = safetensors_files(model_dir)
    big = sum(f.stat().st_size for f in files) > _PROGRESS_MIN_BYTES
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not (show_progress and big))
    for name, path, tensor in _iter_checkpoint(files):
        target = targets.get(name)
        if target is None:
            if _IGNORED.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            raise ValueError(
                f"unexpected tensor {name!r} in {path.name}: it has no place in a "
                f"{config.architecture} with this config"
            )
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint (again in {path.name})")
        param = params[target.param]
        dest = param if target.start is None else param[target.start : target.start + target.rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"tensor {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                f"but the config implies {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        seen.add(name)
        bar.update(1)
    bar.close()
    missing = sorted(set(targets) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} is missing {len(missing)} tensor(s): {shown}")


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights without files: matrices ~ N(0, std²), norm weights 1 (load_format="dummy")."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values)


def build_model(
    config: ModelConfig,
    ops: Ops,
    *,
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    show_progress: bool = False,
) -> CausalLM:
    """Construct on the meta device, materialise on `device`, then load (or randomise) the weights."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {list(LOAD_FORMATS)}")
    with torch.device("meta"):
        model = CausalLM(config, ops, max_positions, dtype)
    model = model.to_empty(device=device)
    model.init_rope_table()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, model_dir, show_progress=show_progress)
    return model.eval().requires_grad_(False)
