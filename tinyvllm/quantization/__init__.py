"""Quantization: the typed config (config.py), FP8 numerics (fp8.py), the FP8 linear layer (linear.py)
and loading FP8 checkpoints or quantizing at load (loading.py). docs/fp8.md is the user's page."""

from tinyvllm.quantization.config import (
    QUANTIZATION_METHODS,
    QuantizationConfig,
    parse_quantization_config,
    resolve_quantization,
)

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "parse_quantization_config", "resolve_quantization"]
