"""Hardware ceilings measured in the run, and the floors they put under each workload.

Counts for a decoder (any supported family) with P_m matrix parameters per token (all layers'
projections plus the LM head; the embedding lookup is no product), W weight bytes a decode step reads
(every parameter once, but an untied embedding table not at all: a step reads one row of it; a tied one
is the LM head, counted once), KV bytes per token κ = layers · 2 · Hk · D · bytes:
  * a forward of one token costs 2·P_m FLOPs, plus 4·c·Hq·D per layer of attention at context c;
  * a decode step of B sequences reads every weight once (W bytes) and each sequence's cache once
    (Σ c_i · κ): it cannot beat max(FLOPs / matmul rate, bytes / copy bandwidth);
  * a prefill is compute-bound: FLOPs / matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyvllm.config import ModelConfig


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # bf16 8192³ product through torch
    device_name: str


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written (random data)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _time_ms(lambda: dst.copy_(src)) * 1e-3
    return 2 * nbytes / seconds


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """bf16 n³ matrix product rate through torch in FLOP/s (random data: zeros run faster)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / (_time_ms(lambda: a @ b) * 1e-3)


def measure_ceilings(device: torch.device) -> Ceilings:
    """Measure both ceilings; the temporaries are freed before returning."""
    copy = copy_bandwidth(device)
    mm = matmul_rate(device)
    torch.cuda.empty_cache()
    return Ceilings(copy, mm, torch.cuda.get_device_name(device))


@dataclass(frozen=True)
class ModelCosts:
    matmul_params: int  # P_m
    weight_bytes: int  # W
    kv_bytes_per_token: int  # κ
    attn_flops_per_ctx_token: int  # 4·Hq·D·layers: attention FLOPs per query token per context token

    @classmethod
    def of(
        cls, c: ModelConfig, bytes_per_param: int = 2, fp8_weights: bool = False, fp8_kv_cache: bool = False
    ) -> ModelCosts:
        """The counts for `c` stored at `bytes_per_param`; `fp8_weights`: the decoder layers' projections
        at one byte per weight plus a float32 scale per output row (the embedding, norms and LM head stay
        at `bytes_per_param`, as FP8 checkpoints keep them); `fp8_kv_cache`: one byte per K/V value."""
        linear_in_layer = (
            c.hidden_size * (c.q_size + 2 * c.kv_size)
            + c.q_size * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        linear = c.num_hidden_layers * linear_in_layer
        matmul = linear + c.hidden_size * c.vocab_size
        embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size  # read one row a step
        rest = c.num_parameters() - embedding - linear
        if fp8_weights:
            rows = c.num_hidden_layers * (c.q_size + 2 * c.kv_size + 2 * c.hidden_size + 2 * c.intermediate_size)
            weight_bytes = rest * bytes_per_param + linear + 4 * rows
        else:
            weight_bytes = (rest + linear) * bytes_per_param
        return cls(
            matmul_params=matmul,
            weight_bytes=weight_bytes,
            kv_bytes_per_token=c.num_hidden_layers * 2 * c.kv_size * (1 if fp8_kv_cache else bytes_per_param),
            attn_flops_per_ctx_token=4 * c.num_hidden_layers * c.q_size,
        )


def decode_step_floor(costs: ModelCosts, contexts: list[int], ceil: Ceilings) -> float:
    """Seconds for one decode step of len(contexts) sequences at those context lengths."""
    flops = 2 * costs.matmul_params * len(contexts) + costs.attn_flops_per_ctx_token * sum(contexts)
    nbytes = costs.weight_bytes + costs.kv_bytes_per_token * sum(contexts)
    return max(flops / ceil.matmul_flops_per_s, nbytes / ceil.copy_bytes_per_s)


def prefill_floor(costs: ModelCosts, prompt_lens: list[int], ceil: Ceilings) -> float:
    """Seconds to prefill the prompts (causal attention: L²/2 query-key pairs each)."""
    flops = sum(2 * costs.matmul_params * n + costs.attn_flops_per_ctx_token * n * n // 2 for n in prompt_lens)
    return flops / ceil.matmul_flops_per_s


def latency_floor(
    costs: ModelCosts, prompt_len: int, output_len: int, ceil: Ceilings, batch_size: int = 1
) -> dict[str, float]:
    """`batch_size` rows decoding together: time to first token (their prefill) and decode tokens per
    second over all rows (weights once a step, each row's cache)."""
    decode = sum(decode_step_floor(costs, [prompt_len + t] * batch_size, ceil) for t in range(1, output_len))
    return {
        "ttft_s": prefill_floor(costs, [prompt_len] * batch_size, ceil),
        "decode_tokens_per_s": batch_size * (output_len - 1) / decode,
    }


def throughput_floor(
    costs: ModelCosts, prompt_lens: list[int], max_tokens: list[int], ceil: Ceilings
) -> dict[str, float]:
    """All requests decode together after one prefill; step t serves those with more than t outputs
    (the first output comes from the prefill)."""
    total = prefill_floor(costs, prompt_lens, ceil)
    for t in range(1, max(max_tokens)):
        contexts = [p + t for p, m in zip(prompt_lens, max_tokens) if m > t]
        total += decode_step_floor(costs, contexts, ceil)
    return {"seconds": total, "output_tokens_per_s": sum(max_tokens) / total}
