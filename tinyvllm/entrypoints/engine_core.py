"""The engine core loop, and the messages it exchanges with the API side.

`EngineCore` owns an LLMEngine and is the only code that calls it. It runs on the engine thread
(`AsyncLLMEngine`) or as the main loop of the engine process (`MPAsyncLLMEngine`, the default of
`tinyvllm serve`); both feed it the same commands and read the same messages.

Commands (API side -> core), sent in lists, applied in order before each step:

    ("add", request_id, prompt, params, arrival_time)   params: SamplingParams (DELTA or FINAL_ONLY)
    ("abort", request_id)
    ("abort", request_id, index)   completion `index` alone (n > 1); the request goes when none is left
    ("stop",)

The API side sends requests that want text with `output_processor.core_params`: detokenize off, no
stop strings. The core then produces token ids only (its scheduler still applies EOS, stop token ids,
max_tokens and min_tokens); the API side detokenizes them, matches stop strings and aborts the
request (or one completion of it) here when one matches (`tinyvllm.entrypoints.output_processor`).

Messages (core -> API side), one per loop iteration that changed something:

    ("out", replies, deltas, stats, now)
        replies: [(request_id, status, message, prompt_token_ids)], one per "add": status None
                 (queued) or the HTTP status of the rejection (400 bad input, 503 queue full) with
                 its message; prompt_token_ids only when the prompt was given as text
        deltas:  [Delta], one per request that changed in the step (`LLMEngine.step_deltas()`:
                 built without RequestOutputs for token-id requests)
        stats:   LLMEngine.get_metrics() after the step (gauges and counters for /metrics)
        now:     time.monotonic() when the step's outputs were ready (the clock is system-wide on
                 Linux, so arrival times taken in the API process compare with it)

The engine process adds ("ready", EngineInfo fields, stats) once built, ("failed", message) when it
could not be built, and ("dead", message) when the loop raised.

A Delta (`tinyvllm.entrypoints.deltas`, a plain tuple on the wire) carries only what the step added
(the engine's DELTA output kind): the new token ids and logprobs of each completion, and its text when
the request asked the core to detokenize (API-side requests do not); never the prompt nor earlier
tokens. After an abort, Deltas the core had already sent for the request may still arrive: the API
side drops them. Replies go out before the step runs, so a rejection reaches the caller
without waiting for a (possibly long) step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

Recv = Callable[[bool], "list[tuple] | None"]  # block? -> commands ([] when none; None when the sender is gone)
Emit = Callable[[tuple], None]


class EngineCore:
    """Applies commands to an LLMEngine and steps it while it has work; see the module docstring.

    Args:
        engine: a built LLMEngine (only this loop may call it).
        max_waiting_requests: reject an "add" (status 503) while this many requests wait to be
            scheduled; None: no limit.
    """

    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests

    def stats(self) -> dict[str, float]:
        return dict(self.engine.get_metrics())

    def run(self, recv: Recv, emit: Emit) -> None:
        """Loop until a "stop" command (or until `recv` reports the sender gone). Exceptions of the
        engine propagate: the caller reports them."""
        engine = self.engine
        while True:
            commands = recv(not engine.has_unfinished_requests())  # idle: wait for work
            if commands is None:
                return
            replies, stop = self._apply(commands)
            if stop:
                return
            busy = engine.has_unfinished_requests()
            if replies or (commands and not busy):  # aborts that emptied the engine: fresh stats
                emit(("out", replies, [], self.stats(), time.monotonic()))
            if busy:
                deltas = engine.step_deltas()
                emit(("out", [], deltas, self.stats(), time.monotonic()))

    def _apply(self, commands: Sequence[tuple]) -> tuple[list[tuple], bool]:
        replies = []
        for command in commands:
            kind = command[0]
            if kind == "add":
                replies.append(self._add(*command[1:]))
            elif kind == "abort":
                if len(command) > 2:
                    self.engine.abort_child(command[1], command[2])
                else:
                    self.engine.abort_request(command[1])
            elif kind == "stop":
                return replies, True
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        return replies, False

    def _add(self, request_id: str, prompt: Any, params: Any, arrival_time: float) -> tuple:
        limit = self.max_waiting_requests
        waiting = len(self.engine.scheduler.waiting)
        if limit is not None and waiting >= limit:
            return (
                request_id,
                503,
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting-requests {limit}); retry later",
                None,
            )
        try:
            ids = None
            if not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
                text, ids = self.engine.tokenize_prompt(prompt)  # the caller learns the ids in the reply
                prompt = {"prompt": text, "prompt_token_ids": ids}
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
        except (ValueError, TypeError) as e:
            return request_id, 400, str(e), None
        return request_id, None, None, ids
