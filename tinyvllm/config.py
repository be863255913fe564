"""Frozen configuration dataclasses: what the model is, how the cache and the scheduler are sized.

No I/O beyond `ModelConfig.from_dir` reading one JSON file, and no torch: these are plain values that
every layer can share. Validation happens here, with messages a user can act on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.quantization.config import QuantizationConfig, parse_quantization_config

# architecture (config.json `architectures[0]`) → its `model_type`; a family is a set of ModelConfig fields
# (QKV bias, per-head q/k norm, sliding window) read from config.json by `_family_fields`.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8_e4m3: vLLM's other name for fp8
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
    """The shape of a decoder of one of the supported families, read from a Hugging Face `config.json`.

    One decoder serves every family (Llama 3.x, Mistral, Qwen2/2.5, Qwen3); a family differs only in:
    `qkv_bias` (Qwen2: biases on the q, k and v projections), `qk_norm` (Qwen3: RMSNorm over each head's
    `head_dim` features of q and k, after the projection and before RoPE) and sliding-window attention
    (`sliding_window` W on the layers whose `layer_types` entry is "sliding_attention": the query at
    position p sees keys p − W + 1 .. p).
    """

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
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # one entry per layer (LAYER_TYPES); empty: every layer full attention
    quantization: QuantizationConfig | None = None  # the checkpoint's own (config.json quantization_config)

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
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if self.layer_types:
            _check_layer_types(self.layer_types, self.num_hidden_layers)
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is null")

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys p − W + 1 .. p are visible), or None: full causal."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_sliding_window(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return "sliding_attention" in self.layer_types

    @property
    def all_layers_sliding(self) -> bool:
        """Whether every layer has the window: then K/V older than the window is never read again."""
        return bool(self.layer_types) and all(t == "sliding_attention" for t in self.layer_types)

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
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * f
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        return L * per_layer + h + emb * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config dict; unknown architectures and unsupported options are errors."""
        arch = _architecture(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for {arch}; tinyvllm supports 'silu'")
        family = _family_fields(arch, cfg)
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
            quantization=_quantization(cfg),
            **family,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _quantization(cfg: dict[str, Any]) -> QuantizationConfig | None:
    raw = cfg.get("quantization_config")
    return None if raw is None else parse_quantization_config(raw)


def _architecture(cfg: dict[str, Any]) -> str:
    """The config's architecture: `architectures[0]`, or the one of its `model_type`; unknown is an error."""
    archs = cfg.get("architectures")
    if archs:
        if len(archs) != 1:
            raise ValueError(f"config.json lists {len(archs)} architectures {archs}; expected one")
        arch = archs[0]
    else:
        by_type = {t: a for a, t in ARCHITECTURES.items()}
        arch = by_type.get(cfg.get("model_type"), f"model_type {cfg.get('model_type')!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; tinyvllm supports {list(SUPPORTED_ARCHITECTURES)}")
    return arch


def _check_layer_types(layer_types: Sequence[str], num_layers: int) -> None:
    """One known type (LAYER_TYPES) per layer, or a ValueError naming what is wrong."""
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; tinyvllm supports {list(LAYER_TYPES)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")


def _family_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's family fields for `arch`, read as transformers' own config class reads them; an
    option that changes the maths and that we do not implement is an error naming it."""
    if cfg.get("mlp_bias"):
        raise ValueError(f"unsupported option mlp_bias=true for {arch}; tinyvllm has no MLP biases")
    if cfg.get("attention_bias"):
        # Llama and Qwen3 put the bias on all four projections, o_proj included; Qwen2 has no such flag.
        raise ValueError(
            f"unsupported option attention_bias=true for {arch}; tinyvllm supports q/k/v biases only as "
            "Qwen2ForCausalLM has them"
        )
    fields: dict[str, Any] = {"qkv_bias": arch == "Qwen2ForCausalLM", "qk_norm": arch == "Qwen3ForCausalLM"}
    layers = int(cfg["num_hidden_layers"])
    if arch == "LlamaForCausalLM":
        window = None
        default_types = ["full_attention"] * layers
    elif arch == "MistralForCausalLM":
        window = cfg.get("sliding_window")
        default_types = ["sliding_attention" if window is not None else "full_attention"] * layers
    else:  # Qwen2 / Qwen3: the window applies from layer max_window_layers on, when use_sliding_window
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        first = int(cfg.get("max_window_layers", 28))
        default_types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
        ]
    layer_types = cfg.get("layer_types") or default_types
    _check_layer_types(layer_types, layers)  # here too: types dropped below would escape __post_init__
    if arch == "LlamaForCausalLM" and "sliding_attention" in layer_types:
        raise ValueError("unsupported layer_types with sliding_attention for LlamaForCausalLM")
    fields["sliding_window"] = int(window) if window is not None else None
    # transformers gives a "sliding_attention" layer no window when sliding_window is null: full attention.
    sliding = window is not None and "sliding_attention" in layer_types
    fields["layer_types"] = tuple(layer_types) if sliding else ()
    return fields


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
    cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn with per-layer K and V scales

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.cache_dtype!r} is not supported; expected one of {list(KV_CACHE_DTYPES)}"
            )
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


GRAPH_CAPTURE_MODES = ("lazy", "eager")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runner executes a step: which execution path serves which step shape.

    Every field is an `EngineArgs` field of the same name; the defaults are the engine's (docs/perf.md
    gives the measurements behind each threshold). Fields that only matter on CUDA are ignored elsewhere.

    Attributes:
        fused_gemv: steps of at most `fused_max_tokens` token rows run the decoder through our
            matrix-vector kernels, with SwiGLU and the residual adds folded in.
        fused_max_tokens: the largest step (token rows) the fused matrix-vector path serves (1..16).
        pdl: our kernels are launched with programmatic dependent launch on sm_90+ (kernels/pdl.py):
            each kernel's programs start while the previous kernel finishes. In the fused path (and its
            LM head) every kernel, the gate/up product then on our kernel too (cuBLAS's are not launched
            so); in the layer loop those between cuBLAS's products. Off by default: the fused path under it
            measured behind the layer loop (docs/perf.md §1e).
        decode_megakernel: a decode step of one sequence runs every layer in one kernel launch (CUDA and
            the Triton backend only); None: on for hidden sizes up to `megakernel_max_hidden` (measured
            faster than the fused path at 1,024, 2,048, 2,560, 3,072 and 4,096: docs/perf.md §1e), with FP8
            weights for powers of two only (the others untimed with them).
        megakernel_max_hidden: the largest hidden size the megakernel is on for by default.
        rows_megakernel: a decode step of 2–16 sequences runs every layer in one kernel launch, each
            weight tile multiplied by all rows at once (CUDA and the Triton backend only; off by default
            until measured: docs/perf.md §1e).
        pruned_lm_head: batch-1 decode graph steps whose sampling is greedy or temperature only draw their
            token from an int8 copy of the LM head that bounds every row's score, plus the few rows it
            cannot rule out (the same token; vocab × hidden bytes more memory).
        cuda_graphs: capture decode steps as CUDA graphs (EngineArgs.enforce_eager turns them off).
        graph_capture: "lazy": the engine is ready before any graph exists; a decode step whose bucket has
            no graph yet runs eagerly and that bucket is captured before the next step, and an idle
            serving engine captures the remaining buckets one at a time (engine/cuda_graphs.py).
            "eager": every bucket is captured at start-up (steady state from the first step).
        sample_in_lm_head: graph steps find the fused sampler's per-block bests inside the LM head's
            kernel where that kernel is our fused product.
        graph_io_max_rows: graph buckets of at most this many rows load their own inputs and write their
            own sampled ids (a step is one graph launch); 0 turns it off.
        kernel_copy_max_rows: steps of at most this many sampled rows move their inputs and sampled ids by
            kernels reading pinned host memory instead of copy-engine copies.
        cascade_min_batch: decode-only steps of at least this many rows may use cascade attention.
        cascade_min_prefix: ... when their rows share at least this many leading keys in the same blocks.
        batch_invariant: a request's tokens and logprobs do not depend on the other requests of a step,
            on how its prompt is chunked or on prefix-cache hits: batch-invariant ops
            (kernels.get_ops), the layer loop for every step, no cascade attention (docs/determinism.md).
    """

    fused_gemv: bool = True
    fused_max_tokens: int = 1
    pdl: bool = False
    decode_megakernel: bool | None = None
    megakernel_max_hidden: int = 8192
    rows_megakernel: bool = False
    pruned_lm_head: bool = True
    cuda_graphs: bool = True
    graph_capture: str = "lazy"
    sample_in_lm_head: bool = True
    graph_io_max_rows: int = 1
    kernel_copy_max_rows: int = 8
    cascade_min_batch: int = 96
    cascade_min_prefix: int = 256
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.fused_max_tokens <= 16:
            raise ValueError(
                f"fused_max_tokens must be in [1, 16] (the fused kernels' row limit), got {self.fused_max_tokens}"
            )
        if self.graph_capture not in GRAPH_CAPTURE_MODES:
            raise ValueError(f"graph_capture must be one of {GRAPH_CAPTURE_MODES}, got {self.graph_capture!r}")
        if self.graph_io_max_rows not in (0, 1):
            raise ValueError(
                f"graph_io_max_rows must be 0 or 1 (one program loads a row), got {self.graph_io_max_rows}"
            )
        for name in ("megakernel_max_hidden", "kernel_copy_max_rows", "cascade_min_batch", "cascade_min_prefix"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the engine spreads over processes and devices: `data_parallel_size` engine cores behind one
    server, each splitting the model by tensor parallelism over `tensor_parallel_size` ranks, on `nnodes`
    machines of `tensor_parallel_size / nnodes` ranks each (one GPU per rank on CUDA).

    The rendezvous fields are torchrun's: every machine is launched with the same `nnodes`,
    `master_addr` and `master_port` and its own `node_rank`; machine k hosts global ranks
    k·L .. (k+1)·L − 1 with L = tensor_parallel_size / nnodes. Rank 0 (machine 0) is the driver: it owns
    the scheduler and the KV-cache manager and sends every step to the others (docs/parallelism.md).

    Attributes:
        data_parallel_size: engine cores, each a process of its own with its own device(s) (on CUDA,
            GPUs i*tp .. i*tp+tp-1 for core i), behind one API server that routes each request to
            one of them (`tinyvllm.engine.dp_client`, `tinyvllm serve` only). A request runs on
            one core from start to end.
        tensor_parallel_size: the number of ranks the model's heads, MLP and vocabulary are split over.
        nnodes, node_rank: the machines, and which one this is.
        master_addr, master_port: where rank 0 listens for the rendezvous (None: a free port, one machine
            only).
        distributed_timeout_s: how long a collective (a step's all-reduce) waits for a rank before the
            driver declares it hung.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError(
                "data_parallel_size > 1 runs its engine cores on one machine: nnodes must be 1 (run one server "
                "per machine behind a load balancer instead)"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes ({self.nnodes}): "
                "every machine hosts the same number of ranks"
            )
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ValueError(f"master_port must be a TCP port (1..65535), got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several machines (nnodes > 1) need --master-port: every machine must be given the same")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this machine hosts."""
        per = self.ranks_per_node
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def check_model(self, config: ModelConfig) -> None:
        """Raise ValueError unless `config` splits over `tensor_parallel_size` ranks: query heads, the MLP's
        intermediate size and the vocabulary divide evenly; KV heads divide evenly or, when there are fewer
        KV heads than ranks, the ranks divide evenly among them (each KV head is then replicated)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        problems = []
        if config.num_attention_heads % tp:
            problems.append(f"num_attention_heads ({config.num_attention_heads})")
        hk = config.num_key_value_heads
        if (hk >= tp and hk % tp) or (hk < tp and tp % hk):
            problems.append(
                f"num_key_value_heads ({hk}: a multiple of the ranks, or a divisor of them to replicate KV heads)"
            )
        if config.intermediate_size % tp:
            problems.append(f"intermediate_size ({config.intermediate_size})")
        if config.vocab_size % tp:
            problems.append(f"vocab_size ({config.vocab_size})")
        if problems:
            raise ValueError(
                f"tensor_parallel_size={tp} does not split this model: " + "; ".join(problems) + f" must divide by {tp}"
            )
