"""Per-row inputs of the fused samplers, rebuilt only when the batch's rows change.

The fused greedy/Gumbel kernel (`tinyvllm.kernels.sampling`) needs a temperature (0 = greedy) and a seed
per row; the fused top-k/top-p/min-p kernel (`tinyvllm.kernels.top_p_sampling`) also each row's filters.
A request's temperature and seeding never change, and in steady decoding the batch keeps the same
requests in the same order for many steps, so the per-row constants live in a `FusedSamplingPlan`
keyed by the ordered request ids: when a step's rows equal the previous step's, the plan (and its
device copy of the temperatures) is reused and only the seeds are drawn, vectorised, instead of a
per-row Python loop every step. The temperatures reach the device only when an eager step first asks
for them: a decode graph step writes the host values into its input arena, which reaches the device in
the step's one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tinyvllm.core.outputs import ScheduledSequence
from tinyvllm.sampling.logits_processors import masks_tokens
from tinyvllm.sampling.tensors import float32_scale

_SEED_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads (seed, step) pairs over the seed space


def step_seed(seed: int, output_index: int) -> int:
    """The random seed for a seeded request's output token `output_index`: a function of the two only,
    so a request samples the same tokens whatever shares its batch and however often it is preempted."""
    return (seed * _SEED_MIX + output_index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def is_plain(params) -> bool:
    """Sampling the fused kernel handles: greedy or temperature only, no penalties, no logit_bias, no
    logprobs (allowed_token_ids and bad_words reach it through the bitmask)."""
    return (
        params.logprobs is None
        and not params.logit_bias
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
        and (params.is_greedy or not truncates(params))
    )


def truncates(params) -> bool:
    """Whether a random request's sampling cuts the distribution (top-k, top-p or min-p)."""
    return params.top_p < 1 or params.top_k > 0 or params.min_p > 0


def is_truncated(params) -> bool:
    """Sampling the fused top-k/top-p/min-p kernel handles: random with one of those filters, and
    otherwise as plain as `is_plain` asks (no penalties, logit_bias or logprobs)."""
    return (
        not params.is_greedy
        and truncates(params)
        and params.logprobs is None
        and not params.logit_bias
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
    )


@dataclass
class FusedSamplingPlan:
    """The fused sampler's constants for one ordered list of rows.

    Attributes:
        request_ids: the rows' request ids, in batch order (the plan's key).
        plain_rows: the rows whose parameters the fused kernel handles (`is_plain`).
        truncated_rows: the rows the fused top-k/top-p/min-p kernel handles (`is_truncated`).
        host_temperatures: [N] float32 on the host; 0 for greedy rows (`device_temperatures`: on the device).
        host_filters: (top_k [N] int32, 0 = off; top_p [N] float32, 1 = off; min_p [N] float32, 0 = off)
            on the host (`device_filters`: on the device).
        seeded: (row, request seed) of the rows whose request carries a seed.
        min_tokens: (row, min_tokens) of the rows whose request bans EOS and stop ids for a while; the
            fused kernel cannot ban tokens, so a step where one of them is still short goes to the
            full sampler.
        index: request id -> row (the next step gathers its placeholder inputs through it).
        masked_rows: the rows whose request removes tokens through the step's bitmask
            (allowed_token_ids, bad_words: sampling/logits_processors.py).
    """

    request_ids: list[str]
    plain_rows: list[int]
    host_temperatures: np.ndarray
    seeded: list[tuple[int, int]]
    min_tokens: list[tuple[int, int]]
    index: dict[str, int]
    masked_rows: list[int] = field(default_factory=list)
    truncated_rows: list[int] = field(default_factory=list)
    host_filters: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    _device_temperatures: torch.Tensor | None = field(default=None, repr=False)
    _device_filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, seqs: Sequence[ScheduledSequence], request_ids: list[str]) -> FusedSamplingPlan:
        params = [s.sampling_params for s in seqs]
        plain_rows = [i for i, p in enumerate(params) if is_plain(p)]
        return cls(
            request_ids=request_ids,
            plain_rows=plain_rows,
            host_temperatures=np.array(
                [0.0 if p.is_greedy else float32_scale(p.temperature) for p in params], dtype=np.float32
            ),
            seeded=[(i, p.seed) for i, p in enumerate(params) if p.seed is not None and not p.is_greedy],
            min_tokens=[(i, p.min_tokens) for i, p in enumerate(params) if p.min_tokens],
            index={rid: i for i, rid in enumerate(request_ids)},
            masked_rows=[i for i, p in enumerate(params) if masks_tokens(p)],
            truncated_rows=[i for i, p in enumerate(params) if is_truncated(p)],
            host_filters=(
                np.array([p.top_k for p in params], dtype=np.int32),
                np.array([p.top_p for p in params], dtype=np.float32),
                np.array([p.min_p for p in params], dtype=np.float32),
            ),
        )

    def device_temperatures(self, device: torch.device, staging: torch.Tensor) -> torch.Tensor:
        """The temperatures [N] float32 on `device`, copied on the first call through `staging` (a host
        float32 buffer of at least N elements, pinned on CUDA, that must not be rewritten before the
        copy has run: the caller alternates two) and kept for the plan's later steps."""
        if self._device_temperatures is None:
            temps = staging[: len(self.request_ids)]
            temps.numpy()[:] = self.host_temperatures
            self._device_temperatures = temps.to(device, non_blocking=True, copy=True)
        return self._device_temperatures

    def device_filters(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top_k, top_p, min_p) [N] on `device`, copied on the first call (through pinned memory on CUDA,
        which torch's host allocator keeps until the copy has run) and kept for the plan's later steps."""
        if self._device_filters is None:
            assert self.host_filters is not None
            hosts = [torch.from_numpy(a) for a in self.host_filters]
            if device.type == "cuda":
                hosts = [h.pin_memory() for h in hosts]
            top_k, top_p, min_p = (h.to(device, non_blocking=True) for h in hosts)
            self._device_filters = (top_k, top_p, min_p)
        return self._device_filters

    def fused_rows(self, seqs: Sequence[ScheduledSequence]) -> list[int]:
        """The rows the fused kernel samples this step: plain ones not still under min_tokens (the
        kernel cannot ban tokens). In row order."""
        return self._unbanned(self.plain_rows, seqs)

    def truncating_rows(self, seqs: Sequence[ScheduledSequence]) -> list[int]:
        """The rows the fused top-k/top-p/min-p kernel samples this step (`truncated_rows` not still under
        min_tokens). In row order."""
        return self._unbanned(self.truncated_rows, seqs)

    def _unbanned(self, rows: list[int], seqs: Sequence[ScheduledSequence]) -> list[int]:
        banned = {i for i, m in self.min_tokens if seqs[i].output_index < m}
        if not banned:
            return rows
        return [i for i in rows if i not in banned]

    def seeds(self, seqs: Sequence[ScheduledSequence], rng: np.random.Generator, out: np.ndarray) -> None:
        """Write this step's per-row seeds into `out[:N]`: fresh random ones for unseeded rows, and
        `step_seed(seed, output index)` for seeded ones (so their draws do not depend on the batch)."""
        n = len(self.request_ids)
        out[:n] = rng.integers(0, 1 << 63, size=n, dtype=np.int64)
        for i, seed in self.seeded:
            out[i] = step_seed(seed, seqs[i].output_index)
