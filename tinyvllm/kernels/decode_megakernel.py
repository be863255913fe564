"""A whole batch-1 decode token through every decoder layer in one launch (a persistent "megakernel").

Per layer l, with r the residual stream (the embedding row before layer 0), the same maths and
roundings as the fused small-batch path of models/llama.py:
    A  h = RMSNorm(r; w1[l]);  qkv = round(Wqkv[l] h);  q, k ← RoPE(q, k, pos);  cache[l][slot] ← k, v
    B  o = softmax(scale · q Kᵀ) V over the sequence's cached keys (split-KV, merged by logsumexp)
    C  r = round(round(Wo[l] o) + r)   (with `split_o`, the default: Wo[l] o summed in float32 by KV group,
                                        the residual add done by phase D)
    D  h = RMSNorm(r; w2[l]);  g, u = round(Wg[l] h), round(Wu[l] h);  a = round(silu(g) ⊙ u)
    E  r = round(round(Wd[l] a) + r)
and finally out = RMSNorm(r; w_final). The LM head and sampling stay kernels of their own.

Why one launch: a batch-1 token reads every weight once (2.47 GB for Llama 3.2 1B, 0.58 ms at the
H200's 4.25 TB/s), but as ~150 separate kernels each product pays ~2–3 µs of launch, ramp and tail
beyond its bytes and every small op (norm, RoPE, attention merge) pays a launch of its own: the
one-kernel-per-op step measured 1.15 ms (docs/perf.md). Here one program per multiprocessor runs all
phases, separated by grid-wide barriers: no launches, no host gaps, and the small ops (norms, RoPE, the
K/V write, the attention merge, SwiGLU, residual adds) folded into the phases around them. Measured on
the H200 (docs/perf.md, v5–v14): 1.34× the layer-by-layer path in CUDA-graph replays (0.67 ms of layers
at 640 keys), short of the bandwidth floor because each of the 80 phases pays ~1.5–3 µs of ramp, tail
and barrier beyond its bytes and attention costs ~4 µs per layer. Asking L2 to prefetch tiles ahead was
no faster; phase D on the tensor cores (v10), the split-minor merge (v12) and phase C split by KV group
(v14) are.

Layout of the work. A phase is a list of "units" of about TILE weight elements each, dealt to the
programs round-robin (unit u goes to program u mod P). Each weight phase (A, C, D, E) is a loop
software-pipelined by Triton (`stages` − 1 tiles in flight through shared memory, cp.async), and it
starts with the wait of the barrier before it: inside the loop's first iteration, so that the
pipeline's prologue, the program's first tiles, is issued before the wait and streams while the last
programs finish the previous phase (with `prefetch`; the activation vector, which does depend on the
barrier, is loaded after it, once per program). Triton pipelines no loop that holds a nested loop or a
CTA barrier, so the wait is one asm statement (`_wait_asm`). The earlier scheme, a unit's tile loaded
whole into registers and double-buffered (the first one between arrival and wait), was 13 % slower
(docs/perf.md, v7; `benchmarks/kernels/bench_stream.py` isolates the streaming schemes). A deeper
pipeline helps a phase only through its prologue, which lands during the previous phase's tail and costs
that phase about as much (v11, v19); more bytes in flight after the wait (an L2 prefetch ahead, or empty
leading units) gained nothing (v19). Phase E's 4 stages are the one depth that gained (+0.4 %).
  A: a unit is RQ rows of a head's first half and their RoPE partners in its second half, so RoPE
     is applied in registers; q goes to a scratch vector, k and v straight into the paged cache.
  B: a unit is (KV head, split of the context) through the FlashAttention-2 inner loop of the other
     attention kernels (flash_tiles.py: tl.dot over 64-key tiles, log2-domain scores), the GQA group's
     query heads padded to 16 rows; each writes (m, l, acc) of its keys, split index fastest
     (`_store_partial`). With `split_o` (the default) that is all: phase C's programs merge them. Else
     the last split to arrive at a per-head ticket merges them, each thread reducing its own runs of
     splits (`_merge_partials`; the split-K semaphore of gemv.py), and writes the group's output.
     A program's first unit takes its first key tile preloaded between phase A's arrival and wait
     (every key but the newest, which phase A is writing; that row is read from L2 afterwards; the
     tile's block-table entries are read once per launch). A head's context is cut into at most
     `num_splits` splits of whole 64-key tiles, none empty.
  C: with `split_o` (the default), RO output rows × one KV group's G·D columns (`_o_group_phase`): each
     program merges its group's partials after the barrier (no ticket, merge and store before it: −1.3 µs
     per layer, docs/perf.md v14) and adds its products to float32 sums by atomics, so the order of the
     eight groups' sums varies from launch to launch (last bits; the layer-by-layer path,
     `--no-decode-megakernel`, is bitwise reproducible). Phase D adds them to the residual; the last
     program stores that residual for phase E and, after E's barrier, zeroes the sums for the layer after
     next.
     Without `split_o`: RO full output rows with the residual add, as E.
  E: RD output rows with the residual add.  D: RG gate rows and the matching up rows; with
     `dot_d` (the default) on the tensor cores: reducing every tile across the program's threads took
     ~1.4 µs of the phase's 18.7 (docs/perf.md, v10), so the unit is laid out as [rows × chunks, CW]
     and multiplied by the normed input cut into the same chunks, [chunks, CW], in one tl.dot; each
     row's product is the sum of its chunks' diagonal entries (`_gate_up_dot_unit`).

Barriers: five per layer, none before layer 0 (each program normalises the embedding row itself) and
none after the last layer (the last program to leave, ordered after every program's phase-E stores by
the leave count's acquire, applies the final norm): 5L − 1 a launch, ~2 µs fewer per step (docs/perf.md,
v20). A monotone arrival counter; the b-th barrier waits until it reads b·P (a CTA barrier
first orders the CTA's stores before thread 0's gpu-scope release; thread 0's acquire and a second CTA
barrier order the loads after). Arrival and wait are separate calls: a release waits for the loads
issued before it, so the next phase's prefetch goes after the arrival. Data written inside the launch
is read with `.cg` loads (L2; an SM's L1 is not coherent with other SMs' stores), never by a pipeline
(its copies may allocate in L1), except the KV cache in phase B: no SM reads a layer's cache lines
before that layer's phase B, and L1 holds nothing from earlier launches. The attention tickets only
grow within a launch (layer l's last split sees (l + 1)·splits − 1). At exit the last program to leave
also resets the counters and tickets for the next launch: no memset, no host sync, capturable in a CUDA
graph.

Every program must be resident at once (a waiting program spins): the grid is one program per
multiprocessor (`max_programs`; one always fits; `programs_per_sm` > 1 caps registers with maxnreg and
checks the compiled kernel's occupancy before the first launch), and nothing else runs on the device
concurrently (the engine uses one stream). On the CPU interpreter programs run one after another, so
the grid is one program there; that one program then does every unit itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.flash_tiles import attn_inner, dot_pv, dot_qk
from tinyvllm.kernels.launch import check_int, next_power_of_2, num_sms, upcast_dot


class MegakernelConfig(NamedTuple):
    tile: int = 16384  # weight elements per unit (a power of two)
    num_warps: int = 8
    programs_per_sm: int = 1  # CUDA: above 1, registers are capped (maxnreg) so that this many fit on an SM
    stages: int = 3  # phase D's software pipeline: this many shared-memory stages (1: none)
    prefetch: bool = True  # weight phases: the pipeline's first tiles issued before the barrier's wait
    preload_kv: bool = True  # phase B: the first key tile's old keys loaded between A's arrival and wait
    ace_stages: int = 3  # the same for phases A and C
    e_stages: int = 4  # the same for phase E (v19: 4 stages, its deeper prologue landing during D's tail, +0.4 %)
    dot_d: bool = True  # phase D's products on the tensor cores (`_gate_up_dot_unit`, where the shape allows)
    split_o: bool = True  # phase C split along K by KV group, merging attention's partials itself (`_o_group_phase`)
    programs: int = 0  # CUDA: at most this many programs (0: `programs_per_sm` on every multiprocessor)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the kernel is specialised on."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def unsupported_reason(shape: ModelShape, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve this model, or None. It needs power-of-two head dims ≥ 4, a group
    of query heads per KV head that is a power of two, and activation vectors small enough for
    registers (hidden ≤ 8192, intermediate ≤ 32768). (The KV block size, a power of two, is checked
    at launch.)"""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    d, g = shape.head_dim, shape.num_heads // max(1, shape.num_kv_heads)
    if d < 4 or d & (d - 1) or shape.num_heads % shape.num_kv_heads or g & (g - 1):
        return f"head_dim {d} / query heads per KV head {g} (need powers of two)"
    if shape.hidden > 8192 or shape.intermediate > 32768 or shape.num_heads * d > 8192:
        return "hidden or intermediate size too large for one program's registers"
    return None


