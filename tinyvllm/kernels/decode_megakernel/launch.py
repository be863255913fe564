"""Host side of the decode megakernel: its configuration, the model shape it is specialised on, the
stacked weights and the workspace it reads and writes, and the launcher `decode_megakernel_fwd`.

FP8 weights (float8_e4m3fn stacked weights with float32 row scales) and an FP8 KV cache (with per-layer
scales) are recognised by their dtypes; kernel.py describes what the kernel does with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tinyvllm.kernels.decode_megakernel.attention_phase import kv_alignable
from tinyvllm.kernels.decode_megakernel.grid_sync import TRACE_BASE, TRACE_BLOCK, TRACE_MAX_LAYERS
from tinyvllm.kernels.decode_megakernel.kernel import decode_megakernel_kernel
from tinyvllm.kernels.launch import check_int, next_power_of_2, num_sms, upcast_dot

ATTN_KEYS = 64  # keys per attention tile (tl.dot's N), as in the decode attention kernel
MAX_SPLITS = 16  # context splits per KV head in the attention phase
PIPELINE_BYTES = 160 << 10  # shared memory the pipelined weight tiles may take (of an H200 SM's 227 KB)


class MegakernelConfig(NamedTuple):
    """Launch choices of the decode megakernel. `split_o=False` selects phase C's ticket merge instead of
    the split by KV group; both are bitwise reproducible from launch to launch (the split's sums are exact
    fixed point, residual_phases.py), though the two differ from each other in the last bits. The other
    fields are sizes."""

    tile: int = 16384  # weight elements per unit at 2 bytes (a power of two; `unit_tile` doubles it for FP8
    # weights, so a unit keeps its bytes, and may halve it)
    num_warps: int = 8
    stages: int = 3  # phase D's software pipeline: this many shared-memory stages (1: none)
    ace_stages: int = 3  # the same for phases A and C
    e_stages: int = 4  # the same for phase E: its deeper prologue lands during phase D's tail
    split_o: bool = True  # phase C split along K by KV group, merging attention's partials itself
    programs: int = 0  # CUDA: at most this many programs (0: one on every multiprocessor)
    kv_align: bool = True  # tell the compiler the caches' layer stride and V offset are multiples of 16
    # elements (where they are; the launcher checks, else the hint is off), so phase B's K/V tiles load as
    # 16-byte vectors; off: unhinted 2-byte loads, which at head dim 128 also spill registers


DEFAULT_CONFIG = MegakernelConfig()


@dataclass(frozen=True)
class ModelShape:
    """The dimensions and the family options the kernel is specialised on: q/k/v biases (Qwen2), per-head
    q/k RMSNorm (Qwen3), and a sliding window of `window` keys on some layers (StackedWeights.sliding) or,
    with `all_windowed`, on every layer (Mistral)."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False
    window: int | None = None
    all_windowed: bool = False

    @property
    def window_mode(self) -> int:
        """The kernel's WINDOW: 0 no window, 1 on the layers StackedWeights.sliding marks, 2 every layer."""
        if self.window is None:
            return 0
        return 2 if self.all_windowed else 1


