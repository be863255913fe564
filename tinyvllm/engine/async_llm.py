"""The engine for asyncio callers: request streams over an EngineCore run elsewhere.

Two clients share the caller side (`EngineClient`) and differ in where the EngineCore loop runs:

- `AsyncLLMEngine(engine)`: on a thread of this process, around an already-built LLMEngine (tests
  inject fake or failing engines this way; `tinyvllm serve --engine-in-thread`).
- `MPAsyncLLMEngine(engine_args)` (`tinyvllm.engine.mp_client`, the default of `tinyvllm serve`):
  in a process of its own, so that the engine's Python (scheduling, step inputs, token ids) and the
  server's (detokenizing, HTTP, JSON, SSE) do not share one GIL.

Callers, on any event loop (several loops may share one engine):

    stream = await engine.add_request(request_id, prompt, params)  # raises RequestRejected
    async for output in stream:                                    # RequestOutputs, see RequestStream
        ...
    stream.abort()                                                 # at any time; idempotent

`add_request` returns once the core has queued the request, so a rejection (a malformed prompt or
sampling value, a full waiting queue, a dead engine) reaches the caller before it commits to a
response. The core works in token ids and sends EngineCoreOutputs after each step
(`tinyvllm.engine.messages`); the thread that receives them (the engine thread, or the reader thread
of the process client) runs the output processing (`tinyvllm.engine.output_processor`, one
RequestState per stream: text, stop strings; a matched stop string aborts the request, or that
completion of it, in the core), then hands each loop its streams' RequestDeltas with one
`loop.call_soon_threadsafe` per step. If the core dies (an exception, a crashed process), the engine
is dead (`is_dead`): every in-flight stream raises EngineDeadError and so does every later
`add_request`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.messages import (
    AbortRequest,
    AddReply,
    AddRequest,
    EngineCommand,
    EngineCoreOutput,
    EngineCoreOutputs,
    OutputAccumulator,
    RequestDelta,
    Shutdown,
    merge_deltas,
)
from tinyvllm.engine.output_processor import RequestState, process_outputs
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class RequestRejected(Exception):
    """The request was not queued. `status` is the HTTP status it maps to."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RequestRejected):
    status = 503


class EngineDeadError(RequestRejected):
    status = 503


@dataclass
class EngineInfo:
    """What the API side needs to know of the engine to validate requests and describe the model."""

    tokenizer: Any  # tinyvllm.tokenizer.Tokenizer
    vocab_size: int
    max_model_len: int
    default_sampling_params: SamplingParams  # SamplingParams() over generation_config.json
    model_dir: str
    # the generation config's max_new_tokens: the server's max_tokens for a request without one (None: none)
    default_max_tokens: int | None = None
    # the server's cap on every request's max_tokens, from a max_new_tokens on the command line (None: none)
    max_tokens_cap: int | None = None

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls(
            engine.tokenizer,
            engine.model_config.vocab_size,
            engine.scheduler_config.max_model_len,
            engine.default_sampling_params,
            str(engine.model_dir),
            engine.default_max_tokens,
            engine.max_tokens_cap,
        )


class StatsListener(Protocol):
    """Called on the thread that receives the core's messages (never on an event loop): after each
    step with its (stream, RequestDelta) pairs and the step's time, and with the ids of aborted
    requests."""

    def on_step(self, items: Sequence[tuple[RequestStream, RequestDelta]], now: float) -> None: ...

    def on_abort(self, request_ids: Sequence[str]) -> None: ...


