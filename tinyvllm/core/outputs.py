"""The contracts between the scheduler and the model runner. Plain data, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PLACEHOLDER = -1  # a token id not yet known on the host


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2x, and 256 are built per step
class ScheduledSequence:
    """One request's share of a step: feed `token_ids` at positions
    `num_computed_tokens ... num_computed_tokens + len(token_ids) - 1`."""

    request_id: str
    token_ids: Sequence[int]  # the step's input tokens (one for a decode); PLACEHOLDER: the token the
    # previous step sampled for this request, still on the device (async scheduling)
    num_computed_tokens: int  # tokens whose K/V was in the cache before this step
    block_ids: Sequence[int]  # the request's block table after this step's allocation; read-only
    sample: bool  # the chunk ends at the request's last known token: sample the next one
    is_new: bool  # first step since admission (or re-admission after preemption)
    sampling_params: Any = None  # opaque to the core; the runner's sampler reads it
    prompt_len: int = 0  # for penalties: token_ids of the whole request are prompt then output
    all_token_ids: Sequence[int] = ()  # the request's known tokens (read-only view), for penalties
    output_index: int = 0  # when sampling: the index, among the request's outputs, of the token sampled

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has written its K/V."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step."""

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    # Requests that left the running set since the previous step (finished, aborted or preempted):
    # the runner drops whatever it cached for them.
    released_request_ids: frozenset[str] = frozenset()
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass
class ModelRunnerOutput:
    """What the runner returns for a step: one sampled token per sequence with `sample` set, in the
    order of `SchedulerOutput.sequences`; optional logprobs in the same order."""

    sampled_token_ids: list[int]
    # Per sampled row: list of (token_id, logprob, rank), sampled token first, then the top-k.
    logprobs: list[list[tuple[int, float, int]]] | None = None
    # Request id -> (p, entries) for the requests whose prompt logprobs this step computed: entries[i] is
    # the distribution of prompt token p + 1 + i given the tokens before it, as (that token, its logprob,
    # its rank) followed by the top-k (token, logprob, rank). None: no row of the step asked.
    prompt_logprobs: dict[str, tuple[int, list[list[tuple[int, float, int]]]]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