def unsupported_reason(shape: ModelShape, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve this model, or None.

    It needs power-of-two head dims ≥ 4 (a group of query heads per KV head that is not a power of two is
    padded to one, masked), and activation
    vectors small enough for one program's registers (hidden ≤ 8192, intermediate ≤ 32768). The KV block
    size, a power of two, is checked at launch.
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    d = shape.head_dim
    if d < 4 or d & (d - 1) or shape.num_heads % max(1, shape.num_kv_heads):
        return f"head_dim {d} (needs a power of two) or query heads not a multiple of KV heads"
    if shape.hidden > 8192 or shape.intermediate > 32768 or shape.num_heads * d > 8192:
        return "hidden or intermediate size too large for one program's registers"
    return None


@dataclass(frozen=True)
class StackedWeights:
    """Every layer's weights of one kind in one tensor, [L, ...] (the layers' parameters are views)."""

    embed: torch.Tensor  # [V, H]
    qkv: torch.Tensor  # [L, (Hq + 2·Hk)·D, H], rows [q | k | v]
    o: torch.Tensor  # [L, H, Hq·D]
    gate_up: torch.Tensor  # [L, 2F, H], rows [gate | up]
    down: torch.Tensor  # [L, H, F]
    norm1: torch.Tensor  # [L, H]
    norm2: torch.Tensor  # [L, H]
    norm_final: torch.Tensor  # [H]
    qkv_bias: torch.Tensor | None = None  # [L, (Hq + 2·Hk)·D] (ModelShape.qkv_bias)
    q_norm: torch.Tensor | None = None  # [L, D] (ModelShape.qk_norm)
    k_norm: torch.Tensor | None = None  # [L, D]
    sliding: torch.Tensor | None = None  # [L] int32, 1 where the layer has the window (ModelShape.window)
    # FP8 weights (qkv, o, gate_up and down float8_e4m3fn): W[l, n, :] = q[l, n, :] · scale[l, n]
    qkv_scale: torch.Tensor | None = None  # [L, (Hq + 2·Hk)·D] float32
    o_scale: torch.Tensor | None = None  # [L, H]
    gate_up_scale: torch.Tensor | None = None  # [L, 2F]
    down_scale: torch.Tensor | None = None  # [L, H]
    kv_scales: torch.Tensor | None = None  # [L, 2] float32: (k_scale, v_scale) of an FP8 cache, per layer

    @property
    def fp8(self) -> bool:
        """Whether the layer weights are FP8 (with their row scales)."""
        return self.qkv.dtype == torch.float8_e4m3fn

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype: the activations', the workspace's and the output's."""
        return self.embed.dtype


class Workspace:
    """The buffers of one launch configuration, allocated once (captured CUDA graphs point at them).

    r [H]: the residual stream (the embedding row before layer 0). r2 [H]: with `split_o`, the residual
    after attention, which phase D stores for phase E. o_sums [2, H] int64: with `split_o`, phase C's
    fixed-point sums (residual_phases.O_SCALE) of W_o·attention for two consecutive layers (each zeroed in
    the phase E after its last reader).
    q [(Hq + Hk)·D]: phase A's rotated queries (with qk_norm: its unrotated q and k heads). attn [Hq·D]:
    the ticket merge's attention output. act [F]: phase D's
    SwiGLU output. partials: phase B's per-split (acc, m, l) in the split-minor layout. tickets [Hk]:
    the ticket merge's arrival counts. barrier [2]: the grid barrier's arrival count and the leave count.
    trace: a traced launch's timer readings (grown on first use). The kernel leaves o_sums, tickets and
    barrier at zero, as the next launch needs them.

    The context of each KV head is cut into at most `num_splits` splits (default: as many as fill the
    programs).
    """

    def __init__(
        self, shape: ModelShape, dtype: torch.dtype, device: torch.device, programs: int, num_splits: int | None = None
    ) -> None:
        s = shape
        self.programs = programs
        self.num_splits = num_splits or max(1, min(MAX_SPLITS, programs // s.num_kv_heads))
        group = s.num_heads // s.num_kv_heads
        z = lambda n, dt=dtype: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        self.r, self.q, self.attn, self.act = (
            z(s.hidden),
            z((s.num_heads + s.num_kv_heads) * s.head_dim),
            z(s.num_heads * s.head_dim),
            z(s.intermediate),
        )
        self.r2, self.o_sums = z(s.hidden), z(2 * s.hidden, torch.int64)
        # split-minor partials: runs of at least 4 slots, a power of two
        self.partials = z(
            s.num_kv_heads * max(4, next_power_of_2(self.num_splits)) * group * (s.head_dim + 2), torch.float32
        )
        self.tickets = z(s.num_kv_heads, torch.int32)
        self.barrier = z(2, torch.int32)
        self.trace = torch.zeros(1, dtype=torch.int64, device=device)


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def unit_rows(shape: ModelShape, tile: int) -> tuple[int, int, int, int]:
    """(RQ, RO, RG, RD): rows per unit of phases A (per half-head), C (unsplit), D (gate rows) and E, each
    the largest power of two that divides its matrix's rows and gives about `tile` weight elements."""
    bh = next_power_of_2(shape.hidden)

    def dividing(r: int, n: int) -> int:  # the largest power of two ≤ r that divides n
        r = max(1, _pow2_at_most(max(1, r)))
        while n % r:
            r //= 2
        return r

    rq = dividing(min(shape.head_dim // 2, tile // (2 * bh)), shape.head_dim // 2)
    ro = dividing(tile // next_power_of_2(shape.num_heads * shape.head_dim), shape.hidden)
    rg = dividing(tile // (2 * bh), shape.intermediate)
    rd = dividing(tile // next_power_of_2(shape.intermediate), shape.hidden)
    return rq, ro, rg, rd


def split_o_rows(shape: ModelShape, tile: int) -> int:
    """Rows per unit of the split phase C (units [rows, G·D]): the largest power of two that divides the
    hidden size and gives at most about `tile` weight elements per unit (at least one row)."""
    group_cols = shape.num_heads // shape.num_kv_heads * shape.head_dim
    r = _pow2_at_most(max(1, tile // group_cols))
    while shape.hidden % r:
        r //= 2
    return r


def phase_d_chunks(shape: ModelShape, rg: int, elem_bytes: int) -> tuple[int, bool]:
    """(CW, usable) of phase D on the tensor cores: a weight row is cut into chunks of CW columns (one
    warp's 16-byte vectors, at most the padded hidden size), at most 32 of them, and the unit's tile
    [2·RG·chunks, CW] must meet tl.dot's minimum of 16 in every dimension. Never for 1-byte FP8 weights:
    their conversion before the product (to the input's dtype, or to float16) makes the tensor-core
    layout slower than the reduction on the H200 (docs/perf.md §9)."""
    bh = next_power_of_2(shape.hidden)
    cw = min(bh, 32 * 16 // elem_bytes)
    return cw, elem_bytes > 1 and bh // cw <= 32 and 2 * rg * (bh // cw) >= 16 and cw >= 16


def unit_tile(config: MegakernelConfig, elem_bytes: int) -> int:
    """Weight elements per unit: config.tile (twice that for 1-byte FP8 weights: the same bytes per unit,
    so a phase has half the units), halved until the deepest pipeline's stages − 1 tiles in flight fit
    in PIPELINE_BYTES (float32 weights take half the elements of bf16)."""
    tile, stages = config.tile * (2 if elem_bytes == 1 else 1), max(config.stages, config.ace_stages, config.e_stages)
    while stages > 1 and tile > 256 and tile * elem_bytes * (stages - 1) > PIPELINE_BYTES:
        tile //= 2
    return tile


def max_programs(device: torch.device, config: MegakernelConfig = DEFAULT_CONFIG) -> int:
    """The grid: one program per multiprocessor on CUDA (at most `config.programs` where that is set),
    so that every program is resident at once; one program on the CPU interpreter, which runs programs
    one after another."""
    if device.type != "cuda":
        return 1
    full = num_sms(device)
    return min(full, config.programs) if config.programs > 0 else full


def kv_layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], shape: ModelShape) -> tuple[int, int, int]:
    """(block_size, layer_stride, v_offset) of the layers' caches, which must be views of one buffer:
    layer l's K at layer 0's K + l·layer_stride elements, its V at its K + v_offset."""
    k0, v0 = kv_caches[0]
    _, hk, block_size, d = k0.shape
    if (hk, d) != (shape.num_kv_heads, shape.head_dim) or k0.stride(-1) != 1 or k0.stride(-2) != d:
        raise ValueError(f"KV cache {tuple(k0.shape)} does not fit the model shape {shape}")
    elem = k0.element_size()
    layer_stride = (kv_caches[1][0].data_ptr() - k0.data_ptr()) // elem if len(kv_caches) > 1 else 0
    v_offset = (v0.data_ptr() - k0.data_ptr()) // elem
    for i, (k, v) in enumerate(kv_caches):
        if k.data_ptr() != k0.data_ptr() + i * layer_stride * elem or v.data_ptr() != k.data_ptr() + v_offset * elem:
            raise ValueError("the layers' KV caches must be views of one buffer at a fixed stride")
    if block_size & (block_size - 1):
        raise ValueError(f"the decode megakernel needs a power-of-two KV block size, got {block_size}")
    return block_size, layer_stride, v_offset


def check_family(shape: ModelShape, weights: StackedWeights, num_layers: int) -> None:
    """Raise ValueError unless the stacked family tensors are there exactly where `shape` asks for them."""
    q = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    wants = {
        "qkv_bias": ((num_layers, q), shape.qkv_bias),
        "q_norm": ((num_layers, shape.head_dim), shape.qk_norm),
        "k_norm": ((num_layers, shape.head_dim), shape.qk_norm),
        "sliding": ((num_layers,), shape.window_mode == 1),
    }
    for name, (dims, needed) in wants.items():
        t = getattr(weights, name)
        if needed and (t is None or tuple(t.shape) != dims or not t.is_contiguous()):
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"megakernel: {name} must be a contiguous {list(dims)} tensor for {shape}, got {got}")
    if shape.window is not None and shape.window < 1:
        raise ValueError(f"megakernel: window must be a positive number of keys, got {shape.window}")
    if shape.window_mode == 1 and weights.sliding.dtype != torch.int32:
        raise ValueError(f"megakernel: sliding must be int32, got {weights.sliding.dtype}")
    _check_fp8(weights, num_layers)


def _check_fp8(weights: StackedWeights, num_layers: int) -> None:
    """Raise ValueError unless the four stacked weights are all FP8 with contiguous float32 row scales
    [L, N], or all in the model's dtype."""
    w = weights
    mats = {"qkv": w.qkv, "o": w.o, "gate_up": w.gate_up, "down": w.down}
    dtypes = {t.dtype for t in mats.values()}
    if dtypes != {w.dtype} and dtypes != {torch.float8_e4m3fn}:
        got = {k: str(t.dtype) for k, t in mats.items()}
        raise ValueError(f"megakernel: the layer weights must all be {w.dtype} or all float8_e4m3fn, got {got}")
    if not w.fp8:
        return
    for name, t in mats.items():
        s = getattr(w, f"{name}_scale")
        dims = (num_layers, t.shape[1])
        if s is None or tuple(s.shape) != dims or s.dtype != torch.float32 or not s.is_contiguous():
            got = None if s is None else (tuple(s.shape), s.dtype)
            raise ValueError(f"megakernel: {name}_scale must be a contiguous float32 {list(dims)} tensor, got {got}")


def check_kv_dtype(kv_dtype: torch.dtype, weights: StackedWeights, num_layers: int) -> bool:
    """Whether the cache is FP8 (then weights.kv_scales must be float32 [L, 2]); ValueError for a cache
    in neither the model's dtype nor float8_e4m3fn."""
    if kv_dtype == weights.dtype:
        return False
    if kv_dtype != torch.float8_e4m3fn:
        raise ValueError(f"megakernel: KV cache dtype {kv_dtype}: the model's {weights.dtype} or float8_e4m3fn")
    s = weights.kv_scales
    if s is None or tuple(s.shape) != (num_layers, 2) or s.dtype != torch.float32 or not s.is_contiguous():
        got = None if s is None else (tuple(s.shape), s.dtype)
        raise ValueError(f"megakernel: an FP8 KV cache needs kv_scales, contiguous float32 [{num_layers}, 2]: {got}")
    return True


def _constexprs(
    shape: ModelShape,
    config: MegakernelConfig,
    ws: Workspace,
    block_size: int,
    weights: StackedWeights,
    device: torch.device,
    trace: bool,
    fp8_kv: bool,
    kv_aligned: bool = False,
) -> dict:
    """The kernel's compile-time arguments and launch options for this shape, config and workspace
    (`kv_aligned`: the caches' layer stride and V offset are multiples of 16 elements)."""
    elem = weights.qkv.element_size()  # 1 for FP8 weights
    rq, ro, rg, rd = unit_rows(shape, unit_tile(config, elem))
    cw, dot_d = phase_d_chunks(shape, rg, elem)
    cuda = device.type == "cuda"
    return dict(
        H=shape.hidden,
        F=shape.intermediate,
        HQ=shape.num_heads,
        HK=shape.num_kv_heads,
        D=shape.head_dim,
        BS=block_size,
        RQ=rq,
        RO=split_o_rows(shape, unit_tile(config, elem)) if config.split_o else ro,
        RG=rg,
        RD=rd,
        KEYS=ATTN_KEYS,
        SM=max(4, next_power_of_2(ws.num_splits)),
        BG=max(16, next_power_of_2(shape.num_heads // shape.num_kv_heads)),
        GP=next_power_of_2(shape.num_heads // shape.num_kv_heads),
        UPCAST=upcast_dot(device),
        IEEE=weights.dtype == torch.float32,
        TRACE=trace and cuda,
        MAXU_C=next_power_of_2(-(-(shape.hidden // ro) // ws.programs)),
        MAXU_E=next_power_of_2(-(-(shape.hidden // rd) // ws.programs)),
        STAGES=config.stages,
        PIPE=config.ace_stages,
        ASM=cuda,
        DOT_D=dot_d,
        CW=cw,
        SPLIT_O=config.split_o,
        E_PIPE=config.e_stages,
        HAS_BIAS=shape.qkv_bias,
        QK_NORM=shape.qk_norm,
        WINDOW=shape.window_mode,
        FP8W=weights.fp8,
        FP8KV=fp8_kv,
        KV_ALIGN=bool(config.kv_align) and kv_aligned,
        num_warps=config.num_warps,
        num_stages=1,
    )


def decode_megakernel_fwd(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    weights: StackedWeights,
    cos_sin: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    shape: ModelShape,
    eps: float,
    scale: float,
    workspace: Workspace,
    config: MegakernelConfig = DEFAULT_CONFIG,
    trace: bool = False,
) -> torch.Tensor:
    """One decode token of one sequence through every layer.

    Args:
        input_ids, positions, slot_mapping: [1] int64; the new token's K/V go to cache slot
            slot_mapping[0] (−1: nowhere).
        seq_lens: [1] int32, the context including the new token.
        block_table: [≥ cdiv(seq_len, block_size)] int32, the sequence's cache blocks.
        kv_caches: per layer (k, v), each [num_blocks, Hk, block_size, D], views of one buffer at a fixed
            layer stride (as the model runner allocates them); in the model's dtype, or float8_e4m3fn
            with weights.kv_scales.
        trace: (CUDA) record the global timer in workspace.trace (grid_sync.py describes the layout).

    Returns:
        The final-normed hidden state [1, H].
    """
    block_size, layer_stride, v_offset = kv_layout(kv_caches, shape)
    for name, t in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        check_int(name, t)
    if config.stages < 1 or config.ace_stages < 1 or config.e_stages < 1:
        raise ValueError(f"megakernel config {config}: stages ≥ 1 needed")
    ws = workspace
    device = input_ids.device
    if device.type == "cuda" and ws.programs > num_sms(device):
        raise ValueError(f"{ws.programs} programs: more than one per multiprocessor may not all be resident")
    num_layers = weights.qkv.shape[0]
    if trace and num_layers > TRACE_MAX_LAYERS:
        raise ValueError(f"a traced launch records at most {TRACE_MAX_LAYERS} layers")
    if trace and ws.trace.numel() != TRACE_BASE + ws.programs * TRACE_BLOCK:
        ws.trace = torch.zeros(TRACE_BASE + ws.programs * TRACE_BLOCK, dtype=torch.int64, device=device)
    check_family(shape, weights, num_layers)
    fp8_kv = check_kv_dtype(kv_caches[0][0].dtype, weights, num_layers)
    w = weights
    out = torch.empty((1, shape.hidden), dtype=w.dtype, device=device)
    family = tuple(t if t is not None else w.norm1 for t in (w.qkv_bias, w.q_norm, w.k_norm, w.sliding))
    scales = tuple(
        t if t is not None else w.norm1 for t in (w.qkv_scale, w.o_scale, w.gate_up_scale, w.down_scale, w.kv_scales)
    )
    kv_aligned = kv_alignable(layer_stride, v_offset)
    decode_megakernel_kernel[(ws.programs,)](
        *(input_ids, positions, slot_mapping, seq_lens, block_table),
        *(w.embed, w.qkv, w.o, w.gate_up, w.down, *scales, w.norm1, w.norm2, w.norm_final, *family, cos_sin),
        *(kv_caches[0][0], layer_stride, v_offset, kv_caches[0][0].stride(0), kv_caches[0][0].stride(1)),
        *(ws.r, ws.r2, ws.o_sums, ws.q, ws.attn, ws.act, ws.partials, ws.tickets, ws.barrier, out, ws.trace),
        *(num_layers, ws.num_splits, eps, scale, shape.window or 0),
        **_constexprs(shape, config, ws, block_size, weights, device, trace, fp8_kv, kv_aligned),
    )
    return out
