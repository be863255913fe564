"""Engine options, with vLLM's names, shared by `LLM`, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "demo"  # the small trained model shipped in tinyvllm/models/demo
FALLBACK_MODEL = "dummy:tiny"  # a tiny random-weight checkpoint (written on first use) where demo is absent
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def default_model() -> str:
    """The model used when none is named: DEFAULT_MODEL, or FALLBACK_MODEL (with a warning) in an
    installation that lacks the demo model's weights."""
    from tinyvllm.models.checkpoint import demo_model_available

    if demo_model_available():
        return DEFAULT_MODEL
    logger.warning(
        "the demo model's weights are not installed; using %s (random weights: its text is noise)", FALLBACK_MODEL
    )
    return FALLBACK_MODEL


@dataclass
class EngineArgs:
    """Everything needed to build an engine. `None` means "derive it" (see each field)."""

    model: str | None = None  # a Hugging Face model directory, "demo" or "dummy:<preset>"; None: default_model()
    tokenizer: str | None = None  # directory with tokenizer.json; None: the model's
    dtype: str = "auto"  # auto (the checkpoint's), bfloat16, float16, float32
    device: str = "auto"  # auto (cuda if available), cpu, cuda, cuda:N
    kernel_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere), torch, triton
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 (at least max_model_len without chunking)
    max_model_len: int | None = None  # None: min(max_position_embeddings, what the KV cache holds)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # KV cache budget; on the CPU the default is 1 GiB
    load_format: str = "auto"  # auto/safetensors, or dummy (random weights, config only)
    seed: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool | None = None  # overlap host work with the device; None: on for CUDA
    fused_gemv: bool = True  # batch-1 decode through our matrix-vector kernels with the residual adds and
    # SwiGLU folded in (models/llama.py; measured 897 vs 845 tok/s on the H200, docs/perf.md)
    decode_megakernel: bool | None = None  # on CUDA, a decode step of one sequence runs every layer in one
    # kernel launch (kernels/decode_megakernel.py); None: where it was measured faster (hidden ≤ 2048)
    pruned_lm_head: bool = True  # on CUDA with CUDA graphs, a decode step of one sequence whose sampling is
    # greedy or temperature-only samples from an int8 copy of the LM head (vocab × hidden bytes more
    # memory) and the few rows it cannot rule out: the same tokens (kernels/lm_head_bounds.py)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def add_engine_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineArgs field, spelled as vLLM spells it (--max-num-seqs, ...)."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="model directory, demo or dummy:<preset> (default: %s, the small model shipped with "
        "tinyvllm)" % DEFAULT_MODEL,
    )
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default=d.device)
    g.add_argument("--kernel-backend", default=d.kernel_backend, choices=["auto", "torch", "triton"])
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "safetensors", "dummy"])
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 before reading step N's tokens (default: on for CUDA)",
    )
    g.add_argument(
        "--fused-gemv",
        action=argparse.BooleanOptionalAction,
        default=d.fused_gemv,
        help="batch-1 decode steps through our matrix-vector kernels, with SwiGLU and the "
        "residual adds folded in (default: on; see docs/perf.md)",
    )
    g.add_argument(
        "--decode-megakernel",
        action=argparse.BooleanOptionalAction,
        default=d.decode_megakernel,
        help="on CUDA, run a decode step of one sequence through all layers in one kernel launch "
        "(default: on for hidden sizes up to 2048, where it was measured faster; docs/perf.md)",
    )
    g.add_argument(
        "--pruned-lm-head",
        action=argparse.BooleanOptionalAction,
        default=d.pruned_lm_head,
        help="on CUDA with CUDA graphs, sample a batch-1 decode step (greedy or temperature only) "
        "from an int8 copy of the LM head and the few rows it cannot rule out: the same "
        "tokens, about half the LM head's bytes, vocab × hidden bytes more memory (default: on)",
    )


def engine_args_from_cli(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
