"""A whole batch-1 decode token through every decoder layer in one launch (a persistent "megakernel").

Per layer l, with r the residual stream (the embedding row before layer 0), the same maths and
roundings as the fused small-batch path of models/llama.py:
    A  h = RMSNorm(r; w1[l]);  qkv = round(Wqkv[l] h);  q, k ← RoPE(q, k, pos);  cache[l][slot] ← k, v
    B  o = softmax(scale · q Kᵀ) V over the sequence's cached keys (split-KV, merged by logsumexp)
    C  r = round(round(Wo[l] o) + r)
    D  h = RMSNorm(r; w2[l]);  g, u = round(Wg[l] h), round(Wu[l] h);  a = round(silu(g) ⊙ u)
    E  r = round(round(Wd[l] a) + r)
and finally out = RMSNorm(r; w_final). The LM head and sampling stay kernels of their own.

Why one launch: a batch-1 token reads every weight once (2.47 GB for Llama 3.2 1B, 0.58 ms at the
H200's 4.25 TB/s), but as ~150 separate kernels each product pays ~2–3 µs of launch, ramp and tail
beyond its bytes and every small op (norm, RoPE, attention merge) pays a launch of its own: the
one-kernel-per-op step measured 1.15 ms (docs/perf.md). Here one program per multiprocessor runs all
phases, separated by grid-wide barriers: no launches, no host gaps, and the small ops (norms, RoPE, the
K/V write, the attention merge, SwiGLU, residual adds) folded into the phases around them. Measured on
the H200 (docs/perf.md, v5–v7): 1.23× the layer-by-layer path in CUDA-graph replays (0.74 ms of layers
at 640 keys), short of the bandwidth floor because each of the 80 phases pays ~1.5–3 µs of ramp, tail
and barrier beyond its bytes and attention costs ~9 µs per layer (its split merge and the barrier
behind it). Asking L2 to prefetch tiles ahead, and tensor-core phases, were slower or no faster.

Layout of the work. A phase is a list of "units" of about TILE weight elements each, dealt to the
programs round-robin (unit u goes to program u mod P). Each weight phase (A, C, D, E) is a loop
software-pipelined by Triton (`stages` − 1 tiles in flight through shared memory, cp.async), and it
starts with the wait of the barrier before it: inside the loop's first iteration, so that the
pipeline's prologue, the program's first tiles, is issued before the wait and streams while the last
programs finish the previous phase (with `prefetch`; the activation vector, which does depend on the
barrier, is loaded after it, once per program). Triton pipelines no loop that holds a nested loop or a
CTA barrier, so the wait is one asm statement (`_wait_asm`). The earlier scheme, a unit's tile loaded
whole into registers and double-buffered (the first one between arrival and wait), was 13 % slower
(docs/perf.md, v7; `benchmarks/kernels/bench_stream.py` isolates the streaming schemes).
  A: a unit is RQ rows of a head's first half and their RoPE partners in its second half, so RoPE
     is applied in registers; q goes to a scratch vector, k and v straight into the paged cache.
  B: a unit is (KV head, split of the context) through the FlashAttention-2 inner loop of the other
     attention kernels (_flash.py: tl.dot over 64-key tiles, log2-domain scores), the GQA group's
     query heads padded to 16 rows; each writes (m, l, acc) of its keys; the last split to arrive at
     a per-head ticket merges them (the split-K semaphore of gemv.py) and writes the group's output.
     A program's first unit takes its first key tile preloaded between phase A's arrival and wait
     (every key but the newest, which phase A is writing; that row is read from L2 afterwards; the
     tile's block-table entries are read once per launch). A head's context is cut into at most
     `num_splits` splits of whole 64-key tiles, none empty.
  C, E: RO / RD output rows with the residual add.  D: RG gate rows and the matching up rows.

Barriers: a monotone arrival counter; the b-th barrier waits until it reads b·P (a CTA barrier
first orders the CTA's stores before thread 0's gpu-scope release; thread 0's acquire and a second CTA
barrier order the loads after). Arrival and wait are separate calls: a release waits for the loads
issued before it, so the next phase's prefetch goes after the arrival. Data written inside the launch
is read with `.cg` loads (L2; an SM's L1 is not coherent with other SMs' stores), never by a pipeline
(its copies may allocate in L1), except the KV cache in phase B: no SM reads a layer's cache lines
before that layer's phase B, and L1 holds nothing from earlier launches. At exit the last
program to leave resets the counter for the next launch: no memset, no host sync, capturable in a CUDA
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

from tinyvllm.kernels._flash import _attn_inner, _dot_pv, _dot_qk
from tinyvllm.kernels._launch import check_int, next_power_of_2, num_sms, upcast_dot


class MegakernelConfig(NamedTuple):
    tile: int = 16384  # weight elements per unit (a power of two)
    num_warps: int = 8
    programs_per_sm: int = 1  # CUDA: above 1, registers are capped (maxnreg) so that this many fit on an SM
    stages: int = 3  # phase D's software pipeline: this many shared-memory stages (1: none)
    prefetch: bool = True  # weight phases: the pipeline's first tiles issued before the barrier's wait
    preload_kv: bool = True  # phase B: the first key tile's old keys loaded between A's arrival and wait
    ace_stages: int = 3  # the same for phases A, C and E
    merge_width: int = 16  # attention partials merged per step (a power of two; at most 4 splits: 4 wide)


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
    if shape.hidden % 2 or shape.intermediate % 2:
        return "odd hidden or intermediate size (flagged words hold value pairs)"
    return None


# ---------------------------------------------------------------------------------------------- flagged words
# Every vector one phase hands to the next (the residual, q and the new K/V, the attention output, the
# SwiGLU output) travels as 64-bit words: the low 32 bits carry the payload (two 16-bit values, or one
# float32), the high 32 bits the flag of the phase instance that wrote it (`_flag`). An aligned 8-byte
# store is single-copy atomic, so a reader that sees the expected flag holds that word's data too: no
# fence, no arrival counter, no second read after a barrier. (NCCL's "LL" protocol is the same idea.)

def _spin_asm(pack: int) -> tuple[str, str]:
    """PTX that loads `pack` words (one relaxed gpu-scope load each, all issued before any is checked)
    and loads them all again until every word's high half equals the flag operand; its constraints.
    Outputs are early-clobber: they are written while the addresses are still needed."""
    loads = " ".join(f"ld.relaxed.gpu.global.b64 ${i}, [${pack + i}];" for i in range(pack))
    checks = " ".join(f"mov.b64 {{lo, hi}}, ${i}; setp.ne.s32 p, hi, ${2 * pack}; @p bra $$spin_${{:uid}};"
                      for i in range(pack))
    asm = "{ .reg .pred p; .reg .b32 lo, hi; $$spin_${:uid}: " + loads + " " + checks + " }"
    return asm, ",".join(["=&l"] * pack + ["l"] * pack + ["r"] * pack)


_SPIN1, _SPIN1_C = (tl.constexpr(x) for x in _spin_asm(1))
_SPIN2, _SPIN2_C = (tl.constexpr(x) for x in _spin_asm(2))
_SPIN4, _SPIN4_C = (tl.constexpr(x) for x in _spin_asm(4))
_SPIN8, _SPIN8_C = (tl.constexpr(x) for x in _spin_asm(8))
_SPIN16, _SPIN16_C = (tl.constexpr(x) for x in _spin_asm(16))
MAX_PACK = 16


@triton.jit
def _arrive(count_ptr):
    """This program's arrival after a phase: a CTA barrier (every warp has issued its stores), then a
    relaxed increment, no fence: the count only tells readers when to look; the flags tell them what
    they see is new."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def _gate(count_ptr, target, ASM: tl.constexpr):
    """Wait until `target` arrivals have been counted (b · P before the b-th phase's input): one thread
    polls one word, where a flagged read by every thread of every program would flood the lines it
    polls. CUDA: one asm statement (thread 0's spin, then `bar.sync 0`), so that the pipelined weight
    loops that hold it still pipeline (Triton pipelines no loop with a nested loop or a CTA barrier)."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.ne.u32 p, t, 0; @p bra $$done_${:uid}; "
            "$$spin_${:uid}: ld.relaxed.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra $$spin_${:uid}; "
            "$$done_${:uid}: bar.sync 0; }",
            "=r,l,r", [count_ptr, target], dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.atomic_add(count_ptr, 0, sem="relaxed", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _flag(epoch, phase):
    """The flag of phase instance `phase` (1 + its index in the launch, < 2048) of launch `epoch`
    (counted modulo 2²⁰ by the kernel): never 0, the value of a fresh buffer, and never a flag of the
    previous launch, whose words are the only stale ones (every word is written in every launch)."""
    return epoch * 2048 + phase


@triton.jit
def _ll_read(ptrs, flag, PACK: tl.constexpr, ASM: tl.constexpr):
    """The words at `ptrs` once every one carries `flag`. CUDA (ASM): each thread spins on its words,
    PACK of them per asm statement (all of a thread's words, when PACK is the words per thread, so they
    arrive in one round trip). The interpreter runs one program, which has written every word before it
    reads it: a word with another flag there is a bug in the phases' order, and reads as NaN values
    (payload 0x7FC07FC0: NaN as one float32 and as two bfloat16 halves), which the tests see."""
    if ASM:
        flags = tl.zeros(ptrs.shape, tl.int32) + flag
        if PACK == 16:
            w = tl.inline_asm_elementwise(_SPIN16, _SPIN16_C, [ptrs, flags], dtype=tl.int64, is_pure=False, pack=16)
        elif PACK == 8:
            w = tl.inline_asm_elementwise(_SPIN8, _SPIN8_C, [ptrs, flags], dtype=tl.int64, is_pure=False, pack=8)
        elif PACK == 4:
            w = tl.inline_asm_elementwise(_SPIN4, _SPIN4_C, [ptrs, flags], dtype=tl.int64, is_pure=False, pack=4)
        elif PACK == 2:
            w = tl.inline_asm_elementwise(_SPIN2, _SPIN2_C, [ptrs, flags], dtype=tl.int64, is_pure=False, pack=2)
        else:
            w = tl.inline_asm_elementwise(_SPIN1, _SPIN1_C, [ptrs, flags], dtype=tl.int64, is_pure=False, pack=1)
    else:
        w = tl.load(ptrs)
        w = tl.where((w >> 32).to(tl.int32) == flag, w, 0x7FC07FC0)
    return w


@triton.jit
def _ll_write(ptrs, words, ASM: tl.constexpr):
    """Store words (a relaxed gpu-scope store each on CUDA: other SMs spin on them)."""
    if ASM:
        tl.inline_asm_elementwise("st.relaxed.gpu.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l", [ptrs, words],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, words)


@triton.jit
def _ll_pack(x, flag, VPW: tl.constexpr):
    """Values x [N] (1-D) → words [N // VPW]: VPW = 2, 16-bit values 2i and 2i + 1 in word i (low, high
    half of the payload); VPW = 1, one float32 per word."""
    if VPW == 2:
        lo, hi = tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))
        payload = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    else:
        payload = x.to(tl.uint32, bitcast=True)
    return (payload.to(tl.uint64) | (flag.to(tl.uint32).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)


@triton.jit
def _ll_values(w, DT: tl.constexpr, VPW: tl.constexpr):
    """Words [W] (1-D) → their values [W · VPW] in DT, in order (the inverse of `_ll_pack`)."""
    payload = (w & 0xFFFFFFFF).to(tl.uint32)
    if VPW == 2:
        lo = payload.to(tl.uint16).to(DT, bitcast=True)
        hi = (payload >> 16).to(tl.uint16).to(DT, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [w.shape[0] * 2])
    else:
        return payload.to(DT, bitcast=True)


@triton.jit
def _ll_vector(ll_ptr, flag, N: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, VPW: tl.constexpr,
               PACK: tl.constexpr, ASM: tl.constexpr):
    """A flagged vector of N values as [BN] (zeros beyond N), once written with `flag`."""
    W: tl.constexpr = BN // VPW
    wi = tl.arange(0, W)
    x = _ll_values(_ll_read(ll_ptr + tl.where(wi < N // VPW, wi, 0), flag, PACK, ASM), DT, VPW)
    return tl.where(tl.arange(0, BN) < N, x, 0.0)


@triton.jit
def _ll_rows(ll_ptr, first_row, valid, flag, R: tl.constexpr, DT: tl.constexpr, VPW: tl.constexpr,
             ASM: tl.constexpr):
    """Rows first_row[i] + [0, R) of a flagged vector for each i with valid[i] ([M] each; other rows
    zero) as [M, R], once written with `flag` (a few words per program: one per thread)."""
    RW: tl.constexpr = R // VPW
    M: tl.constexpr = first_row.shape[0]
    words = tl.where(valid, first_row // VPW, 0)[:, None] + tl.arange(0, RW)[None, :]
    x = _ll_values(_ll_read(ll_ptr + tl.reshape(words, [M * RW]), flag, 1, ASM), DT, VPW)
    return tl.where(valid[:, None], tl.reshape(x, [M, R]), 0.0)


@triton.jit
def _ll_put(ll_ptr, first_row, x, flag, VPW: tl.constexpr, ASM: tl.constexpr):
    """Write values x [N] (1-D) at rows first_row + [0, N) of a flagged vector (first_row a multiple of
    VPW)."""
    W: tl.constexpr = x.shape[0] // VPW
    _ll_write(ll_ptr + first_row // VPW + tl.arange(0, W), _ll_pack(x, flag, VPW), ASM)


@triton.jit
def _now(x):
    """The GPU's global nanosecond timer (phase trace only; CUDA only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _mark(trace_ptr, i, pid, TRACE: tl.constexpr):
    """When tracing, program 0 writes the timer into trace[i]."""
    if TRACE:
        if pid == 0:
            tl.store(trace_ptr + i, _now(pid))


