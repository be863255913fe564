"""Engine options with vLLM's names: the one configuration surface of `LLM`, the CLI and the server.

`EngineArgs` is flat, as vLLM's is, so `LLM(model, **kwargs)` takes its fields as keyword arguments.
Each field carries its help text; `add_engine_cli_args` generates one flag per field from them
(`max_num_seqs` → `--max-num-seqs`, a bool → `--flag/--no-flag`), so a new field is a new flag. The
engine turns the fields into the typed configs it passes down (`runner_config()`; the cache and
scheduler configs are sized by the engine, which needs the model's memory profile first).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.config import GRAPH_CAPTURE_MODES, ParallelConfig, RunnerConfig
from tinyvllm.structured.reasoning_gate import REASONING_END_TEXT

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


def _opt(default, help: str, choices: tuple | None = None, cli: bool = True, aliases: tuple[str, ...] = ()):
    """A field with its CLI help (and choices, and short flags such as -tp); `cli=False` keeps it out of
    the generated flags."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli, "aliases": aliases})


_RUNNER = {f.name for f in dataclasses.fields(RunnerConfig)}


@dataclass
class EngineArgs:
    """Everything needed to build an engine. `None` means "derive it" (each field's help says how)."""

    model: str | None = _opt(None, "model directory (Hugging Face format), demo or dummy:<preset> (default: demo)")
    tokenizer: str | None = _opt(None, "directory with tokenizer.json (default: the model's)")
    dtype: str = _opt(
        "auto", "weights and activations dtype (auto: the checkpoint's)", ("auto", "bfloat16", "float16", "float32")
    )
    device: str = _opt("auto", "auto (cuda if available), cpu, cuda or cuda:N")
    kernel_backend: str = _opt(
        "auto", "auto: Triton on CUDA, the torch reference elsewhere", ("auto", "torch", "triton")
    )
    block_size: int = _opt(16, "tokens per KV cache block")
    max_num_seqs: int = _opt(256, "most sequences in one step")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget of one step (default: 8192, at least max_model_len without chunked prefill)"
    )
    max_model_len: int | None = _opt(None, "longest sequence (default: the model's limit or what the cache holds)")
    gpu_memory_utilization: float = _opt(0.9, "fraction of the GPU's memory the engine may take")
    num_gpu_blocks_override: int | None = _opt(None, "KV cache blocks, instead of sizing the cache from memory")
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "KV cache size in bytes, instead of sizing it (default: on CUDA, what gpu_memory_utilization leaves; on the "
        "CPU, what max_num_seqs sequences of max_model_len tokens need, at most 1/4 of the memory)",
    )
    quantization: str | None = _opt(
        None,
        "fp8: quantize the weights to FP8 at load (per-channel weight scales, per-token activation scales); "
        "checkpoints already in FP8 (compressed-tensors, quant_method fp8) run in FP8 without it",
        ("fp8",),
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache dtype: auto (the model's) or fp8 (float8_e4m3fn, twice the tokens)",
        ("auto", "fp8", "fp8_e4m3"),
    )
    load_format: str = _opt(
        "auto", "auto/safetensors, or dummy (random weights, config only)", ("auto", "safetensors", "dummy")
    )
    seed: int = _opt(0, "seed of the engine's random state (dummy weights, unseeded sampling)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV cache blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps")
    enforce_eager: bool = _opt(False, "no CUDA graphs")
    graph_capture: str = _opt(
        "lazy",
        "when decode CUDA graphs are captured: lazy (ready at once; a bucket is captured after its first eager "
        "step, the rest while a server idles) or eager (all at start-up: steady state from the first step)",
        GRAPH_CAPTURE_MODES,
    )
    async_scheduling: bool | None = _opt(
        None, "schedule step N+1 before reading step N's tokens (default: on for CUDA)"
    )
    chat_template: str | None = _opt(
        None,
        "a Jinja chat template, or the path of a file holding one, used instead of the model's (a request's "
        "own chat_template still wins)",
    )
    generation_config: str = _opt(
        "auto",
        "where the default sampling parameters come from: auto (the model's generation_config.json), vllm "
        "(none: SamplingParams' own defaults) or a directory holding a generation_config.json",
    )
    override_generation_config: Mapping[str, Any] | None = _opt(
        None,
        "fields laid over the generation config, as JSON on the command line: '{\"temperature\": 0.5}'",
    )
    reasoning_parser: str | None = _opt(
        None,
        "the model thinks before it answers and ends thinking as this parser says: structured outputs "
        "constrain only the answer",
        tuple(REASONING_END_TEXT),
    )
    structured_outputs_workers: int | None = _opt(
        None,
        "processes that accept constrained requests' tokens and fill their token masks beside the engine "
        "(default on CUDA: a quarter of the CPU cores, at most 4, none below 8 cores; none on the CPU)",
    )
    # Parallelism (ParallelConfig); docs/parallelism.md. The rendezvous flags are torchrun's.
    data_parallel_size: int = _opt(
        1,
        "engine cores behind one server (tinyvllm serve), each a process of its own with its own GPU(s); "
        "each request runs on the least-loaded core",
        aliases=("-dp",),
    )
    tensor_parallel_size: int = _opt(
        1, "split the model over this many processes (one GPU each on CUDA)", aliases=("-tp",)
    )
    nnodes: int = _opt(1, "machines the tensor-parallel ranks span (each runs the same command)")
    node_rank: int = _opt(
        0, "this machine's index; machines other than 0 run workers only (python -m tinyvllm.distributed.headless)"
    )
    master_addr: str = _opt("127.0.0.1", "address of machine 0, where the ranks meet")
    master_port: int | None = _opt(None, "port of the rendezvous on machine 0 (default: a free one; one machine only)")
    distributed_timeout_s: float = _opt(
        60.0, "seconds a step's collective waits for a rank before the engine declares it hung"
    )
    # Execution paths (RunnerConfig); docs/perf.md has the measurements behind the defaults.
    fused_gemv: bool = _opt(
        True, "small decode steps through our matrix-vector kernels, with SwiGLU and the residual adds folded in"
    )
    fused_max_tokens: int = _opt(1, "largest step (token rows, 1-16) the fused matrix-vector path serves")
    pdl: bool = _opt(
        False,
        "on sm_90+ GPUs, launch our kernels with programmatic dependent launch: each starts while the previous"
        " one finishes (docs/perf.md section 1e)",
    )
    decode_megakernel: bool | None = _opt(
        None,
        "on CUDA, a decode step of one sequence runs every layer in one kernel launch "
        "(default: on for hidden sizes up to --megakernel-max-hidden)",
    )
    megakernel_max_hidden: int = _opt(8192, "largest hidden size the decode megakernel is on for by default")
    rows_megakernel: bool = _opt(
        False,
        "on CUDA, a decode step of 2-16 sequences runs every layer in one kernel launch (slower than the"
        " default layer loop today: docs/perf.md section 1e)",
    )
    pruned_lm_head: bool = _opt(
        True,
        "on CUDA with CUDA graphs, sample a batch-1 decode step (greedy or temperature only) from an "
        "int8 copy of the LM head and the few rows it cannot rule out: the same tokens, vocab x hidden bytes "
        "more memory",
    )
    sample_in_lm_head: bool = _opt(True, "decode graphs sample inside the LM head's fused kernel")
    graph_io_max_rows: int = _opt(1, "graph buckets of up to this many rows (0 or 1) load their own inputs")
    kernel_copy_max_rows: int = _opt(8, "steps of up to this many rows copy inputs and ids by kernels")
    cascade_min_batch: int = _opt(96, "decode steps of at least this many rows may use cascade attention")
    cascade_min_prefix: int = _opt(256, "shared prefix (keys) from which cascade attention is used")
    batch_invariant: bool = _opt(
        False,
        "a request's tokens and logprobs do not depend on the other requests in a step, on prompt chunking or "
        "on prefix-cache hits (batch-invariant kernels; slower)",
    )

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def parallel_config(self) -> ParallelConfig:
        """The typed parallelism config (raises ValueError on an impossible one)."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            distributed_timeout_s=self.distributed_timeout_s,
        )

    def runner_config(self, device_type: str) -> RunnerConfig:
        """The runner's typed config; CUDA graphs only on CUDA and without `enforce_eager`."""
        values = {name: getattr(self, name) for name in _RUNNER if name != "cuda_graphs"}
        return RunnerConfig(**values, cuda_graphs=device_type == "cuda" and not self.enforce_eager)


def add_engine_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineArgs field, spelled as vLLM spells it (`--max-num-seqs`, ...)."""
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if not f.metadata.get("cli", True):
            continue
        flags = [*f.metadata.get("aliases", ()), "--" + f.name.replace("_", "-")]
        kind = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if typing.get_origin(kind) in (dict, Mapping):
            kind = _json_object
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(
                *flags, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"), help=help_text
            )


def _json_object(text: str) -> dict[str, Any]:
    """A command-line value that must be a JSON object."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _base_type(hint) -> type:
    """`int | None` → int; `bool` → bool."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def engine_args_from_cli(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
