"""Which quantization a model runs with: parsed from config.json's `quantization_config` or asked for by
`EngineArgs.quantization`. No torch, no I/O.

Supported (everything else is a ValueError naming the field and listing these):

* `quantization="fp8"` on an unquantized checkpoint: weights quantized at load to float8_e4m3fn with one
  scale per output channel, activations quantized per token at run time (dynamic).
* compressed-tensors (`quant_method: "compressed-tensors"`, format "float-quantized" or
  "naive-quantized"): one config group targeting "Linear" whose `weights` are 8-bit float, symmetric,
  static, strategy "channel" or "tensor", and whose `input_activations` are 8-bit float, strategy "token"
  (dynamic) or "tensor" (dynamic or static), or absent (FP8 weights, activations in the model's dtype:
  not yet; an error). `ignore` lists modules kept unquantized (e.g. "lm_head"); `kv_cache_scheme`
  (8-bit float, strategy "tensor") means the checkpoint carries K/V cache scales.
* vLLM/HF's `quant_method: "fp8"` (`activation_scheme` "dynamic" or "static", per-tensor weight scales
  `weight_scale`, `ignored_modules`/`modules_to_not_convert`); `weight_block_size` is not supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("fp8",)  # EngineArgs.quantization
WEIGHT_STRATEGIES = ("channel", "tensor")
ACTIVATION_STRATEGIES = ("token", "tensor")
CT_FORMATS = ("float-quantized", "naive-quantized")
_SUPPORTED = (
    "supported: quantization='fp8' (quantize at load); compressed-tensors FP8 (8-bit float weights per "
    "channel or per tensor, 8-bit float input activations per token (dynamic) or per tensor (dynamic or "
    "static)); quant_method 'fp8' without weight_block_size"
)


@dataclass(frozen=True)
class QuantizationConfig:
    """FP8 (e4m3) quantization of the linear layers (not the embeddings; the LM head only if not ignored).

    Attributes:
        weight_strategy: "channel" (one scale per output row) or "tensor" (one per matrix; the fused
            QKV and gate/up layers keep each source matrix's scale on its rows).
        activation_strategy: "token" (one scale per row of x) or "tensor" (one for all of x).
        activation_dynamic: scales computed from x at run time; False: the checkpoint's `input_scale`.
        ignore: Hugging Face module names kept unquantized ("lm_head", "model.layers.0.mlp.down_proj", or
            "re:<regex>" patterns as compressed-tensors writes them).
        checkpoint_quantized: the checkpoint stores FP8 weights and their scales; False: quantize the
            checkpoint's weights at load.
        kv_cache_scales: the checkpoint carries per-layer K and V cache scales.
    """

    weight_strategy: str = "channel"
    activation_strategy: str = "token"
    activation_dynamic: bool = True
    ignore: tuple[str, ...] = ("lm_head",)
    checkpoint_quantized: bool = False
    kv_cache_scales: bool = False

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight strategy {self.weight_strategy!r} is not supported; {_SUPPORTED}")
        if self.activation_strategy not in ACTIVATION_STRATEGIES:
            raise ValueError(f"activation strategy {self.activation_strategy!r} is not supported; {_SUPPORTED}")
        if self.activation_strategy == "token" and not self.activation_dynamic:
            raise ValueError("static per-token activation scales cannot exist; use strategy 'tensor'")

    def is_ignored(self, module: str) -> bool:
        """Whether the Hugging Face module `module` (e.g. "model.layers.0.self_attn.q_proj") stays unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def resolve_quantization(requested: str | None, checkpoint: QuantizationConfig | None) -> QuantizationConfig | None:
    """The quantization to run with: the checkpoint's (`ModelConfig.quantization`) if it has one, which
    `requested` may name but not change; else `requested` ("fp8": quantize at load); else None."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; expected one of {list(QUANTIZATION_METHODS)}")
    if checkpoint is not None:
        return checkpoint  # already FP8: `requested` ("fp8" or None) agrees
    return QuantizationConfig() if requested == "fp8" else None


def parse_quantization_config(raw: dict[str, Any]) -> QuantizationConfig:
    """config.json's `quantization_config` → QuantizationConfig, or a ValueError naming the field."""
    if not isinstance(raw, dict):
        raise TypeError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "fp8":
        return _parse_fp8(raw)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; {_SUPPORTED}")


def _parse_fp8(raw: dict[str, Any]) -> QuantizationConfig:
    if raw.get("weight_block_size") is not None:
        raise ValueError(
            f"quantization_config.weight_block_size {raw['weight_block_size']!r}: block-wise FP8 scales are not "
            f"supported; {_SUPPORTED}"
        )
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"quantization_config.activation_scheme {scheme!r} is not supported; expected dynamic or static"
        )
    ignore = raw.get("ignored_modules") or raw.get("modules_to_not_convert") or ["lm_head"]
    # Dynamic: vLLM quantizes activations per tensor for these checkpoints; static: the checkpoint's input_scale.
    return QuantizationConfig(
        weight_strategy="tensor",
        activation_strategy="tensor",
        activation_dynamic=scheme == "dynamic",
        ignore=tuple(ignore),
        checkpoint_quantized=True,
        kv_cache_scales=bool(raw.get("kv_cache_scheme")),
    )


