"""The messages between the engine core and its callers, and how a caller merges deltas.

Two levels of output:

- `EngineCoreOutput`: token level, what the engine core produces for one completion of one request
  in one step (new token ids and logprobs, finish and stop reason, and timestamps on the first and
  the finishing output). It crosses the process boundary (core -> API process) inside
  `EngineCoreOutputs`, encoded with msgpack (`encoder` / `output_decoder`): msgspec Structs with
  `array_like=True` encode as plain arrays, so a batch-256 step costs about what pickling bare
  tuples did while every field keeps its name in the code.
- `RequestDelta` / `CompletionDelta`: text level, what the output processor
  (`tinyvllm.engine.output_processor`) makes of a step's token-level outputs for one request:
  detokenized text, stop strings applied, one entry per completion. They stay in the process that
  made them. `OutputAccumulator` merges consecutive RequestDeltas into a RequestOutput (a stream's
  CUMULATIVE output, or the reader of a DELTA stream who fell behind); `merge_deltas` merges them
  into one RequestDelta (the SSE path).

Commands (API side -> core: `AddRequest`, `AbortRequest`, `Shutdown`) carry SamplingParams and
prompts of any form; they are named Structs too, pickled (they are few: one per request, not one
per token). The engine process's start-up handshake (`EngineReady`, `EngineFailed`) is pickled as
well; after it, each message from the core is `EngineCoreOutputs` or `EngineDead`, in msgpack.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams


# ---------------------------------------------------------------------- core -> API side (msgpack)
class RequestTimes(msgspec.Struct, array_like=True, gc=False):
    """When a request was first scheduled, got its first token and finished (time.monotonic())."""

    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What one step added to completion `index` of a request, at the token level.

    The core sends one for each completion that got tokens in the step, unless the request's
    outputs are FINAL_ONLY without stop strings (`streams_every_step`): then only when the
    completion finishes, with all its tokens. `new_token_ids` and `new_logprobs` hold what was not
    sent before. `times` comes with a completion's first output and its finishing one; a request's
    `prompt_logprobs`, when asked, with the first output of its completion 0. A request that could
    not run at all gets one output with `error` set and finish_reason "error".
    """

    request_id: str
    new_token_ids: list[int]
    num_cached_tokens: int | None = None  # prefix-cache hit tokens (None: never admitted)
    index: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while it runs
    stop_reason: int | str | None = None  # the stop token id that ended it
    cumulative_logprob: float | None = None  # of the whole completion so far, when logprobs are asked
    new_logprobs: list[dict[int, Logprob]] | None = None  # one entry per new token, when asked
    times: RequestTimes | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # as RequestOutput.prompt_logprobs


class AddReply(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """The core's answer to an `AddRequest`: queued (`status` None; `prompt_token_ids` set when the
    core tokenized the prompt) or rejected with an HTTP status (400 bad input, 503 queue full)."""

    request_id: str
    status: int | None = None
    message: str | None = None
    prompt_token_ids: list[int] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, gc=False, tag="out"):
    """One message of the core loop: replies to the adds it applied, the token-level outputs of the
    step it ran (either may be empty), the engine's `get_metrics()` after it, and `timestamp`, the
    time.monotonic() when the outputs were ready (system-wide on Linux, so the API process's
    arrival times compare with it)."""

    outputs: list[EngineCoreOutput]
    replies: list[AddReply]
    stats: dict[str, int | float]
    timestamp: float


class EngineDead(msgspec.Struct, array_like=True, tag="dead"):
    """The core loop raised; the engine process exits after sending this."""

    message: str


CoreMessage = EngineCoreOutputs | EngineDead
encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)


# ---------------------------------------------------------------------- API side -> core (pickled)
class AddRequest(msgspec.Struct, array_like=True):
    """Queue a request. `prompt`: anything `LLMEngine.tokenize_prompt` takes."""

    request_id: str
    prompt: Any
    params: SamplingParams
    arrival_time: float


class AbortRequest(msgspec.Struct, array_like=True, gc=False):
    """Abort a request, or only its completion `index` (the request goes when none is left)."""

    request_id: str
    index: int | None = None


class Shutdown(msgspec.Struct, array_like=True, gc=False):
    """Stop the core loop."""


EngineCommand = AddRequest | AbortRequest | Shutdown


class EngineReady(msgspec.Struct):
    """The engine process built its engine: what the API side needs to know of it, and its stats."""

    tokenizer: str  # where to load the tokenizer from
    vocab_size: int
    max_model_len: int
    default_sampling_params: SamplingParams
    model_dir: str
    stats: dict[str, int | float]
    chat_template: str | dict[str, str] | None = None  # the engine's own when `chat_template` replaced the model's
    default_max_tokens: int | None = None  # EngineInfo's
    max_tokens_cap: int | None = None  # EngineInfo's


class EngineFailed(msgspec.Struct):
    """The engine process could not build its engine."""

    message: str


