"""A step's sampling: each row to the sampler its parameters call for, whatever shares its batch.

Three samplers serve a step's rows:
- the fused greedy/Gumbel kernel (kernels/sampling.py) for rows whose sampling is greedy or temperature
  only and that no min_tokens ban still holds back (`FusedSamplingPlan.fused_rows`); it may already have
  run inside the decode graph or the LM head's product (`presampled`);
- the fused top-k/top-p/min-p kernel (kernels/top_p_sampling/) for random rows with those filters and
  nothing else the full sampler is needed for (`FusedSamplingPlan.truncating_rows`), over the logits
  (inside a decode graph's truncating sampler graph, engine/cuda_graphs.py, or eagerly);
- the full sampler (sampling/sampler.py: penalties, logit_bias, logprobs, bans) for the others.

A seeded request samples a function of (its seed, its output index) alone, so it samples the same
tokens alone or in any batch, and however often it is preempted. The fused kernels share their noise
(a truncating row with nothing to cut draws the plain kernel's id); the full sampler draws differently
from the same seed. Which sampler serves a row depends on the row's own parameters only.

Host-side preparation lives here and in sampling/tensors.py and sampling/fused_plan.py; the kernels live
in kernels/.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tinyvllm.core.outputs import ScheduledSequence, SchedulerOutput
from tinyvllm.sampling.fused_plan import FusedSamplingPlan, step_seed
from tinyvllm.sampling.sampler import LogprobsTensors, Sampler
from tinyvllm.sampling.tensors import SamplingRow, SamplingTensors


class StepSampler:
    """Samples the rows of each step (module docstring).

    Args:
        vocab_size: the logits' width.
        device: where the logits live.
        seed: seeds the engine's random state (unseeded requests' draws).
        eos_token_ids: banned with a request's stop ids while it is shorter than its min_tokens.
        fused_kernel: whether the fused Triton sampler may serve rows (the Triton ops are in use).
    """

    def __init__(
        self, vocab_size: int, device: torch.device, seed: int, eos_token_ids: Sequence[int], fused_kernel: bool
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fused_kernel = fused_kernel
        self.sampler = Sampler()
        self.batch_generator = torch.Generator(device=device).manual_seed(seed)
        self._rng = np.random.default_rng(seed)  # seeds of unseeded requests for the fused sampler
        self._plan: FusedSamplingPlan | None = None  # the last sampled batch's rows

    def plan(self, sched: SchedulerOutput, seqs: list[ScheduledSequence]) -> FusedSamplingPlan:
        """The fused sampler's constants for these rows: the previous step's plan when the rows are the
        same requests in the same order and none left the running set since (a request id may be reused
        only after its request left)."""
        rids = [s.request_id for s in seqs]
        plan = self._plan
        if plan is None or sched.released_request_ids or plan.request_ids != rids:
            plan = self._plan = FusedSamplingPlan.build(seqs, rids)
        return plan

    def fused_rows(self, plan: FusedSamplingPlan, seqs: list[ScheduledSequence]) -> list[int]:
        """The rows the fused kernel samples this step (none without the Triton kernels)."""
        return plan.fused_rows(seqs) if self.fused_kernel else []

    def truncating_rows(self, plan: FusedSamplingPlan, seqs: list[ScheduledSequence]) -> list[int]:
        """The rows the fused top-k/top-p/min-p kernel samples this step (none without the Triton kernels)."""
        return plan.truncating_rows(seqs) if self.fused_kernel else []

    def needs_seeds(self, plan: FusedSamplingPlan, seqs: list[ScheduledSequence]) -> bool:
        """Whether a fused kernel serves some row this step (so `draw_seeds` must run)."""
        return bool(self.fused_rows(plan, seqs) or self.truncating_rows(plan, seqs))

    def draw_seeds(self, plan: FusedSamplingPlan, seqs: list[ScheduledSequence], out: np.ndarray) -> None:
        """This step's per-row seeds of the fused sampler into `out[:N]` (see FusedSamplingPlan.seeds)."""
        plan.seeds(seqs, self._rng, out)

    def sample(
        self,
        logits: torch.Tensor | None,
        seqs: list[ScheduledSequence],
        plan: FusedSamplingPlan,
        fused: list[int],
        seeds: torch.Tensor | None,
        presampled: torch.Tensor | None,
        staging: dict[str, torch.Tensor],
        bitmask: torch.Tensor | None = None,
        truncated_in: bool = False,
    ) -> tuple[torch.Tensor, LogprobsTensors | None, list[int] | None]:
        """Sampled ids [N], logprobs, and the rows the logprobs cover (None: all).

        Args:
            logits: [N, V] (None only when `presampled` serves every row: a pruned LM head's graph
                computes no logits).
            fused: the rows the fused kernel serves (`fused_rows`); the fused top-k/top-p/min-p kernel
                serves `truncating_rows`.
            seeds: the fused kernels' host seeds (`draw_seeds`), when they serve some row.
            presampled: the fused kernel's ids for every row, already computed inside the decode graph
                (the kernel samples each row on its own, so they equal a separate launch's).
            staging: the runner's host buffers of this step ("temps", "rows"; pinned on CUDA).
            bitmask: [N, ceil(V / 32)] int32 on the device: the tokens each row may sample
                (sampling/bitmask.py; all ones for unconstrained rows), or None. With a bitmask,
                `presampled` must be None (it was drawn without it).
            truncated_in: `presampled` comes from the truncating kernel (a decode graph's, over every
                row), so it serves `truncating_rows` too; `fused` then lists them as well.
        """
        n = len(seqs)
        truncating = [] if truncated_in else self.truncating_rows(plan, seqs)
        if not fused and not truncating:
            out = self._sample_full(logits, seqs, bitmask)
            return out.sampled_token_ids, out.logprobs, None
        seeds_dev = seeds.to(self.device, non_blocking=True)
        temperatures = plan.device_temperatures(self.device, staging["temps"])
        if fused and presampled is None:
            from tinyvllm.kernels.sampling import sample_greedy_or_gumbel

            presampled = sample_greedy_or_gumbel(logits, temperatures, seeds_dev, bitmask=bitmask)
        if len(fused) == n:
            return presampled, None, None
        if len(truncating) == n:
            return self._sample_truncating(logits, temperatures, seeds_dev, plan, None, bitmask), None, None
        served = set(fused) | set(truncating)
        other = [i for i in range(n) if i not in served]
        rows = staging["rows"]
        rows.numpy()[:n] = fused + truncating + other
        rows_dev = rows[:n].to(self.device, non_blocking=True)
        f_idx = rows_dev[: len(fused)]
        t_idx = rows_dev[len(fused) : len(fused) + len(truncating)]
        o_idx = rows_dev[len(fused) + len(truncating) :]
        sampled = torch.empty(n, dtype=torch.int64, device=logits.device)
        if fused:
            sampled[f_idx] = presampled[f_idx]
        if truncating:
            sampled[t_idx] = self._sample_truncating(logits, temperatures, seeds_dev, plan, t_idx, bitmask)
        if not other:
            return sampled, None, None
        out = self._sample_full(logits[o_idx], [seqs[i] for i in other], None if bitmask is None else bitmask[o_idx])
        sampled[o_idx] = out.sampled_token_ids
        return sampled, out.logprobs, other

    def _sample_truncating(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        seeds: torch.Tensor,
        plan: FusedSamplingPlan,
        rows: torch.Tensor | None,
        bitmask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The fused top-k/top-p/min-p kernel's ids for `rows` (device indices; None: every row)."""
        from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p

        top_k, top_p, min_p = plan.device_filters(self.device)
        args = (logits, temperatures, seeds, top_k, top_p, min_p)
        if rows is not None:
            args = tuple(t[rows] for t in args)
            bitmask = None if bitmask is None else bitmask[rows]
        return sample_top_k_top_p(*args, bitmask=bitmask)

    def _sample_full(self, logits: torch.Tensor, seqs: list[ScheduledSequence], bitmask: torch.Tensor | None = None):
        """The full sampler (bitmask, penalties, top-k/p, min-p, logprobs, min_tokens bans) over these rows."""
        rows = [self._sampling_row(s) for s in seqs]
        tensors = SamplingTensors.from_rows(rows, self.vocab_size, self.device)
        return self.sampler(logits, tensors, self.batch_generator, bitmask)

    def _sampling_row(self, seq: ScheduledSequence) -> SamplingRow:
        params = seq.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(step_seed(params.seed, seq.output_index))
        banned: frozenset[int] = frozenset()
        if seq.output_index < params.min_tokens:  # EOS is banned even with ignore_eos, as in vLLM
            banned = frozenset(params.stop_token_ids) | self.eos_token_ids
        # Token lists are copied only for the penalties that read them.
        uses_output = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        prompt = seq.all_token_ids[: seq.prompt_len] if params.repetition_penalty != 1 else ()
        output = seq.all_token_ids[seq.prompt_len :] if uses_output else ()  # bans are decided above
        return SamplingRow(
            params=params,
            prompt_token_ids=prompt,
            output_token_ids=output,
            generator=generator,
            min_tokens_banned_ids=banned,
        )
