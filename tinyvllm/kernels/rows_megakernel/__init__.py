"""A decode step of up to 16 sequences through every decoder layer in one launch (the "rows megakernel").

The batch-1 megakernel (kernels/decode_megakernel) reads every weight once per token. At 2–16 rows the
layer loop reads the weights once per step too, but as ~10 kernels a layer, each paying a launch, a ramp
and a tail on [rows, H] activations far below the copy bandwidth (docs/perf.md §1e: 0.44–0.50 of the
floor). This kernel keeps the batch-1 kernel's structure (one persistent program per SM, five phases a
layer separated by grid barriers, the stacked weights, the same maths and roundings per row) and
changes how a phase multiplies: every weight tile is multiplied by all rows at once on the tensor cores.

The maths per row, with r its residual stream (its token's embedding row before layer 0):
    A  h = RMSNorm(r; w1);  qkv = round(Wqkv h (+ b));  q, k ← RoPE(q, k, pos);  cache[l][slot] ← k, v
    B  o = softmax(scale · q Kᵀ) V over the row's cached keys (split-KV, merged by logsumexp)
    C  r = round(round(Wo o) + r)
    D  h = RMSNorm(r; w2);  a = round(silu(round(Wg h)) ⊙ round(Wu h))
    E  r = round(round(Wd a) + r)
and out = RMSNorm(r; w_final) per row.

Weight phases (products.py). A unit is R ≥ 16 weight rows; a program takes units round-robin and, per
K chunk, multiplies all of its units' rows at once by the rows' input chunk [16, KC] in one tl.dot (the
rows padded to 16, tl.dot's minimum; padding rows load nothing), its K split over the warps where the
program has few rows. The input chunk is read once per program and chunk. The phase's epilogue (RoPE
and the cache write, SwiGLU, the residual add) runs per unit after the last chunk. Where the batch-1
kernel holds the whole normed input vector in registers, here each chunk is normed as it loads, from a
per-row rstd summed from the previous residual phase's per-unit sums of squares.

Phase B (attention.py): units (row, KV head, split), the merge by the last split's ticket.

Barriers, residency and memory rules are the batch-1 kernel's (decode_megakernel/__init__.py): one
program per SM, monotone arrival counters, data written inside the launch read with `.cg` loads and
through a software pipeline only where the pipeline starts after the barrier (the weight phases'
input, products.py), the counters and tickets reset by the last program out, so a launch
is graph-capturable and bitwise reproducible (every sum in a fixed order, no float atomics).

Not yet served (rows_unsupported_reason): per-head q/k norms (Qwen3), head dims below 16.
"""

from tinyvllm.kernels.rows_megakernel.launch import (
    DEFAULT_ROWS_CONFIG,
    MAX_ROWS,
    RowsConfig,
    RowsWorkspace,
    num_splits_for,
    rows_megakernel_fwd,
    rows_unsupported_reason,
)

__all__ = [
    "DEFAULT_ROWS_CONFIG",
    "MAX_ROWS",
    "RowsConfig",
    "RowsWorkspace",
    "num_splits_for",
    "rows_megakernel_fwd",
    "rows_unsupported_reason",
]
