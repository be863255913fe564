"""The engine: add_request / step / abort. Owns the scheduler, the model runner and the output processor.

It works in two layers:

- the core (`add_core_request`, `core_step`): one step schedules a batch, launches it, appends the
  sampled tokens and applies the token-level stopping rules (EOS, stop token ids, max_tokens,
  min_tokens: the scheduler's), and returns an `EngineCoreOutput` for every completion that has news
  (`tinyvllm.engine.messages`). This is what the core loop (`tinyvllm.engine.core`) sends to the API
  process of `tinyvllm serve`.
- `add_request` / `step()`: the same, through the output processor that the server uses too
  (`tinyvllm.engine.output_processor`: detokenization, stop strings, output kinds), giving
  `RequestOutput`s. A stop string matched there aborts the request (or that completion) here.

Parallel sampling (`n > 1`) runs n child sequences under one request id.

Prompt logprobs (`SamplingParams.prompt_logprobs`) are scored by the runner as the prompt's chunks are
computed (tinyvllm/sampling/prompt_logprobs.py), appended here in order, and sent complete with the first
output of completion 0. That completion alone scores them (its siblings share them) and it reads nothing
from the prefix cache: every prompt position is computed (vLLM's rule). A preempted request recomputes
its prompt; the entries it already holds are kept.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tinyvllm.chat_template import resolve_chat_template
from tinyvllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import SchedulerOutput
from tinyvllm.core.request import Request, RequestStatus
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.args import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs, default_model
from tinyvllm.engine.driver_init import DriverInit
from tinyvllm.engine.messages import AbortRequest, EngineCoreOutput, RequestTimes
from tinyvllm.engine.model_runner import ModelRunner, StepHandle
from tinyvllm.engine.output_processor import OutputProcessor, streams_every_step
from tinyvllm.engine.startup_timing import StartupTimer
from tinyvllm.engine.step_timing import StepRecord, StepTimer
from tinyvllm.gc_pause import gc_paused
from tinyvllm.kernels import default_backend, get_ops
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.quantization.config import resolve_quantization
from tinyvllm.sampling.logits_processors import bad_words_token_ids, check_vocab, needs_history
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import Tokenizer, check_text

if TYPE_CHECKING:
    from tinyvllm.distributed.driver import TensorParallelRunner

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Sampling defaults a checkpoint's generation_config.json may set (vLLM's "generation config" defaults).
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; expected auto, cpu or cuda[:N]")
    return dev


def check_tensor_parallel(
    parallel: ParallelConfig, model_config: ModelConfig, device: torch.device, quantization: Any
) -> None:
    """Raise ValueError, before any process starts, for a tensor-parallel engine that cannot run: a model
    that does not split (ParallelConfig.check_model), a machine other than 0 (it runs workers only), more
    ranks on a machine than it has GPUs, FP8 weights (not sharded yet)."""
    parallel.check_model(model_config)
    if parallel.node_rank != 0:
        raise ValueError(
            f"node_rank={parallel.node_rank}: machines other than 0 run tensor-parallel workers only; start them "
            "with `python -m tinyvllm.distributed.headless` and the same flags (docs/parallelism.md)"
        )
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ValueError(f"tensor parallelism runs rank r on cuda:r; device={device} is not supported")
        count = torch.cuda.device_count()
        if parallel.ranks_per_node > count:
            raise ValueError(
                f"tensor_parallel_size={parallel.tensor_parallel_size} over nnodes={parallel.nnodes} needs "
                f"{parallel.ranks_per_node} GPUs on this machine; it has {count}"
            )
    if quantization is not None:
        raise ValueError("tensor parallelism with FP8 weights is not supported yet; drop quantization or use -tp 1")


def resolve_dtype(dtype: str, model_config: ModelConfig) -> torch.dtype:
    name = model_config.dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected auto, bfloat16, float16 or float32")
    return _DTYPES[name]


def _needs_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's token history (penalties; a bad word of several tokens): no
    async overlap then. A grammar needs only the previous step's token, which the runner waits for after
    enqueuing the next step's forward (`core_step`'s `before_mask`), so constrained requests keep it."""
    return (
        needs_history(params)
        or params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.repetition_penalty != 1
    )


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


# What an override of the generation config may set: the sampling defaults, do_sample and eos_token_id
_OVERRIDABLE = frozenset({*_GENERATION_DEFAULTS, "do_sample", "eos_token_id"})


def load_generation_config(model_dir: Path, source: str = "auto", override: dict[str, Any] | None = None) -> dict:
    """The generation config the engine's defaults come from (vLLM's ``--generation-config`` and
    ``--override-generation-config``): the model's generation_config.json ("auto"), none ("vllm"), or
    the one in the directory `source` names; then `override`'s fields laid over it.

    Raises:
        ValueError: `source` names no directory with a generation_config.json, or `override` sets a
            field other than those that change the engine's defaults (`_OVERRIDABLE`).
    """
    if source == "auto":
        config = read_generation_config(model_dir)
    elif source == "vllm":
        config = {}
    else:
        path = Path(source).expanduser()
        if not (path / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config={source!r}: expected auto, vllm or a directory holding generation_config.json"
            )
        config = read_generation_config(path)
    if override:
        unknown = sorted(set(override) - _OVERRIDABLE)
        if unknown:
            raise ValueError(
                f"override_generation_config sets {unknown}, which change nothing here; it may set "
                f"{sorted(_OVERRIDABLE)}"
            )
        config = {**config, **override}
    return config


