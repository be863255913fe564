"""Teacher-forced logits through the engine's runner: the input of parity checks against transformers."""

from __future__ import annotations

import torch


@torch.no_grad()
def teacher_forced_logits(engine, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits [len(prompt), V] at every position of `prompt`, run through `engine`'s runner chunk by chunk
    (each chunk reads the previous ones' K/V from the paged cache, as chunked prefill does), in the last
    blocks of the cache. The engine must be idle."""
    from tinyvllm.core.outputs import ScheduledSequence, SchedulerOutput

    if sum(chunks) != len(prompt):
        raise ValueError(f"chunks {chunks} sum to {sum(chunks)}, not the prompt's {len(prompt)} tokens")
    runner = engine.runner
    bs = runner.block_size
    blocks = list(range(engine.num_blocks - 1, engine.num_blocks - 1 - (len(prompt) + bs - 1) // bs, -1))
    logits, start = [], 0
    for n in chunks:
        seq = ScheduledSequence(
            request_id="tf",
            token_ids=prompt[start : start + n],
            num_computed_tokens=start,
            block_ids=blocks,
            sample=False,
            is_new=start == 0,
        )
        inputs = runner.builder.build(SchedulerOutput([seq], n))
        hidden = runner.executor.hidden_states(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches)
        logits.append(runner.executor.lm_head.logits(hidden))
        start += n
    return torch.cat(logits)
