"""Shutdown with a contract: what the server does between the first SIGINT/SIGTERM and its exit.

1. The signal starts the drain (`Drain.begin`). The listening socket stays open: every new request,
   on a new connection or an open keep-alive one, gets a 503 in OpenAI's shape (`RequestGuard`).
2. Requests in flight run on, for up to `--shutdown-timeout` seconds.
3. Then every request still generating ends with `ServerShuttingDown`: a stream gets an error event in
   OpenAI's shape and `data: [DONE]`, a non-streamed request a 503; their KV blocks are freed.
4. After a short flush (`FLUSH_S`), uvicorn closes the listener and the connections; a task still
   stuck (a client that never reads) is cancelled quietly. One summary line is logged.

A second signal skips what is left: the remaining streams end at once (with the same error event)
and the server exits as soon as they are written (at most uvicorn's 1 s graceful timeout).

An engine that dies (a core process killed, crashed, raised, or hung past its deadline) ends the
server the same way, without a signal: its own in-flight requests have already failed with the
engine's error (a stream gets an error event and [DONE], a non-streamed request a 503); `/health` and
every new request get 503 at once; requests on other data-parallel cores get `DEATH_GRACE_S`
seconds to finish; then the server exits with status 1 (`GracefulServer.engine_died`), well within
30 s of the death.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import uvicorn

from tinyvllm.engine.async_llm import RequestRejected, RequestStream

logger = logging.getLogger(__name__)

FLUSH_S = 2.0  # after the streams are ended: time for their last events to reach the clients
DEATH_GRACE_S = 5.0  # after the engine died: time for requests on the surviving cores to finish


class ServerShuttingDown(RequestRejected):
    status = 503


class Drain:
    """The server's shutdown state, shared by `RequestGuard` (counts requests, refuses new ones once
    draining), the handlers (register the engine streams they read) and `GracefulServer` (drives it).
    Touched on the event loop only, except `begin`, which a signal handler calls (plain stores)."""

    def __init__(self) -> None:
        self.draining = False
        self.grace_s = 0.0
        self.active = 0  # requests inside the app
        self.streams: set[RequestStream] = set()
        self.begun_at: float | None = None
        self.ended_at: float | None = None
        self.in_flight_at_begin: int | None = None
        self.ended = 0  # requests ended with ServerShuttingDown
        self.refused = 0  # requests answered 503 while draining
        self.cut = 0  # requests cancelled by uvicorn at the very end
        self.reason = "the server is shutting down"  # what refused requests are told

    def begin(self, grace_s: float, reason: str | None = None) -> None:
        if not self.draining:
            if reason is not None:
                self.reason = f"the server is shutting down: {reason}"
            self.grace_s = grace_s
            self.begun_at = time.monotonic()
            self.draining = True

    def register(self, streams: list[RequestStream]) -> None:
        self.streams.update(streams)
        if self.ended_at is not None:
            self.end_streams(streams)

    def unregister(self, streams: list[RequestStream]) -> None:
        self.streams.difference_update(streams)

    def end_streams(self, streams: Any) -> None:
        for s in list(streams):
            if not s.finished:
                s.fail(ServerShuttingDown("the server is shutting down; the request was stopped"))
                self.ended += 1

    def step(self, now: float) -> bool:
        """Drive the drain (on the loop, every tick); True once the server may stop."""
        if self.begun_at is None:
            return False
        if self.in_flight_at_begin is None:
            self.in_flight_at_begin = self.active
        if self.active <= 0:
            return True
        if self.ended_at is None and now >= self.begun_at + self.grace_s:
            self.ended_at = now
            self.end_streams(self.streams)
        return self.ended_at is not None and now >= self.ended_at + FLUSH_S

    def summary(self) -> str:
        in_flight = self.in_flight_at_begin or 0
        finished = max(in_flight - self.ended - self.cut, 0)
        after = (self.ended_at or self.begun_at or 0.0) - (self.begun_at or 0.0)
        return (
            f"shutdown: {in_flight} request(s) in flight at the signal, {finished} finished or closed by the "
            f"client, {self.ended} stopped with an error after {after:.1f} s, {self.cut} cut; "
            f"{self.refused} new request(s) refused with 503"
        )


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGINT/SIGTERM starts `drain` instead of closing the listener, and
    whose second one exits at once (uvicorn's force_exit). With `engine` given (anything with
    `is_dead` and `dead_error`), its death starts the drain too, with at most `DEATH_GRACE_S`
    seconds of grace, and sets `engine_died` (the server's exit status is then 1)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float, engine: Any = None) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s
        self.engine = engine
        self.engine_died = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._captured_signals.append(sig)
        if self.drain.draining:
            self.should_exit = True  # the next tick ends the streams, uvicorn's shutdown follows
        else:
            self.drain.begin(self.grace_s)

    async def on_tick(self, counter: int) -> bool:
        if self.engine is not None and not self.engine_died and self.engine.is_dead:
            self.engine_died = True
            logger.error("the engine died (%s); the server stops", self.engine.dead_error)
            self.drain.begin(min(self.grace_s, DEATH_GRACE_S), f"the engine died ({self.engine.dead_error})")
        if await super().on_tick(counter):
            if self.drain.draining:
                self.drain.ended_at = self.drain.ended_at or time.monotonic()
                self.drain.end_streams(self.drain.streams)
                await asyncio.sleep(0)  # their error events go out before uvicorn closes the connections
            return True
        return self.drain.step(time.monotonic())
