"""Host side of the rows megakernel: its configuration, workspace and launcher `rows_megakernel_fwd`.

The model shape, the stacked weights and the KV cache's layout are the batch-1 megakernel's
(decode_megakernel/launch.py): both kernels read the same stacks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tinyvllm.kernels.decode_megakernel.attention_phase import kv_alignable
from tinyvllm.kernels.decode_megakernel.grid_sync import TRACE_BASE, TRACE_BLOCK, TRACE_MAX_LAYERS
from tinyvllm.kernels.decode_megakernel.launch import (
    ATTN_KEYS,
    MAX_SPLITS,
    ModelShape,
    StackedWeights,
    check_family,
    check_kv_dtype,
    kv_layout,
)
from tinyvllm.kernels.launch import check_int, next_power_of_2, num_sms, upcast_dot
from tinyvllm.kernels.rows_megakernel.kernel import rows_megakernel_kernel

MAX_ROWS = 16  # token rows a launch serves: the products' N (tl.dot's minimum)


class RowsConfig(NamedTuple):
    """Launch choices of the rows megakernel (products.py describes the product loop they shape)."""

    rows: int = 16  # weight rows per unit (QKV's half-head rows are rows / 2); a program multiplies all of its
    # units' rows at once, M = (most units a program has, a power of two) · rows
    chunk: int = 256  # K columns per weight tile, at most (FP8 weights: twice); the largest power of two
    # dividing K within this and `tile`
    tile: int = 16384  # bytes of a weight tile (M rows × chunk), at most: phases with many rows take narrower chunks
    split: int = 0  # K slices of a chunk multiplied side by side where M < 16 · num_warps (0: num_warps), one
    # per warp; at least 16 columns each. Phases with more rows split M over the warps instead (one slice)
    stages: int = 4  # the weight and input tiles' software pipeline: this many shared-memory stages
    kv_stages: int = 5  # phase B's key loop: this many shared-memory stages (from 5 it copies two tiles ahead)
    kv_align: int = 1  # 1: tell the compiler the caches' layer stride and V offset are multiples of 16 elements
    # (where they are; the launcher checks), so phase B's K/V tiles load as 16-byte vectors that its key loop's
    # pipeline copies ahead (cp.async); 0: unhinted (2-byte loads, synchronous)
    attn_splits: int = 0  # phase B's context splits per (row, KV head), at least (0: as many as fill the programs,
    # `num_splits_for`); more splits make more, shorter units, several a program
    num_warps: int = 4
    programs: int = 0  # CUDA: at most this many programs (0: one on every multiprocessor)


class PhasePlan(NamedTuple):
    """How one weight phase multiplies: most units per program, K chunk, K split (products.py)."""

    maxu: int
    chunk: int
    split: int


DEFAULT_ROWS_CONFIG = RowsConfig()


def _pow2_chunk(k: int, at_most: int) -> int:
    """The largest power of two ≤ at_most that divides k."""
    c = 1 << max(0, at_most.bit_length() - 1)
    while k % c:
        c //= 2
    return c


def _maxu(n_rows: int, config: RowsConfig, programs: int) -> int:
    """A phase's most units per program (a power of two): the program's rows are maxu · config.rows."""
    return next_power_of_2(-(-(n_rows // config.rows) // programs))


def phase_plan(n_rows: int, k: int, config: RowsConfig, programs: int, weight_bytes: int, fp8: bool) -> PhasePlan:
    """The plan of a phase of n_rows weight rows of k columns, weight_bytes per element."""
    maxu = _maxu(n_rows, config, programs)
    m = maxu * config.rows
    cap = config.chunk * (2 if fp8 else 1)
    chunk = _pow2_chunk(k, max(16, min(cap, config.tile // (m * weight_bytes))))
    split = 1
    if m < 16 * config.num_warps:
        split = next_power_of_2(config.split or config.num_warps)
    while split > 1 and chunk // split < 16:
        split //= 2
    return PhasePlan(maxu, chunk, split)


def _phase_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(N, K) of each weight phase: A (QKV), C (out), D (gate/up), E (down)."""
    s = shape
    qd, nqkv = s.num_heads * s.head_dim, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    f = s.intermediate
    return {"A": (nqkv, s.hidden), "C": (s.hidden, qd), "D": (2 * f, s.hidden), "E": (s.hidden, f)}


