"""Sampling: host-side parameter preparation, and the samplers that run on the device.

- `step_sampler.py`: `StepSampler`, which sends each row of a step to the sampler its parameters call for.
- `fused_plan.py`: per-row constants of the fused greedy/Gumbel kernel, kept while the batch's rows stay.
- `tensors.py`: `SamplingTensors`, the full sampler's per-row parameters as device tensors.
- `sampler.py`: the full sampler in torch (penalties, top-k/p, min-p, logprobs, bans).
- `prompt_logprobs.py`: the prompt tokens' logprobs, ranks and top-k, scored in slices of rows.

The Triton kernels are in tinyvllm/kernels/ (sampling.py; gemv.py and lm_head_bounds.py, which sample
inside the LM head's product).
"""
