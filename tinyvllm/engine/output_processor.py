"""Output processing: the engine core's token-level outputs -> text, stop strings, output kinds
(vLLM v1's OutputProcessor).

The engine core works in token ids only: its scheduler applies the token-level stopping rules (EOS,
stop token ids, max_tokens, min_tokens) and it sends `EngineCoreOutput`s. Everything about text
happens here, in one implementation shared by `LLMEngine.step()` (the offline `LLM`) and the
server's engine clients (`tinyvllm.engine.async_llm`, on the thread that receives the core's
messages):

- text: incremental detokenization (IncrementalDetokenizer, from the prompt's ids), except that the
  text of the token that ended a completion with finish_reason "stop" (EOS or a stop token id) is left
  out unless include_stop_str_in_output. While a completion runs, its last max(len(stop)) - 1
  characters are held back (they may still become a stop string; nothing is held back with
  include_stop_str_in_output). Requests with detokenize off get no text.
- stop strings: the first one completed ends the completion: finish_reason "stop", stop_reason the
  string, text cut before it (after it with include_stop_str_in_output), token ids up to and including
  the token that completed it. The completion is then finished here; `RequestState.aborts` tells the
  caller to stop it in the core (its KV blocks return to the pool at once). Tokens the core produced
  after that, before it heard of the stop, are dropped with their logprobs; the cumulative logprob
  stays the one at the stop. min_tokens does not delay stop strings.
- a FINAL_ONLY request without stop strings is decoded once, from all its ids, when it finishes (the
  core sends it one output then: `streams_every_step`).
- n > 1: each completion has its own state; the request finishes when all have, and each of its
  RequestDeltas lists every completion (those without news with empty text and ids).
- output kinds (`OutputProcessor`, for `LLMEngine.step()`): DELTA outputs carry a step's RequestDelta,
  CUMULATIVE ones everything so far, FINAL_ONLY one output when the request finishes. The server's
  `RequestStream` applies the same kinds to the RequestDeltas it receives.

This module imports no torch (it also runs in the API process).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from tinyvllm.engine.messages import (
    AbortRequest,
    CompletionDelta,
    EngineCoreOutput,
    RequestDelta,
    RequestTimes,
)
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_NO_ABORTS: tuple = ()


def streams_every_step(params: SamplingParams) -> bool:
    """Whether the core sends a request's outputs after every step (else only when a completion
    finishes): always, except for FINAL_ONLY requests without stop strings to match."""
    return params.output_kind is not _FINAL_ONLY or (params.detokenize and bool(params.stop))


class _CompletionState:
    """Text state of one completion; see the module docstring. With `totals`, it also keeps
    everything so far (`output()`, for CUMULATIVE and FINAL_ONLY RequestOutputs)."""

    __slots__ = (
        "cumulative_logprob",
        "decode",
        "detokenizer",
        "finish_reason",
        "finished",
        "holdback",
        "include_stop",
        "index",
        "logprobs",
        "sent",
        "skip_special_tokens",
        "stop_reason",
        "text",
        "token_ids",
        "wants_logprobs",
    )

    def __init__(
        self, index: int, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams, totals: bool
    ) -> None:
        self.index = index
        self.include_stop = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.decode = tokenizer.decode if params.detokenize else None
        incremental = params.detokenize and streams_every_step(params)
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
        self.holdback = 0 if self.include_stop else max((len(s) for s in params.stop), default=1) - 1
        self.wants_logprobs = params.logprobs is not None
        self.sent = 0  # characters of text sent so far
        self.finished = False
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""  # the text so far (kept with totals)
        self.token_ids: list[int] | None = [] if totals else None
        self.logprobs: list | None = [] if totals and self.wants_logprobs else None

    def add(self, out: EngineCoreOutput) -> CompletionDelta:
        """The core's news for this completion -> its CompletionDelta; marks it finished when it is
        (by the core, or by a stop string here)."""
        if self.finished:  # a stop string ended it here: what the core sent since is dropped
            return self.unchanged()
        token_ids, finish_reason, stop_reason = out.new_token_ids, out.finish_reason, out.stop_reason
        finished = finish_reason is not None
        text = ""
        if self.decode is not None:
            # A stop token (or EOS) is not part of the text unless include_stop_str_in_output.
            ids = token_ids[:-1] if finish_reason == "stop" and not self.include_stop else token_ids
            det = self.detokenizer
            if det is None:  # FINAL_ONLY without stop strings: all ids at once, decoded once
                text = self.decode(ids, skip_special_tokens=self.skip_special_tokens) if finished else ""
                self.text = text
            else:
                stop_str = det.add_tokens(ids) if ids else None
                if stop_str is None and finished:
                    stop_str = det.finish()  # flush bytes that never formed a whole character
                if stop_str is not None:
                    finish_reason, stop_reason, finished = "stop", stop_str, True
                text = det.output_text
                if self.holdback and not finished:
                    text = text[: len(text) - self.holdback]
                self.text = text
                text, self.sent = text[self.sent :], len(text)
        if self.token_ids is not None:
            self.token_ids += token_ids
            if self.logprobs is not None and out.new_logprobs:
                self.logprobs += out.new_logprobs
        self.cumulative_logprob = out.cumulative_logprob
        if finished:
            self.finished = True
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return CompletionDelta(
            self.index, text, token_ids, out.new_logprobs, out.cumulative_logprob, finish_reason, stop_reason
        )

    def unchanged(self) -> CompletionDelta:
        """A delta without news (its current finish state)."""
        return CompletionDelta(
            self.index,
            "",
            [],
            [] if self.wants_logprobs else None,
            self.cumulative_logprob,
            self.finish_reason,
            self.stop_reason,
        )

    def output(self) -> CompletionOutput:
        """Everything so far (needs totals)."""
        assert self.token_ids is not None
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )

    def fail(self) -> CompletionDelta:
        """The request could not run: finish_reason "error", nothing generated."""
        self.finished = True
        self.finish_reason = "error"
        return self.unchanged()


class RequestState:
    """Output processing of one request (all its completions); see the module docstring. Not
    thread-safe: one thread feeds it.

    Args:
        request_id: the request's id (the core's outputs carry it).
        params: the request's SamplingParams.
        tokenizer: tinyvllm.tokenizer.Tokenizer (anything with `decode(ids, skip_special_tokens)`),
            used when params.detokenize.
        prompt, prompt_token_ids: the request's prompt. The ids are the detokenizers' context, read at
            the request's first output (a caller that learns them late may set them until then).
        arrival_time: for RequestMetrics.
    """

    __slots__ = (
        "_completions",
        "_tokenizer",
        "aborts",
        "arrival_time",
        "error",
        "finished",
        "n",
        "num_cached_tokens",
        "params",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "times",
        "totals",
    )

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        tokenizer: Any,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] = (),
        arrival_time: float | None = None,
        totals: bool = False,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = arrival_time
        self.finished = False
        self.error: str | None = None
        self.num_cached_tokens: int | None = None
        self.prompt_logprobs: list | None = None  # once the core sent them (RequestOutput.prompt_logprobs)
        self.times: RequestTimes | None = None  # the first completion's, finished_time the latest
        self.aborts: Sequence[AbortRequest] = _NO_ABORTS  # what to stop in the core; the caller clears it
        self.totals = totals
        self._tokenizer = tokenizer
        self._completions: list[_CompletionState] | None = None  # built with the first output

    def add(self, out: EngineCoreOutput) -> CompletionDelta:
        """One core output of this request -> its completion's CompletionDelta. Updates `finished`,
        the times and `aborts` (a stop string matched while the core still runs the completion)."""
        states = self._completions
        if states is None:
            ids = self.prompt_token_ids
            states = self._completions = [
                _CompletionState(i, self._tokenizer, ids, self.params, self.totals) for i in range(self.n)
            ]
        if out.error is not None:
            return self._fail(out)
        self.num_cached_tokens = out.num_cached_tokens
        if out.times is not None:
            self._note_times(out)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        state = states[out.index]
        was_finished = state.finished
        delta = state.add(out)
        if state.finished and not was_finished:
            if self.n == 1:
                self.finished = True
            else:
                self.finished = all(s.finished for s in states)
            if out.finish_reason is None:  # finished here, by a stop string
                self._stopped_here(state.index)
        return delta

    def _note_times(self, out: EngineCoreOutput) -> None:
        times = out.times
        if self.times is None or out.index == 0:
            finished = self.times.finished_time if self.times is not None else None
            self.times = RequestTimes(times.first_scheduled_time, times.first_token_time, finished)
        if times.finished_time is not None:
            self._finished_at(times.finished_time)

    def _finished_at(self, when: float) -> None:
        times = self.times
        if times is None:
            self.times = RequestTimes(None, None, when)
        elif times.finished_time is None or when > times.finished_time:
            times.finished_time = when

    def _stopped_here(self, index: int) -> None:
        self._finished_at(time.monotonic())
        command = AbortRequest(self.request_id) if self.finished else AbortRequest(self.request_id, index)
        self.aborts = [*self.aborts, command]

    def _fail(self, out: EngineCoreOutput) -> CompletionDelta:
        """The request could not run: every completion ends with finish_reason "error"."""
        assert self._completions is not None
        self.error = out.error
        self.finished = True
        if out.times is not None:
            self._note_times(out)
        for s in self._completions[1:]:
            s.fail()
        return self._completions[0].fail()

    def delta(self, news: dict[int, CompletionDelta], prompt_logprobs: list | None = None) -> RequestDelta:
        """The request's RequestDelta for a step whose news, by completion index, are `news` (and the
        prompt logprobs, if they came in that step): every completion is listed."""
        assert self._completions is not None
        completions = [news.get(s.index) or s.unchanged() for s in self._completions]
        return RequestDelta(
            self.request_id, self.finished, completions, self.error, self.num_cached_tokens, prompt_logprobs
        )

    def output(self) -> RequestOutput:
        """Everything so far, as a RequestOutput (needs totals)."""
        assert self._completions is not None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.output() for c in self._completions],
            self.finished,
            self.num_cached_tokens,
            self.error,
            self.metrics(),
            self.prompt_logprobs,
        )

    def metrics(self) -> RequestMetrics | None:
        if self.arrival_time is None:
            return None
        times = self.times
        if times is None:
            return RequestMetrics(self.arrival_time)
        finished = times.finished_time if self.finished else None
        return RequestMetrics(self.arrival_time, times.first_scheduled_time, times.first_token_time, finished)


def process_outputs(
    states: Sequence[RequestState], outputs: Sequence[EngineCoreOutput]
) -> Iterator[tuple[RequestState, RequestDelta]]:
    """One step's core outputs -> one RequestDelta per request that has news: those of n = 1
    requests as their outputs are processed (a generator: each can be consumed, and freed, before the
    next is made), then those of n > 1 requests, once all of the step's outputs are in, in the order
    of their first outputs. `states[i]` is the RequestState of `outputs[i]`'s request."""
    # n > 1, by id(): (state, news by completion index, the prompt logprobs if they came in this step)
    groups: dict[int, list] = {}
    for state, out in zip(states, outputs):
        news = state.add(out)
        if state.n == 1:
            yield (
                state,
                RequestDelta(
                    state.request_id, state.finished, [news], state.error, state.num_cached_tokens, out.prompt_logprobs
                ),
            )
        else:
            group = groups.get(id(state))
            if group is None:
                group = groups[id(state)] = [state, {}, None]
            group[1][news.index] = news
            if out.prompt_logprobs is not None:
                group[2] = out.prompt_logprobs
    for state, news_by_index, prompt_logprobs in groups.values():
        yield state, state.delta(news_by_index, prompt_logprobs)


