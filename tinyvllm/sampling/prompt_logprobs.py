"""Prompt logprobs (vLLM's semantics): each prompt token's log-probability given the tokens before it,
its rank, and the k most likely tokens at its position.

Prompt token t_{p+1} is scored by the logits of position p, z_p = W h_p (h_p: the final hidden state, W:
the LM head):

    logprob(t_{p+1}) = z_p[t_{p+1}] - logsumexp(z_p)
    rank(t_{p+1})    = 1 + #{v : logprob_v > logprob(t_{p+1})}   (the sampler's rank: ties share the better)

and the top-k entries are the k largest logprob_v with ranks 1..k. The first prompt token has no entry.
A step that computes positions c .. c + n - 1 of a prompt of L tokens therefore yields the entries of
tokens c + 1 .. min(c + n, L - 1): every position of the chunk but the prompt's last, whose logits are the
ones the sampler reads. Chunks of one prompt arrive in order over several steps; the engine appends them.

The rows go through the LM head in slices of at most `max_rows` rows, so a long prompt never holds more
than one slice's [max_rows, V] float32 logits (turned into logprobs in place) at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinyvllm.core.outputs import ScheduledSequence

# One prompt position's entry as the runner hands it to the engine: (the next prompt token, its logprob,
# its rank), then the top-k as (token, logprob, rank).
Entry = list[tuple[int, float, int]]


@dataclass(frozen=True)
class PromptSpan:
    """The rows of one step that score tokens of one request's prompt.

    Attributes:
        request_id: the request.
        start: the first position p whose logits are computed (the span scores t_{start+1} onwards).
        row: p's row in the step's hidden states; the span's rows are consecutive.
        targets: the prompt tokens scored, t_{start+1} .. t_{start+len(targets)}.
        k: how many of the most likely tokens each entry lists (SamplingParams.prompt_logprobs).
    """

    request_id: str
    start: int
    row: int
    targets: list[int]
    k: int


def prompt_spans(ordered: Sequence[ScheduledSequence]) -> list[PromptSpan]:
    """The spans of a step's sequences that want prompt logprobs; `ordered`: the sequences in the step's
    row order (each one's rows follow the previous one's)."""
    spans = []
    row = 0
    for s in ordered:
        n = len(s.token_ids)
        params = s.sampling_params
        k = None if params is None else params.prompt_logprobs
        if k is not None:
            start = s.num_computed_tokens
            end = min(start + n, s.prompt_len - 1)
            if end > start:
                spans.append(PromptSpan(s.request_id, start, row, list(s.all_token_ids[start + 1 : end + 1]), k))
        row += n
    return spans


def may_score_prompts(num_sequences: int, num_tokens: int, num_sampled: int) -> bool:
    """Whether a step of `num_tokens` tokens over `num_sequences` sequences, `num_sampled` of which
    sample, may hold prompt rows to score, without reading any sampling parameters: only one with a
    prompt chunk (more tokens than sequences) or a sequence that does not sample. In a step of one
    sampled token per sequence, every row is its request's last known position."""
    return num_tokens > num_sequences or num_sampled < num_sequences


@dataclass
class PromptLogprobsTensors:
    """Every scored prompt row of a step, in span order (R rows, K = the spans' largest k).

    Attributes:
        token_logprobs: [R] float32, logprob of each scored token.
        ranks: [R] int64, its rank.
        top_ids: [R, K] int64, the K most likely tokens, most likely first.
        top_logprobs: [R, K] float32, their logprobs.
    """

    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def score_rows(
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    max_rows: int,
) -> PromptLogprobsTensors:
    """Logprob, rank and top-k of `targets` under the logits of `hidden[rows]` (module docstring).

    Args:
        hidden: [T, H] final hidden states of a step.
        rows: [R] int64, the rows to score.
        targets: [R] int64, the token each row scores.
        k: how many of the most likely tokens to list (0: none).
        logits_fn: [r, H] -> [r, V] float32 logits, a fresh tensor (it is overwritten).
        max_rows: the most rows whose logits exist at once (>= 1).
    """
    assert max_rows >= 1
    R = rows.shape[0]
    dev = hidden.device
    token_logprobs = torch.empty(R, dtype=torch.float32, device=dev)
    ranks = torch.empty(R, dtype=torch.int64, device=dev)
    top_ids = torch.empty(R, k, dtype=torch.int64, device=dev)
    top_logprobs = torch.empty(R, k, dtype=torch.float32, device=dev)
    for lo in range(0, R, max_rows):
        hi = min(lo + max_rows, R)
        logprobs = logits_fn(hidden[rows[lo:hi]])  # [r, V] float32
        logprobs.sub_(torch.logsumexp(logprobs, dim=-1, keepdim=True))
        chosen = logprobs.gather(1, targets[lo:hi, None])  # [r, 1]
        token_logprobs[lo:hi] = chosen[:, 0]
        ranks[lo:hi] = (logprobs > chosen).sum(dim=-1) + 1
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_logprobs[lo:hi], top_ids[lo:hi] = values, ids
        del logprobs
    return PromptLogprobsTensors(token_logprobs, ranks, top_ids, top_logprobs)


@dataclass
class StepPromptLogprobs:
    """A step's prompt logprobs, on the device until `to_host()` (after the step's results are ready)."""

    spans: list[PromptSpan]
    tensors: PromptLogprobsTensors

    def to_host(self) -> dict[str, tuple[int, list[Entry]]]:
        """Request id -> (the span's start, one entry per scored token), as ModelRunnerOutput holds them."""
        t = self.tensors
        lps, ranks = t.token_logprobs.tolist(), t.ranks.tolist()
        top_ids, top_lps = t.top_ids.tolist(), t.top_logprobs.tolist()
        out = {}
        i = 0
        for span in self.spans:
            k = span.k
            entries = []
            for target in span.targets:
                entry = [(target, lps[i], ranks[i])]
                entry += [(tok, lp, j + 1) for j, (tok, lp) in enumerate(zip(top_ids[i][:k], top_lps[i][:k]))]
                entries.append(entry)
                i += 1
            out[span.request_id] = (span.start, entries)
        return out


def step_prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    max_rows: int,
) -> StepPromptLogprobs:
    """Score the spans' rows of a step's hidden states [T, H] (`score_rows`); enqueues device work only."""
    rows = [span.row + i for span in spans for i in range(len(span.targets))]
    targets = [t for span in spans for t in span.targets]
    dev = hidden.device
    tensors = score_rows(
        hidden,
        torch.tensor(rows, dtype=torch.int64, device=dev),
        torch.tensor(targets, dtype=torch.int64, device=dev),
        max(span.k for span in spans),
        logits_fn,
        max_rows,
    )
    return StepPromptLogprobs(spans, tensors)
