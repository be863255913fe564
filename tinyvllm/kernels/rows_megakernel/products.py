"""The weight phases of the rows megakernel: a matrix product over a few token rows with its epilogue.

Every weight phase computes Y = W X for the step's rows, W [N, K] one layer's stacked weight and X
[rows, K] the phase's input, and hands each unit of R output rows to an epilogue (`KIND`):

    QKV       X = RMSNorm(r; w1)   q, k ← RoPE; q to the workspace, k and v into the paged cache
                                   (QK_NORM: q and k unrotated to the workspace, for phase B)
    OUT       X = attention out    r ← round(round(Y) + r), with each row's Σ r² per unit
    GATE_UP   X = RMSNorm(r; w2)   act = round(silu(round(Yg)) ⊙ round(Yu))
    DOWN      X = act              r ← round(round(Y) + r), with each row's Σ r² per unit

A unit is R weight rows (QKV: R/2 rows of a head's first half and their RoPE partners; GATE_UP: R/2
gate rows and the matching up rows), dealt round-robin to the programs: a program owns units pid, pid
+ P, ..., at most MAXU of them, M = MAXU·R rows (the rows of units it lacks are masked: loaded as zeros,
no memory read).

The loop. One iteration per K chunk of KC columns: a program gathers the chunk's columns of all of its
M rows (per-row pointers) and multiplies them by the input chunk of every row at once, one wide tl.dot
whose float32 accumulator stays in the MMA layout for the whole loop (never converted or selected per
unit). So each input chunk is read once per program, and an iteration is one MMA over all of the
program's rows instead of one tiny [R, KC] product per unit with a layout conversion after it. Where M
is small (the out and down products: one unit a program at 1B) a [M, KC] product would leave most warps
idle and run a long dependent MMA chain on the others, so the chunk's K is split S ways (S = the warps,
launch.phase_plan): a batched product [S, M, KC/S] · [S, KC/S, BP] → [S, M, BP], one slice per warp, its
S partial sums added in order after the last chunk. Phases with M ≥ 16 per warp (S = 1) split M over
the warps instead (on sm_90 a wgmma). After the loop the products [M, BP] (FP8 weights: times their row
scales) go to a per-program float32 scratch in global memory, and each unit's epilogue reads its R rows
back.

Pipelining. Both operands stream through shared memory in a PIPE-deep software pipeline (cp.async; the
input with `.cg`, from L2: an SM's L1 is not coherent with the other SMs' stores). The input depends on
the barrier before the phase, so the loop starts after its wait; the weights do not: their first PIPE − 1
tiles are prefetched into L2 before the wait, so the pipeline's first copies after it hit L2.

The input norm. RMSNorm needs each row's Σ x² over all K columns before any chunk is normalised. The
OUT and DOWN epilogues store their units' Σ r² per row (`ss`, [BP, NUP]); the next normed phase sums
them in unit order (deterministic) for its rstd. Layer 0's input is the embedding rows, whose rstd the
kernel computes once before the layer loop (`embedding_rstd`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.grid_sync import end_phase
from tinyvllm.kernels.flash_tiles import dot_pv
from tinyvllm.kernels.fp8_convert import cache_value
from tinyvllm.kernels.grid_dependency import prefetch_l2

QKV = tl.constexpr(0)  # the kinds of weight phase (module docstring)
OUT = tl.constexpr(1)
GATE_UP = tl.constexpr(2)
DOWN = tl.constexpr(3)


@triton.jit
def weight_rows(u, r, KIND: tl.constexpr, R: tl.constexpr, D: tl.constexpr, F: tl.constexpr):
    """Row r (in [0, R)) of unit u (u, r broadcastable tensors): QKV rows head·D + j0 + [0, R/2) then the
    same + D/2 (their RoPE partners; R/2 divides D/2), GATE_UP gate rows u·R/2 + [0, R/2) then the same + F
    (the up rows), OUT and DOWN rows u·R + [0, R)."""
    RH: tl.constexpr = R // 2
    if KIND == QKV:
        UPH: tl.constexpr = D // 2 // RH
        rows = (u // UPH) * D + (u % UPH) * RH + (r % RH) + (r // RH) * (D // 2)
    elif KIND == GATE_UP:
        rows = u * RH + (r % RH) + (r // RH) * F
    else:
        rows = u * R + r
    return rows


@triton.jit
def unit_weight_rows(u, KIND: tl.constexpr, R: tl.constexpr, D: tl.constexpr, F: tl.constexpr):
    """The R weight rows of unit u, [R] (`weight_rows`)."""
    return weight_rows(u, tl.arange(0, R), KIND, R, D, F)


@triton.jit
def rstd_from_sums(ss_ptr, num_sums, live, H, eps, BP: tl.constexpr, NUP: tl.constexpr):
    """1 / sqrt(Σ x² / H + eps) per row [BP] from the per-unit sums of squares ss [BP, NUP] (the first
    num_sums of each row), summed in unit order."""
    j = tl.arange(0, NUP)
    b = tl.arange(0, BP)
    s = tl.load(
        ss_ptr + b[:, None] * NUP + j[None, :],
        mask=live[:, None] & (j < num_sums)[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    return 1.0 / tl.sqrt(tl.sum(s, axis=1) / H + eps)


@triton.jit
def embedding_rstd(emb_ptr, x_rows, live, H: tl.constexpr, eps, BP: tl.constexpr, KC: tl.constexpr):
    """rstd [BP] of the embedding rows at element offsets x_rows [BP] (layer 0's input), in KC chunks."""
    acc = tl.zeros([BP], tl.float32)
    for k0 in range(0, H, KC):
        cols = k0 + tl.arange(0, KC)
        x = tl.load(emb_ptr + x_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(acc / H + eps)


@triton.jit
def _input_chunk(x_ptr, x_rows, live, cols, nw_ptr, rstd, NORMED: tl.constexpr):
    """The phase's input at columns `cols` of every row, transposed: [KC, BP] (cols [KC, 1]) or [S, KC/S, BP]
    (cols [S, KC/S, 1]), in x's dtype (rows not `live`: zero): x itself, or with NORMED RMSNorm(x; w) in
    rms_norm.py's roundings, round(w ⊙ round(x · rstd)). A pipelined `.cg` load: the loop that issues it
    starts after the phase's barrier."""
    x = tl.load(x_ptr + x_rows + cols, mask=live, other=0.0, cache_modifier=".cg")
    if NORMED:
        w = tl.load(nw_ptr + cols).to(tl.float32)
        y = (x.to(tl.float32) * rstd).to(x.dtype)
        x = (w * y.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _halves(y, R: tl.constexpr, BP: tl.constexpr):
    """(rows [0, R/2), rows [R/2, R)) of y [R, BP], each [R/2, BP], exactly."""
    y3 = tl.reshape(y, [2, R // 2, BP])
    h = tl.arange(0, 2)[:, None, None]
    return tl.sum(tl.where(h == 0, y3, 0.0), axis=0), tl.sum(tl.where(h == 1, y3, 0.0), axis=0)


@triton.jit
def _qkv_epilogue(
    y,
    u,
    live,
    pos,
    kv_off,
    cs_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    stride_head,
    k_scale,
    v_scale,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Unit u of phase A from its rows' float32 products y [R, BP] (scaled already, FP8 weights): add the
    bias (HAS_BIAS, this layer's), round, rotate q and k by RoPE at each row's position pos [BP]
    (y₁, y₂ → y₁c − y₂s, y₂c + y₁s; cs_ptr the cos/sin table [positions, D]); q into the workspace [BP,
    QS], k and v into the cache at each row's kv_off (−1: nowhere). QK_NORM (Qwen3):
    RoPE follows a per-head RMSNorm that needs a head's whole D outputs, which a unit does not hold: q and
    k go into the workspace unrotated, [q heads | k heads] per row, and phase B normalises and rotates
    them (attention.py); v goes to the cache either way."""
    RH: tl.constexpr = R // 2
    HALF: tl.constexpr = D // 2
    UPH: tl.constexpr = HALF // RH
    QS: tl.constexpr = (HQ + HK * QK_NORM) * D  # a row of q: its q heads (QK_NORM: and its k heads)
    head = u // UPH
    j = (u % UPH) * RH + tl.arange(0, RH)  # offsets within the head's first half
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    if HAS_BIAS:
        rows = unit_weight_rows(u, QKV, R, D, 1)
        y += tl.load(bias_ptr + rows)[:, None].to(tl.float32)
    y = y.to(dtype).to(tl.float32)
    y1, y2 = _halves(y, R, BP)
    b = tl.arange(0, BP)
    to_workspace = head < HQ
    if QK_NORM:
        to_workspace = head < HQ + HK
    elif head < HQ + HK:
        c = tl.load(cs_ptr + pos[None, :] * D + j[:, None], mask=live[None, :], other=0.0)
        s = tl.load(cs_ptr + pos[None, :] * D + HALF + j[:, None], mask=live[None, :], other=0.0)
        y1, y2 = y1 * c - y2 * s, y2 * c + y1 * s
    if to_workspace:
        q_at = q_ptr + b[None, :] * QS + head * D + j[:, None]
        tl.store(q_at, y1.to(dtype), mask=live[None, :])
        tl.store(q_at + HALF, y2.to(dtype), mask=live[None, :])
    else:
        writes = live & (kv_off >= 0)
        if head < HQ + HK:
            cache_at = k_ptr + (head - HQ) * stride_head
            scale = k_scale
        else:
            cache_at = v_ptr + (head - HQ - HK) * stride_head
            scale = v_scale
        cache_at = cache_at + kv_off[None, :] + j[:, None]
        cdt: tl.constexpr = k_ptr.dtype.element_ty
        y1 = y1.to(dtype).to(tl.float32)
        y2 = y2.to(dtype).to(tl.float32)
        tl.store(cache_at, cache_value(y1, scale, cdt, FP8KV, EMULATE), mask=writes[None, :])
        tl.store(cache_at + HALF, cache_value(y2, scale, cdt, FP8KV, EMULATE), mask=writes[None, :])


@triton.jit
def _gate_up_epilogue(y, u, live, act_ptr, F: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
    """Unit u of phase D from y [R, BP] (gate rows, then up rows): act = round(silu(round(g)) ⊙ round(u))
    into act [BP, F]."""
    dtype: tl.constexpr = act_ptr.dtype.element_ty
    g, up = _halves(y.to(dtype).to(tl.float32), R, BP)
    a = g / (1.0 + tl.exp(-g)) * up
    cols = u * (R // 2) + tl.arange(0, R // 2)
    tl.store(act_ptr + tl.arange(0, BP)[None, :] * F + cols[:, None], a.to(dtype), mask=live[None, :])


@triton.jit
def _residual_epilogue(
    y, u, live, res_ptr, res_rows, r_ptr, ss_ptr, H: tl.constexpr, R: tl.constexpr, BP: tl.constexpr, NUP: tl.constexpr
):
    """Unit u of phase C or E from y [R, BP]: r[rows] = round(round(y) + res[rows]) for every row (res at
    element offsets res_rows [BP]: the embedding rows in layer 0's phase C, else r itself), and each
    row's Σ r² over the unit's rows into ss[row, u]."""
    dtype: tl.constexpr = r_ptr.dtype.element_ty
    rows = u * R + tl.arange(0, R)
    b = tl.arange(0, BP)
    res = tl.load(res_ptr + res_rows[None, :] + rows[:, None], mask=live[None, :], other=0.0, cache_modifier=".cg")
    out = (y.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(r_ptr + b[None, :] * H + rows[:, None], out, mask=live[None, :])
    of = out.to(tl.float32)
    tl.store(ss_ptr + b * NUP + u, tl.sum(of * of, axis=0), mask=live)


@triton.jit
def product_phase(
    KIND: tl.constexpr,
    layer,
    pid,
    P,
    live,
    x_ptr,
    x_rows,
    nw_ptr,
    rstd,
    from_sums,
    ss_in_ptr,
    num_sums_in,
    w_ptr,
    ws_ptr,
    out_ptr,
    res_ptr,
    res_rows,
    ss_out_ptr,
    pos,
    kv_off,
    cs_ptr,
    k_ptr,
    v_ptr,
    bias_ptr,
    stride_head,
    k_scale,
    v_scale,
    eps,
    scratch_ptr,
    bar_ptr,
    b,
    trace_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    H: tl.constexpr,
    F: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    KC: tl.constexpr,
    BP: tl.constexpr,
    MAXU: tl.constexpr,
    S: tl.constexpr,
    NUP: tl.constexpr,
    PIPE: tl.constexpr,
    NORMED: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8W: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One weight phase of `layer` (module docstring): the first weight tiles prefetched into L2, the wait
    of barrier b, the PIPE-deep pipelined loop over the K chunks, the units' epilogues.

    Input: x_ptr at element offsets x_rows [BP] per row (rows not `live` are skipped); NORMED: RMSNorm'd
    by this layer's weight nw_ptr [K], with rstd [BP] given, or where from_sums computed after the wait
    from the previous residual phase's num_sums_in unit sums at ss_in_ptr. Weights: w_ptr the stacked
    [L, N, K]; FP8W: float8_e4m3fn with the stacked row scales ws_ptr [L, N], converted to the input's
    dtype for the product and each row's float32 sum scaled after it. A program's rows: M = MAXU·R (its
    units' rows; those of units it lacks masked), each chunk's K split S ways (S = 1: a 2-D product).
    scratch_ptr: the programs' float32 [P, M, BP] products, read back per unit. The epilogue's operands
    by KIND: QKV out_ptr = q, pos, kv_off, cs_ptr, k_ptr, v_ptr, bias_ptr (this layer's), stride_head,
    the cache scales; GATE_UP out_ptr = act; OUT and DOWN out_ptr = r, the residual res_ptr + res_rows,
    ss_out_ptr.
    """
    M: tl.constexpr = MAXU * R
    NKC: tl.constexpr = K // KC
    KS: tl.constexpr = KC // S
    n_units = N // R
    mine = tl.cdiv(tl.maximum(n_units - pid, 0), P)  # this program's units: pid, pid + P, ...
    m = tl.arange(0, M)
    owned = m // R < mine
    u_of = tl.where(owned, pid + (m // R) * P, pid)  # units it lacks: its first unit's rows (masked loads)
    rows = weight_rows(u_of, m % R, KIND, R, D, F)
    w_rows = w_ptr + tl.cast(layer, tl.int64) * (N * K) + rows.to(tl.int64) * K  # [M]
    if ASM:  # noqa: SIM102 (a constexpr, then a runtime condition): the first tiles into L2 while the barrier waits
        if mine > 0:
            ELT: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
            LPR: tl.constexpr = (KC * ELT + 127) // 128  # 128-byte lines per row of a tile
            for t in tl.static_range(PIPE - 1):
                if t < NKC:
                    prefetch_l2(w_rows[:, None] + t * KC + tl.arange(0, LPR)[None, :] * (128 // ELT))
    end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
    if NORMED and from_sums:
        rstd = rstd_from_sums(ss_in_ptr, num_sums_in, live, H, eps, BP, NUP)
    if S == 1:
        w_at = w_rows[:, None] + tl.arange(0, KC)[None, :]  # [M, KC]
        w_mask = owned[:, None]
        x_cols = tl.arange(0, KC)[:, None]  # [KC, 1]
        x_at = x_rows[None, :]
        x_live = live[None, :]
        x_rstd = rstd[None, :]
        acc = tl.zeros([M, BP], tl.float32)
    else:
        s_of = tl.arange(0, S)[:, None, None] * KS
        k_of = tl.arange(0, KS)
        w_at = w_rows[None, :, None] + s_of + k_of[None, None, :]  # [S, M, KS]
        w_mask = owned[None, :, None]
        x_cols = s_of + k_of[None, :, None]  # [S, KS, 1]
        x_at = x_rows[None, None, :]
        x_live = live[None, None, :]
        x_rstd = rstd[None, None, :]
        acc = tl.zeros([S, M, BP], tl.float32)
    for kc in tl.range(0, tl.where(mine > 0, NKC, 0), num_stages=PIPE):
        w = tl.load(w_at + kc * KC, mask=w_mask, other=0.0)
        x = _input_chunk(x_ptr, x_at, x_live, x_cols + kc * KC, nw_ptr, x_rstd, NORMED)
        if FP8W:
            w = w.to(x.dtype)
        acc = dot_pv(w, x, acc, UPCAST, IEEE)
    if S == 1:
        y = acc
    else:
        y = tl.sum(acc, axis=0)  # [M, BP]: the K slices summed in order
    if FP8W:
        y = y * tl.load(ws_ptr + tl.cast(layer, tl.int64) * N + rows, mask=owned, other=0.0)[:, None]
    r = tl.arange(0, R)
    bp = tl.arange(0, BP)
    scratch = scratch_ptr + pid * (M * BP)
    tl.store(scratch + m[:, None] * BP + bp[None, :], y)
    tl.debug_barrier()
    for j in range(mine):
        u = pid + j * P
        yu = tl.load(scratch + (j * R + r)[:, None] * BP + bp[None, :])
        if KIND == QKV:
            _qkv_epilogue(
                yu,
                u,
                live,
                pos,
                kv_off,
                cs_ptr,
                out_ptr,
                k_ptr,
                v_ptr,
                bias_ptr,
                stride_head,
                k_scale,
                v_scale,
                HQ,
                HK,
                D,
                R,
                BP,
                HAS_BIAS,
                QK_NORM,
                FP8KV,
                EMULATE,
            )
        elif KIND == GATE_UP:
            _gate_up_epilogue(yu, u, live, out_ptr, F, R, BP)
        else:
            _residual_epilogue(yu, u, live, res_ptr, res_rows, out_ptr, ss_out_ptr, H, R, BP, NUP)
