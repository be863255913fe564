"""Delta outputs: what the engine core sends after each step, and how the API side merges them.

The server asks the engine for DELTA outputs: each carries only what one step added. The engine core
sends them as `Delta` tuples: no prompt, no earlier tokens, and plain tuples on the wire (pickling a
NamedTuple costs 8x more: 0.32 vs 0.04 ms for a batch-256 step), so consumers unpack them by position
in the order the two NamedTuples below document. A request stream whose
reader falls behind merges the Deltas that piled up into one RequestOutput (texts, token ids and
logprobs concatenated; the latest finish_reason, stop_reason and cumulative logprob kept), so one SSE
event carries every token since the previous one. Accumulating all of a request's Deltas gives its
cumulative output (what a CUMULATIVE request would have returned after the same step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class CompletionDelta(NamedTuple):
    """What one step added to completion `index` of a request (the field order of the wire tuple)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # one entry per new token, when requested
    cumulative_logprob: float | None  # of the whole completion so far
    finish_reason: str | None
    stop_reason: int | str | None


class Delta(NamedTuple):
    """What one step added to a request: its completions' news, and whether it has finished (the
    field order of the wire tuple)."""

    request_id: str
    finished: bool
    completions: list[CompletionDelta]
    error: str | None = None  # set when the request could not run at all (finish_reason "error")
    num_cached_tokens: int | None = None


def encode_outputs(outputs: Sequence[RequestOutput]) -> list[tuple]:
    """The engine's DELTA (or FINAL_ONLY) RequestOutputs as Delta-shaped plain tuples (prompt and
    metrics left out)."""
    return [
        (
            o.request_id,
            o.finished,
            [
                (c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                for c in o.outputs
            ],
            o.error,
            o.num_cached_tokens,
        )
        for o in outputs
    ]


class _Completion:
    __slots__ = ("cumulative_logprob", "finish_reason", "index", "logprobs", "stop_reason", "texts", "token_ids")

    def __init__(self, index: int) -> None:
        self.index = index
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list | None,
        cumulative_logprob: float | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> None:
        if text:
            self.texts.append(text)
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text="".join(self.texts),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class OutputAccumulator:
    """Merges consecutive deltas of one request (Deltas or delta RequestOutputs) into one RequestOutput.

    Args:
        request_id, prompt, prompt_token_ids, arrival_time: what the merged RequestOutput reports
            (Deltas do not carry them).
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
        self._completions: dict[int, _Completion] = {}

    def add(self, delta: tuple | RequestOutput) -> None:
        """Add a Delta(-shaped tuple) or a delta RequestOutput."""
        if isinstance(delta, RequestOutput):
            completions: Iterable[tuple] = [
                (c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                for c in delta.outputs
            ]
            finished, error, cached = delta.finished, delta.error, delta.num_cached_tokens
        else:
            _, finished, completions, error, cached = delta
        slots = self._completions
        for index, *news in completions:
            slot = slots.get(index)
            if slot is None:
                slot = slots[index] = _Completion(index)
            slot.add(*news)
        self.finished = finished
        if error is not None:
            self.error = error
        if cached is not None:
            self.num_cached_tokens = cached

    def extend(self, deltas: Iterable[tuple | RequestOutput]) -> OutputAccumulator:
        for d in deltas:
            self.add(d)
        return self

    def output(self) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=self.arrival_time) if self.arrival_time is not None else None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._completions[i].output() for i in sorted(self._completions)],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            metrics=metrics,
        )


def merge_deltas(deltas: Sequence[tuple | RequestOutput], **request_fields) -> RequestOutput:
    """One RequestOutput holding everything `deltas` (consecutive, of one request) added.
    `request_fields`: OutputAccumulator's request_id (default: the deltas'), prompt, prompt_token_ids,
    arrival_time; for RequestOutput deltas the prompt fields default to the first delta's."""
    first = deltas[0]
    if isinstance(first, RequestOutput):
        request_fields.setdefault("prompt", first.prompt)
        request_fields.setdefault("prompt_token_ids", first.prompt_token_ids)
    request_fields.setdefault("request_id", first.request_id if isinstance(first, RequestOutput) else first[0])
    return OutputAccumulator(**request_fields).extend(deltas).output()
