"""Host-side description of a sampling batch, and its device tensors.

The engine describes each row it samples this step with a :class:`SamplingRow`;
:meth:`SamplingTensors.from_rows` turns the rows into the few device tensors the
:class:`~tinyvllm.sampling.sampler.Sampler` needs, once per step.

Only what some row uses is built (a field is ``None`` otherwise), so a batch of
plain requests costs one small host-to-device copy. Everything is assembled in
CPU tensors first and reaches the device in at most two copies (one float32
block of per-row scalars, one int64 block of flat indices), pinned and
non-blocking on CUDA: building the tensors never waits for the GPU.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from tinyvllm.sampling.logits_processors import bias_indices
from tinyvllm.sampling_params import SamplingParams, SamplingType

TOPK_FAST_PATH_MAX_K = 1024
"""Top-k alone uses ``torch.topk(max_top_k)`` up to this k, a full sort above it."""

FLOAT32_SCALE_LIMIT = 1e20
"""Largest temperature, and the bounds ``[1 / limit, limit]`` of the repetition penalty, that the
sampler computes with (see :func:`float32_scale`)."""


def float32_scale(value: float) -> float:
    """A temperature or repetition penalty (> 0, finite, but any size) as the float32 sampler takes it:
    clamped to ``[1e-20, 1e20]``.

    Beyond those bounds float32 overflows (``1e308`` becomes ``inf``, and ``-inf / inf`` is NaN for a
    banned token) or underflows (``1e-300`` becomes 0, a division by zero), while the result is
    already at its limit: with logit differences ``d`` below ``1e12`` the exponents change by less
    than ``d * 1e-20``, far under float32's resolution of ``2**-24``. So a temperature of ``1e308``
    samples exactly like ``1e20``: uniformly over the tokens not masked out (``-inf``), the limit of
    ``softmax(l / T)`` as ``T`` grows.
    """
    return min(max(value, 1.0 / FLOAT32_SCALE_LIMIT), FLOAT32_SCALE_LIMIT)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One row of the logits being sampled this step (host side, filled by the engine).

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (read only when the row's repetition_penalty != 1).
        output_token_ids: the tokens generated so far (read for penalties and min_tokens).
            Token rows may be lists, ``array.array('q')`` or int64 numpy arrays; the last
            two are read without a Python loop (penalties cost O(tokens) host time a step).
        generator: the request's own generator, on the sampling device, seeded with
            ``params.seed`` (see :func:`make_generator`); required when the request has a
            seed, ``None`` otherwise (the row then draws from the batch generator).
        min_tokens_banned_ids: token ids banned while ``len(output_token_ids) <
            params.min_tokens``; the engine fills it with the EOS ids and
            ``params.stop_token_ids``.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    min_tokens_banned_ids: frozenset[int] = frozenset()


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, for a request with ``SamplingParams.seed``."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


@dataclasses.dataclass
class SamplingTensors:
    """Per-step device tensors for :class:`~tinyvllm.sampling.sampler.Sampler` (B rows, V vocab).

    A tensor field is ``None`` when no row of the batch uses the feature; neutral rows of a
    tensor that exists hold the neutral value (temperature 1, top_k V, top_p 1, min_p 0,
    penalties 0 / 0 / 1).

    Attributes:
        batch_size, vocab_size: B and V.
        all_greedy: every row is greedy (the sampler does one argmax).
        all_random: no row is greedy (the sampler skips the argmax).
        is_greedy: [B] bool, only for a mixed batch.
        temperature: [B] float32, greedy rows hold 1.0; None when all greedy.
        top_k: [B] int64 in [1, V] (V = disabled); None when no row uses top-k.
        max_top_k: the largest enabled top_k (host int; 0 when none).
        top_p: [B] float32; None when no row uses top-p.
        min_p: [B] float32; None when no row uses min-p.
        repetition_penalty: [B] float32; None when every row has 1.0.
        frequency_penalty, presence_penalty: [B] float32; both None when every row has 0.
        prompt_mask: [B, V] bool, token occurs in the prompt; with repetition_penalty.
        output_counts: [B, V] float32, occurrences of the token in the output; with any
            penalty (float32 counts are exact below 2**24).
        min_tokens_ban: [N] int64 flat indices ``row * V + token`` to set to -inf; None if none.
        logit_bias: ([M] int64 flat indices ``row * V + token``, [M] float32 biases) to add to the
            logits (``SamplingParams.logit_bias``); None when no row has one.
        seeded_generators: (row, generator) for every random row with its own generator.
        needs_batch_draw: some random row draws from the batch generator.
        max_num_logprobs: the largest ``params.logprobs`` of the batch; None when no row asks.
    """

    batch_size: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    max_top_k: int
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None
    min_tokens_ban: torch.Tensor | None
    seeded_generators: tuple[tuple[int, torch.Generator], ...]
    needs_batch_draw: bool
    max_num_logprobs: int | None
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device | None:
        """The device of the tensors (None when the batch needed none, e.g. all greedy, no extras)."""
        for t in (self.temperature, self.output_counts, self.min_tokens_ban, self.is_greedy):
            if t is not None:
                return t.device
        return None

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingTensors:
        """Build the tensors of one step.

        Host work is O(B + tokens read for penalties); the device receives at most two
        non-blocking copies.

        Args:
            rows: The rows sampled this step, in logits-row order.
            vocab_size: V, the logits' width.
            device: Where the logits are.

        Raises:
            ValueError: No rows, a vocab_size below 1, a seeded row without its generator or with one on
                another device, a token id outside the vocabulary, or ``logprobs`` above V.
        """
        device = torch.device(device)
        if not rows:
            raise ValueError("rows must not be empty: there is nothing to sample.")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}.")
        B, V = len(rows), vocab_size
        greedy = [r.params.sampling_type is SamplingType.GREEDY for r in rows]
        all_greedy, all_random = all(greedy), not any(greedy)
        seeded, needs_batch_draw = _random_draws(rows, greedy, device)
        use_rep = any(r.params.repetition_penalty != 1.0 for r in rows)
        use_freq_pres = any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows)
        columns, max_top_k = _scalar_columns(rows, greedy, V, use_rep, use_freq_pres)
        index_parts = _index_parts(rows, V, use_rep, use_freq_pres)
        col, indices = _copy_to_device(columns, index_parts, device)
        output_counts, prompt_mask = _penalty_tensors(indices, B, V, device)
        nums = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if nums and max(nums) > V:
            raise ValueError(f"logprobs={max(nums)} exceeds the vocabulary size {V}.")
        return cls(
            batch_size=B,
            vocab_size=V,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=col["is_greedy"].bool() if "is_greedy" in col else None,
            temperature=col.get("temperature"),
            top_k=col["top_k"].to(torch.int64) if "top_k" in col else None,
            max_top_k=max_top_k,
            top_p=col.get("top_p"),
            min_p=col.get("min_p"),
            repetition_penalty=col.get("repetition_penalty"),
            frequency_penalty=col.get("frequency_penalty"),
            presence_penalty=col.get("presence_penalty"),
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            min_tokens_ban=indices.get("ban"),
            seeded_generators=tuple(seeded),
            needs_batch_draw=needs_batch_draw,
            max_num_logprobs=max(nums) if nums else None,
            logit_bias=_bias_tensors(rows, V, device),
        )


def _bias_tensors(
    rows: Sequence[SamplingRow], V: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows' logit_bias as (flat indices, biases) on ``device``; ids outside [0, V) raise ValueError."""
    found = bias_indices([r.params for r in rows], V)
    if found is None:
        return None
    flat, values = found
    for r in rows:
        for t in r.params.logit_bias or ():
            if t >= V:
                raise ValueError(f"logit_bias holds token id {t}, outside the vocabulary [0, {V}).")
    return _to_device(torch.from_numpy(flat), device), _to_device(torch.from_numpy(values), device)


