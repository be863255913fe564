"""The engine: add_request / step / abort. Owns the scheduler, the model runner and the detokenizers.

One `step()` schedules a batch, runs it, appends the sampled tokens, applies the stopping rules (token
ids in the scheduler, stop strings here, after detokenizing) and returns a `RequestOutput` for every
request that changed. Parallel sampling (`n > 1`) runs n child sequences under one request id.

The offline `LLM` has the engine detokenize; `tinyvllm serve` sends it requests with detokenize off and
no stop strings, detokenizes their token ids in the API process and aborts a request (`abort_request`)
or one child of it (`abort_child`) when a stop string matches there
(`tinyvllm.entrypoints.output_processor`, which keeps `_detokenize` and `_completion`'s semantics).
Its engine core steps with `step_deltas()`: the same step, its outputs as wire Delta tuples, built
directly (no RequestOutput) for such token-id requests.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tinyvllm.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.outputs import SchedulerOutput
from tinyvllm.core.request import Request, RequestStatus
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.args import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs, default_model
from tinyvllm.engine.model_runner import ModelRunner, StepHandle
from tinyvllm.engine.step_timing import StepRecord, StepTimer
from tinyvllm.entrypoints.deltas import encode_outputs
from tinyvllm.kernels import default_backend
from tinyvllm.models.checkpoint import resolve_model
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer

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


def resolve_dtype(dtype: str, model_config: ModelConfig) -> torch.dtype:
    name = model_config.dtype if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected auto, bfloat16, float16 or float32")
    return _DTYPES[name]


def _needs_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's whole token history (penalties): no async overlap then."""
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def _wants_token_deltas(params: SamplingParams) -> bool:
    """Whether a request's outputs are DELTA token ids without text (LLMEngine._completion_delta
    builds them): detokenize off (so no stop strings either) and the DELTA output kind."""
    return params.output_kind is RequestOutputKind.DELTA and not params.detokenize


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


class TokenizedPrompt(NamedTuple):
    """A prompt as `LLMEngine.tokenize_prompt` returns it: its ids are known to be valid token ids, so
    `add_request` takes it without checking them again (a 1k-token prompt costs ~35 µs to check)."""

    text: str | None
    token_ids: list[int]


@dataclass
class _Sequence:
    """Engine-side state of one child sequence (the scheduler's Request plus text and logprobs)."""

    request: Request
    parent_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None: no text, or text decoded once at the end
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finished_time: float | None = None
    final_text: str | None = None  # text decoded at finish when there was no incremental detokenizer
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_chars: int = 0
    holdback: int = 0  # characters withheld from unfinished text (see LLMEngine._holdback)
    # The only child of a request whose outputs are token-id Deltas (step_deltas builds them inline).
    lone_token_deltas: bool = field(init=False)

    def __post_init__(self) -> None:
        self.lone_token_deltas = _wants_token_deltas(self.params) and self.request.request_id == self.parent_id


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Sequence] = field(default_factory=list)
    arrival_time: float = 0.0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.request.status.is_finished for c in self.children)


