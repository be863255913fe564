"""A request as the scheduler sees it: token ids, progress through the KV cache, and status.

Never imports torch. The sampling parameters travel with the request but the core reads only the
token-level stopping rules from them (resolved into plain fields at construction).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits to be recomputed from scratch
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or (set by the engine) a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller (client disconnect, LLM shutdown)
    FINISHED_ERROR = "error"  # could never run (e.g. prompt longer than the model allows)

    @property
    def is_finished(self) -> bool:
        return self._finished  # set below: a plain attribute, since an Enum's hash is Python code

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM finish reason string, or None while unfinished."""
        return self.value if self._finished else None


for _status in RequestStatus:
    _status._finished = _status.name.startswith("FINISHED_")


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    `token_ids` is prompt + output so far; the first `num_computed_tokens` of them have K/V in the
    cache. A decode step feeds the last token (`num_computed_tokens == num_tokens - 1`); a prefill chunk
    feeds several.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # resolved: never more than max_model_len - len(prompt)
    sampling_params: Any = None  # opaque to the core; the runner's sampler reads it
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # None, or whether the request may be admitted yet (False while its grammar compiles); waiting
    # requests behind one that is not ready are admitted meanwhile
    ready: Callable[[], bool] | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens sampled by steps still running on the device (async scheduling): their positions exist,
    # their ids arrive with the step's results.
    num_pending_outputs: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit tokens at first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    # Compute every token from position 0 at admission, never adopting cached prefix blocks (its own full
    # blocks are still offered to the cache): set for requests that want prompt logprobs, which need the
    # logits of every prompt position (vLLM's `skip_reading_prefix_cache`).
    skip_reading_prefix_cache: bool = False
    token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those being sampled by steps in flight."""
        return len(self.token_ids) + self.num_pending_outputs

    def has_room_to_grow(self, max_model_len: int) -> bool:
        """Whether another output token may be scheduled, counting the ones in flight."""
        return (
            self.num_output_tokens + self.num_pending_outputs < self.max_tokens
            and self.num_total_tokens < max_model_len
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stopping rules after a new output token; returns the finished status or None.

        Order as in vLLM: a stop token id or EOS (only once min_tokens are out), then max_tokens, then
        the model's length limit.
        """
        num_output = len(self.output_token_ids)
        if (self.stop_token_ids or self.eos_token_ids) and num_output >= self.min_tokens:
            last = self.output_token_ids[-1]
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens or len(self.token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