def _random_draws(
    rows: Sequence[SamplingRow], greedy: list[bool], device: torch.device
) -> tuple[list[tuple[int, torch.Generator]], bool]:
    """(row, generator) of every random row with its own generator, and whether some random row draws
    from the batch generator instead."""
    seeded: list[tuple[int, torch.Generator]] = []
    needs_batch_draw = False
    for i, (row, g) in enumerate(zip(rows, greedy)):
        if g:
            continue
        if row.generator is None:
            if row.params.seed is not None:
                raise ValueError(f"row {i} has seed={row.params.seed} but no generator; see make_generator().")
            needs_batch_draw = True
        else:
            if not _same_device(row.generator.device, device):
                raise ValueError(f"row {i}'s generator is on {row.generator.device}, sampling is on {device}.")
            seeded.append((i, row.generator))
    return seeded, needs_batch_draw


def _scalar_columns(
    rows: Sequence[SamplingRow], greedy: list[bool], V: int, use_rep: bool, use_freq_pres: bool
) -> tuple[dict[str, list[float]], int]:
    """The per-row float32 scalars that some row uses, by field name (one [F, B] block on the device),
    and the largest enabled top_k (0 when none)."""
    random_params = [r.params for r, g in zip(rows, greedy) if not g]
    columns: dict[str, list[float]] = {}
    if random_params:
        columns["temperature"] = [1.0 if g else float32_scale(r.params.temperature) for r, g in zip(rows, greedy)]
    max_top_k = max((p.top_k for p in random_params if 0 < p.top_k < V), default=0)
    if max_top_k:
        columns["top_k"] = [float(r.params.top_k if 0 < r.params.top_k < V else V) for r in rows]
    if any(p.top_p < 1.0 for p in random_params):
        columns["top_p"] = [r.params.top_p for r in rows]
    if any(p.min_p > 0.0 for p in random_params):
        columns["min_p"] = [r.params.min_p for r in rows]
    if use_rep:
        columns["repetition_penalty"] = [float32_scale(r.params.repetition_penalty) for r in rows]
    if use_freq_pres:
        columns["frequency_penalty"] = [r.params.frequency_penalty for r in rows]
        columns["presence_penalty"] = [r.params.presence_penalty for r in rows]
    if random_params and len(random_params) < len(rows):  # a mixed batch
        columns["is_greedy"] = [float(g) for g in greedy]
    return columns, max_top_k