class LLMEngine:
    """Synchronous engine core: `add_request`, then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, args: EngineArgs, show_progress: bool = False) -> None:
        self.args = args
        self.model_dir = resolve_model(args.model or default_model())
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(args.tokenizer or self.model_dir)
        self.generation_config = read_generation_config(self.model_dir)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.model_config)
        backend = default_backend(self.device.type) if args.kernel_backend == "auto" else args.kernel_backend
        self.eos_token_ids = self._eos_token_ids()

        self.runner = ModelRunner(
            self.model_config,
            args.runner_config(self.device.type),
            model_dir=str(self.model_dir),
            device=self.device,
            dtype=self.dtype,
            kernel_backend=backend,
            load_format=args.load_format,
            seed=args.seed,
            eos_token_ids=self.eos_token_ids,
            show_progress=show_progress,
        )
        cache_config = CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cpu_kv_cache_bytes=args.kv_cache_memory_bytes or (1 << 30),
            enable_prefix_caching=args.enable_prefix_caching,
        )
        budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if args.kv_cache_memory_bytes is not None and args.num_gpu_blocks_override is None:
            num_blocks = max(1, args.kv_cache_memory_bytes // self.runner.bytes_per_block(args.block_size))
        else:
            num_blocks = self.runner.determine_num_blocks(cache_config, budget, args.max_num_seqs)
        max_model_len = self._max_model_len(num_blocks * args.block_size)
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
        self.runner.initialize(
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
        )
        # Async scheduling: on CUDA, step N+1 is scheduled and launched before step N's tokens are read,
        # so the host's work overlaps the device's. Requests with penalties need every token of their
        # history at sampling time; while one is live, steps run one at a time.
        self.async_scheduling = self.device.type == "cuda" if args.async_scheduling is None else args.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.step_timer = StepTimer()  # set keep_log to see where each step's time went
        self._wait_s = 0.0  # time blocked on the device inside the current step's _process calls
        self._num_history_requests = 0
        pool = BlockPool(num_blocks, enable_caching=args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, KVCacheManager(pool, args.block_size))
        self.default_sampling_params = self._default_sampling_params()
        self._sequences: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (rejected requests)
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Everything built so far (model, tokenizer, graphs, tables) lives as long as the engine: move it
        # out of the garbage collector's generations, whose full passes otherwise rescan it every few
        # hundred steps (measured: ~0.5 ms per batch-256 step on the development CPU).
        gc.collect()
        gc.freeze()
        logger.info(
            "engine ready: %s on %s (%s, %s kernels), %d KV blocks of %d tokens, max_model_len %d",
            self.model_dir,
            self.device,
            self.dtype,
            backend,
            num_blocks,
            args.block_size,
            max_model_len,
        )

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
            logger.warning("ignoring sampling defaults of generation_config.json: %s", e)
            return SamplingParams()

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType) -> TokenizedPrompt:
        """(prompt text or None, token ids), checked. Raises ValueError/TypeError for malformed prompts.
        The result can be passed to `add_request` as the prompt, which then skips the checks."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return TokenizedPrompt(prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return TokenizedPrompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, (list, tuple)):
            return TokenizedPrompt(None, self._check_token_ids(prompt))
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        # set(map(type, ...)), min and max run in C: ~10 ns a token (a 1k-token prompt costs 13 µs).
        if not isinstance(ids, (list, tuple)) or not set(map(type, ids)) <= {int}:
            raise TypeError("prompt_token_ids must be a list of integers")
        vocab = self.model_config.vocab_size
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return list(ids)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Malformed input raises ValueError/TypeError and queues
        nothing. A well-formed request that can never run (prompt too long) finishes at once: its
        RequestOutput, with `error` set and finish_reason "error", comes out of the next `step()`."""
        params = self.default_sampling_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported by tinyvllm yet")
        if params.logprobs is not None and params.logprobs > self.model_config.vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size")
        text, token_ids = self.tokenize_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(request_id, text, token_ids, arrival_time=arrival_time)
        max_tokens = max(1, self.scheduler_config.max_model_len - len(token_ids))
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.replace(seed=params.seed + index)
            request = Request(
                request_id=request_id if params.n == 1 else f"{index}_{request_id}",
                prompt_token_ids=token_ids,
                max_tokens=max_tokens,
                sampling_params=child_params,
                min_tokens=params.min_tokens,
                eos_token_ids=frozenset() if params.ignore_eos else frozenset(self.eos_token_ids),
                stop_token_ids=frozenset(params.stop_token_ids),
                arrival_time=arrival_time,
            )
            parent.children.append(
                _Sequence(
                    request,
                    request_id,
                    index,
                    child_params,
                    self._detokenizer(child_params, token_ids),
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                    holdback=self._holdback(child_params),
                )
            )
        if not self.scheduler.add_request(parent.children[0].request):
            parent.error = parent.children[0].request.error
            for c in parent.children:
                c.request.status = RequestStatus.FINISHED_ERROR
                c.finished_time = time.monotonic()
            self._pending.append(self._make_output(parent))
            logger.warning("request %s rejected: %s", request_id, parent.error)
            return request_id
        for c in parent.children[1:]:
            self.scheduler.add_request(c.request)
        self._parents[request_id] = parent
        for c in parent.children:
            self._sequences[c.request.request_id] = c
            self._num_history_requests += _needs_history(params)
        return request_id

    def _detokenizer(self, params: SamplingParams, prompt_ids: list[int]) -> IncrementalDetokenizer | None:
        """Incremental only when text is needed before the end (stop strings, streamed outputs)."""
        if not params.detokenize or (params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop):
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (by the ids add_request returned); their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            child_ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self._forget(parent)

    def abort_child(self, request_id: str, index: int) -> None:
        """Abort completion `index` of a request (the caller ended it, e.g. on a stop string it matched
        itself); its blocks return to the pool at once and it reports finish_reason "abort" from then
        on. A request left with no running completion is dropped as `abort_request` drops it. Unknown
        ids and finished completions are ignored."""
        parent = self._parents.get(request_id)
        if parent is None or not 0 <= index < len(parent.children):
            return
        child = parent.children[index]
        if self.scheduler.finish_requests(child.request.request_id, RequestStatus.FINISHED_ABORTED):
            child.finished_time = time.monotonic()
        if parent.finished:
            self.abort_request(request_id)

    def _forget(self, parent: _Parent) -> None:
        for c in parent.children:
            if self._sequences.pop(c.request.request_id, None) is not None:
                self._num_history_requests -= _needs_history(c.params)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending) or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a batch, then process the previous one (async scheduling) or this one.
        Returns the outputs of every request that changed."""
        outputs, self._pending = self._pending, []
        return self._step(self._process, outputs)

    def step_deltas(self) -> list[tuple]:
        """The same step as `step()`, its outputs as wire Deltas: returns exactly what
        `encode_outputs(self.step())` would (same order, same tuples) for requests of any kind.

        Requests that need no text from the engine (DELTA output kind, detokenize off: what
        `tinyvllm serve` sends its core) get their Delta tuple built directly from the engine's
        state, without a RequestOutput; the others (engine-side text, FINAL_ONLY, CUMULATIVE) go
        through `_make_output` and `encode_outputs` as in `step()`. RequestMetrics are not built;
        the requests' timestamps are still recorded."""
        pending, self._pending = self._pending, []
        return self._step(self._process_deltas, encode_outputs(pending))

    def _step(self, process: Callable[[SchedulerOutput, StepHandle], list], outputs: list) -> list:
        """One step (see `step`); `process` turns a launched step into outputs, appended to `outputs`."""
        clock = time.perf_counter
        t0 = clock()
        self._wait_s = 0.0
        overlap = self.async_scheduling and self._num_history_requests == 0
        if not overlap and self._in_flight is not None:
            outputs += process(*self._in_flight)
            self._in_flight = None
        t1 = clock()
        sched = self.scheduler.schedule()
        t2 = clock()
        launched = None
        if not sched.is_empty:
            self._note_scheduled(sched)
            launched = (sched, self.runner.launch(sched))
        t3 = clock()
        if self._in_flight is not None:
            outputs += process(*self._in_flight)
        self._in_flight = launched
        if not overlap and self._in_flight is not None:
            outputs += process(*self._in_flight)
            self._in_flight = None
        if self.step_timer.keep_log:
            t4 = clock()
            self.step_timer.record(
                StepRecord(
                    sched.num_batched_tokens,
                    len(sched.sequences),
                    t2 - t1,
                    t3 - t2,
                    (t1 - t0) + (t4 - t3) - self._wait_s,
                    self._wait_s,
                )
            )
        return outputs

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for seq in sched.sequences:
            if seq.is_new:
                req = self._sequences[seq.request_id].request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    self.num_prompt_tokens += req.num_prompt_tokens

    def _process(self, sched: SchedulerOutput, handle: StepHandle) -> list[RequestOutput]:
        """Read a launched step's tokens and turn them into outputs."""
        updated, logprobs_by_id = self._read_step(sched, handle)
        now = time.monotonic()
        changed: dict[str, _Parent] = {}
        final_only = RequestOutputKind.FINAL_ONLY
        for request, new_ids in updated:
            seq = self._sequences[request.request_id]
            # _update_child inlined (a call per request costs ~4% of a batch-256 final-only step);
            # test_step_deltas checks that the two agree.
            if request.first_token_time is None:
                request.first_token_time = now
            if seq.logprobs is not None:
                self._update_logprobs(seq, logprobs_by_id.get(request.request_id))
            finished = request.status.is_finished
            if seq.detokenizer is not None or finished:
                self._detokenize(seq, new_ids)
                finished = request.status.is_finished  # a stop string may have ended it
            if finished:
                seq.finished_time = now
            if finished or seq.params.output_kind is not final_only:
                changed[seq.parent_id] = self._parents[seq.parent_id]
        outputs = []
        for parent in changed.values():
            finished = parent.finished
            if finished or parent.children[0].params.output_kind is not final_only:
                outputs.append(self._make_output(parent))
            if finished:
                self._drop(parent)
        return outputs

    def _process_deltas(self, sched: SchedulerOutput, handle: StepHandle) -> list[tuple]:
        """`encode_outputs(self._process(sched, handle))`, with the Deltas of token-id DELTA requests
        (`_wants_token_deltas`) of one completion built inline, those of other requests once all of
        their completions are updated (placeholders keep `_process`'s order: a request's output goes
        where its first changed completion came)."""
        updated, logprobs_by_id = self._read_step(sched, handle)
        now = time.monotonic()
        sequences = self._sequences
        outputs: list[tuple | None] = []
        places: dict[str, int] = {}  # parent id -> its placeholder in outputs
        for request, new_ids in updated:
            rid = request.request_id
            seq = sequences[rid]
            if seq.lone_token_deltas:  # n == 1, token ids, DELTA
                if request.first_token_time is None:
                    request.first_token_time = now
                logprobs = seq.logprobs
                if logprobs is not None:
                    self._update_logprobs(seq, logprobs_by_id.get(rid))
                status = request.status
                finished = status._finished
                # _completion_delta inlined (a call per request costs ~3% of the step). Error None: a
                # request that runs was not rejected (rejections never reach _parents).
                token_ids, start = request.output_token_ids, seq.num_sent_tokens
                seq.num_sent_tokens = len(token_ids)
                outputs.append(
                    (
                        rid,
                        finished,
                        [
                            (
                                0,
                                "",
                                token_ids[start:],
                                logprobs[start:] if logprobs is not None else None,
                                seq.cumulative_logprob,
                                status.value if finished else None,
                                request.stop_reason,
                            )
                        ],
                        None,
                        request.num_cached_tokens,
                    )
                )
                if finished:
                    seq.finished_time = now
                    self._drop(self._parents[rid])
            elif self._update_child(seq, new_ids, logprobs_by_id, now) and seq.parent_id not in places:
                places[seq.parent_id] = len(outputs)
                outputs.append(None)
        if not places:
            return outputs
        for parent_id, place in places.items():
            outputs[place] = self._parent_delta(self._parents[parent_id])
        return [o for o in outputs if o is not None]

    def _read_step(
        self, sched: SchedulerOutput, handle: StepHandle
    ) -> tuple[list[tuple[Request, list[int]]], dict[str, Any]]:
        """Wait for a launched step, hand its tokens to the scheduler (stop rules applied) and count
        them: (the scheduler's (request, new token ids) per request that got a token, the sampled
        logprobs entry by request id when the step computed logprobs)."""
        t0 = time.perf_counter()
        runner_out = handle.result()
        self._wait_s += time.perf_counter() - t0
        logprobs_by_id = {}
        if runner_out.logprobs is not None:
            sampled_ids = [s.request_id for s in sched.sequences if s.sample]
            logprobs_by_id = dict(zip(sampled_ids, runner_out.logprobs))
        updated = self.scheduler.update_from_output(sched, runner_out)
        self.num_generation_tokens += len(updated)  # one token each
        return updated, logprobs_by_id

    def _update_child(self, seq: _Sequence, new_ids: list[int], logprobs_by_id: dict[str, Any], now: float) -> bool:
        """Record a child's new tokens: first-token time, logprobs, text (which may end it on a stop
        string), finish time. Returns whether its request has an output this step (DELTA and
        CUMULATIVE requests: every step; FINAL_ONLY: when a child finished)."""
        request = seq.request
        if request.first_token_time is None:
            request.first_token_time = now
        if seq.logprobs is not None:
            self._update_logprobs(seq, logprobs_by_id.get(request.request_id))
        finished = request.status.is_finished
        if seq.detokenizer is not None or finished:
            self._detokenize(seq, new_ids)
            finished = request.status.is_finished  # a stop string may have ended it
        if finished:
            seq.finished_time = now
        return finished or seq.params.output_kind is not RequestOutputKind.FINAL_ONLY

    def _parent_delta(self, parent: _Parent) -> tuple | None:
        """The Delta tuple of a request one of whose children changed this step (None for an
        unfinished FINAL_ONLY request), as `encode_outputs` of `_make_output` would give it; drops
        the request when it finished."""
        finished = parent.finished
        params = parent.children[0].params
        delta = None
        if _wants_token_deltas(params):
            delta = (
                parent.request_id,
                finished,
                [self._completion_delta(c) for c in parent.children],
                parent.error,
                parent.children[0].request.num_cached_tokens,
            )
        elif finished or params.output_kind is not RequestOutputKind.FINAL_ONLY:
            delta = encode_outputs([self._make_output(parent)])[0]
        if finished:
            self._drop(parent)
        return delta

    @staticmethod
    def _completion_delta(c: _Sequence) -> tuple:
        """A `_wants_token_deltas` child's CompletionDelta tuple since its last one (what
        `_completion` returns for it, as a tuple; text is always "")."""
        r = c.request
        token_ids, start = r.output_token_ids, c.num_sent_tokens
        c.num_sent_tokens = len(token_ids)
        logprobs = c.logprobs
        return (
            c.index,
            "",
            token_ids[start:],
            logprobs[start:] if logprobs is not None else None,
            c.cumulative_logprob,
            r.status.finish_reason,
            r.stop_reason,
        )

    def _drop(self, parent: _Parent) -> None:
        """Forget a finished request."""
        del self._parents[parent.request_id]
        self._forget(parent)

    def _detokenize(self, seq: _Sequence, new_ids: list[int]) -> None:
        request = seq.request
        stopped_by_token = (
            request.status == RequestStatus.FINISHED_STOPPED and not seq.params.include_stop_str_in_output
        )
        if seq.detokenizer is None:
            if request.is_finished and seq.params.detokenize:
                ids = request.output_token_ids[:-1] if stopped_by_token else request.output_token_ids
                seq.final_text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
            return
        ids = new_ids[:-1] if stopped_by_token else new_ids
        stop_str = seq.detokenizer.add_tokens(ids) if ids else None
        if stop_str is None and request.is_finished:
            stop_str = seq.detokenizer.finish()  # flush bytes that never formed a whole character
        if stop_str is not None:
            if not request.is_finished:
                self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)
            else:
                request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_str

    def _update_logprobs(self, seq: _Sequence, entry: list[tuple[int, float, int]] | None) -> None:
        if seq.logprobs is None or entry is None:
            return
        decoded = self.tokenizer.convert_ids_to_tokens([t for t, _, _ in entry])
        seq.logprobs.append({t: Logprob(lp, rank, text) for (t, lp, rank), text in zip(entry, decoded)})
        seq.cumulative_logprob += entry[0][1]

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = [self._completion(c) for c in parent.children]
        first = parent.children[0].request
        finished = parent.finished
        metrics = RequestMetrics(
            parent.arrival_time,
            first.first_scheduled_time,
            first.first_token_time,
            max((c.finished_time or 0.0) for c in parent.children) if finished else None,
        )
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outs,
            finished,
            first.num_cached_tokens,
            parent.error,
            metrics,
        )

    def _completion(self, c: _Sequence) -> CompletionOutput:
        r = c.request
        text = c.final_text or ""
        status = r.status
        if c.detokenizer is not None:
            text = c.detokenizer.output_text
            if c.holdback and not status._finished:
                text = text[: len(text) - c.holdback]
        token_ids, logprobs = r.output_token_ids, c.logprobs
        if c.params.output_kind is RequestOutputKind.DELTA:
            text, c.num_sent_chars = text[c.num_sent_chars :], len(text)
            token_ids, start, c.num_sent_tokens = token_ids[c.num_sent_tokens :], c.num_sent_tokens, len(token_ids)
            logprobs = logprobs[start:] if logprobs is not None else None
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            c.index, text, token_ids, c.cumulative_logprob, logprobs, status.finish_reason, r.stop_reason
        )

    @staticmethod
    def _holdback(params: SamplingParams) -> int:
        """Characters withheld from unfinished text: they might still turn into a stop string
        (none when the stop string is part of the output anyway, as in vLLM)."""
        if params.include_stop_str_in_output:
            return 0
        return max((len(s) for s in params.stop), default=1) - 1

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