def rows_unsupported_reason(
    shape: ModelShape, dtype: torch.dtype, config: RowsConfig = DEFAULT_ROWS_CONFIG
) -> str | None:
    """Why the rows megakernel cannot serve this model, or None.

    It needs power-of-two head dims of at least `config.rows` (a QKV unit is rows / 2 of a head's first
    half and their partners), hidden and intermediate sizes divisible by the unit rows, and every
    product's K divisible by a power of two of at least 16 (its chunk, tl.dot's K).
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    d, r = shape.head_dim, config.rows
    if r < 16 or r & (r - 1):
        return f"unit rows {r} (needs a power of two ≥ 16)"
    if config.stages < 1 or config.kv_stages < 1 or config.tile < 1 or config.split < 0 or config.attn_splits < 0:
        return f"config {config}: stages, kv_stages and tile ≥ 1, split and attn_splits ≥ 0 needed"
    if d < r or d & (d - 1) or shape.num_heads % max(1, shape.num_kv_heads):
        return f"head_dim {d} (needs a power of two ≥ {r}) or query heads not a multiple of KV heads"
    if shape.hidden % r or shape.intermediate % (r // 2):
        return f"hidden {shape.hidden} or intermediate {shape.intermediate} not divisible by the unit rows"
    for k in (shape.hidden, shape.num_heads * d, shape.intermediate):
        if _pow2_chunk(k, max(16, config.chunk)) < 16:
            return f"a product's K = {k} has no power-of-two chunk of at least 16 columns"
    if shape.hidden > 8192:
        return "hidden size too large for the final norm's one vector"
    return None


def _splits_run(programs: int, num_kv_heads: int) -> int:
    """SM, the partials' slots per (row, KV head): the most splits any launch of ≥ 1 row uses, ≥ 4."""
    return max(4, next_power_of_2(min(MAX_SPLITS, max(1, programs // num_kv_heads))))


def num_splits_for(programs: int, num_rows: int, num_kv_heads: int, at_least: int = 0) -> int:
    """Context splits per (row, KV head): as many as fill the programs, and at least `at_least`
    (RowsConfig.attn_splits); at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, max(at_least, programs // (num_rows * num_kv_heads))))


class RowsWorkspace:
    """The buffers of the rows megakernel for one shape, allocated once (graphs point at them):
    r [BP, H] the residual stream, ss [BP, NUP] float32 per-unit sums of squares, q and attn [BP, HQ·D],
    act [BP, F], scratch [P, max M, BP] float32 (each program's products), the attention partials (per row,
    the batch-1 kernel's split-minor layout), tickets [BP, HK], barrier [2], trace (a traced launch's timer
    readings, grown on first use). The kernel leaves tickets
    and barrier at zero. `num_splits` fixes the context splits per (row, KV head) of every launch (tests;
    None: as many as fill the programs)."""

    def __init__(
        self,
        shape: ModelShape,
        dtype: torch.dtype,
        device: torch.device,
        programs: int,
        config: RowsConfig,
        num_splits: int | None = None,
    ):
        s, bp = shape, MAX_ROWS
        self.programs = programs
        self.config = config
        self.num_splits = num_splits  # None: `num_splits_for` the launch's rows
        most = max(num_splits or 1, min(MAX_SPLITS, config.attn_splits))
        self.splits_run = max(_splits_run(programs, s.num_kv_heads), next_power_of_2(most))
        z = lambda n, dt=dtype: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        qd = s.num_heads * s.head_dim
        self.nup = next_power_of_2(s.hidden // config.rows)
        self.r, self.attn, self.act = z(bp * s.hidden), z(bp * qd), z(bp * s.intermediate)
        self.q = z(bp * (s.num_heads + s.num_kv_heads) * s.head_dim)  # with qk_norm: q and k heads
        self.ss = z(bp * self.nup, torch.float32)
        most_rows = max(_maxu(n, config, programs) for n, _ in _phase_shapes(s).values()) * config.rows
        self.scratch = z(programs * most_rows * bp, torch.float32)
        self.partials = z(bp * qd * (s.head_dim + 2) // s.head_dim * self.splits_run, torch.float32)
        self.tickets = z(bp * s.num_kv_heads, torch.int32)
        self.barrier = z(2, torch.int32)
        self.trace = torch.zeros(1, dtype=torch.int64, device=device)


def _constexprs(
    shape: ModelShape,
    ws: RowsWorkspace,
    block_size: int,
    weights: StackedWeights,
    device,
    fp8_kv,
    trace=False,
    kv_aligned=False,
):
    """The kernel's compile-time arguments and launch options (`trace`: TRACE, on CUDA only; `kv_aligned`:
    the caches' layer stride and V offset are multiples of 16 elements)."""
    s, cfg, p = shape, ws.config, ws.programs
    group = s.num_heads // s.num_kv_heads
    wbytes = 1 if weights.fp8 else weights.dtype.itemsize
    plans = {ph: phase_plan(n, k, cfg, p, wbytes, weights.fp8) for ph, (n, k) in _phase_shapes(s).items()}
    per_phase = {}
    for ph, plan in plans.items():
        per_phase |= {f"R{ph}": cfg.rows, f"KC{ph}": plan.chunk, f"MAXU_{ph}": plan.maxu, f"S{ph}": plan.split}
    return dict(
        H=s.hidden,
        F=s.intermediate,
        HQ=s.num_heads,
        HK=s.num_kv_heads,
        D=s.head_dim,
        BS=block_size,
        BP=MAX_ROWS,
        **per_phase,
        NUP=ws.nup,
        KEYS=ATTN_KEYS,
        SM=ws.splits_run,
        BG=max(16, next_power_of_2(group)),
        GP=next_power_of_2(group),
        PIPE=cfg.stages,
        KV_STAGES=cfg.kv_stages,
        KV_ALIGN=bool(cfg.kv_align) and kv_aligned,
        TRACE=trace and device.type == "cuda",
        ASM=device.type == "cuda",
        UPCAST=upcast_dot(device),
        IEEE=weights.dtype == torch.float32,
        HAS_BIAS=s.qkv_bias,
        QK_NORM=s.qk_norm,
        WINDOW=s.window_mode,
        FP8W=weights.fp8,
        FP8KV=fp8_kv,
        num_warps=cfg.num_warps,
        num_stages=1,
    )


def rows_megakernel_fwd(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    weights: StackedWeights,
    cos_sin: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    shape: ModelShape,
    eps: float,
    scale: float,
    workspace: RowsWorkspace,
    trace: bool = False,
) -> torch.Tensor:
    """One decode token of each of T ≤ MAX_ROWS sequences through every layer.

    Args:
        input_ids, positions, slot_mapping: [T] int; row i's new K/V go to cache slot slot_mapping[i]
            (−1: nowhere, a graph's padding row).
        seq_lens: [T] int32, each row's context including its new token (0: a padding row).
        block_tables: [T, ≥ cdiv(max seq_len, block_size)] int32, last dim contiguous.
        kv_caches: per layer (k, v), views of one buffer as the batch-1 megakernel reads them.
        trace: (CUDA) record the global timer in workspace.trace (decode_megakernel/grid_sync.py describes
            the layout; phase B's inner points are not recorded).

    Returns:
        The final-normed hidden states [T, H].
    """
    t = input_ids.shape[0]
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"the rows megakernel serves 1 to {MAX_ROWS} rows, got {t}")
    for name, x in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        check_int(name, x)
    if block_tables.dim() != 2 or block_tables.shape[0] < t or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be [{t}, blocks] with a contiguous last dim, got {tuple(block_tables.shape)}"
        )
    ws = workspace
    device = input_ids.device
    if device.type == "cuda" and ws.programs > num_sms(device):
        raise ValueError(f"{ws.programs} programs: more than one per multiprocessor may not all be resident")
    if ws.config.stages < 1 or ws.config.kv_stages < 1 or ws.config.tile < 1 or ws.config.split < 0:
        raise ValueError(f"rows megakernel config {ws.config}: stages, kv_stages and tile ≥ 1, split ≥ 0 needed")
    if ws.config.attn_splits < 0:
        raise ValueError(f"rows megakernel config {ws.config}: attn_splits ≥ 0 needed")
    block_size, layer_stride, v_offset = kv_layout(kv_caches, shape)
    num_layers = weights.qkv.shape[0]
    if trace and num_layers > TRACE_MAX_LAYERS:
        raise ValueError(f"a traced launch records at most {TRACE_MAX_LAYERS} layers")
    if trace and ws.trace.numel() != TRACE_BASE + ws.programs * TRACE_BLOCK:
        ws.trace = torch.zeros(TRACE_BASE + ws.programs * TRACE_BLOCK, dtype=torch.int64, device=device)
    check_family(shape, weights, num_layers)
    fp8_kv = check_kv_dtype(kv_caches[0][0].dtype, weights, num_layers)
    w = weights
    out = torch.empty((t, shape.hidden), dtype=w.dtype, device=device)
    bias = w.qkv_bias if w.qkv_bias is not None else w.norm1
    qn, kn = (x if x is not None else w.norm1 for x in (w.q_norm, w.k_norm))
    sliding = w.sliding if w.sliding is not None else w.norm1
    scales = tuple(
        x if x is not None else w.norm1 for x in (w.qkv_scale, w.o_scale, w.gate_up_scale, w.down_scale, w.kv_scales)
    )
    k0 = kv_caches[0][0]
    kv_aligned = kv_alignable(layer_stride, v_offset)
    rows_megakernel_kernel[(ws.programs,)](
        *(input_ids, positions, slot_mapping, seq_lens, block_tables, block_tables.stride(0)),
        *(
            w.embed,
            w.qkv,
            w.o,
            w.gate_up,
            w.down,
            *scales,
            w.norm1,
            w.norm2,
            w.norm_final,
            bias,
            qn,
            kn,
            sliding,
            cos_sin,
        ),
        *(k0, layer_stride, v_offset, k0.stride(0), k0.stride(1)),
        *(ws.r, ws.ss, ws.q, ws.attn, ws.act, ws.scratch, ws.partials, ws.tickets, ws.barrier, out, ws.trace),
        *(
            t,
            num_layers,
            ws.num_splits or num_splits_for(ws.programs, t, shape.num_kv_heads, ws.config.attn_splits),
            eps,
            scale,
            shape.window or 0,
        ),
        **_constexprs(shape, ws, block_size, weights, device, fp8_kv, trace=trace, kv_aligned=kv_aligned),
    )
    return out