@triton.jit
def _normed(x, w_ptr, H, eps, BH: tl.constexpr):
    """RMSNorm of the residual vector x [BH] (zeros beyond H) in rms_norm.py's roundings, in x's dtype."""
    cols = tl.arange(0, BH)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _normed_residual(r_ll, flag, w_ptr, H: tl.constexpr, eps, BH: tl.constexpr, DT: tl.constexpr,
                     VPW: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr):
    """RMSNorm (weights w_ptr) of the residual vector, once written with `flag`, as [BH]."""
    return _normed(_ll_vector(r_ll, flag, H, BH, DT, VPW, PACK, ASM), w_ptr, H, eps, BH)


# ---------------------------------------------------------------------------------------------- units
# A unit's weight tile, a load that Triton's pipeliner turns into cp.async copies into shared memory.
# Only the padding columns are masked: every caller loops over valid units (u < n_units), and the rows
# per unit divide the matrix's rows (`unit_rows`).
@triton.jit
def _qkv_tile(w_ptr, layer, u, H: tl.constexpr, NQKV: tl.constexpr, D: tl.constexpr,
              RQ: tl.constexpr, BH: tl.constexpr):
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
def _gate_up_tile(w_ptr, layer, u, H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr,
                  BH: tl.constexpr):
    """Unit u of phase D: gate rows u·RG + [0, RG) and the matching up rows (+ F), as [RG, 2, BH]."""
    gate_rows = u * RG + tl.arange(0, RG)[:, None, None]
    rows = gate_rows + tl.arange(0, 2)[None, :, None] * F
    cols = tl.arange(0, BH)[None, None, :]
    base = w_ptr + tl.cast(layer, tl.int64) * (2 * F * H)
    return tl.load(base + rows * H + cols, mask=cols < H, other=0.0)


