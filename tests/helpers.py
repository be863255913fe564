"""Helpers shared by the tests."""

from __future__ import annotations

import torch


@torch.no_grad()
def chunked_logits(engine, prompt: list[int], chunks: list[int]) -> torch.Tensor:
    """Run the prompt through the runner chunk by chunk (each chunk reads the previous ones' K/V from
    the paged cache) and return logits for every position."""
    from tinyvllm.core.outputs import ScheduledSequence, SchedulerOutput

    assert sum(chunks) == len(prompt)
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


def record_cascade_prefixes(builder) -> list[int | None]:
    """Wrap a StepInputBuilder's `build` so that every step appends its cascade prefix length (None
    when the step uses no cascade attention) to the returned list."""
    used: list[int | None] = []
    build = builder.build

    def recording_build(*args, **kwargs):
        inputs = build(*args, **kwargs)
        # The host value: on a graph step the device's is written only after `build` returns.
        used.append(inputs.prefix_len or None)
        return inputs

    builder.build = recording_build
    return used
