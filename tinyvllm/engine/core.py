"""The engine core loop: applies commands to an LLMEngine and steps it while it has work.

`EngineCore` owns an LLMEngine and is the only code that calls it. It runs on the engine thread
(`tinyvllm.engine.async_llm.AsyncLLMEngine`) or as the main loop of the engine process
(`tinyvllm.engine.mp_client.MPAsyncLLMEngine`, the default of `tinyvllm serve`); both feed it the same
commands and read the same messages (`tinyvllm.engine.messages`):

- commands, in lists, applied in order before each step: `AddRequest`, `AbortRequest` (a whole
  request, or one completion of it), `Shutdown`.
- idle work: while no request is in the engine, the loop polls for commands and does one piece of the
  engine's idle work between polls (`LLMEngine.do_idle_work`: capture one decode graph bucket), until
  none is left; then it blocks for commands again.
- messages: one `EngineCoreOutputs` per loop iteration that changed something: the `AddReply`s to the
  adds just applied (sent before the step runs, so a rejection reaches the caller without waiting for
  a possibly long step), then the step's token-level `EngineCoreOutput`s, with the engine's stats.

The core works in token ids only (`LLMEngine.add_core_request`, `LLMEngine.core_step`): the caller
detokenizes, matches stop strings and sends an AbortRequest when one matches
(`tinyvllm.engine.output_processor`). After an abort, outputs the core had already sent for the
request may still arrive: the caller drops them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from tinyvllm.engine.messages import (
    AbortRequest,
    AddReply,
    AddRequest,
    EngineCommand,
    EngineCoreOutput,
    EngineCoreOutputs,
    Shutdown,
)

Recv = Callable[[bool], "list[EngineCommand] | None"]  # block? -> commands ([] when none; None: sender gone)
Emit = Callable[[EngineCoreOutputs], None]


class EngineCore:
    """Applies commands to an LLMEngine and steps it while it has work; see the module docstring.

    Args:
        engine: a built LLMEngine (only this loop may call it).
        max_waiting_requests: reject an add (status 503) while this many requests wait to be
            scheduled; None: no limit.
    """

    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests

    def stats(self) -> dict[str, int | float]:
        return dict(self.engine.get_metrics())

    def run(self, recv: Recv, emit: Emit) -> None:
        """Loop until a Shutdown command (or until `recv` reports the sender gone). Exceptions of the
        engine propagate: the caller reports them."""
        engine = self.engine

        def early(outputs: list[EngineCoreOutput]) -> None:  # core_step's: outputs sent as soon as it has them
            emit(EngineCoreOutputs(outputs, [], self.stats(), time.monotonic()))

        while True:
            idle_work = engine.has_idle_work()  # start-up work left for idle moments (lazy graph capture)
            commands = recv(not engine.has_unfinished_requests() and not idle_work)  # idle: wait for work
            if commands is None:
                return
            replies, stop = self._apply(commands)
            if stop:
                return
            busy = engine.has_unfinished_requests()
            if replies or (commands and not busy):  # aborts that emptied the engine: fresh stats
                emit(EngineCoreOutputs([], replies, self.stats(), time.monotonic()))
            if busy:
                outputs = engine.core_step(early)
                emit(EngineCoreOutputs(outputs, [], self.stats(), time.monotonic()))
            elif idle_work:
                engine.do_idle_work()

    def _apply(self, commands: Sequence[EngineCommand]) -> tuple[list[AddReply], bool]:
        replies = []
        for command in commands:
            if isinstance(command, AddRequest):
                replies.append(self._add(command))
            elif isinstance(command, AbortRequest):
                self.engine.abort(command)
            elif isinstance(command, Shutdown):
                return replies, True
            else:
                raise ValueError(f"unknown engine command {command!r}")
        return replies, False

    def _add(self, command: AddRequest) -> AddReply:
        request_id, prompt = command.request_id, command.prompt
        limit = self.max_waiting_requests
        waiting = len(self.engine.scheduler.waiting)
        if limit is not None and waiting >= limit:
            message = (
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting-requests {limit}); retry later"
            )
            return AddReply(request_id, 503, message)
        try:
            ids = None
            if not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
                prompt = self.engine.tokenize_prompt(prompt)  # the caller learns the ids in the reply
                ids = prompt.token_ids
            self.engine.add_core_request(request_id, prompt, command.params, command.arrival_time)
        except (ValueError, TypeError) as e:
            return AddReply(request_id, 400, str(e))
        return AddReply(request_id, prompt_token_ids=ids)
