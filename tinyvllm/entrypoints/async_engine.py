"""AsyncLLMEngine: the synchronous LLMEngine driven by one dedicated thread, for asyncio callers.

The engine thread is the only one that ever touches the LLMEngine. It loops: apply the commands
that arrived (add, abort, stop), run one `step()` if any request is unfinished, hand the outputs to
their callers; when there is nothing to do it blocks on the command queue.

Callers, on any event loop (several loops may share one engine):

    stream = await engine.add_request(request_id, prompt, params)  # raises RequestRejected
    async for output in stream:                                    # cumulative RequestOutputs
        ...
    stream.abort()                                                 # at any time; idempotent

`add_request` returns once the engine thread has queued the request, so a rejection (a malformed
prompt or sampling value, a full waiting queue, a dead engine) reaches the caller before it commits
to a response. Outputs are delivered through `loop.call_soon_threadsafe`, one call per step and
loop. An exception in the engine loop marks the engine dead (`is_dead`): every in-flight stream
raises EngineDeadError and so does every later `add_request`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

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


class StatsListener(Protocol):
    """Called on the engine thread: after each step with its outputs, and with the ids it aborted."""

    def on_step(self, outputs: Sequence[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_ids: Sequence[str]) -> None: ...


@dataclass(eq=False)
class RequestStream:
    """One request's outputs, read on the event loop that added it. Iterate for cumulative
    RequestOutputs (when the reader falls behind, intermediate ones are skipped: each output
    contains the ones before it); iteration ends after the finished output."""

    request_id: str
    _engine: AsyncLLMEngine
    _loop: asyncio.AbstractEventLoop
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _accepted: asyncio.Future | None = None
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            while not self._queue.empty() and isinstance(item, RequestOutput):
                item = self._queue.get_nowait()  # coalesce: outputs are cumulative
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Abort the request unless it has finished; its KV blocks return to the pool after the
        current step. Safe to call from any thread, any number of times."""
        if not self.finished:
            self.finished = True
            self._engine._send(("abort", self.request_id))

    # ---- called on the stream's loop by the engine thread (through call_soon_threadsafe)
    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class AsyncLLMEngine:
    """Owns an LLMEngine and the thread that steps it. See the module docstring.

    Args:
        engine: a built LLMEngine; nothing else may call it once `start()` has run.
        max_waiting_requests: reject (QueueFullError) a request while this many requests wait to
            be scheduled; None: no limit.
    """

    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1 (or None), got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._listeners: tuple[StatsListener, ...] = ()
        self.dead_error: BaseException | None = None
        self.stats: dict[str, float] = dict(engine.get_metrics())  # snapshot, replaced after each step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()  # orders "is it dead? then send" against "die, then drain"
        self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)

    # ------------------------------------------------------------------ caller side
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Have `listener` called on the engine thread after every step and abort (the metrics)."""
        self._listeners = (*self._listeners, listener)  # a new tuple: the engine thread never sees it change

    def start(self) -> AsyncLLMEngine:
        self._thread.start()
        return self

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine thread has accepted it.

        Raises:
            RequestRejected: the engine's ValueError/TypeError for this request (status 400).
            QueueFullError: `max_waiting_requests` requests are already waiting (status 503).
            EngineDeadError: the engine loop has died or was shut down (status 503).
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop, _accepted=loop.create_future())
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._send(("add", stream, prompt, params, arrival_time))
        await stream._accepted
        return stream

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request if the caller stops early (or is cancelled)."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort everything in flight, stop the thread and wait for it. Later adds are rejected."""
        if self._thread.is_alive():
            self._send(("stop",))
            self._thread.join(timeout)

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self.dead_error is None:
                self._commands.put(command)
                return
        if command[0] == "add":
            _deliver_to(command[1], self._dead())

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"the engine is not running ({self.dead_error})")

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block=idle):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._publish(outputs)
                self.stats = dict(self.engine.get_metrics())
            self._die(RuntimeError("the engine was shut down"))
        except BaseException as e:  # noqa: BLE001 -- any failure ends the loop; callers must hear of it
            logger.exception("engine loop died")
            self._die(e)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, stream: RequestStream, prompt: Any, params: SamplingParams, arrival_time: float) -> None:
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            _accept(stream, QueueFullError(f"the server is overloaded: {waiting} requests are waiting "
                                           f"(--max-waiting-requests {self.max_waiting_requests}); retry later"))
            return
        try:
            self.engine.add_request(stream.request_id, prompt, params, arrival_time=arrival_time)
        except (ValueError, TypeError) as e:
            _accept(stream, RequestRejected(str(e)))
            return
        self._streams[stream.request_id] = stream
        _accept(stream, None)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            for listener in self._listeners:
                listener.on_abort([request_id])

    def _publish(self, outputs: Sequence[RequestOutput]) -> None:
        now = time.monotonic()
        for listener in self._listeners:
            listener.on_step(outputs, now)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver_all, items)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.dead_error = error
        dead = self._dead()
        while True:  # adds that raced with our death
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                _deliver_to(command[1], dead)
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _deliver_to(stream, dead)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody is listening any more


def _accept(stream: RequestStream, error: BaseException | None) -> None:
    def resolve() -> None:
        if not stream._accepted.done():
            if error is None:
                stream._accepted.set_result(None)
            else:
                stream._accepted.set_exception(error)
    _call_soon(stream._loop, resolve)


def _deliver_to(stream: RequestStream, error: BaseException) -> None:
    """Fail a stream: its pending add_request raises, or its reader does."""
    def fail() -> None:
        if stream._accepted is not None and not stream._accepted.done():
            stream._accepted.set_exception(error)
        else:
            stream._put(error)
    _call_soon(stream._loop, fail)


def _deliver_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
