"""One request's grammar state: its compiled grammar (a future), its matcher, its reasoning gate.

The matcher holds exactly the request's accepted output tokens after the end of its thinking (all
of them without a reasoning parser). It lives in the engine's process, or in a grammar worker
(structured/workers.py) once the manager places the sequence there (`worker`): from then on the
manager sends the tokens to the worker, which keeps them; `accepted` and `last_token` stay as they
were at the move, and `terminated` is the worker's answer. The engine accepts each token it appends to the request, so a
preempted request (whose output tokens are kept and recomputed) resumes with the same state; tokens
the engine discards are never accepted. `rollback(k)` undoes the last k accepted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tinyvllm.structured.reasoning_gate import reasoning_ended


class RequestGrammar:
    """The grammar state of one sequence (module docstring).

    Args:
        compiled: the future of its compiled grammar (`GrammarCompiler.submit`).
        reasoning_end_ids: token ids that end the model's thinking; the grammar applies only to the
            tokens after them. None: from the first output token.
        prompt_closed_thinking: the prompt already closed its thinking block (`reasoning_gate`): the
            grammar applies from the first output token.
        stop_token_ids: the grammar's stop tokens (`TokenizerInfo.stop_token_ids`): a matcher terminates
            only by accepting one, so only those tokens are followed by a termination check. None: check
            after every token.

    Attributes:
        terminated: the grammar is complete and its stop token accepted (kept in step with the matcher by
            `accept` and `rollback`, so that reading it costs no call into xgrammar).
        last_token: the last accepted token, or None.
        worker: the grammar worker holding the matcher; None while it is in this process. Set by the
            manager, once, when it places the sequence there (sid: its name on that worker).
        remote_rollback: for a sequence on a worker, `rollback`'s call into it (num_tokens) -> terminated.
    """

    def __init__(
        self,
        compiled: Future,
        reasoning_end_ids: Sequence[int] | None = None,
        prompt_closed_thinking: bool = False,
        stop_token_ids: frozenset[int] | None = None,
    ) -> None:
        self.compiled = compiled
        self.reasoning_end_ids = None if reasoning_end_ids is None else tuple(reasoning_end_ids)
        self.gate_open = reasoning_end_ids is None or prompt_closed_thinking
        self.stop_token_ids = stop_token_ids
        self.matcher: Any = None  # xgrammar.GrammarMatcher, made on first use
        self.accepted: list[int] = []  # the tokens the grammar accepted in this process, in order
        self.terminated = False
        self.last_token: int | None = None
        self.worker: int | None = None
        self.sid: int | None = None  # its name on that worker
        self.remote_rollback: Any = None

    def is_ready(self) -> bool:
        """Whether the grammar has compiled (successfully: a failed one is the engine's to end)."""
        return self.compiled.done() and self.compiled.exception() is None

    def failure(self) -> str | None:
        """The compile error, once the future has failed; None otherwise."""
        if not self.compiled.done():
            return None
        error = self.compiled.exception()
        return None if error is None else str(error)

    def get_matcher(self) -> Any:
        assert self.worker is None, "the matcher lives in a grammar worker"
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        return self.matcher

    @property
    def is_active(self) -> bool:
        """Whether the next token is constrained (past the reasoning, not terminated)."""
        return self.gate_open and not self.terminated

    def accept(self, token_id: int, output_token_ids: Sequence[int]) -> bool:
        """Advance by the request's new output token `token_id` (`output_token_ids`: all of them, this
        one last). Before the gate opens, only looks for the end of thinking. Returns False when the
        grammar rejects the token."""
        if not self.gate_passes(output_token_ids):
            return True
        matcher = self.matcher or self.get_matcher()
        if not matcher.accept_token(token_id):
            return False
        self.accepted.append(token_id)
        self.last_token = token_id
        stops = self.stop_token_ids
        if stops is None or token_id in stops:
            self.terminated = matcher.is_terminated()
        return True

    def gate_passes(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the request's new token (the last of `output_token_ids`) goes to the matcher. Before the
        gate opens it does not, and the gate opens after the token that ends the thinking."""
        if self.gate_open:
            return True
        if reasoning_ended(output_token_ids[-len(self.reasoning_end_ids) :], self.reasoning_end_ids) is not None:
            self.gate_open = True
        return False

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token accepted: the request is done."""
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not num_tokens:
            return
        if self.worker is not None:  # the worker holds the tokens (and checks the bound)
            self.terminated = self.remote_rollback(num_tokens)
            return
        assert num_tokens <= len(self.accepted), "rollback past the grammar's start"
        matcher = self.get_matcher()
        matcher.rollback(num_tokens)
        self.terminated = matcher.is_terminated()
        del self.accepted[-num_tokens:]
        self.last_token = self.accepted[-1] if self.accepted else None

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)