# ---------------------------------------------------------------------------------------------- phases
@triton.jit
def _qkv_unit(w, a, c, s, u, slot, kv_off, qkv_ll, k_ptr, v_ptr, stride_head, flag,
              HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, RQ: tl.constexpr, VPW: tl.constexpr,
              ASM: tl.constexpr):
    """Unit u of phase A from its tile w [RQ, 2, BH] (`_qkv_tile`), the normed input a [1, 1, BH] and
    the RoPE factors c, s [RQ] of its rows: y = round(W a); q and k rotated, (y₁, y₂) → (y₁c − y₂s,
    y₂c + y₁s). Every head's rows go to the flagged q|k|v vector (phase B reads the new K/V there), k
    and v also into the cache row kv_off (slot −1: not into the cache)."""
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    WPH: tl.constexpr = RQ // VPW  # words per half-head run of the unit
    jj = tl.arange(0, RQ)
    hh = tl.arange(0, 2)
    in_head = hh[None, :] * HALF + jj[:, None]  # [RQ, 2]: offset of each output within its head
    sign = tl.where(hh[None, :] == 0, -1.0, 1.0)
    other_half = (hh[None, :, None] != hh[None, None, :]).to(tl.float32)  # [1, 2, 2]
    dt = k_ptr.dtype.element_ty
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2).to(dt).to(tl.float32)  # [RQ, 2]
    partner = tl.sum(y[:, None, :] * other_half, axis=2)  # y of the other half, exactly
    roped = (y * c[:, None] + sign * partner * s[:, None]).to(dt)
    head = u // UPH
    j0 = (u % UPH) * RQ
    out = tl.where(head < HQ + HK, roped, y.to(dt))  # v is not rotated
    wi = tl.arange(0, 2 * WPH)
    words = (head * D + (wi // WPH) * HALF + j0) // VPW + wi % WPH
    _ll_write(qkv_ll + words, _ll_pack(tl.reshape(tl.trans(out), [2 * RQ]), flag, VPW), ASM)
    if slot >= 0:
        if head >= HQ:
            if head < HQ + HK:
                tl.store(k_ptr + kv_off + (head - HQ) * stride_head + j0 + in_head, out)
            else:
                tl.store(v_ptr + kv_off + (head - HQ - HK) * stride_head + j0 + in_head, out)


@triton.jit
def _qkv_phase(layer, pid, P, r_ll, n1_ptr, wqkv_ptr, cos_sin_ptr, pos, slot, qkv_ll, k_ptr, v_ptr,
               stride_blk, stride_head, eps, epoch, bar_ptr, b, trace_ptr,
               H: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
               RQ: tl.constexpr, BH: tl.constexpr, VPW: tl.constexpr, PACK_H: tl.constexpr, PIPE: tl.constexpr,
               PREFETCH: tl.constexpr, TRACE: tl.constexpr, ASM: tl.constexpr):
    """Phase A of `layer`: its input, the residual, is read when the previous layer's phase E (or the
    embedding) has written it (see the kernel's docstring for PIPE and PREFETCH)."""
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RQ
    DT: tl.constexpr = wqkv_ptr.dtype.element_ty
    n_units = (HQ + 2 * HK) * UPH
    r_flag = _flag(epoch, 1 + 5 * layer)
    out_flag = _flag(epoch, 2 + 5 * layer)
    jj = tl.arange(0, RQ)
    kv_off = (slot // BS) * stride_blk + (slot % BS) * D
    cs_row = cos_sin_ptr + pos * D
    a = tl.zeros([1, 1, BH], DT)
    if not PREFETCH:
        _gate(bar_ptr, b * P, ASM)
        a = _normed_residual(r_ll, r_flag, n1_ptr + layer * H, H, eps, BH, DT, VPW, PACK_H, ASM)[None, None, :]
        _mark(trace_ptr, 1 + 5 * layer, pid, TRACE)
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _qkv_tile(wqkv_ptr, layer, u, H, NQKV, D, RQ, BH)
        c = tl.load(cs_row + (u % UPH) * RQ + jj)
        s = tl.load(cs_row + HALF + (u % UPH) * RQ + jj)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _gate(bar_ptr, b * P, ASM)
                a = _normed_residual(r_ll, r_flag, n1_ptr + layer * H, H, eps, BH, DT, VPW, PACK_H,
                                     ASM)[None, None, :]
                _mark(trace_ptr, 1 + 5 * layer, pid, TRACE)
        _qkv_unit(w, a, c, s, u, slot, kv_off, qkv_ll, k_ptr, v_ptr, stride_head, out_flag, HQ, HK, D, RQ, VPW, ASM)


@triton.jit
def _keys_per_split(seq_len, num_splits, KEYS: tl.constexpr):
    """Keys of the context per attention split: whole KEYS tiles (each split starts at a multiple of
    KEYS), enough for num_splits of them to cover seq_len."""
    return tl.cdiv(tl.cdiv(seq_len, KEYS), num_splits) * KEYS


@triton.jit
def _first_tile_rows(pid, bt_ptr, seq_len, num_splits, stride_blk, HK: tl.constexpr, D: tl.constexpr,
                     BS: tl.constexpr, KEYS: tl.constexpr):
    """Cache-row offsets [KEYS] (within a layer's K or V, head 0) of the first key tile of this program's
    first attention unit (unit `pid`): the same pages in every layer, so read from the block table once
    per launch."""
    split = pid % num_splits
    keys = split * _keys_per_split(seq_len, num_splits, KEYS) + tl.arange(0, KEYS)
    mine = keys * 0 + pid < HK * num_splits
    blk = tl.load(bt_ptr + keys // BS, mask=(keys < seq_len) & mine, other=0).to(tl.int64)
    return blk * stride_blk + (keys % BS) * D


@triton.jit
def _preload_kv(pid, k_ptr, v_ptr, rows, seq_len, num_splits, stride_head,
                HK: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr):
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
def _attn_preloaded_tile(acc, l_i, m_i, q, kp, vp, lo, kv_end, qk_scale, KEYS: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """`_attn_inner`'s masked step over keys lo .. lo+KEYS−1 below kv_end (at least key lo) from a
    tile preloaded by `_preload_kv`."""
    keys = lo + tl.arange(0, KEYS)
    qk = _dot_qk(q, kp, UPCAST, IEEE)
    qk = tl.where((keys < kv_end)[None, :], qk * qk_scale, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot_pv(p.to(vp.dtype), vp, acc * alpha[:, None], UPCAST, IEEE)
    return acc, l_i, m_ij


@triton.jit
def _attn_newest(acc, l_i, m_i, q, k, v, qk_scale):
    """Fold the newest key (k, v [D], float32 holding the cache dtype's values) into (acc, l_i, m_i) as
    `_attn_inner` folds a tile: scores in the log2 domain, p rounded to the cache dtype (q's) for p·v."""
    s = tl.sum(q.to(tl.float32) * k[None, :], axis=1) * qk_scale
    m_ij = tl.maximum(m_i, s)
    p = tl.math.exp2(s - m_ij)
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * v[None, :]
    return acc, l_i, m_ij


@triton.jit
def _merge_partials(part_ptr, kvh, num_splits, G: tl.constexpr, D: tl.constexpr, MERGE: tl.constexpr):
    """The attention output [G, D] of KV head kvh's query heads from its num_splits partials (acc [D],
    m, l per query head; m in the log2 domain): Σₛ 2^(mₛ−M) accₛ / Σₛ 2^(mₛ−M) lₛ with M the running
    maximum, MERGE splits per step, in split order; 0 where no split had keys."""
    PW: tl.constexpr = D + 2
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    mx = tl.full([G], float("-inf"), tl.float32)
    den = tl.zeros([G], tl.float32)
    num = tl.zeros([G, D], tl.float32)
    for s0 in range(0, num_splits, MERGE):
        sp = s0 + tl.arange(0, MERGE)
        have = sp < num_splits
        rows = part_ptr + ((kvh * num_splits + sp)[:, None] * G + g[None, :]) * PW  # [MERGE, G]
        ms = tl.load(rows + D, mask=have[:, None], other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(rows + D + 1, mask=have[:, None], other=0.0, cache_modifier=".cg")
        accs = tl.load(rows[:, :, None] + d[None, None, :], mask=have[:, None, None], other=0.0,
                       cache_modifier=".cg")
        mx_new = tl.maximum(mx, tl.max(ms, axis=0))  # finite once a split with keys is seen
        alpha = tl.where(mx == float("-inf"), 0.0, tl.math.exp2(mx - mx_new))
        wgt = tl.where(ms == float("-inf"), 0.0, tl.math.exp2(ms - mx_new[None, :]))
        num = num * alpha[:, None] + tl.sum(wgt[:, :, None] * accs, axis=0)
        den = den * alpha + tl.sum(wgt * ls, axis=0)
        mx = mx_new
    return tl.where(den[:, None] > 0, num / den[:, None], 0.0)


@triton.jit
def _attention_phase(pid, P, layer, qkv_ll, k_ptr, v_ptr, bt_ptr, seq_len, num_splits, part_ptr, tickets_ptr,
                     attn_ll, stride_blk, stride_head, qk_scale, kp, vp, epoch, bar_ptr, b, trace_ptr, tb,
                     HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     KEYS: tl.constexpr, MERGE: tl.constexpr, MERGE_SMALL: tl.constexpr, BG: tl.constexpr,
                     VPW: tl.constexpr, PACK_B: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                     PRELOAD: tl.constexpr, TRACE: tl.constexpr, ASM: tl.constexpr):
    """Split-KV attention of the group's G query heads (padded to BG ≥ G + 2 rows, ≥ 16 for tl.dot)
    through the FlashAttention-2 inner loop of the other kernels (_flash.py; scores in the log2 domain)
    over the cached keys, then the newest key, read with q from phase A's flagged vector (one read: rows
    0..G−1 q, G the new k, G+1 the new v). With PRELOAD, (kp, vp) is the first tile of unit `pid` from
    `_preload_kv`. The last split of a KV head to take its ticket (monotone over the launch's layers)
    merges the head's partials into the flagged attention output."""
    G: tl.constexpr = HQ // HK
    PW: tl.constexpr = D + 2  # a partial: acc [D], m, l
    WD: tl.constexpr = D // VPW
    DT: tl.constexpr = k_ptr.dtype.element_ty
    in_flag = _flag(epoch, 2 + 5 * layer)
    out_flag = _flag(epoch, 3 + 5 * layer)
    rows_g = tl.arange(0, BG)
    d = tl.arange(0, D)
    keys_per_split = _keys_per_split(seq_len, num_splits, KEYS)
    for u in range(pid, HK * num_splits, P):
        kvh = u // num_splits
        split = u % num_splits
        head = tl.where(rows_g < G, kvh * G + rows_g,
                        tl.where(rows_g == G, HQ + kvh, tl.where(rows_g == G + 1, HQ + HK + kvh, kvh * G)))
        words = tl.reshape(head[:, None] * WD + tl.arange(0, WD)[None, :], [BG * WD])
        if u == pid:
            _gate(bar_ptr, b * P, ASM)
        x = tl.reshape(_ll_values(_ll_read(qkv_ll + words, in_flag, PACK_B, ASM), DT, VPW), [BG, D])
        if TRACE:
            if pid == 0:
                if u == pid:
                    tl.store(trace_ptr + 2 + 5 * layer, _now(pid))
        q = tl.where((rows_g < G)[:, None], x, 0.0)
        k_new = tl.sum(tl.where((rows_g == G)[:, None], x.to(tl.float32), 0.0), axis=0)
        v_new = tl.sum(tl.where((rows_g == G + 1)[:, None], x.to(tl.float32), 0.0), axis=0)
        q_pos = tl.full([BG], 0, tl.int32) + seq_len  # the new token sees every key
        m = tl.full([BG], float("-inf"), tl.float32)
        l = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, D], tl.float32)
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, seq_len)
        old_end = seq_len - 1  # keys before the new token's, all in the cache since earlier steps
        start = lo
        if PRELOAD:
            if u == pid:
                if lo < old_end:
                    acc, l, m = _attn_preloaded_tile(acc, l, m, q, kp, vp, lo, old_end, qk_scale, KEYS, UPCAST, IEEE)
                start = lo + KEYS
        acc, l, m = _attn_inner(acc, l, m, q, q_pos, k_ptr + kvh * stride_head, v_ptr + kvh * stride_head, bt_ptr,
                                start, tl.minimum(hi, old_end), old_end, qk_scale, stride_blk, D, D, KEYS, BS, False,
                                True, UPCAST, IEEE)
        if (hi == seq_len) & (seq_len > 0):  # the last split also takes the new token's key
            acc, l, m = _attn_newest(acc, l, m, q, k_new, v_new, qk_scale)
        if TRACE:
            if pid == 0:
                if u == pid:
                    tl.store(trace_ptr + tb, _now(pid))
        m = tl.where(l > 0, m, float("-inf"))  # an empty split
        real = rows_g < G  # the padding rows are not stored
        part = part_ptr + (u * G + rows_g) * PW  # [BG] row starts of this unit's partials
        tl.store(part[:, None] + d[None, :], acc, mask=real[:, None])
        tl.store(part + D, m, mask=real)
        tl.store(part + D + 1, l, mask=real)
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + kvh, 1, sem="acq_rel", scope="gpu")
        if TRACE:
            if pid == 0:
                if u == pid:
                    tl.store(trace_ptr + tb + 1, _now(ticket))
        if ticket == (layer + 1) * num_splits - 1:  # the last split of this KV head merges them all, in split order
            if num_splits <= MERGE_SMALL:  # one narrow step (a wide one reduces mostly padding)
                out = _merge_partials(part_ptr, kvh, num_splits, G, D, MERGE_SMALL)
            else:
                out = _merge_partials(part_ptr, kvh, num_splits, G, D, MERGE)
            _ll_put(attn_ll, kvh * G * D, tl.reshape(out.to(DT), [G * D]), out_flag, VPW, ASM)
        if TRACE:
            if pid == 0:
                if u == pid:
                    tl.store(trace_ptr + tb + 2, _now(pid))


@triton.jit
def _residual_unit(w, a, res, u, r_ll, flag, R: tl.constexpr, VPW: tl.constexpr, ASM: tl.constexpr):
    """Unit u of phases C and E: r[rows] = round(round(W x)[rows] + res) for its tile w [R, BK] (rows
    u·R + [0, R)), x as a [1, BK] and the rows' residual res [R] (float32), written with `flag`."""
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1).to(w.dtype)
    _ll_put(r_ll, u * R, (y.to(tl.float32) + res).to(w.dtype), flag, VPW, ASM)


@triton.jit
def _residual_phase(layer, pid, P, x_ll, x_flag, w_ptr, r_ll, r_flag, out_flag, bar_ptr, b, trace_ptr, tm,
                    N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, MAXU: tl.constexpr,
                    VPW: tl.constexpr, PACK_X: tl.constexpr, PIPE: tl.constexpr, PREFETCH: tl.constexpr,
                    TRACE: tl.constexpr, ASM: tl.constexpr):
    """r ← round(round(W x) + r) over the units of W [N, K] (phases C and E): x read once written with
    x_flag, r's rows with r_flag (earlier, so always there first: that read is issued first and its
    round trip hides under the wait for x), the new rows written with out_flag. The residual rows of all
    of this program's units (at most MAXU) are read once, not by the pipelined loop."""
    DT: tl.constexpr = w_ptr.dtype.element_ty
    n_units = N // R
    it = tl.arange(0, MAXU)
    mine = pid + it * P  # [MAXU]: this program's i-th unit
    a = tl.zeros([1, BK], DT)
    res_all = tl.zeros([MAXU, R], DT)
    if not PREFETCH:
        _gate(bar_ptr, b * P, ASM)
        res_all = _ll_rows(r_ll, mine * R, mine < n_units, r_flag, R, DT, VPW, ASM)
        a = _ll_vector(x_ll, x_flag, K, BK, DT, VPW, PACK_X, ASM)[None, :]
        _mark(trace_ptr, tm, pid, TRACE)
    for u in tl.range(pid, n_units, P, num_stages=PIPE):
        w = _rows_tile(w_ptr, layer, u, N, K, R, BK)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _gate(bar_ptr, b * P, ASM)
                res_all = _ll_rows(r_ll, mine * R, mine < n_units, r_flag, R, DT, VPW, ASM)
                a = _ll_vector(x_ll, x_flag, K, BK, DT, VPW, PACK_X, ASM)[None, :]
                _mark(trace_ptr, tm, pid, TRACE)
        res = tl.sum(tl.where(it[:, None] == (u - pid) // P, res_all.to(tl.float32), 0.0), axis=0)
        _residual_unit(w, a, res, u, r_ll, out_flag, R, VPW, ASM)


@triton.jit
def _gate_up_phase(layer, pid, P, r_ll, n2_ptr, wgu_ptr, act_ll, eps, epoch, bar_ptr, b, trace_ptr,
                   H: tl.constexpr, F: tl.constexpr, RG: tl.constexpr, BH: tl.constexpr, VPW: tl.constexpr,
                   PACK_H: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, TRACE: tl.constexpr,
                   ASM: tl.constexpr):
    """Phase D of `layer`: its input is the residual as phase C wrote it."""
    DT: tl.constexpr = wgu_ptr.dtype.element_ty
    n_units = F // RG
    r_flag = _flag(epoch, 4 + 5 * layer)
    out_flag = _flag(epoch, 5 + 5 * layer)
    a = tl.zeros([1, 1, BH], DT)
    if not PREFETCH:
        _gate(bar_ptr, b * P, ASM)
        a = _normed_residual(r_ll, r_flag, n2_ptr + layer * H, H, eps, BH, DT, VPW, PACK_H, ASM)[None, None, :]
        _mark(trace_ptr, 4 + 5 * layer, pid, TRACE)
    for u in tl.range(pid, n_units, P, num_stages=STAGES):
        w = _gate_up_tile(wgu_ptr, layer, u, H, F, RG, BH)
        if PREFETCH:
            if u == pid:  # the pipeline's first tiles are in flight
                _gate(bar_ptr, b * P, ASM)
                a = _normed_residual(r_ll, r_flag, n2_ptr + layer * H, H, eps, BH, DT, VPW, PACK_H,
                                     ASM)[None, None, :]
                _mark(trace_ptr, 4 + 5 * layer, pid, TRACE)
        _gate_up_unit(w, a, u, act_ll, out_flag, RG, VPW, ASM)


@triton.jit
def _gate_up_unit(w, a, u, act_ll, flag, RG: tl.constexpr, VPW: tl.constexpr, ASM: tl.constexpr):
    """Unit u of phase D: act[rows] = round(silu(g) ⊙ u) with g, u = round(W a) of its tile [RG, 2, BH],
    written with `flag`."""
    hh = tl.arange(0, 2)[None, :]
    y = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=2).to(w.dtype).to(tl.float32)  # [RG, 2]
    gate = tl.sum(tl.where(hh == 0, y, 0.0), axis=1)
    up = tl.sum(tl.where(hh == 1, y, 0.0), axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    _ll_put(act_ll, u * RG, act.to(w.dtype), flag, VPW, ASM)


# ---------------------------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["num_layers", "num_splits", "layer_stride", "v_offset"])
def _decode_megakernel(ids_ptr, pos_ptr, slot_ptr, seq_len_ptr, bt_ptr,
                       emb_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, n1_ptr, n2_ptr, nf_ptr, cos_sin_ptr,
                       kv_ptr, layer_stride, v_offset, stride_blk, stride_head,
                       r_ll, qkv_ll, attn_ll, act_ll, part_ptr, tickets_ptr, counters_ptr, out_ptr, trace_ptr,
                       num_layers, num_splits, eps, scale,
                       H: tl.constexpr, F: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                       BS: tl.constexpr, RQ: tl.constexpr, RO: tl.constexpr, RG: tl.constexpr,
                       RD: tl.constexpr, KEYS: tl.constexpr, MERGE: tl.constexpr, MERGE_SMALL: tl.constexpr,
                       BG: tl.constexpr, MAXU_C: tl.constexpr, MAXU_E: tl.constexpr, VPW: tl.constexpr,
                       PACK_H: tl.constexpr, PACK_Q: tl.constexpr, PACK_F: tl.constexpr, PACK_B: tl.constexpr,
                       TRACE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr,
                       PIPE: tl.constexpr, PREFETCH: tl.constexpr, PRELOAD: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    BH: tl.constexpr = triton.next_power_of_2(H)
    BF: tl.constexpr = triton.next_power_of_2(F)
    QD: tl.constexpr = HQ * D
    BQ: tl.constexpr = triton.next_power_of_2(QD)
    HKP: tl.constexpr = triton.next_power_of_2(HK)

    if TRACE:
        if pid == 0:
            tl.store(trace_ptr, _now(pid))
    epoch = tl.load(counters_ptr, cache_modifier=".cg")  # this launch's number (mod 2²⁰): the flags' base
    tok = tl.load(ids_ptr).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    seq_len = tl.load(seq_len_ptr)
    # context splits per KV head: at most num_splits, each a whole number of KEYS tiles, none empty (one,
    # without keys, at seq_len 0: a padded graph row still writes its attention output, zeros)
    tiles = tl.maximum(tl.cdiv(seq_len, KEYS), 1)
    splits = tl.cdiv(tiles, tl.cdiv(tiles, num_splits))
    bar_ptr = counters_ptr + 1  # arrivals: phase b's readers wait for b · P of them
    cols = tl.arange(0, BH)
    if pid == 0:  # r ← the token's embedding row
        e = tl.load(emb_ptr + tok * H + cols, mask=cols < H, other=0.0)
        _ll_put(r_ll, 0, tl.reshape(e, [BH]).to(emb_ptr.dtype.element_ty), _flag(epoch, 1), VPW, ASM)
    if PRELOAD:
        rows_pre = _first_tile_rows(pid, bt_ptr, seq_len, splits, stride_blk, HK, D, BS, KEYS)
    else:
        rows_pre = 0
    _arrive(bar_ptr)
    # Each phase reads its input vector, flagged by the phase that wrote it (phase p of layer l: 2 + 5l + p;
    # the embedding 1), after the arrival count says that phase is done; with PREFETCH, after issuing its
    # first weight tiles (they depend on nothing), so they stream while the slowest programs finish.
    for layer in range(num_layers):
        b = 1 + 5 * layer  # arrival rounds before this layer: the embedding's, then 5 per layer
        k_ptr = kv_ptr + tl.cast(layer, tl.int64) * layer_stride
        v_ptr = k_ptr + v_offset
        _qkv_phase(layer, pid, P, r_ll, n1_ptr, wqkv_ptr, cos_sin_ptr, pos, slot, qkv_ll, k_ptr, v_ptr,
                   stride_blk, stride_head, eps, epoch, bar_ptr, b, trace_ptr, H, HQ, HK, D, BS, RQ, BH, VPW, PACK_H,
                   PIPE, PREFETCH, TRACE, ASM)
        _arrive(bar_ptr)
        if PRELOAD:
            kp, vp = _preload_kv(pid, k_ptr, v_ptr, rows_pre, seq_len, splits, stride_head, HK, D, KEYS)
        else:
            kp, vp = 0, 0
        _attention_phase(pid, P, layer, qkv_ll, k_ptr, v_ptr, bt_ptr, seq_len, splits, part_ptr, tickets_ptr,
                         attn_ll, stride_blk, stride_head, scale * 1.4426950408889634, kp, vp, epoch, bar_ptr, b + 1,
                         trace_ptr, 3 + 5 * num_layers + 3 * layer, HQ, HK, D, BS, KEYS, MERGE, MERGE_SMALL, BG,
                         VPW, PACK_B, UPCAST, IEEE, PRELOAD, TRACE, ASM)
        _arrive(bar_ptr)
        _residual_phase(layer, pid, P, attn_ll, _flag(epoch, 3 + 5 * layer), wo_ptr, r_ll,
                        _flag(epoch, 1 + 5 * layer), _flag(epoch, 4 + 5 * layer), bar_ptr, b + 2, trace_ptr,
                        3 + 5 * layer, H, QD, RO, BQ, MAXU_C, VPW, PACK_Q, PIPE, PREFETCH, TRACE, ASM)
        _arrive(bar_ptr)
        _gate_up_phase(layer, pid, P, r_ll, n2_ptr, wgu_ptr, act_ll, eps, epoch, bar_ptr, b + 3, trace_ptr,
                       H, F, RG, BH, VPW, PACK_H, STAGES, PREFETCH, TRACE, ASM)
        _arrive(bar_ptr)
        _residual_phase(layer, pid, P, act_ll, _flag(epoch, 5 + 5 * layer), wd_ptr, r_ll,
                        _flag(epoch, 4 + 5 * layer), _flag(epoch, 6 + 5 * layer), bar_ptr, b + 4, trace_ptr,
                        5 + 5 * layer, H, F, RD, BF, MAXU_E, VPW, PACK_F, PIPE, PREFETCH, TRACE, ASM)
        _arrive(bar_ptr)
    if pid == 0:
        _gate(bar_ptr, (1 + 5 * num_layers) * P, ASM)
        x = _ll_vector(r_ll, _flag(epoch, 1 + 5 * num_layers), H, BH, nf_ptr.dtype.element_ty, VPW, PACK_H, ASM)
        _mark(trace_ptr, 1 + 5 * num_layers, pid, TRACE)
        out = _normed(x, nf_ptr, H, eps, BH)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < H)
    # Leave: the last program out (every program has read the epoch, arrived everywhere and taken every
    # ticket) resets the tickets and counts and advances the epoch for the next launch.
    tl.debug_barrier()
    left = tl.atomic_add(counters_ptr + 2, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        hk = tl.arange(0, HKP)
        tl.store(tickets_ptr + hk, tl.zeros([HKP], tl.int32), mask=hk < HK)
        tl.atomic_xchg(counters_ptr + 2, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr, (epoch + 1) % (1 << 20), sem="relaxed", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 2 + 5 * num_layers, _now(pid))


# ---------------------------------------------------------------------------------------------- launcher
def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


ATTN_KEYS = 64  # keys per attention tile (tl.dot's N), as the decode kernel's default
MAX_PHASES = 2048  # phase instances per launch that the flags can tell apart (see _flag)
MAX_SPLITS = 16  # context splits per KV head in the attention phase (33 at 2 programs per SM: slower on the H200)


class Workspace:
    """Scratch of one launch configuration: the flagged vectors phases hand on (residual, q|k|v,
    attention output, SwiGLU output: int64 words, padded to powers of two), the split partials, the
    per-KV-head tickets, and three counters: the launch's epoch (the flags' base), the phases' arrivals
    and the programs that have left (both zero between launches). Allocated once; captured graphs point at it. The context of
    each KV head is cut into `num_splits` parts (default: as many as fill the programs)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: torch.device, programs: int,
                 num_splits: int | None = None) -> None:
        s = shape
        self.programs = programs
        self.num_splits = num_splits or max(1, min(MAX_SPLITS, programs // s.num_kv_heads))
        self.values_per_word = 4 // torch.empty(0, dtype=dtype).element_size()
        group = s.num_heads // s.num_kv_heads
        words = lambda n: torch.zeros(next_power_of_2(n) // self.values_per_word, dtype=torch.int64,  # noqa: E731
                                      device=device)
        self.r, self.qkv, self.attn, self.act = (words(s.hidden), words((s.num_heads + 2 * s.num_kv_heads) * s.head_dim),
                                                 words(s.num_heads * s.head_dim), words(s.intermediate))
        self.partials = torch.zeros(s.num_kv_heads * self.num_splits * group * (s.head_dim + 2), dtype=torch.float32,
                                    device=device)
        self.tickets = torch.zeros(s.num_kv_heads, dtype=torch.int32, device=device)
        self.counters = torch.zeros(3, dtype=torch.int32, device=device)  # [epoch, arrivals, programs out]
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
    power of two ≥ 2 (a unit writes whole flagged words) giving ~`tile` weight elements per unit."""
    bh = next_power_of_2(shape.hidden)
    def dividing(r: int, n: int) -> int:  # the largest power of two in [2, r] that divides n (n even)
        r = max(2, _pow2_at_most(max(1, r)))
        while n % r:
            r //= 2
        return r

    rq = dividing(min(shape.head_dim // 2, tile // (2 * bh)), shape.head_dim // 2)
    ro = dividing(tile // next_power_of_2(shape.num_heads * shape.head_dim), shape.hidden)
    rg = dividing(tile // (2 * bh), shape.intermediate)
    rd = dividing(tile // next_power_of_2(shape.intermediate), shape.hidden)
    return rq, ro, rg, rd


PIPELINE_BYTES = 160 << 10  # shared memory the pipelined weight tiles may take (of the SM's 227 KB)


def unit_tile(config: MegakernelConfig, elem_bytes: int) -> int:
    """Weight elements per unit: config.tile, halved until the deepest pipeline's stages − 1 buffers in
    flight fit in PIPELINE_BYTES (float32 weights take half the elements of bf16)."""
    tile, stages = config.tile, max(config.stages, config.ace_stages)
    while stages > 1 and tile > 256 and tile * elem_bytes * (stages - 1) > PIPELINE_BYTES:
        tile //= 2
    return tile


def decode_megakernel_fwd(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor, weights: StackedWeights,
                          cos_sin: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                          shape: ModelShape, eps: float, scale: float, workspace: Workspace,
                          config: MegakernelConfig = MegakernelConfig(), trace: bool = False) -> torch.Tensor:
    """One decode token of one sequence through every layer → the final-normed hidden state [1, H].

    input_ids, positions, slot_mapping: [1] (int64); seq_lens: [1] int32, the context including the new
    token (≥ 1); block_table: [≥ cdiv(seq_len, block_size)] int32. kv_caches: per layer (k, v), each
    [num_blocks, Hk, block_size, D], all carved from one buffer at a fixed layer stride (as the model
    runner allocates them); the new token's K/V are written at slot_mapping[0] (−1: nowhere).
    `trace` (CUDA): program 0 writes the global timer each time its input for a phase has arrived into
    workspace.trace ([3 + 8·L] int64 ns: start, after the embedding, 5 per layer when phases A–E got
    their input, end; then 3 per layer inside phase B: program 0's unit computed, its ticket taken, its
    merge (if it was last) done).
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
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping),
                    ("seq_lens", seq_lens), ("block_table", block_table)):
        check_int(name, t)
    if block_size & (block_size - 1):
        raise ValueError(f"the decode megakernel needs a power-of-two KV block size, got {block_size}")
    if config.stages < 1 or config.ace_stages < 1 or config.merge_width & (config.merge_width - 1):
        raise ValueError(f"megakernel config {config}: stages ≥ 1 and a power-of-two merge width needed")
    num_layers = weights.qkv.shape[0]
    if 2 + 5 * num_layers > MAX_PHASES:
        raise ValueError(f"the decode megakernel serves at most {(MAX_PHASES - 2) // 5} layers, got {num_layers}")
    rq, ro, rg, rd = unit_rows(shape, unit_tile(config, weights.qkv.element_size()))
    out = torch.empty((1, shape.hidden), dtype=weights.qkv.dtype, device=input_ids.device)
    ws = workspace
    cuda = input_ids.device.type == "cuda"
    if trace and ws.trace.numel() != 3 + 8 * num_layers:
        ws.trace = torch.zeros(3 + 8 * num_layers, dtype=torch.int64, device=input_ids.device)
    vpw = ws.values_per_word
    group = shape.num_heads // shape.num_kv_heads
    bg = max(16, next_power_of_2(group + 2))
    threads = config.num_warps * 32
    def pack(values: int) -> int:  # a thread's words of a flagged vector: spun on in one asm statement
        return min(MAX_PACK, max(1, next_power_of_2(values) // vpw // threads))
    args = (
        input_ids, positions, slot_mapping, seq_lens, block_table,
        weights.embed, weights.qkv, weights.o, weights.gate_up, weights.down, weights.norm1, weights.norm2,
        weights.norm_final, cos_sin, k0, layer_stride, v_offset, k0.stride(0), k0.stride(1),
        ws.r, ws.qkv, ws.attn, ws.act, ws.partials, ws.tickets, ws.counters, out, ws.trace,
        num_layers, ws.num_splits, eps, scale)
    kwargs = dict(
        H=shape.hidden, F=shape.intermediate, HQ=shape.num_heads, HK=shape.num_kv_heads, D=shape.head_dim,
        BS=block_size, RQ=rq, RO=ro, RG=rg, RD=rd, KEYS=ATTN_KEYS,
        MERGE=min(config.merge_width, next_power_of_2(ws.num_splits)), MERGE_SMALL=min(4, config.merge_width),
        BG=bg, MAXU_C=next_power_of_2(-(-(shape.hidden // ro) // ws.programs)),
        MAXU_E=next_power_of_2(-(-(shape.hidden // rd) // ws.programs)), VPW=vpw,
        PACK_H=pack(shape.hidden), PACK_Q=pack(shape.num_heads * shape.head_dim), PACK_F=pack(shape.intermediate),
        PACK_B=pack(bg * shape.head_dim),
        UPCAST=upcast_dot(input_ids.device), IEEE=weights.qkv.dtype == torch.float32, TRACE=trace and cuda,
        STAGES=config.stages, PIPE=config.ace_stages, PREFETCH=config.prefetch, ASM=cuda,
        PRELOAD=config.preload_kv, num_warps=config.num_warps, num_stages=1)
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
    """The grid: `programs_per_sm` per multiprocessor on CUDA (the launch caps registers at
    `max_registers` so that they fit, and `check_resident` verifies the compiled kernel), one program on
    the CPU interpreter (which runs programs one after another)."""
    return num_sms(device) * config.programs_per_sm if device.type == "cuda" else 1


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
        raise RuntimeError(f"decode megakernel: {config.programs_per_sm} programs per SM do not fit "
                           f"({compiled.n_regs} registers × {threads} threads, {shared} B shared): {fits} do")