# ---------------------------------------------------------------------------------------------- barrier, timer
TRACE_BASE = 4096  # a traced launch: each program's own timer readings from here on, TRACE_BLOCK apiece:
TRACE_BLOCK = 1024  # [0] start; [b] barrier b's wait left; [400 + b] arrival at b (5L: exit); [800 + 3·layer + k]
TRACE_MAX_LAYERS = (TRACE_BLOCK - 800) // 3  # phase B: its unit computed, its ticket taken, its merge done
_TRACE_BASE = tl.constexpr(TRACE_BASE)
_TRACE_BLOCK = tl.constexpr(TRACE_BLOCK)


@triton.jit
def _arrive(count_ptr, trace_ptr, pid, b, TRACE: tl.constexpr):
    """This program's arrival at grid barrier b (a CTA barrier, then thread 0's gpu-scope release: the
    CTA's earlier stores are visible to whoever acquires the count). Loads issued before it delay it
    (the release waits for them), so prefetches go between `_arrive` and `_wait`."""
    if TRACE:
        tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + 400 + b, _now(pid))
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(count_ptr, target):
    """Wait until `target` programs have arrived in total (the b-th barrier of a launch: b · P)."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _wait_asm(count_ptr, target):
    """`_wait` as one asm statement, thread 0 spinning in a PTX loop on a gpu-scope acquire load, then a
    CTA barrier (`bar.sync 0`) inside the asm: Triton does not software-pipeline a loop that holds a
    nested loop or a `tl.debug_barrier`, and a pipelined weight loop holds its barrier's wait (CUDA only)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.ne.u32 p, t, 0; @p bra $$done_${:uid}; "
        "$$spin_${:uid}: ld.acquire.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra $$spin_${:uid}; "
        "$$done_${:uid}: bar.sync 0; }",
        "=r,l,r",
        [count_ptr, target],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _now(x):
    """The GPU's global nanosecond timer (phase trace only; CUDA only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE: tl.constexpr, ASM: tl.constexpr):
    """The wait of the launch's b-th grid barrier (b · P arrivals), with `_wait_asm` if ASM (CUDA); when
    tracing, program 0 then writes the timer into trace[b]. b = 0 is the launch's start: no wait."""
    if b > 0:
        if ASM:
            _wait_asm(bar_ptr, b * P)
        else:
            _wait(bar_ptr, b * P)
        if TRACE:
            t = _now(pid)
            tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + b, t)
            if pid == 0:
                tl.store(trace_ptr + b, t)