def _index_parts(rows: Sequence[SamplingRow], V: int, use_rep: bool, use_freq_pres: bool) -> dict[str, torch.Tensor]:
    """Flat CPU int64 indices ``row * V + token`` by use: "output" tokens (any penalty), "prompt"
    tokens (repetition penalty), "ban" (min_tokens bans of the rows still under min_tokens)."""
    index_parts: dict[str, torch.Tensor] = {}
    if use_rep or use_freq_pres:
        index_parts["output"] = _flat_indices([r.output_token_ids for r in rows], V, "output_token_ids")
    if use_rep:
        index_parts["prompt"] = _flat_indices([r.prompt_token_ids for r in rows], V, "prompt_token_ids")
    bans = [sorted(r.min_tokens_banned_ids) if len(r.output_token_ids) < r.params.min_tokens else [] for r in rows]
    if any(bans):
        index_parts["ban"] = _flat_indices(bans, V, "min_tokens_banned_ids")
    return index_parts


def _copy_to_device(
    columns: dict[str, list[float]], index_parts: dict[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The scalar columns and the index parts on ``device``, by name: one copy for each kind."""
    scalars = _to_device(torch.tensor(list(columns.values()), dtype=torch.float32), device) if columns else None
    col = {name: scalars[j] for j, name in enumerate(columns)} if scalars is not None else {}
    indices: dict[str, torch.Tensor] = {}
    if index_parts:
        flat = _to_device(torch.cat(list(index_parts.values())), device)
        indices = dict(zip(index_parts, flat.split([t.numel() for t in index_parts.values()])))
    return col, indices


def _penalty_tensors(
    indices: dict[str, torch.Tensor], B: int, V: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The [B, V] output-token counts and prompt mask of the penalties, from their flat indices."""
    output_counts = prompt_mask = None
    if "output" in indices:
        output_counts = torch.zeros(B * V, dtype=torch.float32, device=device)
        output_counts.index_add_(0, indices["output"], torch.ones_like(indices["output"], dtype=torch.float32))
        output_counts = output_counts.view(B, V)
    if "prompt" in indices:
        prompt_mask = torch.zeros(B * V, dtype=torch.bool, device=device)
        prompt_mask.index_fill_(0, indices["prompt"], True)
        prompt_mask = prompt_mask.view(B, V)
    return output_counts, prompt_mask


def _flat_indices(token_lists: Sequence[Sequence[int]], vocab_size: int, field: str) -> torch.Tensor:
    """CPU int64 tensor of ``row * vocab_size + token`` over every token of every row.

    This is the host cost of penalties, O(tokens) per step. Rows held as ``array.array``
    ('q' or 'l') or int64 numpy arrays are read without a Python loop; lists go through
    ``np.fromiter`` (about 4x faster than ``torch.tensor`` of a list, still ~50 ns a token).
    """
    lengths = np.fromiter((len(ids) for ids in token_lists), dtype=np.int64, count=len(token_lists))
    if all(_is_int64_buffer(ids) for ids in token_lists):
        tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_lists] or [np.empty(0, np.int64)])
    else:
        tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise ValueError(f"{field} holds token id {bad}, outside the vocabulary [0, {vocab_size}).")
    rows = np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab_size, lengths)
    return torch.from_numpy(rows + tokens)


def _is_int64_buffer(ids: object) -> bool:
    if isinstance(ids, array.array):
        return ids.itemsize == 8 and ids.typecode in "qlQL"
    return isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the current device is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to ``device`` without making the host wait for the GPU."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