class TokenizedPrompt(NamedTuple):
    """A prompt as `LLMEngine.tokenize_prompt` returns it: its ids are known to be valid token ids, so
    `add_request` takes it without checking them again (a 1k-token prompt costs ~35 µs to check)."""

    text: str | None
    token_ids: list[int]


@dataclass
class _Sequence:
    """Engine-side state of one child sequence: the scheduler's Request, its logprobs, what was sent."""

    request: Request
    parent_id: str
    index: int
    params: SamplingParams
    every_step: bool  # outputs after every step (else when it finishes): streams_every_step
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # output tokens already sent in an EngineCoreOutput
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # scored so far (the scoring child only)

    def complete_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """The prompt logprobs when this completion scores them and all are in, else None."""
        lps = self.prompt_logprobs
        return lps if lps is not None and len(lps) == self.request.num_prompt_tokens else None


@dataclass
class _Parent:
    request_id: str
    children: list[_Sequence]
    num_running: int = field(init=False)  # children whose finishing output has not been made yet

    def __post_init__(self) -> None:
        self.num_running = len(self.children)


def _times(request: Request, finished_time: float | None = None) -> RequestTimes:
    return RequestTimes(request.first_scheduled_time, request.first_token_time, finished_time)


def _import_triton_kernels(batch_invariant: bool) -> None:
    """Import the Triton kernels' modules ahead of the runner, which then finds them loaded (where Triton
    is missing, the runner raises its own error later)."""
    with contextlib.suppress(ImportError):
        get_ops("triton", batch_invariant=batch_invariant)


