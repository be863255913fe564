"""Tensor parallelism on torch.distributed (NCCL on CUDA, gloo on the CPU).

- `shard`: which heads, MLP columns and vocabulary rows each rank holds (pure arithmetic).
- `group`: the process groups and the collectives, each taking its group explicitly.
- `layers`: the vocabulary-parallel embedding (the linear layers shard through `make_linear`).
- `worker`: a rank's process: joins the group, builds its ModelRunner, runs the driver's steps.
- `driver`: rank 0's side, in the engine's process: starts the workers and sends them every step.
- `headless`: the entry point of a machine with node_rank > 0 (workers only).

docs/parallelism.md has the design and the launch steps for several machines.
"""