# ---------------------------------------------------------------------- text level (in process)
class CompletionDelta(msgspec.Struct, gc=False):
    """What one step (or several, merged) added to completion `index` of a request, with text."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # one entry per new token, when requested
    cumulative_logprob: float | None  # of the whole completion so far
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, gc=False):
    """What one step (or several, merged) added to a request: each completion's news, and whether
    the request has finished (every completion has)."""

    request_id: str
    finished: bool
    completions: list[CompletionDelta]
    error: str | None = None  # set when the request could not run at all (finish_reason "error")
    num_cached_tokens: int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # in the delta they arrived with


class _Completion:
    __slots__ = ("cumulative_logprob", "finish_reason", "index", "logprobs", "stop_reason", "text", "token_ids")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, c: CompletionDelta) -> None:
        if c.text:
            self.text += c.text
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += c.logprobs
        self.cumulative_logprob = c.cumulative_logprob
        self.finish_reason = c.finish_reason
        self.stop_reason = c.stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            list(self.logprobs) if self.logprobs is not None else None,
            self.finish_reason,
            self.stop_reason,
        )


class OutputAccumulator:
    """Merges consecutive RequestDeltas of one request into one RequestOutput: texts, token ids and
    logprobs concatenated; the latest cumulative logprob, finish_reason and stop_reason kept.
    Accumulating all of a request's deltas gives its CUMULATIVE output.

    Args:
        request_id, prompt, prompt_token_ids: what the merged RequestOutput reports (deltas do not
            carry them).
        arrival_time: the RequestOutput's `metrics.arrival_time` (no metrics when None).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        self.arrival_time = arrival_time
        self.finished = False
        self.error: str | None = None
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._completions: dict[int, _Completion] = {}

    def add(self, delta: RequestDelta) -> None:
        slots = self._completions
        for c in delta.completions:
            slot = slots.get(c.index)
            if slot is None:
                slot = slots[c.index] = _Completion(c.index)
            slot.add(c)
        self.finished = delta.finished
        if delta.error is not None:
            self.error = delta.error
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def extend(self, deltas: Iterable[RequestDelta]) -> OutputAccumulator:
        for d in deltas:
            self.add(d)
        return self

    def output(self, metrics: RequestMetrics | None = None) -> RequestOutput:
        """The merged RequestOutput; `metrics` default: RequestMetrics(arrival_time), if known."""
        if metrics is None and self.arrival_time is not None:
            metrics = RequestMetrics(self.arrival_time)
        completions = self._completions
        if len(completions) == 1:
            outputs = [c.output() for c in completions.values()]
        else:
            outputs = [completions[i].output() for i in sorted(completions)]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            self.num_cached_tokens,
            self.error,
            metrics,
            self.prompt_logprobs,
        )


def merge_deltas(deltas: Sequence[RequestDelta]) -> RequestDelta:
    """Consecutive RequestDeltas of one request as one (as OutputAccumulator merges them, without
    building a RequestOutput): finished from the last, error, num_cached_tokens and prompt_logprobs the
    latest given, completions in index order."""
    if len(deltas) == 1:
        delta = deltas[0]
        completions = delta.completions
        if len(completions) > 1 and any(a.index > b.index for a, b in itertools.pairwise(completions)):
            delta = msgspec.structs.replace(delta, completions=sorted(completions, key=_index))
        return delta
    error = cached = prompt_logprobs = None
    first = deltas[0].completions
    index = first[0].index if len(first) == 1 else None  # one completion in every delta (n = 1)?
    for d in deltas:
        if index is not None and (len(d.completions) != 1 or d.completions[0].index != index):
            index = None
        if d.error is not None:
            error = d.error
        if d.num_cached_tokens is not None:
            cached = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            prompt_logprobs = d.prompt_logprobs
    last = deltas[-1]
    if index is not None:
        merged = [_merge_completion([d.completions[0] for d in deltas])]
    else:
        by_index: dict[int, list[CompletionDelta]] = {}
        for d in deltas:
            for c in d.completions:
                by_index.setdefault(c.index, []).append(c)
        merged = [_merge_completion(by_index[i]) for i in sorted(by_index)]
    return RequestDelta(last.request_id, last.finished, merged, error, cached, prompt_logprobs)


def _index(c: CompletionDelta) -> int:
    return c.index


def _merge_completion(parts: list[CompletionDelta]) -> CompletionDelta:
    """CompletionDeltas of one completion, in order, as one."""
    if len(parts) == 1:
        return parts[0]
    token_ids: list[int] = []
    texts = []
    logprobs: list | None = None
    for part in parts:
        texts.append(part.text)
        token_ids += part.token_ids
        if part.logprobs is not None:
            if logprobs is None:
                logprobs = []
            logprobs += part.logprobs
    last = parts[-1]
    text = "".join(texts)
    return CompletionDelta(
        last.index, text, token_ids, logprobs, last.cumulative_logprob, last.finish_reason, last.stop_reason
    )
