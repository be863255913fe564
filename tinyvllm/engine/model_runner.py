"""Runs one scheduled step on the device: inputs → forward → logits → sampled ids.

Owns the model, the KV cache tensors and the sampler. Sizes the cache: on CUDA from the memory left
after a profiling forward at the largest step (`gpu_memory_utilization`), on the CPU from
`num_gpu_blocks_override` or a byte budget.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tinyvllm.config import CacheConfig, ModelConfig
from tinyvllm.core.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from tinyvllm.engine.sampler import Sampler
from tinyvllm.engine.sampling_tensors import SamplingRow, SamplingTensors
from tinyvllm.engine.step_inputs import build_step_inputs
from tinyvllm.kernels import get_ops
from tinyvllm.models.llama import KVCache
from tinyvllm.models.loader import build_model

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads (seed, step) pairs over the seed space


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed for a seeded request's next token: a function of (seed, position) only, so
    a request samples the same tokens whatever shares its batch and however often it is preempted."""
    return (seed * _SEED_MIX + num_output_tokens * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, *, model_dir: str, device: torch.device,
                 dtype: torch.dtype, kernel_backend: str, load_format: str = "auto", seed: int = 0,
                 eos_token_ids: Sequence[int] = (), show_progress: bool = False) -> None:
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.ops = get_ops(kernel_backend)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model = build_model(model_config, self.ops, model_dir=model_dir, device=device, dtype=dtype,
                                 max_positions=model_config.max_position_embeddings,
                                 load_format=load_format, seed=seed, show_progress=show_progress)
        self.sampler = Sampler()
        self.batch_generator = torch.Generator(device=device).manual_seed(seed)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0

    # ------------------------------------------------------------------ KV cache
    def bytes_per_block(self, block_size: int) -> int:
        c = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * elem

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> int:
        """How many blocks fit: the override if given; on CUDA, what `gpu_memory_utilization` of the
        card leaves after weights and a profiling forward of `max_num_batched_tokens` tokens; on the
        CPU, `cpu_kv_cache_bytes`."""
        per_block = self.bytes_per_block(cache.block_size)
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type != "cuda":
            return max(1, cache.cpu_kv_cache_bytes // per_block)
        peak = self._profile_peak_memory(max_num_batched_tokens, cache.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_for_cache = int(total * cache.gpu_memory_utilization) - peak
        if free_for_cache < per_block:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take {peak / 2**30:.1f} GiB "
                f"of the {total * cache.gpu_memory_utilization / 2**30:.1f} GiB allowed by "
                f"gpu_memory_utilization={cache.gpu_memory_utilization}; raise it or lower "
                f"max_num_batched_tokens")
        return free_for_cache // per_block

    @torch.no_grad()
    def _profile_peak_memory(self, num_tokens: int, block_size: int) -> int:
        """Peak device memory of a prefill forward of `num_tokens` tokens with a one-block cache."""
        self.allocate_kv_cache(1, block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        from tinyvllm.core.outputs import ScheduledSequence as Seq
        seq = Seq(request_id="profile", token_ids=[0] * num_tokens, num_computed_tokens=0,
                  block_ids=[0] * ((num_tokens + block_size - 1) // block_size), sample=True, is_new=True)
        inputs = build_step_inputs(SchedulerOutput([seq], num_tokens), block_size, self.device)
        inputs.meta.slot_mapping.fill_(-1)  # write nothing
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        self.model.compute_logits(hidden[inputs.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """One K and one V tensor per layer, [num_blocks, Hk, block_size, D], carved from one buffer."""
        c = self.model_config
        self.block_size = block_size
        shape = (c.num_hidden_layers, 2, num_blocks, c.num_key_value_heads, block_size, c.head_dim)
        buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(buffer[i, 0], buffer[i, 1]) for i in range(c.num_hidden_layers)]

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        inputs = build_step_inputs(sched, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        if not inputs.sampled:
            return ModelRunnerOutput(sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = [self._sampling_row(s) for s in inputs.sampled]
        tensors = SamplingTensors.from_rows(rows, self.model_config.vocab_size, self.device)
        out = self.sampler(logits, tensors, self.batch_generator)
        ids = out.sampled_token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            per_row = out.logprobs.to_lists([s.sampling_params.logprobs for s in inputs.sampled])
            logprobs = [None if r is None else list(zip(r[0], r[1], [r[2]] + [k + 1 for k in range(len(r[0]) - 1)]))
                        for r in per_row]
            logprobs = [logprobs[j] for j in inputs.sample_order]
        return ModelRunnerOutput(sampled_token_ids=[ids[j] for j in inputs.sample_order], logprobs=logprobs)

    def _sampling_row(self, seq: ScheduledSequence) -> SamplingRow:
        params = seq.sampling_params
        num_output = len(seq.all_token_ids) - seq.prompt_len
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(step_seed(params.seed, num_output))
        banned: frozenset[int] = frozenset()
        if num_output < params.min_tokens:  # EOS is banned even with ignore_eos, as in vLLM
            banned = frozenset(params.stop_token_ids) | self.eos_token_ids
        # Token lists are copied only for the penalties that read them.
        uses_output = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        prompt = seq.all_token_ids[:seq.prompt_len] if params.repetition_penalty != 1 else ()
        output = seq.all_token_ids[seq.prompt_len:] if uses_output else ()
        return SamplingRow(params=params, prompt_token_ids=prompt, output_token_ids=output,
                           generator=generator, min_tokens_banned_ids=banned)
