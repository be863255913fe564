"""A whole batch-1 decode token through every decoder layer in one launch (a persistent "megakernel").

The maths. Per layer l, with r the residual stream (the token's embedding row before layer 0), the same
operations and roundings as the fused small-batch path of models/decoder.py ("round" is to the model's
dtype):
    A  h = RMSNorm(r; w1[l]);  qkv = round(Wqkv[l] h);  q, k ← RoPE(q, k, pos);  cache[l][slot] ← k, v
    B  o = softmax(scale · q Kᵀ) V over the sequence's cached keys (split-KV, merged by logsumexp)
    C  r = round(round(Wo[l] o) + r)
    D  h = RMSNorm(r; w2[l]);  g, u = round(Wg[l] h), round(Wu[l] h);  a = round(silu(g) ⊙ u)
    E  r = round(round(Wd[l] a) + r)
and finally out = RMSNorm(r; w_final). The LM head and the sampler are kernels of their own.

Why one launch. A batch-1 token reads every weight once, and as one kernel per operation each matrix
product pays a launch, a ramp and a tail beyond its bytes, and every small operation (a norm, RoPE, the
attention merge) pays a launch of its own. Here one program per multiprocessor runs every phase of every
layer, the phases separated by grid-wide barriers, and the small operations are folded into the phases
around them.

Work. A phase is a list of units of about `tile` weight elements each, dealt to the programs round-robin
(unit u to program u mod P); the split phase C gives each program a contiguous run instead. Each weight
phase (A, C, D, E) is a loop that Triton software-pipelines (stages − 1 tiles in flight through shared
memory by cp.async), and the wait of the barrier before it sits in the loop's first iteration: the
pipeline's first tiles, which do not depend on the barrier, stream while the last programs finish the
previous phase. The activation vector, which does depend on it, is loaded after the wait, once per
program. Triton pipelines no loop that holds a nested loop or a CTA barrier, so on CUDA the wait is one
asm statement (grid_sync.wait_asm).

Phases, one module each:
  A  qkv_phase.py: RQ rows of a head's first half with their RoPE partners, rotated in registers; q to
     the workspace, k and v straight into the paged cache.
  B  attention_phase.py: unit (KV head, split of the context), the GQA group's query heads against the
     split's keys through flash_tiles.attn_inner; each unit stores its partial (acc, m, l). A program's
     first key tile is loaded between phase A's arrival and its wait.
  C  residual_phases.py. With `split_o` (the default): unit (KV group, RO output rows); each program
     merges its group's partials itself and adds its products to int64 fixed-point sums by atomics
     (exact, so the atomics' arrival order changes no bit), which phase D adds to the residual. With
     `split_o=False`: the last split of each KV head to take its ticket merges the head's partials in
     phase B (in split order, whoever merges), and phase C's units are RO whole output rows with the
     residual add, as E. Either way a launch is bitwise reproducible (docs/determinism.md).
  D  gate_up_phase.py: RG gate rows and the matching up rows, on the tensor cores where the shape allows.
  E  residual_phases.py: RD output rows with the residual add.

Barriers (grid_sync.py). Five per layer, none before layer 0 (each program normalises the embedding row
itself) and none after the last layer: the last program to leave, whose acquire of the leave count
follows every program's release of it after its phase-E stores, applies the final norm. A barrier is a
monotone arrival counter: a CTA barrier orders the CTA's stores before thread 0's gpu-scope release, and
the b-th barrier of the launch opens when thread 0's acquire reads b·P (a second CTA barrier orders the
CTA's loads after it). Arrival and wait are separate calls, because a release waits for the loads issued
before it: prefetches go between them.

Memory. Data written inside the launch is read with `.cg` loads (from L2: an SM's L1 is not coherent with
other SMs' stores) and never through a software pipeline, whose copies may allocate in L1. The one
exception is the KV cache in phase B: no SM reads a layer's cache lines before that layer's phase B, and
L1 keeps nothing from an earlier launch. On leaving, the last program also resets the barrier counters
and the tickets (the tickets only grow within a launch: layer l's last split sees (l + 1)·splits − 1),
so a launch needs no memset and no host synchronisation and can be captured in a CUDA graph.

Residency. A waiting program spins, so every program must be resident at once: the grid is one program
per multiprocessor (`max_programs`), and nothing else runs on the device meanwhile (the engine uses one
stream). The CPU interpreter runs programs one after another, so there the grid is one program, which
does every unit and finds every barrier open.

Workspace (launch.Workspace), allocated once per configuration:
    r [H]           the residual stream
    r2 [H]          split_o: the residual after attention, stored in phase D for phase E
    o_sums [2, H]   split_o: int64 fixed-point sums of Wo·o for two consecutive layers (zeroed after use)
    q, attn [Hq·D]  phase A's rotated queries; the ticket merge's attention output
    act [F]         phase D's SwiGLU output
    partials        phase B's (acc, m, l) per split, split index fastest, in runs of ≥ 4 slots
    tickets [Hk]    the ticket merge's arrival counts
    barrier [2]     the barrier's arrival count and the leave count
    trace           a traced launch's timer readings (grid_sync.py)

Modules: grid_sync.py (barriers, timer, trace), vectors.py (the residual and its norm), the phase
modules above, kernel.py (the kernel), launch.py (configuration, workspace, launcher).
"""

from tinyvllm.kernels.decode_megakernel.grid_sync import TRACE_BASE, TRACE_BLOCK, TRACE_MAX_LAYERS
from tinyvllm.kernels.decode_megakernel.launch import (
    DEFAULT_CONFIG,
    PIPELINE_BYTES,
    MegakernelConfig,
    ModelShape,
    StackedWeights,
    Workspace,
    decode_megakernel_fwd,
    max_programs,
    phase_d_chunks,
    unit_rows,
    unit_tile,
    unsupported_reason,
)

__all__ = [
    "DEFAULT_CONFIG",
    "PIPELINE_BYTES",
    "TRACE_BASE",
    "TRACE_BLOCK",
    "TRACE_MAX_LAYERS",
    "MegakernelConfig",
    "ModelShape",
    "StackedWeights",
    "Workspace",
    "decode_megakernel_fwd",
    "max_programs",
    "phase_d_chunks",
    "unit_rows",
    "unit_tile",
    "unsupported_reason",
]
