"""What the user gets back, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class Logprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Log-probability of one token under the model's raw distribution, its rank (1 = most likely),
    and its text.

    A msgspec Struct (immutable, compared and hashed by value) so that it travels inside the engine
    core's outputs as a compact msgpack array.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # one dict per generated token, when requested
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its completions so far (cumulative)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    error: str | None = None  # set when the request could not run at all (finish_reason "error")
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first; each entry
    # holds the prompt token (always, with its rank) and the prompt_logprobs most likely tokens there.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
