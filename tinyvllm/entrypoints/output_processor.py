"""The API side's output processing: the engine core's token ids -> text and stop strings (vLLM v1's
OutputProcessor).

The engine core runs each request that wants text with `core_params(params)`: token ids only (no
detokenizer, no stop strings), DELTA outputs. The token-level stopping rules (EOS, stop token ids,
max_tokens, min_tokens) stay in the core's scheduler. A `RequestProcessor` per request, on the API side,
turns each of the core's Deltas into the Delta the engine would have sent had it detokenized itself;
the semantics are those of `LLMEngine._detokenize` and `LLMEngine._completion`, kept identical:

- text: incremental detokenization (IncrementalDetokenizer, from the prompt's ids), except that the
  text of the token that ended a completion with finish_reason "stop" (EOS or a stop token id) is left
  out unless include_stop_str_in_output. While a completion runs, its last max(len(stop)) - 1
  characters are held back (they may still become a stop string; nothing is held back with
  include_stop_str_in_output).
- stop strings: the first one completed ends the completion: finish_reason "stop", stop_reason the
  string, text cut before it (after it with include_stop_str_in_output), token ids up to and including
  the token that completed it. Tokens the core produced after that, before it heard of the stop, are
  dropped with their logprobs; the cumulative logprob stays the one at the stop. min_tokens does not
  delay stop strings (it does not in the engine either).
- a FINAL_ONLY request without stop strings is decoded once, from all its ids, when it finishes.

Each completion of a request with n > 1 has its own state, and the request finishes when all have.
When a stop string ends a completion that the core still runs, `process` returns the command that
stops it there (its KV blocks return to the pool at once): ("abort", request_id) when the whole
request is done, else ("abort", request_id, index) for that completion alone.

This module imports no torch (it runs in the API process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_NO_COMMANDS: tuple = ()


def core_params(params: SamplingParams) -> SamplingParams:
    """The SamplingParams the engine core runs for a request the caller made with `params`: DELTA
    outputs (FINAL_ONLY kept when there are no stop strings) and, when text is wanted, no
    detokenization and no stop strings (a RequestProcessor adds them back)."""
    kind = params.output_kind
    if kind is _FINAL_ONLY and params.stop:
        kind = _DELTA  # stop strings are checked after every step
    elif kind is not _FINAL_ONLY:
        kind = _DELTA
    if not params.detokenize:
        return params if kind is params.output_kind else params.replace(output_kind=kind)
    return params.replace(detokenize=False, stop=[], include_stop_str_in_output=False, output_kind=kind)


class _CompletionText:
    """Text state of one completion; see the module docstring."""

    __slots__ = (
        "cumulative_logprob",
        "decode",
        "detokenizer",
        "finish_reason",
        "finished",
        "holdback",
        "include_stop",
        "sent",
        "skip_special_tokens",
        "stop_reason",
    )

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams, incremental: bool
    ) -> None:
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.decode = tokenizer.decode
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if incremental
            else None
        )
        # LLMEngine._holdback: characters withheld from unfinished text.
        self.holdback = 0 if self.include_stop else max((len(s) for s in params.stop), default=1) - 1
        self.sent = 0  # characters of text sent so far
        self.finished = False
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(
        self, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> tuple[str, str | None, int | str | None]:
        """The core's news for this completion -> (new text, finish_reason, stop_reason), as the engine
        would have reported them; marks the completion finished when it is."""
        finished = finish_reason is not None
        # A stop token (or EOS) is not part of the text unless include_stop_str_in_output.
        ids = token_ids[:-1] if finish_reason == "stop" and not self.include_stop else token_ids
        det = self.detokenizer
        if det is None:  # FINAL_ONLY without stop strings: all ids at once, decoded once
            text = self.decode(ids, skip_special_tokens=self.skip_special_tokens) if finished else ""
        else:
            stop_str = det.add_tokens(ids) if ids else None
            if stop_str is None and finished:
                stop_str = det.finish()  # flush bytes that never formed a whole character
            if stop_str is not None:
                finish_reason, stop_reason, finished = "stop", stop_str, True
            text = det.output_text
            if self.holdback and not finished:
                text = text[: len(text) - self.holdback]
            text, self.sent = text[self.sent :], len(text)
        if finished:
            self.finished = True
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return text, finish_reason, stop_reason


class RequestProcessor:
    """Turns the core's Deltas of one request into the Deltas the engine would have sent with
    detokenization on (see the module docstring). Not thread-safe: one thread calls `process`.

    Args:
        tokenizer: tinyvllm.tokenizer.Tokenizer (anything with `decode(ids, skip_special_tokens)`).
        params: the caller's SamplingParams (the core runs `core_params(params)`); detokenize must be
            true (without it there are no stop strings either, and the core's Deltas are final as
            they are).
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        if not params.detokenize:
            raise ValueError("a RequestProcessor is for requests that want text (detokenize=True)")
        self.tokenizer = tokenizer
        self.params = params
        self.finished = False
        self._incremental = params.output_kind is not _FINAL_ONLY or bool(params.stop)
        self._completions: list[_CompletionText] | None = None  # built with the first Delta

    def process(self, delta: Sequence, prompt_token_ids: Sequence[int]) -> tuple[tuple, Sequence[tuple]]:
        """One core Delta(-shaped tuple) of this request -> (the Delta to deliver, commands for the core).

        `prompt_token_ids`: the request's prompt ids (the detokenizers' context; read at the first
        Delta). Completions already finished here (a stop string) report no news, whatever the core
        sent for them. The returned Delta is finished when every completion is.
        """
        request_id, core_finished, completions, error, cached = delta
        if error is not None:  # the request could not run: nothing to decode
            self.finished = True
            return delta, _NO_COMMANDS
        states = self._completions
        if states is None:
            states = self._completions = [
                _CompletionText(self.tokenizer, prompt_token_ids, self.params, self._incremental)
                for _ in range(self.params.n)
            ]
        out = []
        stopped_here: list[int] = []  # completions a stop string ended while the core still runs them
        for index, _, token_ids, logprobs, cumulative_logprob, finish_reason, stop_reason in completions:
            state = states[index]
            if state.finished:
                out.append(
                    (
                        index,
                        "",
                        [],
                        [] if logprobs is not None else None,
                        state.cumulative_logprob,
                        state.finish_reason,
                        state.stop_reason,
                    )
                )
                continue
            state.cumulative_logprob = cumulative_logprob
            text, reason, stop = state.add(token_ids, finish_reason, stop_reason)
            if reason is not None and finish_reason is None:
                stopped_here.append(index)
            out.append((index, text, token_ids, logprobs, cumulative_logprob, reason, stop))
        finished = all(s.finished for s in states)
        commands: Sequence[tuple] = _NO_COMMANDS
        if finished:
            self.finished = True
            if not core_finished:
                commands = [("abort", request_id)]
        elif stopped_here:
            commands = [("abort", request_id, i) for i in stopped_here]
        return (request_id, finished, out, None, cached), commands