class RequestStream:
    """One request's outputs, read on the event loop that added it; iteration ends after the
    finished output. What each output holds follows the request's `output_kind`:

    - DELTA: everything since the previous output. When the reader falls behind, the RequestDeltas
      that piled up are merged into one output (texts and token ids concatenated).
    - CUMULATIVE: everything so far (the stream accumulates the RequestDeltas).
    - FINAL_ONLY: one output, the finished one (the stream accumulates the RequestDeltas, if several).

    `state` is the request's output processing, used by the thread that receives the core's
    messages only.
    """

    def __init__(
        self,
        request_id: str,
        client: EngineClient,
        loop: asyncio.AbstractEventLoop,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.finished = False
        self._client = client
        self._loop = loop
        self._accepted: asyncio.Future = loop.create_future()
        self._pending: list[Any] = []  # RequestDeltas, or the error that ends the stream
        self._waiter: asyncio.Future | None = None
        self._final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self._accumulate = self._final_only or params.output_kind == RequestOutputKind.CUMULATIVE
        self._total: OutputAccumulator | None = None  # everything so far, for CUMULATIVE and FINAL_ONLY
        self.state = RequestState(request_id, params, client.info.tokenizer, prompt, prompt_token_ids, arrival_time)

    def _accumulator(self) -> OutputAccumulator:
        return OutputAccumulator(self.request_id, self.prompt, self.prompt_token_ids, self.arrival_time)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            items, error = await self._take()
            if items:
                if self._accumulate:
                    self._total = acc = self._total or self._accumulator()
                else:
                    acc = self._accumulator()
                acc.extend(items)
                self.finished = acc.finished
                if self.finished or not self._final_only:
                    yield acc.output()
            if error is not None and not self.finished:
                self.finished = True
                raise error

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        """The DELTA stream as RequestDeltas, without building RequestOutputs: the RequestDeltas
        that piled up since the previous one merged into one (`merge_deltas`), completions in index
        order. Ends after the finished one; raises the error that ends the stream. For DELTA
        requests only."""
        while (delta := await self.next_delta()) is not None:
            yield delta

    async def next_delta(self) -> RequestDelta | None:
        """`deltas()` one at a time (the SSE path: one await per event, no generator): the next
        merged RequestDelta, None once the finished one was returned; raises the error that ends
        the stream. For DELTA requests only."""
        if self._accumulate:
            raise ValueError("deltas() is for DELTA requests; iterate the stream for the others")
        while not self.finished:
            pending = self._pending
            if not pending:
                self._waiter = waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
                pending = self._pending
            self._pending = []
            error = None
            for k, item in enumerate(pending):
                if isinstance(item, BaseException):  # what came after it is dropped
                    pending, error = pending[:k], item
                    break
            if pending:
                delta = merge_deltas(pending)
                self.finished = delta.finished
                if error is not None and not self.finished:
                    self._pending = [error]  # raised by the next call, after this delta
                return delta
            if error is not None and not self.finished:
                self.finished = True
                raise error
        return None

    async def _take(self) -> tuple[list[Any], BaseException | None]:
        """Wait until something is queued; then (every RequestDelta queued before the error, if any;
        the error that ends the stream, or None). One wake-up takes all that piled up."""
        if not self._pending:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._pending = self._pending, []
        for k, item in enumerate(items):
            if isinstance(item, BaseException):
                return items[:k], item
        return items, None

    def abort(self) -> None:
        """Abort the request unless it has finished; its KV blocks return to the pool after the
        current step. Safe to call from any thread, any number of times."""
        if not self.finished:
            self.finished = True
            self._client._abort(self)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (its reader gets what was queued before, then the error) and
        abort the request. On the stream's loop; nothing happens once it has finished."""
        if not self.finished:
            self._client._abort(self)
            self._put(error)

    # ---- called on the stream's loop (through call_soon_threadsafe)
    def _put(self, item: Any) -> None:
        self._pending.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EngineClient:
    """The caller side shared by both clients (see the module docstring). Subclasses provide
    `_send(command)` (to the core, in order), `start()`, `shutdown()`, `is_running` and `info`, and
    feed the core's messages to `_handle` and its death to `_die`."""

    info: EngineInfo

    def __init__(self, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1 (or None), got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.dead_error: BaseException | None = None
        self.stats: dict[str, float] = {}  # the core's get_metrics() snapshot, replaced after each step
        self._listeners: tuple[StatsListener, ...] = ()
        self._streams: dict[str, RequestStream] = {}  # queued by the core, unfinished
        self._adding: dict[str, RequestStream] = {}  # sent to the core, not answered yet
        self._lock = threading.Lock()  # guards the two maps and orders "alive? then send" against death

    # ------------------------------------------------------------------ caller side
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished or aborted, as this client counts them (the load a
        data-parallel router compares: exact at once, where the core's stats lag by a step)."""
        return len(self._streams) + len(self._adding)

    def start(self) -> EngineClient:
        raise NotImplementedError

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the core (what is in flight fails with EngineDeadError) and wait for it."""
        raise NotImplementedError

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Have `listener` called after every step and abort (the metrics)."""
        self._listeners = (*self._listeners, listener)  # a new tuple: readers never see it change

    async def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request; returns its stream once the core has accepted it.

        Raises:
            RequestRejected: the engine's ValueError/TypeError for this request (status 400).
            QueueFullError: `max_waiting_requests` requests are already waiting (status 503).
            EngineDeadError: the core has died or was shut down (status 503).
        """
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"sampling params must be SamplingParams, not {type(params).__name__}")
        request_id = str(request_id)
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:
            await self._validate_structured(params)
        text, ids = _prompt_parts(prompt)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, self, loop, params, text, ids, arrival_time)
        with self._lock:
            if self.dead_error is not None:
                raise self._dead()
            if request_id in self._streams or request_id in self._adding:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            self._adding[request_id] = stream
            self._send(AddRequest(request_id, prompt, params, arrival_time))
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def _validate_structured(self, params: SamplingParams) -> None:
        """Compile the request's constraint here, on the compiler's threads (cached; the core compiles
        it again from its own cache): an invalid or unsatisfiable one is rejected before it is queued.

        Raises:
            RequestRejected: the constraint's ValueError (status 400, param "structured_outputs").
        """
        from tinyvllm.structured import submit_validation

        info = self.info
        try:
            await asyncio.wrap_future(submit_validation(params.structured_outputs, info.tokenizer, info.vocab_size))
        except ValueError as e:
            raise RequestRejected(str(e), param="structured_outputs") from None

    async def generate(
        self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request if the caller stops early (or is cancelled)."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def _send(self, command: EngineCommand) -> None:
        raise NotImplementedError

    def _abort(self, stream: RequestStream) -> None:
        rid = stream.request_id
        with self._lock:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
                counted = True
            elif self._adding.get(rid) is stream:
                counted = False  # counted when the core's reply comes
            else:
                return
            if self.dead_error is None:
                self._send(AbortRequest(rid))
        if counted:
            for listener in self._listeners:
                listener.on_abort([rid])

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"the engine is not running ({self.dead_error})")

    # ------------------------------------------------------------------ the core's messages
    def _handle(self, message: EngineCoreOutputs) -> None:
        """One message of the core (see tinyvllm.engine.core); on the engine thread or the reader thread."""
        self.stats = message.stats
        if message.replies:
            self._on_replies(message.replies)
        if message.outputs:
            self._on_outputs(message.outputs, message.timestamp)

    def _on_replies(self, replies: Sequence[AddReply]) -> None:
        answers: list[tuple[RequestStream, BaseException | None]] = []
        aborted = []
        with self._lock:
            for reply in replies:
                rid = reply.request_id
                stream = self._adding.pop(rid, None)
                if stream is None:
                    continue
                if reply.status is not None:
                    error = QueueFullError(reply.message) if reply.status == 503 else RequestRejected(reply.message)
                    answers.append((stream, error))
                    continue
                if reply.prompt_token_ids is not None:
                    stream.prompt_token_ids = stream.state.prompt_token_ids = reply.prompt_token_ids
                if stream.finished:  # aborted while being added; the abort follows the add
                    aborted.append(rid)
                    continue
                self._streams[rid] = stream
                answers.append((stream, None))
        if aborted:
            for listener in self._listeners:
                listener.on_abort(aborted)
        for loop, items in _by_loop(answers).items():
            _call_soon(loop, _resolve_all, items)

    def _on_outputs(self, outputs: Sequence[EngineCoreOutput], now: float) -> None:
        with self._lock:
            streams = self._streams
            found = [streams.get(out.request_id) for out in outputs]
        if None in found:  # aborted meanwhile
            outputs = [out for out, stream in zip(outputs, found) if stream is not None]
            found = [stream for stream in found if stream is not None]
        # Outside the lock: detokenizing a step takes a while.
        processed = list(process_outputs([stream.state for stream in found], outputs))
        items = []
        with self._lock:
            streams = self._streams  # again: _die may have replaced it meanwhile
            alive = self.dead_error is None
            for state, delta in processed:
                rid = delta.request_id
                stream = streams.get(rid)
                if stream is None or stream.state is not state:
                    continue  # aborted while we detokenized: the abort is sent and counted already
                if delta.finished:
                    del streams[rid]
                items.append((stream, delta))
                if state.aborts:  # a stop string matched: stop the request (or completion) in the core
                    if alive:
                        for command in state.aborts:
                            self._send(command)
                    state.aborts = ()
        for listener in self._listeners:
            listener.on_step(items, now)
        for loop, group in _by_loop(items).items():
            _call_soon(loop, _deliver_all, group)

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead and fail every stream in flight (idempotent)."""
        with self._lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            streams = [*self._streams.values(), *self._adding.values()]
            self._streams, self._adding = {}, {}
        dead = self._dead()
        for loop, items in _by_loop([(s, dead) for s in streams]).items():
            _call_soon(loop, _fail_all, items)


class AsyncLLMEngine(EngineClient):
    """The EngineCore loop on a thread of this process, around a built LLMEngine.

    Args:
        engine: a built LLMEngine; nothing else may call it once `start()` has run.
        max_waiting_requests: reject (QueueFullError) a request while this many requests wait to
            be scheduled; None: no limit.
    """

    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        super().__init__(max_waiting_requests)
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self._core = EngineCore(engine, max_waiting_requests)
        self.stats = self._core.stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> AsyncLLMEngine:
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 10.0) -> None:
        if self._thread.is_alive():
            self._commands.put(Shutdown())
            self._thread.join(timeout)

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)

    def _recv(self, block: bool) -> list[EngineCommand]:
        try:
            commands = [self._commands.get() if block else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        try:
            self._core.run(self._recv, self._handle)
            self._die(RuntimeError("the engine was shut down"))
        except BaseException as e:
            logger.exception("engine loop died")
            self._die(e)


def _prompt_parts(prompt: Any) -> tuple[str | None, list[int]]:
    """(text, token ids) as far as the caller gave them (the core reports ids it had to compute)."""
    if isinstance(prompt, dict):
        return prompt.get("prompt"), prompt.get("prompt_token_ids") or []
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    return None, []


def _by_loop(items: Sequence[tuple[RequestStream, Any]]) -> dict[asyncio.AbstractEventLoop, list]:
    groups: dict[asyncio.AbstractEventLoop, list] = {}
    loop = group = None
    for item in items:  # once per token of a step: mostly one loop, so one lookup per change of loop
        if item[0]._loop is not loop:
            loop = item[0]._loop
            group = groups.get(loop)
            if group is None:
                group = groups[loop] = []
        group.append(item)
    return groups


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening any more
        loop.call_soon_threadsafe(fn, *args)


def _resolve_all(items: list[tuple[RequestStream, BaseException | None]]) -> None:
    for stream, error in items:
        if not stream._accepted.done():
            if error is None:
                stream._accepted.set_result(None)
            else:
                stream._accepted.set_exception(error)


def _fail_all(items: list[tuple[RequestStream, BaseException]]) -> None:
    """Fail streams: a pending add_request raises, or the reader does."""
    for stream, error in items:
        if not stream._accepted.done():
            stream._accepted.set_exception(error)
        else:
            stream._put(error)


def _deliver_all(items: list[tuple[RequestStream, RequestDelta]]) -> None:
    """RequestStream._put of each (stream, RequestDelta), inlined: this runs for every token of a step."""
    for stream, delta in items:
        stream._pending.append(delta)
        waiter = stream._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
