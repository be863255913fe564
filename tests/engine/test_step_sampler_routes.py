"""Which sampler serves a row (sampling/step_sampler.py), and that a row's id depends on the row alone.

Rows with top-k / top-p / min-p and nothing else the full sampler is needed for go to the fused
truncating kernel; plain rows to the fused greedy/Gumbel kernel; rows with logprobs, penalties or an
unmet min_tokens to the full sampler. The references are the kernels called on the row alone with the
row's step seed (`step_seed`), and argmax for greedy rows.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tinyvllm.core.outputs import ScheduledSequence, SchedulerOutput
from tinyvllm.sampling.fused_plan import step_seed
from tinyvllm.sampling.step_sampler import StepSampler
from tinyvllm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the fused kernels need CUDA or TRITON_INTERPRET=1",
)
V = 500


def seq(rid: str, params: SamplingParams, output_index: int = 3) -> ScheduledSequence:
    return ScheduledSequence(
        request_id=rid,
        token_ids=[1],
        num_computed_tokens=10,
        block_ids=[0],
        sample=True,
        is_new=False,
        sampling_params=params,
        prompt_len=8,
        all_token_ids=list(range(8 + output_index)),
        output_index=output_index,
    )


def run(sampler: StepSampler, seqs: list[ScheduledSequence], logits: torch.Tensor):
    device = sampler.device
    plan = sampler.plan(SchedulerOutput(sequences=seqs, num_batched_tokens=len(seqs)), seqs)
    fused = sampler.fused_rows(plan, seqs)
    seeds = None
    if sampler.needs_seeds(plan, seqs):
        seeds = torch.empty(len(seqs), dtype=torch.int64)
        sampler.draw_seeds(plan, seqs, seeds.numpy())
    staging = {"temps": torch.empty(len(seqs)), "rows": torch.empty(len(seqs), dtype=torch.int64)}
    ids, logprobs, rows = sampler.sample(logits.to(device), seqs, plan, fused, seeds, None, staging)
    return plan, ids.cpu(), logprobs, rows


def test_rows_go_to_their_sampler_and_draw_the_same_id_alone():
    from tinyvllm.kernels.sampling import sample_greedy_or_gumbel
    from tinyvllm.kernels.top_p_sampling import sample_top_k_top_p

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    top_p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7)
    plain = SamplingParams(temperature=0.7, seed=3)
    with_logprobs = SamplingParams(temperature=0.9, top_p=0.5, seed=5, logprobs=2)
    banned = SamplingParams(temperature=1.0, min_p=0.1, seed=9, min_tokens=10)
    seqs = [
        seq("a", top_p),
        seq("b", plain),
        seq("c", with_logprobs),
        seq("d", SamplingParams(temperature=0.0, top_p=0.5)),
        seq("e", banned),
    ]
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(0)) * 3
    sampler = StepSampler(V, device, seed=0, eos_token_ids=[0], fused_kernel=True)
    plan, ids, logprobs, rows = run(sampler, seqs, logits)
    assert plan.truncated_rows == [0, 4] and sampler.truncating_rows(plan, seqs) == [0]  # e: min_tokens
    assert sampler.fused_rows(plan, seqs) == [1, 3]
    assert rows == [2, 4] and logprobs is not None  # the full sampler's rows, in order

    def one(x):
        return torch.tensor([x], device=device)

    s_a = one(step_seed(7, 3))
    alone = sample_top_k_top_p(
        logits[:1].to(device), one(0.8), s_a, one(40).int(), one(0.9), one(0.0), out=None
    )  # fmt: skip
    assert int(ids[0]) == int(alone)
    plain_alone = sample_greedy_or_gumbel(logits[1:2].to(device), one(0.7), one(step_seed(3, 3)))
    assert int(ids[1]) == int(plain_alone)
    assert int(ids[3]) == int(logits[3].argmax())
    # the truncating row alone through the step sampler, and last in a batch of two
    _, solo, _, _ = run(sampler, [seqs[0]], logits[:1])
    _, pair, _, _ = run(sampler, [seqs[1], seqs[0]], logits[[1, 0]])
    assert int(solo[0]) == int(ids[0]) == int(pair[1])


def test_without_the_triton_kernels_every_filtered_row_takes_the_full_sampler():
    seqs = [seq("a", SamplingParams(temperature=0.8, top_p=0.9, seed=7))]
    sampler = StepSampler(V, torch.device("cpu"), seed=0, eos_token_ids=[0], fused_kernel=False)
    plan, ids, _, _ = run(sampler, seqs, torch.randn(1, V))
    assert sampler.truncating_rows(plan, seqs) == [] and not sampler.needs_seeds(plan, seqs)
    assert 0 <= int(ids[0]) < V
    assert np.array_equal(plan.host_filters[1], np.array([0.9], dtype=np.float32))