@triton.jit
def _residual_at(r_ptr, o_ptr, offs, mask, SPLIT_O: tl.constexpr):
    """The residual stream at offs, read from L2: r, or with SPLIT_O (phase D, after a split phase C)
    round(round(o) + r), o being phase C's float32 sums of W_o·attention (`_o_group_phase`)."""
    x = tl.load(r_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    if SPLIT_O:
        o = tl.load(o_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(x.dtype)
        x = (x.to(tl.float32) + o.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _rstd(r_ptr, o_ptr, H, eps, BH: tl.constexpr, SPLIT_O: tl.constexpr):
    """1 / sqrt(mean(r²) + eps) of the residual vector r (`_residual_at`), as rms_norm.py computes it."""
    cols = tl.arange(0, BH)
    x = _residual_at(r_ptr, o_ptr, cols, cols < H, SPLIT_O).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)


@triton.jit
def _normed(r_ptr, o_ptr, w_ptr, H, eps, BH: tl.constexpr, SPLIT_O: tl.constexpr):
    """RMSNorm of the residual vector (`_residual_at`) in rms_norm.py's roundings, [BH] in r's dtype
    (zeros beyond H)."""
    cols = tl.arange(0, BH)
    mask = cols < H
    x = _residual_at(r_ptr, o_ptr, cols, mask, SPLIT_O)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


# ---------------------------------------------------------------------------------------------- units
# A unit's weight tile, a load that Triton's pipeliner turns into cp.async copies into shared memory.
# Only the padding columns are masked: every caller loops over valid units (u < n_units), and the rows
# per unit divide the matrix's rows (`unit_rows`).
@triton.jit
def _qkv_tile(
    w_ptr, layer, u, H: tl.constexpr, NQKV: tl.constexpr, D: tl.constexpr, RQ: tl.constexpr, BH: tl.constexpr
):
    """Unit u of phase A: rows head·D + j0 + [0, RQ) and their partners + D/2, as [RQ, 2, BH]."""
    UPH: tl.constexpr = D // 2 // RQ
    head = u // UPH
    j0 = (u % UPH) * RQ
    jj = tl.arange(0, RQ)[:, None, None]
    hh = tl.arange(0, 2)[None, :, None]
    cols = tl.arange(0, BH)[None, None, :]
    rows = head * D + j0 + hh * (D // 2) + jj
    base = w_ptr + tl.cast(layer, tl.int64) * (NQKV * H)
    return tl.load(base + rows * H + cols, mask=cols < H, other=0.0)


@triton.jit
def _rows_tile(w_ptr, layer, u, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """Unit u of phases C and E: output rows u·R + [0, R) of W [N, K], as [R, BK]."""
    rows = u * R + tl.arange(0, R)[:, None]
    cols = tl.arange(0, BK)[None, :]
    base = w_ptr + tl.cast(layer, tl.int64) * (N * K)
    return tl.load(base + rows * K + cols, mask=cols < K, other=0.0)


@triton.jit
def _gate_up_tile(w_ptr, layer, u, H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr, BH: tl.constexpr):
    """Unit u of phase D: gate rows u·RG + [0, RG) and the matching up rows (+ F), as [RG, 2, BH]."""
    gate_rows = u * RG + tl.arange(0, RG)[:, None, None]
    rows = gate_rows + tl.arange(0, 2)[None, :, None] * F
    cols = tl.arange(0, BH)[None, None, :]
    base = w_ptr + tl.cast(layer, tl.int64) * (2 * F * H)
    return tl.load(base + rows * H + cols, mask=cols < H, other=0.0)


# ---------------------------------------------------------------------------------------------- phases
@triton.jit
def _qkv_unit(
    w,
    a,
    c,
    s,
    u,
    slot,
    kv_off,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_head,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    RQ: tl.constexpr,
):
    """Unit u of phase A from its tile w [RQ, 2, BH] (`_qkv_tile`), the normed input a [1, 1, BH] and
    the RoPE factors c, s [RQ] of its rows: y = round(W a); q and k rotated, (y₁, y₂) → (y₁c − y₂s,
    y₂c + y₁s); q to the scratch vector, k and v into the cache row kv_off (slot −1: nowhere)."""
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    jj = tl.arange(0, RQ)
    hh = tl.arange(0, 2)
    in_head = hh[None, :] * HALF + jj[:, None]  # [RQ, 2]: offset of each output within its head
    sign = tl.where(hh[None, :] == 0, -1.0, 1.0)
    other_half = (hh[None, :, None] != hh[None, None, :]).to(tl.float32)  # [1, 2, 2]
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2).to(q_ptr.dtype.element_ty).to(tl.float32)  # [RQ, 2]
    partner = tl.sum(y[:, None, :] * other_half, axis=2)  # y of the other half, exactly
    roped = (y * c[:, None] + sign * partner * s[:, None]).to(q_ptr.dtype.element_ty)
    head = u // UPH
    offs = (u % UPH) * RQ + in_head
    if head < HQ:
        tl.store(q_ptr + head * D + offs, roped)
    elif head < HQ + HK:
        if slot >= 0:
            tl.store(k_ptr + kv_off + (head - HQ) * stride_head + offs, roped)
    else:
        if slot >= 0:
            tl.store(v_ptr + kv_off + (head - HQ - HK) * stride_head + offs, y.to(q_ptr.dtype.element_ty))


@triton.jit
def _qkv_phase(
    layer,
    pid,
    P,
    r_ptr,
    n1_ptr,
    wqkv_ptr,
    cos_sin_ptr,
    pos,
    slot,
    q_ptr,
    k_ptr,
    v_ptr,
    stride_blk,
    stride_head,
    eps,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    RQ: tl.constexpr,
    BH: tl.constexpr,
    PIPE: tl.constexpr,
    PREFETCH: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
):
    """Phase A, starting with the wait of barrier b (see the kernel's docstring for PIPE and PREFETCH)."""
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    n_units = (HQ + 2 * HK) * UPH
    jj = tl.arange(0, RQ)
    kv_off = (slot // BS) * stride_blk + (slot % BS) * D
    cs_row = cos_sin_ptr + pos * D
    a = tl.zeros([1, 1, BH], r_ptr.dtype.element_ty)
    if not PREFETCH:
        _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
        a = _normed(r_ptr, r_ptr, n1_ptr + layer * H, H, eps, BH, False)[None, None, :]
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _qkv_tile(wqkv_ptr, layer, u, H, NQKV, D, RQ, BH)
        c = tl.load(cs_row + (u % UPH) * RQ + jj)
        s = tl.load(cs_row + HALF + (u % UPH) * RQ + jj)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
                a = _normed(r_ptr, r_ptr, n1_ptr + layer * H, H, eps, BH, False)[None, None, :]
        _qkv_unit(w, a, c, s, u, slot, kv_off, q_ptr, k_ptr, v_ptr, stride_head, HQ, HK, D, RQ)
    if PREFETCH:
        if pid >= n_units:
            _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)


@triton.jit
def _keys_per_split(seq_len, num_splits, KEYS: tl.constexpr):
    """Keys of the context per attention split: whole KEYS tiles (each split starts at a multiple of
    KEYS), enough for num_splits of them to cover seq_len."""
    return tl.cdiv(tl.cdiv(seq_len, KEYS), num_splits) * KEYS


@triton.jit
def _first_tile_rows(
    pid,
    bt_ptr,
    seq_len,
    num_splits,
    stride_blk,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    KEYS: tl.constexpr,
):
    """Cache-row offsets [KEYS] (within a layer's K or V, head 0) of the first key tile of this program's
    first attention unit (unit `pid`): the same pages in every layer, so read from the block table once
    per launch."""
    split = pid % num_splits
    keys = split * _keys_per_split(seq_len, num_splits, KEYS) + tl.arange(0, KEYS)
    mine = keys * 0 + pid < HK * num_splits
    blk = tl.load(bt_ptr + keys // BS, mask=(keys < seq_len) & mine, other=0).to(tl.int64)
    return blk * stride_blk + (keys % BS) * D


@triton.jit
def _preload_kv(
    pid, k_ptr, v_ptr, rows, seq_len, num_splits, stride_head, HK: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr
):
    """The first key tile of this program's first attention unit (unit `pid`; `rows` from
    `_first_tile_rows`), every key but the newest: those were written by earlier steps, so they load
    while phase A's barrier is still closing. Returns (K [KEYS, D], V [KEYS, D]). The newest key's row is
    left out (masked: its cache line is not touched, a D-element row being whole 128-byte lines at
    D·size ≥ 128) and read after the barrier by `_attn_first_tile`."""
    kvh = pid // num_splits
    keys = (pid % num_splits) * _keys_per_split(seq_len, num_splits, KEYS) + tl.arange(0, KEYS)
    ptrs = kvh * stride_head + rows[:, None] + tl.arange(0, D)[None, :]
    old = ((keys < seq_len - 1) & (keys * 0 + pid < HK * num_splits))[:, None]
    return tl.load(k_ptr + ptrs, mask=old, other=0.0), tl.load(v_ptr + ptrs, mask=old, other=0.0)


@triton.jit
def _attn_first_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    kp,
    vp,
    rows,
    k_head_ptr,
    v_head_ptr,
    lo,
    seq_len,
    qk_scale,
    D: tl.constexpr,
    KEYS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """`attn_inner`'s masked step over keys lo .. lo+KEYS−1 from a preloaded tile (`_preload_kv`), its
    newest key's row read now, from L2 (it was written in phase A, possibly by another SM)."""
    keys = lo + tl.arange(0, KEYS)
    newest = (keys == seq_len - 1)[:, None]
    ptrs = rows[:, None] + tl.arange(0, D)[None, :]
    k = tl.where(newest, tl.load(k_head_ptr + ptrs, mask=newest, other=0.0, cache_modifier=".cg"), kp)
    v = tl.where(newest, tl.load(v_head_ptr + ptrs, mask=newest, other=0.0, cache_modifier=".cg"), vp)
    qk = dot_qk(q, k, UPCAST, IEEE)
    visible = (keys[None, :] <= q_pos[:, None]) & (keys < seq_len)[None, :]
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot_pv(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
    return acc, l_i, m_ij


@triton.jit
def _merge_partials(part_ptr, kvh, num_splits, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SM: tl.constexpr):
    """The attention output [G, D] of KV head kvh's query heads from its num_splits partials (acc [D],
    m, l per query head; m in the log2 domain; `_store_partial`'s layout, SM slots a run):
    Σₛ 2^(mₛ−M) accₛ / Σₛ 2^(mₛ−M) lₛ with M = maxₛ mₛ; 0 where no split had keys. Each thread loads the
    SM-long runs of its (query head, column) pairs as 16-byte vectors and reduces them itself, so the
    merge needs no exchange between warps (a layout with the split index slowest reduced across warps
    and took ~3 µs per merge on the H200; docs/perf.md, v12). m and l are loaded in the same [G, D, SM]
    shape (repeated along D) so that every operand shares one layout. The loads are unmasked (masks
    would split the vectors): the slots beyond num_splits hold earlier launches' partials or zeros, all
    finite, and are masked here."""
    g = tl.arange(0, G)[:, None, None]
    d = tl.arange(0, D)[None, :, None]
    sp = tl.arange(0, SM)[None, None, :]
    have = sp < num_splits
    row = kvh * G + g  # [G, 1, 1]
    accs = tl.load(part_ptr + (row * D + d) * SM + sp, cache_modifier=".cg")
    ms = tl.load(part_ptr + HK * G * D * SM + row * SM + sp + d * 0, cache_modifier=".cg")
    ls = tl.load(part_ptr + HK * G * (D + 1) * SM + row * SM + sp + d * 0, cache_modifier=".cg")
    accs = tl.where(have, accs, 0.0)
    ms = tl.where(have, ms, float("-inf"))
    ls = tl.where(have, ls, 0.0)
    mx = tl.max(ms, axis=2)  # [G, D]; −inf where no split had keys
    wgt = tl.where(ms == float("-inf"), 0.0, tl.math.exp2(ms - mx[:, :, None]))
    num = tl.sum(wgt * accs, axis=2)
    den = tl.sum(wgt * ls, axis=2)
    return tl.where(den > 0, num / den, 0.0)


@triton.jit
def _store_partial(
    part_ptr, kvh, split, acc, m, l, rows_g, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SM: tl.constexpr
):
    """One split's partial (acc [BG, D], m, l [BG]; rows ≥ G are padding) at its slot of the split-minor
    layout, SM slots a run: acc[kvh, g, d, split], then m[kvh, g, split], then l[kvh, g, split]."""
    real = rows_g < G
    row = kvh * G + rows_g
    d = tl.arange(0, D)
    tl.store(part_ptr + (row[:, None] * D + d[None, :]) * SM + split, acc, mask=real[:, None])
    tl.store(part_ptr + HK * G * D * SM + row * SM + split, m, mask=real)
    tl.store(part_ptr + HK * G * (D + 1) * SM + row * SM + split, l, mask=real)


@triton.jit
def _trace_attention(trace_ptr, pid, layer, tb, k: tl.constexpr, t):
    """A traced launch: this program's k-th phase-B time t (0: its unit computed, 1: its ticket taken, 2: its
    merge done) into its own trace block, and program 0's also into trace[tb + k]."""
    tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + 800 + 3 * layer + k, t)
    if pid == 0:
        tl.store(trace_ptr + tb + k, t)


@triton.jit
def _attention_phase(
    pid,
    P,
    layer,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_len,
    num_splits,
    part_ptr,
    tickets_ptr,
    attn_ptr,
    stride_blk,
    stride_head,
    qk_scale,
    kp,
    vp,
    rows_pre,
    trace_ptr,
    tb,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    KEYS: tl.constexpr,
    SM: tl.constexpr,
    BG: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PRELOAD: tl.constexpr,
    TRACE: tl.constexpr,
    SPLIT_O: tl.constexpr,
):
    """Split-KV attention of the group's G query heads (padded to BG ≥ 16 rows for tl.dot) through the
    FlashAttention-2 inner loop of the other kernels (flash_tiles.py; scores in the log2 domain). With
    PRELOAD, (kp, vp, rows_pre) is the first tile of unit `pid` from `_preload_kv`. The last split of a
    KV head to take its ticket merges the head's partials into attn, unless SPLIT_O: then phase C's
    programs merge them (`_o_group_phase`) and this phase only stores them."""
    G: tl.constexpr = HQ // HK
    g = tl.arange(0, G)
    rows_g = tl.arange(0, BG)
    d = tl.arange(0, D)
    keys_per_split = _keys_per_split(seq_len, num_splits, KEYS)
    for u in range(pid, HK * num_splits, P):
        kvh = u // num_splits
        split = u % num_splits
        q = tl.load(
            q_ptr + (kvh * G + rows_g)[:, None] * D + d[None, :],
            mask=(rows_g < G)[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        q_pos = tl.full([BG], 0, tl.int32) + seq_len  # the new token sees every key
        m = tl.full([BG], float("-inf"), tl.float32)
        l = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, D], tl.float32)
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, seq_len)
        start = lo
        if PRELOAD:
            if u == pid:
                if lo < hi:
                    acc, l, m = _attn_first_tile(
                        acc,
                        l,
                        m,
                        q,
                        q_pos,
                        kp,
                        vp,
                        rows_pre,
                        k_ptr + kvh * stride_head,
                        v_ptr + kvh * stride_head,
                        lo,
                        seq_len,
                        qk_scale,
                        D,
                        KEYS,
                        UPCAST,
                        IEEE,
                    )
                start = lo + KEYS
        acc, l, m = attn_inner(
            acc,
            l,
            m,
            q,
            q_pos,
            k_ptr + kvh * stride_head,
            v_ptr + kvh * stride_head,
            bt_ptr,
            start,
            hi,
            hi,
            qk_scale,
            stride_blk,
            D,
            D,
            KEYS,
            BS,
            False,
            True,
            UPCAST,
            IEEE,
        )
        if TRACE:
            if u == pid:
                _trace_attention(trace_ptr, pid, layer, tb, 0, _now(pid))
        m = tl.where(l > 0, m, float("-inf"))  # an empty split
        if num_splits <= 4:  # runs of 4 slots (a narrow merge) when there are at most 4 splits, else SM
            _store_partial(part_ptr, kvh, split, acc, m, l, rows_g, HK, G, D, 4)
        else:
            _store_partial(part_ptr, kvh, split, acc, m, l, rows_g, HK, G, D, SM)
        if SPLIT_O:
            if TRACE:  # no ticket, no merge: both at the unit's time
                if u == pid:
                    t = _now(pid)
                    _trace_attention(trace_ptr, pid, layer, tb, 1, t)
                    _trace_attention(trace_ptr, pid, layer, tb, 2, t)
        else:
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + kvh, 1, sem="acq_rel", scope="gpu")
            if TRACE:
                if u == pid:
                    _trace_attention(trace_ptr, pid, layer, tb, 1, _now(ticket))
            # Tickets only grow within a launch (reset when the last program leaves): no reset on the
            # merger's critical path. The last split of this layer's KV head merges them all, in split order.
            if ticket == (layer + 1) * num_splits - 1:
                out = _group_attention(part_ptr, kvh, num_splits, attn_ptr.dtype.element_ty, HK, G, D, SM)
                tl.store(attn_ptr + (kvh * G + g)[:, None] * D + d[None, :], out)
            if TRACE:
                if u == pid:
                    _trace_attention(trace_ptr, pid, layer, tb, 2, _now(pid))


@triton.jit
def _residual_unit(w, a, res, u, out_ptr, N: tl.constexpr, R: tl.constexpr):
    """Unit u of phases C and E: out[rows] = round(round(W x)[rows] + res) for its tile w [R, BK] (rows
    u·R + [0, R)), x as a [1, BK] and the rows' residual res [R]."""
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1).to(out_ptr.dtype.element_ty)
    rows = u * R + tl.arange(0, R)
    tl.store(out_ptr + rows, (y.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _residual_phase(
    layer,
    pid,
    P,
    x_ptr,
    w_ptr,
    r_ptr,
    out_ptr,
    bar_ptr,
    b,
    trace_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    MAXU: tl.constexpr,
    PIPE: tl.constexpr,
    PREFETCH: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
):
    """out ← round(round(W x) + r) over the units of W [N, K] (phases C and E; out may be r), starting
    with the wait of barrier b. The residual rows of all of this program's units (at most MAXU) are read
    once after the wait, not by the loop: the pipeline's loads are issued ahead of the wait and may be
    cached in L1, which does not see other SMs' stores to r."""
    n_units = N // R
    rr = tl.arange(0, R)
    cols = tl.arange(0, BK)
    it = tl.arange(0, MAXU)
    my_rows = (pid + it * P)[:, None] * R + rr[None, :]  # [MAXU, R]: row i holds this program's i-th unit
    a = tl.zeros([1, BK], x_ptr.dtype.element_ty)
    res_all = tl.zeros([MAXU, R], r_ptr.dtype.element_ty)
    if not PREFETCH:
        _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
        a = tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")[None, :]
        res_all = tl.load(r_ptr + my_rows, mask=my_rows < N, other=0.0, cache_modifier=".cg")
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _rows_tile(w_ptr, layer, u, N, K, R, BK)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
                a = tl.load(x_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")[None, :]
                res_all = tl.load(r_ptr + my_rows, mask=my_rows < N, other=0.0, cache_modifier=".cg")
        res = tl.sum(tl.where(it[:, None] == (u - pid) // P, res_all.to(tl.float32), 0.0), axis=0)
        _residual_unit(w, a, res, u, out_ptr, N, R)
    if PREFETCH:
        if pid >= n_units:
            _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)


@triton.jit
def _group_attention(
    part_ptr, g, num_splits, dtype: tl.constexpr, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SM: tl.constexpr
):
    """KV group g's attention output [G, D] merged from its split partials (`_merge_partials`, runs of
    4 slots at ≤ 4 splits, else SM, as `_store_partial` laid them out), rounded to dtype."""
    if num_splits <= 4:
        o_g = _merge_partials(part_ptr, g, num_splits, HK, G, D, 4)
    else:
        o_g = _merge_partials(part_ptr, g, num_splits, HK, G, D, SM)
    return o_g.to(dtype)


@triton.jit
def _o_group_phase(
    layer,
    pid,
    P,
    part_ptr,
    num_splits,
    wo_ptr,
    o_ptr,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    RO: tl.constexpr,
    SM: tl.constexpr,
    PIPE: tl.constexpr,
    PREFETCH: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
):
    """Phase C split along K by KV group (SPLIT_O), starting with the wait of barrier b: unit (group g, rows
    c·RO + [0, RO)) adds W_o[rows, g's G·D columns] · o_g to the float32 sums o[rows] by atomics (phase D
    adds them to the residual: `_residual_at`; they are zero before the phase), o_g being the attention
    output of g's query heads, merged from phase B's partials by this program itself (`_merge_partials`)
    and rounded to the model's dtype as the layered path stores it. No per-head ticket, merge and store
    precede the barrier, at the price of the sums' order: float32 atomics, so a launch is no longer
    bitwise reproducible (last bits of the sums). A program takes a contiguous run of units, so that at
    the 1B shape (8 groups of 32 units, 2 units a program) both share a group and it merges once; where
    the group changes along the run it merges again."""
    G: tl.constexpr = HQ // HK
    GD: tl.constexpr = G * D
    QD: tl.constexpr = HQ * D
    CPG: tl.constexpr = H // RO  # units per group
    n_units = HK * CPG
    per = tl.cdiv(n_units, P)
    first = pid * per
    last = tl.minimum(first + per, n_units)
    rr = tl.arange(0, RO)[:, None, None]
    cols = tl.arange(0, G)[None, :, None] * D + tl.arange(0, D)[None, None, :]  # [1, G, D]: g's columns
    base = wo_ptr + tl.cast(layer, tl.int64) * (H * QD)
    a = tl.zeros([1, G, D], wo_ptr.dtype.element_ty)
    g_have = -1
    if not PREFETCH:
        _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
    for u in tl.range(first, last, 1, num_stages=PIPE):
        g = u // CPG
        row0 = (u % CPG) * RO
        w = tl.load(base + (row0 + rr) * QD + g * GD + cols)  # [RO, G, D]
        # The first merge sits in the wait's own block: Triton's pipeliner may move an independent block
        # of the loop body ahead of another, and the merge must read the partials after the barrier.
        if PREFETCH:
            if u == first:  # the pipeline's first tiles are in flight
                _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
                a = _group_attention(part_ptr, g, num_splits, wo_ptr.dtype.element_ty, HK, G, D, SM)[None, :, :]
                g_have = g
        if g != g_have:
            a = _group_attention(part_ptr, g, num_splits, wo_ptr.dtype.element_ty, HK, G, D, SM)[None, :, :]
            g_have = g
        y = tl.sum(tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2), axis=1)  # [RO]
        tl.atomic_add(o_ptr + row0 + tl.arange(0, RO), y, sem="relaxed", scope="gpu")
    if PREFETCH:
        if first >= last:
            _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)


@triton.jit
def _gate_up_phase(
    layer,
    pid,
    P,
    r_ptr,
    o_ptr,
    n2_ptr,
    wgu_ptr,
    act_ptr,
    eps,
    bar_ptr,
    b,
    trace_ptr,
    H: tl.constexpr,
    F: tl.constexpr,
    RG: tl.constexpr,
    BH: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    DOT: tl.constexpr,
    CW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_O: tl.constexpr,
):
    """Phase D, starting with the wait of barrier b; with DOT on the tensor cores (`_gate_up_dot_unit`);
    with SPLIT_O its input is the residual plus phase C's sums o (`_residual_at`)."""
    NC: tl.constexpr = BH // CW
    M: tl.constexpr = 16 if NC <= 16 else NC
    n_units = F // RG
    if DOT:
        a = tl.zeros([M, CW], r_ptr.dtype.element_ty)
    else:
        a = tl.zeros([1, 1, BH], r_ptr.dtype.element_ty)
    if not PREFETCH:
        _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
        if DOT:
            a = _normed_chunks(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, M, NC, CW, BH, SPLIT_O)
        else:
            a = _normed(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, BH, SPLIT_O)[None, None, :]
    for u in tl.range(pid, n_units, P, num_stages=STAGES):
        if DOT:
            w = _gate_up_dot_tile(wgu_ptr, layer, u, H, F, RG, NC, CW)
        else:
            w = _gate_up_tile(wgu_ptr, layer, u, H, F, RG, BH)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
                if DOT:
                    a = _normed_chunks(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, M, NC, CW, BH, SPLIT_O)
                else:
                    a = _normed(r_ptr, o_ptr, n2_ptr + layer * H, H, eps, BH, SPLIT_O)[None, None, :]
        if DOT:
            _gate_up_dot_unit(w, a, u, act_ptr, RG, NC, M, UPCAST, IEEE)
        else:
            _gate_up_unit(w, a, u, act_ptr, RG)
    if PREFETCH:
        if pid >= n_units:
            _end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)


@triton.jit
def _gate_up_dot_tile(
    w_ptr, layer, u, H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr, NC: tl.constexpr, CW: tl.constexpr
):
    """Unit u of phase D as [2·RG·NC, CW]: row n is chunk n mod NC (columns c·CW + [0, CW)) of weight row
    n // NC, the rows being RG gate rows u·RG + [0, RG) then the matching up rows (+ F)."""
    n = tl.arange(0, 2 * RG * NC)
    r = n // NC
    rows = u * RG + r % RG + (r // RG) * F
    base = w_ptr + tl.cast(layer, tl.int64) * (2 * F * H)
    cols = (n % NC)[:, None] * CW + tl.arange(0, CW)[None, :]
    return tl.load(base + rows[:, None] * H + cols, mask=cols < H, other=0.0)


@triton.jit
def _normed_chunks(
    r_ptr,
    o_ptr,
    w_ptr,
    H,
    eps,
    M: tl.constexpr,
    NC: tl.constexpr,
    CW: tl.constexpr,
    BH: tl.constexpr,
    SPLIT_O: tl.constexpr,
):
    """RMSNorm(r; w) of the residual (`_residual_at`) as [M, CW]: row c < NC holds columns c·CW + [0, CW),
    rows from NC on are zero (the A operand of `_gate_up_dot_unit`); `_normed`'s roundings."""
    rstd = _rstd(r_ptr, o_ptr, H, eps, BH, SPLIT_O)
    c = tl.arange(0, M)[:, None]
    cols = c * CW + tl.arange(0, CW)[None, :]
    ok = (c < NC) & (cols < H)
    x = _residual_at(r_ptr, o_ptr, cols, ok, SPLIT_O)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    normed = (x.to(tl.float32) * rstd).to(x.dtype)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _gate_up_dot_unit(
    w, a, u, act_ptr, RG: tl.constexpr, NC: tl.constexpr, M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr
):
    """Unit u of phase D from `_gate_up_dot_tile` on the tensor cores: Y = A wᵀ with A the normed input
    as [M, CW] chunks (`_normed_chunks`) gives every chunk of the input against every chunk of every row;
    row r's product is the sum of its chunks' own entries, Σ_c Y[c, r·NC + c]. Then as `_gate_up_unit`."""
    y_all = dot_qk(a, w, UPCAST, IEEE)  # [M, 2·RG·NC]
    n = tl.arange(0, 2 * RG * NC)
    mine = tl.sum(tl.where(tl.arange(0, M)[:, None] == (n % NC)[None, :], y_all, 0.0), axis=0)
    y = tl.sum(tl.reshape(mine, [2 * RG, NC]), axis=1).to(act_ptr.dtype.element_ty).to(tl.float32)  # [2·RG]
    hh = tl.arange(0, 2 * RG)
    gate = tl.sum(tl.where(hh[None, :] == tl.arange(0, RG)[:, None], y[None, :], 0.0), axis=1)
    up = tl.sum(tl.where(hh[None, :] == tl.arange(0, RG)[:, None] + RG, y[None, :], 0.0), axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + u * RG + tl.arange(0, RG), act.to(act_ptr.dtype.element_ty))


@triton.jit
def _gate_up_unit(w, a, u, act_ptr, RG: tl.constexpr):
    """Unit u of phase D: act[rows] = round(silu(g) ⊙ u) with g, u = round(W a) of its tile [RG, 2, BH]."""
    hh = tl.arange(0, 2)[None, :]
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2).to(act_ptr.dtype.element_ty).to(tl.float32)  # [RG, 2]
    gate = tl.sum(tl.where(hh == 0, y, 0.0), axis=1)
    up = tl.sum(tl.where(hh == 1, y, 0.0), axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + u * RG + tl.arange(0, RG), act.to(act_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["num_layers", "num_splits", "layer_stride", "v_offset"])
def _decode_megakernel(
    ids_ptr,
    pos_ptr,
    slot_ptr,
    seq_len_ptr,
    bt_ptr,
    emb_ptr,
    wqkv_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    n1_ptr,
    n2_ptr,
    nf_ptr,
    cos_sin_ptr,
    kv_ptr,
    layer_stride,
    v_offset,
    stride_blk,
    stride_head,
    r_ptr,
    r2_ptr,
    osum_ptr,
    q_ptr,
    attn_ptr,
    act_ptr,
    part_ptr,
    tickets_ptr,
    bar_ptr,
    out_ptr,
    trace_ptr,
    num_layers,
    num_splits,
    eps,
    scale,
    H: tl.constexpr,
    F: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    RQ: tl.constexpr,
    RO: tl.constexpr,
    RG: tl.constexpr,
    RD: tl.constexpr,
    KEYS: tl.constexpr,
    SM: tl.constexpr,
    BG: tl.constexpr,
    MAXU_C: tl.constexpr,
    MAXU_E: tl.constexpr,
    TRACE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    PIPE: tl.constexpr,
    PREFETCH: tl.constexpr,
    PRELOAD: tl.constexpr,
    ASM: tl.constexpr,
    DOT_D: tl.constexpr,
    CW: tl.constexpr,
    SPLIT_O: tl.constexpr,
    E_PIPE: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    BH: tl.constexpr = triton.next_power_of_2(H)
    BF: tl.constexpr = triton.next_power_of_2(F)
    QD: tl.constexpr = HQ * D
    BQ: tl.constexpr = triton.next_power_of_2(QD)
    BHK: tl.constexpr = triton.next_power_of_2(HK)

    if TRACE:
        if pid == 0:
            tl.store(trace_ptr, _now(pid))
    tok = tl.load(ids_ptr).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    seq_len = tl.load(seq_len_ptr)
    # context splits per KV head: at most num_splits, each a whole number of KEYS tiles, none empty (one,
    # without keys, at seq_len 0: a padded graph row, whose split count was once a division by zero)
    tiles = tl.maximum(tl.cdiv(seq_len, KEYS), 1)
    splits = tl.cdiv(tiles, tl.cdiv(tiles, num_splits))
    cols = tl.arange(0, BH)
    if TRACE:
        tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK, _now(pid))
    if pid == 0:  # r ← the token's embedding row (first read in layer 0's phase D, three barriers on)
        e = tl.load(emb_ptr + tok * H + cols, mask=cols < H, other=0.0)
        tl.store(r_ptr + cols, e, mask=cols < H)
    if PRELOAD:
        rows_pre = _first_tile_rows(pid, bt_ptr, seq_len, splits, stride_blk, HK, D, BS, KEYS)
    else:
        rows_pre = 0
    # Each weight phase starts with the wait of the barrier before it: with PREFETCH, after issuing its
    # first weight tiles (they do not depend on the barrier), so they stream while the others arrive.
    # Layer 0's phase A has no barrier before it: each program normalises the embedding row itself.
    for layer in range(num_layers):
        b = 5 * layer  # barriers before this layer: 5 per layer
        k_ptr = kv_ptr + tl.cast(layer, tl.int64) * layer_stride
        v_ptr = k_ptr + v_offset
        x_ptr = r_ptr  # phase A's input: the residual stream, or the embedding row in layer 0
        if layer == 0:
            x_ptr = emb_ptr + tok * H
        _qkv_phase(
            layer,
            pid,
            P,
            x_ptr,
            n1_ptr,
            wqkv_ptr,
            cos_sin_ptr,
            pos,
            slot,
            q_ptr,
            k_ptr,
            v_ptr,
            stride_blk,
            stride_head,
            eps,
            bar_ptr,
            b,
            trace_ptr,
            H,
            HQ,
            HK,
            D,
            BS,
            RQ,
            BH,
            PIPE,
            PREFETCH,
            TRACE,
            ASM,
        )
        _arrive(bar_ptr, trace_ptr, pid, b + 1, TRACE)
        if PRELOAD:
            kp, vp = _preload_kv(pid, k_ptr, v_ptr, rows_pre, seq_len, splits, stride_head, HK, D, KEYS)
        else:
            kp, vp = 0, 0
        _end_phase(bar_ptr, b + 1, P, trace_ptr, pid, TRACE, ASM)
        _attention_phase(
            pid,
            P,
            layer,
            q_ptr,
            k_ptr,
            v_ptr,
            bt_ptr,
            seq_len,
            splits,
            part_ptr,
            tickets_ptr,
            attn_ptr,
            stride_blk,
            stride_head,
            scale * 1.4426950408889634,
            kp,
            vp,
            rows_pre,
            trace_ptr,
            3 + 5 * num_layers + 3 * layer,
            HQ,
            HK,
            D,
            BS,
            KEYS,
            SM,
            BG,
            UPCAST,
            IEEE,
            PRELOAD,
            TRACE,
            SPLIT_O,
        )
        _arrive(bar_ptr, trace_ptr, pid, b + 2, TRACE)
        o_ptr = osum_ptr + (layer % 2) * H  # SPLIT_O: this layer's sums (zeroed in phase E two layers back)
        if SPLIT_O:
            _o_group_phase(
                layer,
                pid,
                P,
                part_ptr,
                splits,
                wo_ptr,
                o_ptr,
                bar_ptr,
                b + 2,
                trace_ptr,
                H,
                HQ,
                HK,
                D,
                RO,
                SM,
                PIPE,
                PREFETCH,
                TRACE,
                ASM,
            )
        else:
            _residual_phase(
                layer,
                pid,
                P,
                attn_ptr,
                wo_ptr,
                r_ptr,
                r_ptr,
                bar_ptr,
                b + 2,
                trace_ptr,
                H,
                QD,
                RO,
                BQ,
                MAXU_C,
                PIPE,
                PREFETCH,
                TRACE,
                ASM,
            )
        _arrive(bar_ptr, trace_ptr, pid, b + 3, TRACE)
        _gate_up_phase(
            layer,
            pid,
            P,
            r_ptr,
            o_ptr,
            n2_ptr,
            wgu_ptr,
            act_ptr,
            eps,
            bar_ptr,
            b + 3,
            trace_ptr,
            H,
            F,
            RG,
            BH,
            STAGES,
            PREFETCH,
            TRACE,
            ASM,
            DOT_D,
            CW,
            UPCAST,
            IEEE,
            SPLIT_O,
        )
        if SPLIT_O:  # the residual after attention, for phase E (r itself is read by every program in D)
            if pid == P - 1:  # a program with the fewest phase-D units
                tl.store(r2_ptr + cols, _residual_at(r_ptr, o_ptr, cols, cols < H, True), mask=cols < H)
        _arrive(bar_ptr, trace_ptr, pid, b + 4, TRACE)
        e_res_ptr = r2_ptr if SPLIT_O else r_ptr  # SPLIT_O: the residual after attention, stored in phase D
        _residual_phase(
            layer,
            pid,
            P,
            act_ptr,
            wd_ptr,
            e_res_ptr,
            r_ptr,
            bar_ptr,
            b + 4,
            trace_ptr,
            H,
            F,
            RD,
            BF,
            MAXU_E,
            E_PIPE,
            PREFETCH,
            TRACE,
            ASM,
        )
        if SPLIT_O:
            if pid == P - 1:  # every program has read this layer's sums in phase D: zero them for layer + 2
                tl.store(o_ptr + cols, tl.zeros([BH], tl.float32), mask=cols < H)
        if layer < num_layers - 1:
            _arrive(bar_ptr, trace_ptr, pid, b + 5, TRACE)
    # Leave: no barrier after the last layer. The last program out (its gpu-scope acquire of the leave
    # count follows every program's release of it, each after its stores of phase E) applies the final
    # norm and resets the counters (every program has passed every barrier).
    if TRACE:
        tl.store(trace_ptr + _TRACE_BASE + pid * _TRACE_BLOCK + 400 + 5 * num_layers, _now(pid))
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        out = _normed(r_ptr, r_ptr, nf_ptr, H, eps, BH, False)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < H)
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(tickets_ptr + tl.arange(0, BHK), 0, mask=tl.arange(0, BHK) < HK, sem="relaxed", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 5 * num_layers, _now(pid))


# ---------------------------------------------------------------------------------------------- launcher
def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


ATTN_KEYS = 64  # keys per attention tile (tl.dot's N), as the decode kernel's default
MAX_SPLITS = 16  # context splits per KV head in the attention phase (33 at 2 programs per SM: slower on the H200)


class Workspace:
    """Scratch of one launch configuration: the residual, q, attention output, SwiGLU output vectors,
    the split partials, the per-KV-head tickets and the barrier counters (zero between launches).
    Allocated once; captured graphs point at it. The context of each KV head is cut into `num_splits`
    parts (default: as many as fill the programs)."""

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
            z(s.num_heads * s.head_dim),
            z(s.num_heads * s.head_dim),
            z(s.intermediate),
        )
        # split phase C (`MegakernelConfig.split_o`): the residual after attention, and the float32 sums of
        # W_o·attention of two consecutive layers (zero between launches)
        self.r2, self.o_sums = z(s.hidden), z(2 * s.hidden, torch.float32)
        # split-minor partials (`_store_partial`): runs of at least 4 slots, a power of two
        self.partials = z(
            s.num_kv_heads * max(4, next_power_of_2(self.num_splits)) * group * (s.head_dim + 2), torch.float32
        )
        self.tickets = z(s.num_kv_heads, torch.int32)
        self.barrier = z(2, torch.int32)
        self.trace = torch.zeros(1, dtype=torch.int64, device=device)  # grown by a traced launch
        self.resident_checked = False


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


def unit_rows(shape: ModelShape, tile: int) -> tuple[int, int, int, int]:
    """(RQ, RO, RG, RD): rows per unit of phases A (per half-head), C, D (gate rows) and E, each a
    power of two giving ~`tile` weight elements per unit."""
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
    """Rows per unit of the split phase C (`_o_group_phase`, units [rows, G·D]): the largest power of two
    that divides the hidden size and gives at most ~`tile` weight elements per unit (at least one)."""
    group_cols = shape.num_heads // shape.num_kv_heads * shape.head_dim
    r = _pow2_at_most(max(1, tile // group_cols))
    while shape.hidden % r:
        r //= 2
    return r


def phase_d_chunks(shape: ModelShape, rg: int, elem_bytes: int) -> tuple[int, bool]:
    """(CW, usable) of phase D on the tensor cores: a weight row is cut into chunks of CW columns (one
    warp's 16-byte vectors, at most the padded hidden size), at most 32 of them, and the unit's tile
    [2·RG·chunks, CW] must meet tl.dot's minimum of 16 in every dimension."""
    bh = next_power_of_2(shape.hidden)
    cw = min(bh, 32 * 16 // elem_bytes)
    return cw, bh // cw <= 32 and 2 * rg * (bh // cw) >= 16 and cw >= 16


PIPELINE_BYTES = 160 << 10  # shared memory the pipelined weight tiles may take (of the SM's 227 KB)


def unit_tile(config: MegakernelConfig, elem_bytes: int) -> int:
    """Weight elements per unit: config.tile, halved until the deepest pipeline's stages − 1 buffers in
    flight fit in PIPELINE_BYTES (float32 weights take half the elements of bf16)."""
    tile, stages = config.tile, max(config.stages, config.ace_stages, config.e_stages)
    while stages > 1 and tile > 256 and tile * elem_bytes * (stages - 1) > PIPELINE_BYTES:
        tile //= 2
    return tile


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
    config: MegakernelConfig = MegakernelConfig(),
    trace: bool = False,
) -> torch.Tensor:
    """One decode token of one sequence through every layer → the final-normed hidden state [1, H].

    input_ids, positions, slot_mapping: [1] (int64); seq_lens: [1] int32, the context including the new
    token (≥ 1); block_table: [≥ cdiv(seq_len, block_size)] int32. kv_caches: per layer (k, v), each
    [num_blocks, Hk, block_size, D], all carved from one buffer at a fixed layer stride (as the model
    runner allocates them); the new token's K/V are written at slot_mapping[0] (−1: nowhere).
    `trace` (CUDA): program 0 writes the global timer after every barrier into workspace.trace
    (int64 ns; [0, 3 + 8·L): [0] start, [5·l + k + 1] after phase k (A–E = 0–4) of layer l (barrier
    5·l + k + 1 opening; [5·L]: the last program's exit, after the final norm), two unused; then 3 per layer inside
    phase B: program 0's unit computed, its ticket taken, its merge (if it was last) done; from TRACE_BASE
    on, every program's own readings, TRACE_BLOCK apiece).
    """
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
    for name, t in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        check_int(name, t)
    if block_size & (block_size - 1):
        raise ValueError(f"the decode megakernel needs a power-of-two KV block size, got {block_size}")
    if config.stages < 1 or config.ace_stages < 1 or config.e_stages < 1:
        raise ValueError(f"megakernel config {config}: stages ≥ 1 needed")
    rq, ro, rg, rd = unit_rows(shape, unit_tile(config, weights.qkv.element_size()))
    cw, dot_d = phase_d_chunks(shape, rg, weights.qkv.element_size())
    ro_split = split_o_rows(shape, unit_tile(config, weights.qkv.element_size()))
    dot_d = dot_d and config.dot_d
    out = torch.empty((1, shape.hidden), dtype=weights.qkv.dtype, device=input_ids.device)
    ws = workspace
    cuda = input_ids.device.type == "cuda"
    num_layers = weights.qkv.shape[0]
    if trace and num_layers > TRACE_MAX_LAYERS:
        raise ValueError(f"a traced launch records at most {TRACE_MAX_LAYERS} layers")
    if trace and ws.trace.numel() != TRACE_BASE + ws.programs * TRACE_BLOCK:
        ws.trace = torch.zeros(TRACE_BASE + ws.programs * TRACE_BLOCK, dtype=torch.int64, device=input_ids.device)
    args = (
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        block_table,
        weights.embed,
        weights.qkv,
        weights.o,
        weights.gate_up,
        weights.down,
        weights.norm1,
        weights.norm2,
        weights.norm_final,
        cos_sin,
        k0,
        layer_stride,
        v_offset,
        k0.stride(0),
        k0.stride(1),
        ws.r,
        ws.r2,
        ws.o_sums,
        ws.q,
        ws.attn,
        ws.act,
        ws.partials,
        ws.tickets,
        ws.barrier,
        out,
        ws.trace,
        num_layers,
        ws.num_splits,
        eps,
        scale,
    )
    kwargs = dict(
        H=shape.hidden,
        F=shape.intermediate,
        HQ=shape.num_heads,
        HK=shape.num_kv_heads,
        D=shape.head_dim,
        BS=block_size,
        RQ=rq,
        RO=ro_split if config.split_o else ro,
        RG=rg,
        RD=rd,
        KEYS=ATTN_KEYS,
        SM=max(4, next_power_of_2(ws.num_splits)),
        BG=max(16, next_power_of_2(shape.num_heads // shape.num_kv_heads)),
        UPCAST=upcast_dot(input_ids.device),
        IEEE=weights.qkv.dtype == torch.float32,
        TRACE=trace and cuda,
        MAXU_C=next_power_of_2(-(-(shape.hidden // ro) // ws.programs)),
        MAXU_E=next_power_of_2(-(-(shape.hidden // rd) // ws.programs)),
        STAGES=config.stages,
        PIPE=config.ace_stages,
        PREFETCH=config.prefetch,
        ASM=cuda,
        PRELOAD=config.preload_kv,
        DOT_D=dot_d,
        CW=cw,
        SPLIT_O=config.split_o,
        E_PIPE=config.e_stages,
        num_warps=config.num_warps,
        num_stages=1,
    )
    if cuda and config.programs_per_sm > 1:
        kwargs["maxnreg"] = max_registers(config)
    if cuda and ws.programs > num_sms(input_ids.device) and not ws.resident_checked:  # a grid too large would hang
        compiled = _decode_megakernel.warmup(*args, grid=(ws.programs,), **kwargs)
        compiled._init_handles()  # loads the module: fills n_regs
        check_resident(compiled, config._replace(programs_per_sm=-(-ws.programs // num_sms(input_ids.device))))
        ws.resident_checked = True
    _decode_megakernel[(ws.programs,)](*args, **kwargs)
    return out


def max_programs(device: torch.device, config: MegakernelConfig = MegakernelConfig()) -> int:
    """The grid: `programs_per_sm` per multiprocessor on CUDA, or `programs` where fewer (the launch caps
    registers at `max_registers` so that they fit, and `check_resident` verifies the compiled kernel),
    one program on the CPU interpreter (which runs programs one after another)."""
    if device.type != "cuda":
        return 1
    full = num_sms(device) * config.programs_per_sm
    return min(full, config.programs) if config.programs > 0 else full


def max_registers(config: MegakernelConfig) -> int:
    """Registers per thread that let `programs_per_sm` programs share an SM's 64K (ptxas's maxnreg)."""
    return min(255, 65536 // (config.programs_per_sm * config.num_warps * 32) // 8 * 8)


def check_resident(compiled, config: MegakernelConfig) -> None:
    """Raise unless `programs_per_sm` copies of the compiled kernel fit on one SM at once (a grid barrier
    with a program left waiting for a free SM would never open)."""
    threads = config.num_warps * 32
    regs = -(-compiled.n_regs * 32 // 256) * 256 * config.num_warps  # allocated per warp in units of 256
    shared = compiled.metadata.shared
    fits = min(65536 // max(1, regs), 2048 // threads, (228 << 10) // max(1, shared + 1024))
    if fits < config.programs_per_sm:
        raise RuntimeError(
            f"decode megakernel: {config.programs_per_sm} programs per SM do not fit "
            f"({compiled.n_regs} registers × {threads} threads, {shared} B shared): {fits} do"
        )
