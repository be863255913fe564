"""Frozen configuration dataclasses: what the model is, how the cache and the scheduler are sized.

No I/O beyond `ModelConfig.from_dir` reading one JSON file, and no torch: these are plain values that
every layer can share. Validation happens here, with messages a user can act on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_DTYPES = ("auto", "bfloat16", "float16", "float32")
_DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type: llama3`).

    For each rotary frequency f_i = theta^(-2i/d) with wavelength w_i = 2π / f_i:
    w_i < L/high_freq_factor keeps f_i; w_i > L/low_freq_factor uses f_i / factor; in between the two are
    blended with s = (L / w_i - low) / (high - low): (1 - s) f_i / factor + s f_i, where
    L = original_max_position_embeddings.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama 3.x model, read from a Hugging Face `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype name: "bfloat16", "float16" or "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, f, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * f
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + h + emb * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config dict; unknown architectures and unsupported options are errors."""
        archs = cfg.get("architectures")
        if archs:
            arch = archs[0]
        else:
            arch = "LlamaForCausalLM" if cfg.get("model_type") == "llama" else str(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; tinyvllm supports {list(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; Llama uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"unsupported option {flag}=true; Llama 3.x has no biases")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling = _parse_rope(cfg)
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        dtype = _DTYPE_ALIASES.get(str(dtype), str(dtype))
        if dtype not in SUPPORTED_DTYPES[1:]:
            raise ValueError(f"unsupported checkpoint dtype {dtype!r}; expected one of {list(SUPPORTED_DTYPES[1:])}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope_theta and rope scaling in either spelling: `rope_scaling` (HF <= 4, Meta's files) or
    `rope_parameters` (transformers >= 5)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is None:
        return theta, None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; tinyvllm supports 'llama3' or none")
    try:
        rs = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope_scaling is missing field {e.args[0]!r}") from None
    if rs.high_freq_factor <= rs.low_freq_factor:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    return theta, rs


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` token slots per layer.

    How many blocks (`tinyvllm.engine.kv_cache_size`): `num_gpu_blocks_override` if set, else
    `kv_cache_memory_bytes` if set (vLLM's `--kv-cache-memory-bytes`), else on CUDA what
    `gpu_memory_utilization` of the card leaves, and on the CPU what `max_num_seqs` sequences of
    `max_model_len` tokens need, at most `cpu_max_memory_fraction` of the machine's memory.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    cpu_max_memory_fraction: float = 0.25
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.cpu_max_memory_fraction <= 1.0:
            raise ValueError(f"cpu_max_memory_fraction must be in (0, 1], got {self.cpu_max_memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: at most `max_num_seqs` sequences and `max_num_batched_tokens` tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size)."""
    return math.ceil(num_tokens / block_size)


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runner executes a step: which execution path serves which step shape.

    Every field is an `EngineArgs` field of the same name; the defaults are the engine's (docs/perf.md
    gives the measurements behind each threshold). Fields that only matter on CUDA are ignored elsewhere.

    Attributes:
        fused_gemv: steps of at most `fused_max_tokens` token rows run the decoder through our
            matrix-vector kernels, with SwiGLU and the residual adds folded in.
        fused_max_tokens: the largest step (token rows) the fused matrix-vector path serves (1..16).
        decode_megakernel: a decode step of one sequence runs every layer in one kernel launch (CUDA and
            the Triton backend only); None: on for hidden sizes up to `megakernel_max_hidden`.
        megakernel_max_hidden: the largest hidden size the megakernel is on for by default.
        pruned_lm_head: batch-1 decode graph steps whose sampling is greedy or temperature only draw their
            token from an int8 copy of the LM head that bounds every row's score, plus the few rows it
            cannot rule out (the same token; vocab × hidden bytes more memory).
        cuda_graphs: capture decode steps as CUDA graphs (EngineArgs.enforce_eager turns them off).
        sample_in_lm_head: graph steps find the fused sampler's per-block bests inside the LM head's
            kernel where that kernel is our fused product.
        graph_io_max_rows: graph buckets of at most this many rows load their own inputs and write their
            own sampled ids (a step is one graph launch); 0 turns it off.
        kernel_copy_max_rows: steps of at most this many sampled rows move their inputs and sampled ids by
            kernels reading pinned host memory instead of copy-engine copies.
        cascade_min_batch: decode-only steps of at least this many rows may use cascade attention.
        cascade_min_prefix: ... when their rows share at least this many leading keys in the same blocks.
    """

    fused_gemv: bool = True
    fused_max_tokens: int = 1
    decode_megakernel: bool | None = None
    megakernel_max_hidden: int = 2048
    pruned_lm_head: bool = True
    cuda_graphs: bool = True
    sample_in_lm_head: bool = True
    graph_io_max_rows: int = 1
    kernel_copy_max_rows: int = 8
    cascade_min_batch: int = 96
    cascade_min_prefix: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.fused_max_tokens <= 16:
            raise ValueError(
                f"fused_max_tokens must be in [1, 16] (the fused kernels' row limit), got {self.fused_max_tokens}"
            )
        if self.graph_io_max_rows not in (0, 1):
            raise ValueError(
                f"graph_io_max_rows must be 0 or 1 (one program loads a row), got {self.graph_io_max_rows}"
            )
        for name in ("megakernel_max_hidden", "kernel_copy_max_rows", "cascade_min_batch", "cascade_min_prefix"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
