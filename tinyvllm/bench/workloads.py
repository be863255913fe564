"""The benchmark workloads, drawn exactly as docs/workloads.md defines them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    max_tokens: list[int]
    temperature: float
    filters: dict[str, float] = field(default_factory=dict)  # SamplingParams top_p / top_k / min_p, if any

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def throughput_workload(num_requests: int = 256, seed: int = 0) -> Workload:
    """nano-vllm's / vLLM's offline set: random.seed(0); prompts of randint(100, 1024) ids in [0, 10000];
    then max_tokens = randint(100, 1024) per request, drawn in that order; temperature 0.6, ignore_eos.
    For 256 requests the outputs total 133,966 tokens."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_requests)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_requests)]
    return Workload(prompts, max_tokens, temperature=0.6)


def latency_workload(prompt_len: int = 128, output_len: int = 512, seed: int = 0, batch_size: int = 1) -> Workload:
    """`batch_size` prompts (1: the `latency` workload) of `prompt_len` random ids each, `output_len`
    greedy tokens each, ignore_eos: every row decodes in the same steps."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(prompt_len)] for _ in range(batch_size)]
    return Workload(prompts, [output_len] * batch_size, temperature=0.0)


def shared_prefix_workload(
    num_requests: int = 256, prefix_len: int = 1024, suffix_len: int = 64, output_len: int = 128, seed: int = 0
) -> Workload:
    """256 requests sharing a 1,024-token prefix, each adding 64 tokens of its own; 128 greedy outputs."""
    rng = random.Random(seed)
    prefix = [rng.randint(0, 10000) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randint(0, 10000) for _ in range(suffix_len)] for _ in range(num_requests)]
    return Workload(prompts, [output_len] * num_requests, temperature=0.0)