class OutputProcessor:
    """The output processing of `LLMEngine.step()`: RequestStates by request id, RequestOutputs of
    the requests' output kinds.

    Args:
        tokenizer: the engine's Tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        arrival_time: float,
    ) -> None:
        totals = params.output_kind is not _DELTA
        state = RequestState(request_id, params, self.tokenizer, prompt, prompt_token_ids, arrival_time, totals)
        self.requests[request_id] = state

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: Sequence[EngineCoreOutput]) -> tuple[list[RequestOutput], list[AbortRequest]]:
        """One step's core outputs -> (the RequestOutputs of the requests that have one, the aborts
        that stop strings matched here ask of the core). Outputs of unknown (aborted) requests are
        dropped."""
        requests = self.requests
        states = [requests.get(o.request_id) for o in outputs]
        if None in states:
            outputs = [o for o, s in zip(outputs, states) if s is not None]
            states = [s for s in states if s is not None]
        request_outputs = []
        aborts: list[AbortRequest] = []
        for state, delta in process_outputs(states, outputs):
            if state.aborts:
                aborts += state.aborts
                state.aborts = _NO_ABORTS
            if delta.finished:
                del requests[state.request_id]
            output = self._request_output(state, delta)
            if output is not None:
                request_outputs.append(output)
        return request_outputs, aborts

    @staticmethod
    def _request_output(state: RequestState, delta: RequestDelta) -> RequestOutput | None:
        """The request's RequestOutput for this step's delta, by its output kind (None: a FINAL_ONLY
        request that has not finished)."""
        if not state.totals:  # DELTA
            completions = [
                CompletionOutput(
                    c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason
                )
                for c in delta.completions
            ]
            return RequestOutput(
                state.request_id,
                state.prompt,
                state.prompt_token_ids,
                completions,
                delta.finished,
                delta.num_cached_tokens,
                delta.error,
                state.metrics(),
                delta.prompt_logprobs,
            )
        if delta.finished or state.params.output_kind is not _FINAL_ONLY:
            return state.output()
        return None