def _check_float8(args: dict[str, Any], where: str) -> None:
    """An 8-bit float, symmetric, ungrouped quantization (`args` is one QuantizationArgs dict)."""
    if args.get("type", "int") != "float":
        raise ValueError(f"{where}.type {args.get('type', 'int')!r} is not supported (only 'float'); {_SUPPORTED}")
    if args.get("num_bits") != 8:
        raise ValueError(f"{where}.num_bits {args.get('num_bits')!r} is not supported (only 8); {_SUPPORTED}")
    if args.get("group_size") is not None or args.get("block_structure") is not None:
        field = "group_size" if args.get("group_size") is not None else "block_structure"
        raise ValueError(f"{where}.{field} {args[field]!r}: grouped or block scales are not supported; {_SUPPORTED}")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}.symmetric false: asymmetric (zero-point) FP8 is not supported; {_SUPPORTED}")


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantizationConfig:
    fmt = raw.get("format")
    if fmt not in CT_FORMATS:
        raise ValueError(f"quantization_config.format {fmt!r} is not supported; expected one of {list(CT_FORMATS)}")
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups has {len(groups)} groups; tinyvllm supports exactly one")
    ((name, group),) = groups.items()
    where = f"quantization_config.config_groups.{name}"
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise ValueError(f"{where}.targets {targets!r} is not supported; expected ['Linear']")
    weights = group.get("weights")
    if not weights:
        raise ValueError(f"{where}.weights is missing: unquantized weights need no quantization_config")
    _check_float8(weights, f"{where}.weights")
    if weights.get("dynamic", False):
        raise ValueError(f"{where}.weights.dynamic true is not supported; FP8 weights carry static scales")
    strategy = weights.get("strategy")
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(
            f"{where}.weights.strategy {strategy!r} is not supported; expected one of {list(WEIGHT_STRATEGIES)}"
        )
    acts = group.get("input_activations")
    if not acts:
        raise ValueError(
            f"{where}.input_activations is missing: FP8 weights with unquantized activations (W8A16) are not "
            f"supported; {_SUPPORTED}"
        )
    _check_float8(acts, f"{where}.input_activations")
    act_strategy = acts.get("strategy")
    if act_strategy not in ACTIVATION_STRATEGIES:
        raise ValueError(
            f"{where}.input_activations.strategy {act_strategy!r} is not supported; "
            f"expected one of {list(ACTIVATION_STRATEGIES)}"
        )
    dynamic = acts.get("dynamic", False)
    if dynamic not in (True, False):
        raise ValueError(f"{where}.input_activations.dynamic {dynamic!r} is not supported; expected true or false")
    if act_strategy == "token" and not dynamic:
        raise ValueError(f"{where}.input_activations: strategy 'token' must be dynamic")
    kv = raw.get("kv_cache_scheme")
    if kv:
        _check_float8(kv, "quantization_config.kv_cache_scheme")
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic", False):
            raise ValueError(
                f"quantization_config.kv_cache_scheme strategy {kv.get('strategy')!r} dynamic {kv.get('dynamic')!r} "
                "is not supported; expected strategy 'tensor', static"
            )
    return QuantizationConfig(
        weight_strategy=strategy,
        activation_strategy=act_strategy,
        activation_dynamic=bool(dynamic),
        ignore=tuple(raw.get("ignore") or ()),
        checkpoint_quantized=True,
        kv_cache_scales=bool(kv),
    )
