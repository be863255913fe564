"""Execution paths of the model runner; the model itself imports none of them.

- `executor.py`: `ModelExecutor`, which picks the path for each step's hidden states and owns the LM head.
- `fused.py`: the small-batch decoder through our matrix-vector kernels.
- `megakernel.py`: a decode step of one sequence as one kernel launch.
- `lm_head.py`: logits by cuBLAS or our fused product, the sampler inside the product, the pruned LM head.
"""
