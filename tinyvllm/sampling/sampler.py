"""Batched sampling on the device: logits [B, V] -> token ids [B] (+ logprobs).

Order of operations (vLLM v1's, with the filter order of vLLM v0 / HF):

1. logprobs, when some row asks: ``log_softmax`` in float32 of the model's raw logits,
   before any penalty or temperature (vLLM v1's default ``raw_logprobs``).
2. the token bitmask of constrained rows (structured outputs): a token it disallows gets -inf
   (sampling/bitmask.py); before everything else that edits the logits, as in vLLM.
2b. min_tokens: the row's banned ids (EOS, stop_token_ids) get -inf while the output is
   shorter than ``min_tokens``.
2c. logit_bias: each row's biases are added to their tokens' logits (a token the bitmask
   removed stays -inf).
3. penalties (on greedy rows too). With ``seen`` = the token occurs in the prompt or the
   output and ``c`` = its count in the output::

       l = l / r  if seen and l > 0;   l = l * r  if seen and l <= 0     (repetition r)
       l = l - f * c - p * [c > 0]                                       (frequency f, presence p)

4. greedy rows: ``argmax`` of the penalised logits (first index on ties).
5. random rows: ``l / T``; top-k; top-p; min-p; ``softmax`` in float32; then the
   exponential race ``argmax_i p_i / q_i`` with ``q_i ~ Exp(1)`` i.i.d., which picks ``i``
   with probability ``p_i`` (``P(q_i / p_i < min_{j != i} q_j / p_j)`` and ``q_j / p_j ~
   Exp(p_j)``, so this is the first arrival of independent exponential clocks). A row with
   its own generator draws its V numbers from it, so a seeded request samples the same
   tokens whatever else is in the batch, and at any position.

Filters on the temperature-scaled logits ``l`` (a removed token gets -inf):

* top-k keeps ``l_i >= l_(k)``, the k-th largest value (ties with it are all kept);
* top-p keeps the smallest set of largest ``l`` whose softmax mass reaches ``p``, computed
  after top-k (the largest is always kept; ties with the smallest kept value are kept);
* min-p keeps ``p_i >= min_p * max_j p_j``, i.e. ``l_i >= max_j l_j + log(min_p)``
  (no softmax needed; its ratio is the same before or after top-k/top-p renormalise).

Nothing here synchronises with the host: the only host values used are those of
:class:`SamplingTensors` built on the host. Sampled ids and logprobs come back as device
tensors; the caller copies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tinyvllm.sampling.bitmask import apply_bitmask_
from tinyvllm.sampling.tensors import TOPK_FAST_PATH_MAX_K, SamplingTensors

_NEG_INF = float("-inf")


@dataclasses.dataclass
class LogprobsTensors:
    """Logprobs of a sampled step, on the device (K = the batch's largest ``logprobs``).

    Attributes:
        logprob_token_ids: [B, K + 1] int64; column 0 is the sampled token, columns 1..K the
            K most likely tokens by raw logprob, in decreasing order.
        logprobs: [B, K + 1] float32, the raw logprobs of those tokens.
        selected_token_ranks: [B] int64, rank of the sampled token under the raw logprobs:
            1 + the number of tokens with a strictly greater logprob.

    A row that asked for ``k < K`` logprobs reads columns ``0..k``; a row that asked for
    none ignores its row.
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def to_lists(self, num_logprobs: Sequence[int | None]) -> list[tuple[list[int], list[float], int] | None]:
        """The logprobs as host lists, one entry per row.

        Copies to the host, so it waits for the device: call it once the step's sampled ids
        are needed on the host anyway.

        Args:
            num_logprobs: Each row's ``logprobs`` request (k), or None where the row asked for none.

        Returns:
            Per row: (token ids, logprobs, rank) cut to the row's ``k + 1`` columns, or None.

        Raises:
            ValueError: ``num_logprobs`` does not have one entry per row.
        """
        ids = self.logprob_token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.selected_token_ranks.tolist()
        if len(num_logprobs) != len(ids):
            raise ValueError(f"num_logprobs has {len(num_logprobs)} entries for {len(ids)} rows.")
        return [None if k is None else (ids[i][: k + 1], lps[i][: k + 1], ranks[i]) for i, k in enumerate(num_logprobs)]


@dataclasses.dataclass
class SamplerOutput:
    """What one sampling step returns, on the device.

    Attributes:
        sampled_token_ids: [B] int64.
        logprobs: present when some row of the batch asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler:
    """Samples one token per row of a logits batch; stateless (randomness comes from generators)."""

    def __call__(
        self,
        logits: torch.Tensor,
        tensors: SamplingTensors,
        batch_generator: torch.Generator | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token id per row of ``logits``.

        Args:
            logits: [B, V], any float dtype; not modified.
            tensors: The batch's sampling tensors, built for B rows and V tokens on ``logits.device``.
            batch_generator: On ``logits.device``; serves the rows without their own generator.
                None: torch's default generator of that device.
            bitmask: [B, ceil(V / 32)] int32 on `logits.device`: the tokens each row may sample
                (all ones: any); None: no constraint.

        Returns:
            The [B] sampled ids, and the logprobs when some row asked for them.

        Raises:
            ValueError: ``logits`` does not fit ``tensors`` or the generator (shape, dtype, device).
        """
        _check_inputs(logits, tensors, batch_generator)
        raw_logprobs = None
        if tensors.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        needs_edit = (
            not tensors.all_greedy
            or tensors.min_tokens_ban is not None
            or tensors.output_counts is not None
            or tensors.logit_bias is not None
            or bitmask is not None
        )
        if not needs_edit:
            # All greedy, nothing to change: argmax of the raw logits in their own dtype
            # (the float32 conversion is monotone, so the argmax is the same).
            sampled = logits.argmax(dim=-1)
        else:
            # A contiguous float32 copy: the caller's logits stay untouched, and flat views work.
            work = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
            if bitmask is not None:
                apply_bitmask_(work, bitmask)
            if tensors.min_tokens_ban is not None:
                work.view(-1).index_fill_(0, tensors.min_tokens_ban, _NEG_INF)
            if tensors.logit_bias is not None:
                work.view(-1).index_add_(0, *tensors.logit_bias)
            if tensors.output_counts is not None:
                work = apply_penalties(work, tensors)
            greedy = None if tensors.all_random else work.argmax(dim=-1)
            if tensors.all_greedy:
                sampled = greedy
            else:
                random = sample_random(work, tensors, batch_generator)
                sampled = random if greedy is None else torch.where(tensors.is_greedy, greedy, random)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, tensors.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _check_inputs(logits: torch.Tensor, tensors: SamplingTensors, generator: torch.Generator | None) -> None:
    """Shape, dtype and device checks on host metadata (no synchronisation)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D floating tensor [B, V], got {tuple(logits.shape)} {logits.dtype}.")
    if tuple(logits.shape) != (tensors.batch_size, tensors.vocab_size):
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}, the sampling tensors were built for "
            f"({tensors.batch_size}, {tensors.vocab_size})."
        )
    device = tensors.device
    if device is not None and device != logits.device:
        raise ValueError(f"logits are on {logits.device}, the sampling tensors on {device}.")
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(f"batch_generator is on {generator.device}, logits on {logits.device}.")


def apply_penalties(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Repetition, frequency and presence penalties (module doc, step 3) on float32 ``logits`` [B, V]."""
    counts = tensors.output_counts
    assert counts is not None
    if tensors.repetition_penalty is not None:
        assert tensors.prompt_mask is not None
        seen = tensors.prompt_mask | (counts > 0)
        r = tensors.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
        del penalised, seen
    if tensors.frequency_penalty is not None:
        assert tensors.presence_penalty is not None
        logits -= tensors.frequency_penalty.unsqueeze(1) * counts
        logits -= tensors.presence_penalty.unsqueeze(1) * (counts > 0).to(torch.float32)
    return logits


def sample_random(
    logits: torch.Tensor, tensors: SamplingTensors, batch_generator: torch.Generator | None
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, softmax, exponential race (module doc, step 5).

    ``logits`` is float32 [B, V] and is modified in place. Greedy rows of a mixed batch go
    through with temperature 1 and no filter; the caller replaces their result.
    """
    assert tensors.temperature is not None
    logits.div_(tensors.temperature.unsqueeze(1))
    if tensors.top_k is not None or tensors.top_p is not None:
        apply_top_k_top_p(logits, tensors.top_k, tensors.top_p, tensors.max_top_k)
    if tensors.min_p is not None:
        apply_min_p(logits, tensors.min_p)
    probs = logits.softmax(dim=-1)
    del logits
    return exponential_race(probs, tensors.seeded_generators, tensors.needs_batch_draw, batch_generator)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> None:
    """Set to -inf, in place, the tokens that top-k then top-p remove (module doc).

    ``top_k`` [B] int64 in [1, V] (V = off), ``top_p`` [B] float32 (1 = off). Each filter
    becomes one threshold value per row, taken from a sorted copy, so the original is
    masked with one comparison and never scattered back.
    """
    V = logits.shape[1]
    if top_p is None and top_k is not None and max_top_k <= TOPK_FAST_PATH_MAX_K:
        # Top-k alone: the k-th largest value from one topk of the batch's largest k.
        top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
        kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= V).unsqueeze(1), _NEG_INF)  # rows with top-k off
        logits.masked_fill_(logits < kth, _NEG_INF)
        return
    sorted_logits = logits.sort(dim=-1).values  # [B, V], ascending
    threshold = None
    if top_k is not None:
        threshold = sorted_logits.gather(1, (V - top_k).unsqueeze(1))  # k-th largest
        sorted_logits.masked_fill_(sorted_logits < threshold, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # Drop the longest ascending prefix whose mass is <= 1 - p; never the largest token.
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        n_drop = drop.sum(dim=-1, keepdim=True)  # the dropped tokens form a prefix
        del cum, drop
        threshold = sorted_logits.gather(1, n_drop)  # smallest kept value (>= the top-k one)
    del sorted_logits
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Set to -inf, in place, the tokens with ``l_i < max_j l_j + log(min_p)``; min_p = 0 is off."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def exponential_race(
    probs: torch.Tensor,
    seeded_generators: Sequence[tuple[int, torch.Generator]],
    needs_batch_draw: bool,
    batch_generator: torch.Generator | None,
) -> torch.Tensor:
    """Per row, ``argmax_i probs_i / q_i`` with ``q_i ~ Exp(1)``: a draw from ``probs`` [B, V].

    Rows in ``seeded_generators`` draw their q from their own generator (V numbers per
    call); the others share one batched draw from ``batch_generator``. ``probs`` is
    overwritten.
    """
    if needs_batch_draw:
        q = torch.empty_like(probs).exponential_(generator=batch_generator)
    else:
        q = torch.ones_like(probs)  # rows left at 1 are greedy rows, replaced by the caller
    for row, generator in seeded_generators:
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0 (from u = 0); 0/0 would be NaN and win the argmax.
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, and the ``num_logprobs`` largest, from [B, V] logprobs."""
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = raw_logprobs.gather(1, sampled)  # [B, 1]
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_values, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([sampled, top_ids], dim=1)
        values = torch.cat([sampled_logprobs, top_values], dim=1)
    else:
        ids, values = sampled, sampled_logprobs
    return LogprobsTensors(logprob_token_ids=ids, logprobs=values, selected_token_ranks=ranks)