class LLMEngine:
    """Synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, args: EngineArgs, show_progress: bool = False) -> None:
        with gc_paused():  # start-up builds long-lived objects only; it ends with a collection and a freeze
            self._start(args, show_progress)

    def _start(self, args: EngineArgs, show_progress: bool) -> None:
        """Everything `__init__` builds, timed by phase (`startup_times`)."""
        self.args = args
        self.parallel_config = args.parallel_config()
        if self.parallel_config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: an LLMEngine (and LLM) is one engine core; "
                "serve several with `tinyvllm serve -dp N`, or run one LLM per device"
            )
        timer = StartupTimer()
        # CUDA's driver initialises on a thread while the config, tokenizer and kernels load (GIL released)
        driver = DriverInit(args.device) if self.parallel_config.world_size == 1 else None
        with timer.phase("config_tokenizer"):
            self.model_dir = resolve_model(args.model or default_model())
            self.model_config = ModelConfig.from_dir(self.model_dir)
            self.tokenizer = Tokenizer.from_pretrained(args.tokenizer or self.model_dir)
            if args.chat_template is not None:
                self.tokenizer.chat_template = resolve_chat_template(args.chat_template)
            self.generation_config = load_generation_config(
                self.model_dir, args.generation_config, args.override_generation_config
            )
        if driver is not None and driver.loaded and args.kernel_backend in ("auto", "triton"):
            with timer.phase("kernels_import"):
                _import_triton_kernels(args.batch_invariant)
        with timer.phase("device_init"):
            if driver is not None:
                driver.join()
            self.device = resolve_device(args.device)
            timer.set_device(self.device)
            if self.device.type == "cuda":
                torch.zeros(1, device=self.device)  # creates the context (or finds the thread's)
        self.dtype = resolve_dtype(args.dtype, self.model_config)
        backend = default_backend(self.device.type) if args.kernel_backend == "auto" else args.kernel_backend
        self.eos_token_ids = self._eos_token_ids()
        self._structured = None  # the StructuredOutputManager, built by the first constrained request

        self.quantization = resolve_quantization(args.quantization, self.model_config.quantization)
        if args.batch_invariant and (self.quantization is not None or args.kv_cache_dtype != "auto"):
            raise ValueError(
                "batch_invariant=True runs bf16/float32 weights and KV cache only (its matrix products and "
                "attention have no FP8 form yet); drop quantization / kv_cache_dtype or batch_invariant"
            )
        with timer.phase("weights"):
            self.runner = self._build_runner(backend, show_progress)
        for name, seconds in self.runner.startup_times.items():  # its own phases, out of "weights"
            timer.move(seconds, "weights", name)
        try:
            self._init_kv_cache_and_scheduler(timer)
        except BaseException:
            self.runner.shutdown()  # a tensor-parallel runner's workers must not outlive a failed start
            raise
        with timer.phase("engine_state"):
            self._init_request_state()
        with timer.phase("gc_freeze"):
            # Everything built so far (model, tokenizer, graphs, tables) lives as long as the engine: move
            # it out of the garbage collector's generations, whose full passes otherwise rescan it every few
            # hundred steps (measured: ~0.5 ms per batch-256 step on the development CPU).
            gc.collect()
            gc.freeze()
        # Seconds per start-up phase (engine/startup_timing.py); lazily captured graphs are not in it.
        self.startup_times: dict[str, float] = timer.times
        logger.info(
            "engine ready: %s on %s (%s, %s kernels%s), %d KV blocks of %d tokens (%s), max_model_len %d",
            self.model_dir,
            self.device,
            self.dtype,
            backend,
            ", FP8 weights" if self.quantization is not None else "",
            self.num_blocks,
            args.block_size,
            self.runner.kv_cache_dtype,
            self.scheduler_config.max_model_len,
        )
        logger.info(
            "start-up took %.2f s: %s", timer.total(), ", ".join(f"{k} {v:.2f} s" for k, v in timer.times.items())
        )

    def _build_runner(self, backend: str, show_progress: bool) -> ModelRunner | TensorParallelRunner:
        """The model runner: builds the model and loads its weights (under tensor parallelism, one per
        rank: distributed/driver.py)."""
        args = self.args
        runner_kwargs = dict(
            model_config=self.model_config,
            runner_config=args.runner_config(self.device.type),
            quantization=self.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            model_dir=str(self.model_dir),
            dtype=self.dtype,
            kernel_backend=backend,
            load_format=args.load_format,
            seed=args.seed,
            eos_token_ids=self.eos_token_ids,
            show_progress=show_progress,
        )
        if self.parallel_config.world_size > 1:
            from tinyvllm.distributed.driver import TensorParallelRunner

            check_tensor_parallel(self.parallel_config, self.model_config, self.device, self.quantization)
            return TensorParallelRunner(self.parallel_config, runner_kwargs, self.device)
        return ModelRunner(**runner_kwargs, device=self.device)

    def _init_kv_cache_and_scheduler(self, timer: StartupTimer) -> None:
        """Size the KV cache (and max_model_len from it), allocate it in the runner, build the scheduler;
        `timer` times the phases (engine/startup_timing.py)."""
        args = self.args
        cache_config = CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching,
            cache_dtype=args.kv_cache_dtype,
        )
        budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        limit = self.model_config.max_position_embeddings
        wanted_len = min(args.max_model_len or limit, limit)  # a larger max_model_len raises below
        with timer.phase("memory_profile"):
            size = self.runner.determine_num_blocks(cache_config, budget, args.max_num_seqs, wanted_len)
        logger.info("KV cache: %s", size.describe(args.block_size))
        num_blocks = size.num_blocks
        # Where every layer slides, K/V older than the window is released (core.kv_cache_manager), so a
        # request holds at most the window's blocks plus one step's chunk: the cache then bounds
        # max_model_len only if that span does not fit.
        window = self.model_config.sliding_window if self.model_config.all_layers_sliding else None
        with timer.phase("scheduler"):
            kv_manager = KVCacheManager(
                BlockPool(num_blocks, enable_caching=args.enable_prefix_caching),
                args.block_size,
                sliding_window=window,
            )
        cache_tokens = num_blocks * args.block_size
        if window is not None and kv_manager.max_blocks_held(wanted_len, budget) <= num_blocks:
            cache_tokens = wanted_len
        max_model_len = self._max_model_len(cache_tokens)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
            budget = max(budget, max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
        )
        self.cache_config = cache_config
        self.num_blocks = num_blocks
        with timer.phase("kv_allocation"):
            self.runner.initialize(
                num_blocks=num_blocks,
                block_size=args.block_size,
                max_model_len=max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=budget,
            )
        captures = self.runner.graphs.capture_log if self.runner.graphs is not None else []
        timer.move(sum(c[1] for c in captures), "kv_allocation", "graph_warmup")
        timer.move(sum(c[2] for c in captures), "kv_allocation", "graph_capture")
        with timer.phase("scheduler"):
            self.scheduler = Scheduler(self.scheduler_config, kv_manager)

    def _init_request_state(self) -> None:
        """Step scheduling, timing and the per-request bookkeeping (empty)."""
        args = self.args
        # Async scheduling: on CUDA, step N+1 is scheduled and launched before step N's tokens are read,
        # so the host's work overlaps the device's. Requests with penalties need every token of their
        # history at sampling time; while one is live, steps run one at a time.
        self.async_scheduling = self.device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.step_timer = StepTimer()  # set keep_log to see where each step's time went
        self._wait_s = 0.0  # time blocked on the device inside the current step's _process calls
        self._num_history_requests = 0
        self._early_outputs: list[EngineCoreOutput] = []  # the in-flight step's, processed inside a launch
        # core_step's `early` (or `_early_outputs.extend`) while a core_step runs
        self._early: Callable[[list[EngineCoreOutput]], None] | None = None
        # A step with constrained rows waits, between its forward and its sampling, for the grammar
        # workers' mask; with `schedule_in_launch` the engine schedules the next step in that wait
        # (`_process_in_flight_early`), so that after the sampling is enqueued only the next step's
        # launch stands between it and the next forward; with `prepare_in_launch` the runner packs that
        # step's inputs in the wait too (ModelRunner.prepare), leaving only its enqueues (off by default
        # until the `structured` bench has timed it on the device: docs/perf.md §10). That schedule
        # is the one `core_step` would make: the in-flight step processed, the current one in flight.
        # What happens between the two points (an abort, a new request) reaches the schedule after it,
        # as it reaches an in-flight step.
        self.schedule_in_launch = True
        self.prepare_in_launch = False
        self._scheduled_early: SchedulerOutput | None = None
        self._in_launch = False  # inside _process_in_flight_early's processing of the in-flight step
        self.default_sampling_params = self._default_sampling_params()
        self.default_max_tokens = self._default_max_tokens()
        self.max_tokens_cap = self._max_tokens_cap()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}
        self._pending: list[EngineCoreOutput] = []  # outputs produced outside a step (rejections, aborts)
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # ------------------------------------------------------------------ configuration helpers
    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen_eos = self.generation_config.get("eos_token_id")
        for source in (self.tokenizer.eos_token_id, gen_eos, list(self.model_config.eos_token_ids)):
            for i in source if isinstance(source, list) else [source]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        return tuple(ids)

    def _max_model_len(self, cache_tokens: int) -> int:
        limit = self.model_config.max_position_embeddings
        asked = self.args.max_model_len
        if asked is None:
            return min(limit, cache_tokens)
        if asked > limit:
            raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings ({limit})")
        if asked > cache_tokens:
            raise ValueError(
                f"max_model_len={asked} exceeds what the KV cache holds ({cache_tokens} tokens); "
                f"lower max_model_len or give the cache more memory"
            )
        return asked

    def _default_sampling_params(self) -> SamplingParams:
        """SamplingParams() overridden by the sampling fields of generation_config.json, as vLLM does."""
        changes = {
            ours: self.generation_config[theirs]
            for theirs, ours in _GENERATION_DEFAULTS.items()
            if theirs in self.generation_config
        }
        if not self.generation_config.get("do_sample", True):
            changes["temperature"] = 0.0
        try:
            return SamplingParams().replace(**changes)
        except (TypeError, ValueError) as e:
            if self.args.override_generation_config:  # the user's own values: an error, not a warning
                raise ValueError(f"override_generation_config: {e}") from None
            logger.warning("ignoring sampling defaults of generation_config.json: %s", e)
            return SamplingParams()

    def _default_max_tokens(self) -> int | None:
        """The generation config's max_new_tokens, for the OpenAI server: the max_tokens of a request
        that sets none (vLLM's rule; `LLM` has it in `default_sampling_params` already). None when the
        config sets none, or when its sampling defaults were dropped as invalid (a warning said so)."""
        value = self.generation_config.get("max_new_tokens")
        if value is None or self.default_sampling_params.max_tokens != value:
            return None
        return value

    def _max_tokens_cap(self) -> int | None:
        """The most tokens the OpenAI server lets any request generate, its own max_tokens included
        (vLLM's rule): a max_new_tokens given on the command line, in the generation config of the
        directory --generation-config names (after the override) or in --override-generation-config.
        The checkpoint's own generation_config.json sets only the default. None: no cap."""
        if self.default_max_tokens is None:
            return None
        if self.args.generation_config not in ("auto", "vllm"):
            return self.default_max_tokens
        override = self.args.override_generation_config or {}
        return self.default_max_tokens if override.get("max_new_tokens") is not None else None

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType, name: str = "prompt") -> TokenizedPrompt:
        """(prompt text or None, token ids), checked; `name` is how error messages call the prompt
        (e.g. "prompt 3"). The result can be passed to `add_request` as the prompt, which then skips
        the checks.

        Raises:
            TypeError: a prompt that is not a string, a list of ints or a dict of them.
            ValueError: text that is not valid Unicode, a token id outside the vocabulary, a dict
                without "prompt" or "prompt_token_ids".
        """
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{name}: 'prompt' must be a string, not {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                if text is not None:
                    check_text(text, name)
                return TokenizedPrompt(text, self._check_token_ids(prompt["prompt_token_ids"], name))
            if text is None:
                raise ValueError(
                    f"{name}: a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of ints)"
                )
            prompt = text
        if isinstance(prompt, str):
            return TokenizedPrompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=True, what=name))
        if isinstance(prompt, (list, tuple)):
            return TokenizedPrompt(None, self._check_token_ids(prompt, name))
        raise TypeError(
            f"{name} must be a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids', "
            f"not {type(prompt).__name__}"
        )

    def _check_token_ids(self, ids: Any, name: str = "prompt") -> list[int]:
        # set(map(type, ...)), min and max run in C: ~10 ns a token (a 1k-token prompt costs 13 µs).
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{name}: prompt_token_ids must be a list of ints, not {type(ids).__name__}")
        if not set(map(type, ids)) <= {int}:
            pos, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int)
            raise TypeError(
                f"{name}: prompt_token_ids must be a list of ints; the one at position {pos} is "
                f"{type(bad).__name__} ({bad!r})"
            )
        vocab = self.model_config.vocab_size
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            pos, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{name}: token id {bad} (at position {pos}) is outside the vocabulary [0, {vocab})")
        return list(ids)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request whose outputs come out of `step()` as RequestOutputs; returns its id.

        Malformed input raises ValueError/TypeError and queues nothing. A well-formed request that can
        never run (prompt too long) finishes at once: its RequestOutput, with `error` set and
        finish_reason "error", comes out of the next `step()`.
        """
        params = self.default_sampling_params if params is None else params
        prompt = self.tokenize_prompt(prompt)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)  # compiled now: errors before queueing
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        request_id = self.add_core_request(request_id, prompt, params, arrival_time)
        self.output_processor.add_request(request_id, params, prompt.text, prompt.token_ids, arrival_time)
        return request_id

    def add_core_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request whose outputs come out of `core_step()` as EngineCoreOutputs (token ids
        only; the caller processes them); returns its id. Raises as `add_request` does; a request that
        can never run gets an EngineCoreOutput with `error` set from the next `core_step()`."""
        params = self._check_params(self.default_sampling_params if params is None else params)
        _, token_ids = self.tokenize_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(request_id, self._children(request_id, token_ids, params, arrival_time))
        first = parent.children[0].request
        if not self.scheduler.add_request(first):
            logger.warning("request %s rejected: %s", request_id, first.error)
            for c in parent.children:
                c.request.status = RequestStatus.FINISHED_ERROR
            self._pending.append(
                EngineCoreOutput(
                    request_id, [], finish_reason="error", times=_times(first, time.monotonic()), error=first.error
                )
            )
            return request_id
        for c in parent.children[1:]:
            self.scheduler.add_request(c.request)
        self._parents[request_id] = parent
        for c in parent.children:
            self._sequences[c.request.request_id] = c
            self._num_history_requests += _needs_history(params)
        return request_id

    @property
    def structured(self):
        """The engine's `StructuredOutputManager` (built on first use: it imports xgrammar)."""
        if self._structured is None:
            from tinyvllm.structured.manager import StructuredOutputManager
            from tinyvllm.structured.reasoning_gate import end_token_ids, start_token_ids
            from tinyvllm.structured.workers import default_num_workers

            parser = self.args.reasoning_parser
            end_ids = None if parser is None else end_token_ids(self.tokenizer, parser)
            start_ids = None if parser is None else start_token_ids(self.tokenizer, parser)
            workers = self.args.structured_outputs_workers
            if workers is None:  # on the CPU the forward, not the grammar work, bounds a step
                workers = default_num_workers() if self.device.type == "cuda" else 0
            self._structured = StructuredOutputManager(
                self.tokenizer,
                self.model_config.vocab_size,
                self.eos_token_ids,
                end_ids,
                start_ids,
                num_workers=workers,
            )
        return self._structured

    def _check_params(self, params: Any) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size ({vocab})")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary size ({vocab})")
        check_vocab(params, vocab)
        if params.bad_words and params.bad_words_token_ids is None:
            # a copy: the caller's params may serve other engines, and are not ours to edit
            ids = bad_words_token_ids(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False), vocab
            )
            params = params.replace()
            params.bad_words_token_ids = ids
        return params

    def _children(
        self, request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> list[_Sequence]:
        """The n child sequences of a request (child i of n > 1 is request `{i}_{request_id}` in the
        scheduler, seeded with seed + i). Child 0 alone scores prompt logprobs (module docstring)."""
        max_tokens = max(1, self.scheduler_config.max_model_len - len(token_ids))
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        every_step = streams_every_step(params)
        scores_prompt = params.prompt_logprobs is not None
        children = []
        structured = None if params.structured_outputs is None else self.structured
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.replace(seed=params.seed + index)
            if index > 0 and scores_prompt:
                child_params = child_params.replace(prompt_logprobs=None)
            request = Request(
                request_id=request_id if params.n == 1 else f"{index}_{request_id}",
                prompt_token_ids=token_ids,
                max_tokens=max_tokens,
                sampling_params=child_params,
                min_tokens=params.min_tokens,
                eos_token_ids=frozenset() if params.ignore_eos else frozenset(self.eos_token_ids),
                stop_token_ids=frozenset(params.stop_token_ids),
                arrival_time=arrival_time,
                skip_reading_prefix_cache=scores_prompt and index == 0,
            )
            if structured is not None:  # compiles off the step loop; admitted once compiled
                grammar = structured.add(request.request_id, params.structured_outputs, token_ids)
                request.ready = grammar.is_ready
            logprobs = params.logprobs is not None
            children.append(
                _Sequence(
                    request,
                    request_id,
                    index,
                    child_params,
                    every_step,
                    logprobs=[] if logprobs else None,
                    cumulative_logprob=0.0 if logprobs else None,
                    prompt_logprobs=[None] if scores_prompt and index == 0 else None,
                )
            )
        return children

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (by the ids add_request returned); their blocks return to the pool at once.
        They produce no more outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.output_processor.abort_request(rid)
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(parent)

    def abort_child(self, request_id: str, index: int) -> None:
        """Abort completion `index` of a request (the caller ended it, e.g. on a stop string it matched
        itself); its blocks return to the pool at once and its finishing output, finish_reason
        "abort", comes out of the next step. A request left with no running completion is dropped as
        `abort_request` drops it. Unknown ids and finished completions are ignored."""
        parent = self._parents.get(request_id)
        if parent is None or not 0 <= index < len(parent.children):
            return
        child = parent.children[index]
        if not self.scheduler.finish_requests(child.request.request_id, RequestStatus.FINISHED_ABORTED):
            return
        parent.num_running -= 1
        if parent.num_running == 0:
            self.abort_request(request_id)
        else:
            self._pending.append(self._finished_output(child, time.monotonic()))

    def abort(self, command: AbortRequest) -> None:
        """`abort_request` or `abort_child`, as the command says."""
        if command.index is None:
            self.abort_request(command.request_id)
        else:
            self.abort_child(command.request_id, command.index)

    def _forget(self, parent: _Parent) -> None:
        for c in parent.children:
            if self._sequences.pop(c.request.request_id, None) is not None:
                self._num_history_requests -= _needs_history(c.params)
                if c.params.structured_outputs is not None:
                    self.structured.remove(c.request.request_id)

    def _drop(self, parent: _Parent) -> None:
        """Forget a finished request."""
        del self._parents[parent.request_id]
        self._forget(parent)

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._parents)
            or bool(self._pending)
            or self._in_flight is not None
            or self._scheduled_early is not None
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a batch, then process the previous one (async scheduling) or this one.
        Returns the RequestOutputs of the requests that have one (by their output kinds)."""
        processed: list[RequestOutput] = []
        aborts: list[AbortRequest] = []

        def process(core_outputs: list[EngineCoreOutput]) -> None:
            request_outputs, step_aborts = self.output_processor.process_outputs(core_outputs)
            processed.extend(request_outputs)
            aborts.extend(step_aborts)

        process(self.core_step(process))
        for command in aborts:  # stop strings matched: stop those completions here too
            self.abort(command)
        return processed

    def core_step(self, early: Callable[[list[EngineCoreOutput]], None] | None = None) -> list[EngineCoreOutput]:
        """The same step as `step()`, its outputs at the token level: an EngineCoreOutput for every
        completion with news (see EngineCoreOutput; the requests' output processing is the caller's).

        `early`: when a step with constrained rows processes the in-flight step from inside its own launch
        (`before_mask`, below), that step's outputs go to `early` there and then, instead of into the
        returned list: the caller's output processing then runs while the device computes the forward and
        the grammar workers fill the mask, not between this step's sampling and the next step's forward,
        where the device waits for it."""
        self._early = early if early is not None else self._early_outputs.extend
        try:
            return self._core_step()
        finally:
            self._early = None

    def _core_step(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        clock = time.perf_counter
        t0 = clock()
        self._wait_s = 0.0
        overlap = self.async_scheduling and self._num_history_requests == 0
        if not overlap and self._in_flight is not None:
            outputs += self._process(*self._in_flight)
            self._in_flight = None
        sched, self._scheduled_early = self._scheduled_early, None
        if sched is None:  # a capture replays graphs: never between a schedule and its launch
            outputs += self._capture_wanted_graph()
        if self._structured is not None:
            self._end_failed_grammars()
        t1 = clock()
        if sched is None:
            sched = self.scheduler.schedule()
        t2 = clock()
        launched = None
        if not sched.is_empty:
            self._note_scheduled(sched)
            # A step with constrained rows needs the in-flight step's tokens in their grammars before
            # its bitmask is filled: the runner calls `before_mask` once the forward is enqueued, so the
            # wait for the in-flight step and the mask fill both overlap the device's work.
            before_mask = self._process_in_flight_early if overlap and self._structured is not None else None
            launched = (sched, self.runner.launch(sched, self._structured, before_mask))
            outputs += self._early_outputs
            self._early_outputs.clear()
        elif self._structured is not None and self._in_flight is None:
            self._structured.wait_for_compile(0.005)  # only compiling requests left: do not spin
        t3 = clock()
        if self._in_flight is not None:
            outputs += self._process(*self._in_flight)
        self._in_flight = launched
        if not overlap and self._in_flight is not None:
            outputs += self._process(*self._in_flight)
            self._in_flight = None
        if self.step_timer.keep_log:
            t4 = clock()
            host_s = (t1 - t0) + (t4 - t3) - self._wait_s
            self.step_timer.record(
                StepRecord(sched.num_batched_tokens, len(sched.sequences), t2 - t1, t3 - t2, host_s, self._wait_s)
            )
        return outputs

    def _capture_wanted_graph(self) -> list[EngineCoreOutput]:
        """Capture the decode graph bucket that an earlier step ran eagerly for want of it (lazy
        capture, engine/cuda_graphs.py), reading the in-flight step first: a capture must not overlap a
        step. Returns that step's outputs; nothing when no bucket is wanted."""
        bucket = self.runner.next_graph_capture()
        if bucket is None:
            return []
        outputs = []
        if self._in_flight is not None:
            outputs = self._process(*self._in_flight)
            self._in_flight = None
        self.runner.capture_graph(bucket)
        return outputs

    def has_idle_work(self) -> bool:
        """Whether `do_idle_work` has something to do: no request is in the engine and a decode graph
        bucket is not captured yet (lazy capture)."""
        return not self.has_unfinished_requests() and self.runner.next_graph_capture(idle=True) is not None

    def do_idle_work(self) -> None:
        """One short piece of start-up work left for idle time: capture one decode graph bucket. The
        serving loop calls it while no request is in the engine, checking for new commands between
        calls, so a request that arrives waits for at most one bucket's capture."""
        bucket = self.runner.next_graph_capture(idle=True)
        if bucket is not None and not self.has_unfinished_requests():
            self.runner.capture_graph(bucket)

    def _process_in_flight_early(self) -> None:
        """Process the in-flight step now, from inside the next step's launch (see `core_step`); its
        outputs to the caller's `early`, or kept for `core_step` to return. Then, with
        `schedule_in_launch`, schedule the step after this one."""
        if self._in_flight is not None:
            self._in_launch = True  # the grammar workers' accept may schedule the next step (_schedule_early)
            try:
                outputs = self._process(*self._in_flight)
            finally:
                self._in_launch = False
            self._in_flight = None
            self._early(outputs)
        self._schedule_early()

    def _schedule_early(self) -> None:
        """With `schedule_in_launch`, schedule the next step now, from inside the current one's launch:
        after the in-flight step's tokens are in the scheduler, while the grammar workers accept them
        (a grammar that completes or rejects its token then ends its request as an abort would: after
        the schedule), or after its processing. Not while a graph capture is due: a capture replays
        graphs, which must not come between a schedule and its launch."""
        if self.schedule_in_launch and self._scheduled_early is None and self.runner.next_graph_capture() is None:
            self._scheduled_early = self.scheduler.schedule()
            if self.prepare_in_launch:
                self.runner.prepare(self._scheduled_early)

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq in sched.sequences:
            if seq.is_new:
                entry = self._sequences.get(seq.request_id)  # None: aborted since it was scheduled
                if entry is None:
                    continue
                req = entry.request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    self.num_prompt_tokens += req.num_prompt_tokens

    def _process(self, sched: SchedulerOutput, handle: StepHandle) -> list[EngineCoreOutput]:
        """Read a launched step's tokens and turn them into EngineCoreOutputs: one per completion that
        got a token, when it finished or its outputs stream every step."""
        updated, logprobs_by_id = self._read_step(sched, handle)
        now = time.monotonic()
        sequences = self._sequences
        outputs = []
        for request, _ in updated:
            seq = sequences[request.request_id]
            if request.first_token_time is None:
                request.first_token_time = now
            logprobs = seq.logprobs
            if logprobs is not None:
                self._update_logprobs(seq, logprobs_by_id.get(request.request_id))
            if request.status._finished:
                outputs.append(self._finished_output(seq, now))
                self._finish_child(seq)
            elif seq.every_step:
                # Built inline rather than by a helper: a call per request costs ~3 % of a batch-256 step.
                token_ids, start = request.output_token_ids, seq.num_sent_tokens
                seq.num_sent_tokens = len(token_ids)
                out = EngineCoreOutput(
                    seq.parent_id,
                    token_ids[start:],
                    request.num_cached_tokens,
                    seq.index,
                    None,
                    None,
                    seq.cumulative_logprob,
                    logprobs[start:] if logprobs is not None else None,
                    _times(request) if start == 0 else None,
                )
                if start == 0 and seq.prompt_logprobs is not None:
                    out.prompt_logprobs = seq.complete_prompt_logprobs()
                outputs.append(out)
        return outputs

    def _read_step(
        self, sched: SchedulerOutput, handle: StepHandle
    ) -> tuple[list[tuple[Request, list[int]]], dict[str, Any]]:
        """Wait for a launched step, hand its tokens to the scheduler (stop rules applied) and count
        them: (the scheduler's (request, new token ids) per request that got a token, the sampled
        logprobs entry by request id when the step computed logprobs)."""
        t0 = time.perf_counter()
        runner_out = handle.result()
        self._wait_s += time.perf_counter() - t0
        if runner_out.prompt_logprobs:
            self._add_prompt_logprobs(runner_out.prompt_logprobs)
        logprobs_by_id = {}
        if runner_out.logprobs is not None:
            sampled_ids = [s.request_id for s in sched.sequences if s.sample]
            logprobs_by_id = dict(zip(sampled_ids, runner_out.logprobs))
        structured = self._structured
        if structured is not None:
            for rid in structured.take_dead():  # before the update, which then drops their token
                self._end_sequence(rid, "the output's grammar allows no next token (the constraint is a dead end)")
        updated = self.scheduler.update_from_output(sched, runner_out)
        self.num_generation_tokens += len(updated)  # one token each
        if structured is not None and structured.grammars:
            self._advance_grammars(updated)
        return updated, logprobs_by_id

    def _advance_grammars(self, updated: list[tuple[Request, list[int]]]) -> None:
        """Accept each constrained sequence's new token into its grammar; a grammar that is complete
        ends its request ("stop"), a token it rejects ends it with an error."""
        grammars = self._structured.grammars
        mine = [(request, tokens[-1]) for request, tokens in updated if request.request_id in grammars]
        if not mine:
            return
        rejected, terminated = self._structured.accept_tokens(
            [(request.request_id, token, request.output_token_ids) for request, token in mine],
            self._schedule_early if self._in_launch else None,
        )
        if not (rejected or terminated):
            return
        by_id = {request.request_id: (request, token) for request, token in mine}
        for rid in rejected:
            request, token = by_id[rid]
            if not request.status._finished:
                self._end_with_error(rid, f"token {token} does not match the output's grammar")
        for rid in terminated:
            if not by_id[rid][0].status._finished:
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)

    def _end_with_error(self, request_id: str, message: str) -> None:
        """Finish a running sequence with finish_reason "error" and `message`."""
        for request in self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR):
            request.error = message
            logger.warning("request %s ended: %s", request_id, message)

    def _end_sequence(self, request_id: str, message: str) -> None:
        """`_end_with_error` outside the step's token processing: its finishing output comes out of the
        next step."""
        seq = self._sequences.get(request_id)
        if seq is None or seq.request.status._finished:
            return
        self._end_with_error(request_id, message)
        self._pending.append(self._finished_output(seq, time.monotonic()))
        self._finish_child(seq)

    def _end_failed_grammars(self) -> None:
        """Sequences whose grammar failed to compile (only where add_core_request was not validated
        first) finish with the compile error."""
        for rid, error in self._structured.failed():
            self._end_sequence(rid, error)

    @staticmethod
    def _finished_output(seq: _Sequence, now: float) -> EngineCoreOutput:
        """The finishing EngineCoreOutput of a completion: the tokens not sent yet, its finish."""
        request = seq.request
        token_ids, start = request.output_token_ids, seq.num_sent_tokens
        seq.num_sent_tokens = len(token_ids)
        logprobs = seq.logprobs
        out = EngineCoreOutput(
            seq.parent_id,
            token_ids[start:],
            request.num_cached_tokens,
            seq.index,
            request.status.finish_reason,
            request.stop_reason,
            seq.cumulative_logprob,
            logprobs[start:] if logprobs is not None else None,
            _times(request, now),
            request.error,
        )
        if start == 0 and seq.prompt_logprobs is not None:
            out.prompt_logprobs = seq.complete_prompt_logprobs()
        return out

    def _finish_child(self, seq: _Sequence) -> None:
        """Count a completion's finishing output; drop its request after the last one."""
        parent = self._parents[seq.parent_id]
        parent.num_running -= 1
        if parent.num_running == 0:
            self._drop(parent)

    def _add_prompt_logprobs(self, chunks: dict[str, tuple[int, list[list[tuple[int, float, int]]]]]) -> None:
        """Append a step's prompt logprobs (ModelRunnerOutput.prompt_logprobs) to their completions, as
        Logprob dicts: the scored prompt token first, with its own rank, then the top-k. Entries held
        already (a recomputation after preemption) are skipped."""
        for request_id, (start, entries) in chunks.items():
            seq = self._sequences.get(request_id)
            if seq is None or seq.prompt_logprobs is None:
                continue  # finished or aborted while the step ran
            held = seq.prompt_logprobs
            skip = len(held) - (start + 1)
            assert skip >= 0, "a request's prompt is scored in order from its first token"
            new = entries[skip:]
            if not new:
                continue
            texts = iter(self.tokenizer.token_texts([t for entry in new for t, _, _ in entry]))
            for entry in new:
                scored: dict[int, Logprob] = {}
                for t, lp, rank in entry:
                    text = next(texts)
                    if t not in scored:  # the scored token keeps its own rank when it is also in the top-k
                        scored[t] = Logprob(lp, rank, text)
                held.append(scored)

    def _update_logprobs(self, seq: _Sequence, entry: list[tuple[int, float, int]] | None) -> None:
        if seq.logprobs is None or entry is None:
            return
        decoded = self.tokenizer.token_texts([t for t, _, _ in entry])  # "" for ids past the tokenizer
        seq.logprobs.append({t: Logprob(lp, rank, text) for (t, lp, rank), text in zip(entry, decoded)})
        seq.cumulative_logprob += entry[0][1]

    def check_health(self) -> None:
        """Raise (WorkerDiedError) if a tensor-parallel worker process of this machine has died; cheap
        (a poll per worker), for an idle engine loop to call between steps. `step()` checks too."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism, grammar workers); the engine cannot step
        afterwards."""
        self.runner.shutdown()
        if self._structured is not None:
            self._structured.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name). Only possible while no request holds blocks;
        returns whether it happened."""
        return self.scheduler.kv_cache.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ introspection
    def get_metrics(self) -> dict[str, float]:
        pool = self.scheduler.kv_cache.pool
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": pool.usage,
            "num_kv_blocks": pool.num_blocks,
            "num_free_kv_blocks": pool.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "prefix_cache_queried_tokens": pool.stats.queried_tokens,
            "prefix_cache_hit_tokens": pool.stats.hit_tokens,
            "prefix_cache_evicted_blocks": pool.stats.evicted_blocks,
        }
