"""The weight phases of the rows megakernel: a matrix product over a few token rows with its epilogue.

Every weight phase computes Y = W X for the step's rows, W [N, K] one layer's stacked weight and X
[rows, K] the phase's input, and hands each unit of R output rows to an epilogue (`KIND`):

    QKV       X = RMSNorm(r; w1)   q, k ← RoPE; q to the workspace, k and v into the paged cache
                                   (QK_NORM: q and k unrotated to the workspace, for phase B)
    OUT       X = attention out    r ← round(round(Y) + r), with each row's Σ r² per unit
    GATE_UP   X = RMSNorm(r; w2)   act = round(silu(round(Yg)) ⊙ round(Yu))
    DOWN      X = act              r ← round(round(Y) + r), with each row's Σ r² per unit

A unit is R weight rows (QKV: R/2 rows of a head's first half and their RoPE partners; GATE_UP: R/2
gate rows and the matching up rows), dealt round-robin to the programs. A program walks its units'
K columns in chunks of KC, chunk-major: for each chunk it multiplies every one of its units' tiles
[R, KC] by the same input chunk [BP, KC] on the tensor cores (tl.dot, R ≥ 16 and BP ≥ 16 rows), so it
reads each input chunk once, and keeps one float32 accumulator [R, BP] per unit ([MAXU, R, BP] in all).
After the last chunk each unit's epilogue runs.

Pipelining. The weight tiles do not depend on the barrier before the phase, so the loop is
software-pipelined over them (tl.range's num_stages) and the pipeline's first tiles are in flight
before the barrier's wait, which sits in the loop's first iteration (as in the batch-1 megakernel).
The input does depend on it: it is loaded inside conditional blocks, which the pipeliner leaves in
place, with `.cg` loads (from L2; an SM's L1 is not coherent with the other SMs' stores), into a ring of
registers AHEAD chunks ahead of the one being multiplied.

The input norm. RMSNorm needs each row's Σ x² over all K columns before any chunk is normalised. The
OUT and DOWN epilogues store their units' Σ r² per row (`ss`, [BP, NUP]); the next normed phase sums
them in unit order (deterministic) for its rstd. Layer 0's input is the embedding rows, whose rstd the
kernel computes once before the layer loop (`embedding_rstd`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.grid_sync import end_phase
from tinyvllm.kernels.decode_megakernel.qkv_phase import cache_value
from tinyvllm.kernels.flash_tiles import dot_qk

QKV = tl.constexpr(0)  # the kinds of weight phase (module docstring)
OUT = tl.constexpr(1)
GATE_UP = tl.constexpr(2)
DOWN = tl.constexpr(3)


@triton.jit
def unit_weight_rows(u, KIND: tl.constexpr, R: tl.constexpr, D: tl.constexpr, F: tl.constexpr):
    """The R weight rows of unit u, [R]: QKV rows head·D + j0 + [0, R/2) then the same + D/2 (their RoPE
    partners; R/2 divides D/2), GATE_UP gate rows u·R/2 + [0, R/2) then the same + F (the up rows), OUT and
    DOWN rows u·R + [0, R)."""
    r = tl.arange(0, R)
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
def _weight_tile(
    w_ptr,
    layer,
    u,
    kc,
    N: tl.constexpr,
    K: tl.constexpr,
    KIND: tl.constexpr,
    R: tl.constexpr,
    KC: tl.constexpr,
    D: tl.constexpr,
    F: tl.constexpr,
):
    """Columns kc·KC + [0, KC) of unit u's rows of layer `layer`'s W [N, K], [R, KC] (a pipelined load)."""
    rows = unit_weight_rows(u, KIND, R, D, F)
    cols = kc * KC + tl.arange(0, KC)
    base = w_ptr + tl.cast(layer, tl.int64) * (N * K)
    return tl.load(base + rows[:, None].to(tl.int64) * K + cols[None, :])


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
def _input_chunk(x_ptr, x_rows, live, kc, nw_ptr, rstd, KC: tl.constexpr, NORMED: tl.constexpr):
    """Columns kc·KC + [0, KC) of the phase's input for every row, [BP, KC] in x's dtype (rows not `live`:
    zero): x itself, or with NORMED RMSNorm(x; w) in rms_norm.py's roundings, round(w ⊙ round(x · rstd))."""
    cols = kc * KC + tl.arange(0, KC)
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    if NORMED:
        w = tl.load(nw_ptr + cols).to(tl.float32)
        y = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (w[None, :] * y.to(tl.float32)).to(x.dtype)
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
    NUP: tl.constexpr,
    PIPE: tl.constexpr,
    NORMED: tl.constexpr,
    AHEAD: tl.constexpr,
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
    """One weight phase of `layer` (module docstring), starting with the wait of barrier b inside the
    first iteration of its PIPE-deep pipelined loop.

    Input: x_ptr at element offsets x_rows [BP] per row (rows not `live` are skipped); NORMED: RMSNorm'd
    by this layer's weight nw_ptr [K], with rstd [BP] given, or where from_sums computed after the wait
    from the previous residual phase's num_sums_in unit sums at ss_in_ptr. Weights: w_ptr the stacked
    [L, N, K]; FP8W: float8_e4m3fn with the stacked row scales ws_ptr [L, N], converted to the input's
    dtype for the product and each row's float32 sum scaled after it. The epilogue's operands by KIND:
    AHEAD (1–3): how many chunks ahead the input is loaded (a program with one unit a chunk multiplies a
    chunk in less time than an L2 load takes).
    QKV out_ptr = q, pos, kv_off, cs_ptr, k_ptr, v_ptr, bias_ptr (this layer's), stride_head, the cache
    scales; GATE_UP out_ptr = act; OUT and DOWN out_ptr = r, the residual res_ptr + res_rows, ss_out_ptr.
    """
    NKC: tl.constexpr = K // KC
    n_units = N // R
    mine = tl.cdiv(tl.maximum(n_units - pid, 0), P)  # this program's units: pid, pid + P, ...
    total = mine * NKC
    j_of = tl.arange(0, MAXU)[:, None, None]
    acc = tl.zeros([MAXU, R, BP], tl.float32)
    x = tl.zeros([BP, KC], x_ptr.dtype.element_ty)  # this chunk's input
    x1, x2, x3 = x, x, x  # the next chunks' (up to AHEAD = 3), loaded while this one is multiplied
    layer_scales = ws_ptr + tl.cast(layer, tl.int64) * N
    for it in tl.range(0, total, num_stages=PIPE):
        kc = it // mine
        jj = it % mine
        u = pid + jj * P
        w = _weight_tile(w_ptr, layer, u, kc, N, K, KIND, R, KC, D, F)
        if it == 0:  # the pipeline's first tiles are in flight
            end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
            if NORMED and from_sums:
                rstd = rstd_from_sums(ss_in_ptr, num_sums_in, live, H, eps, BP, NUP)
            x = _input_chunk(x_ptr, x_rows, live, 0, nw_ptr, rstd, KC, NORMED)
            if AHEAD >= 2 and NKC > 1:
                x1 = _input_chunk(x_ptr, x_rows, live, 1, nw_ptr, rstd, KC, NORMED)
            if AHEAD >= 3 and NKC > 2:
                x2 = _input_chunk(x_ptr, x_rows, live, 2, nw_ptr, rstd, KC, NORMED)
        if (jj == 0) & (kc + AHEAD < NKC):  # chunk kc + AHEAD: the newest of the ring
            if AHEAD == 1:
                x1 = _input_chunk(x_ptr, x_rows, live, kc + 1, nw_ptr, rstd, KC, NORMED)
            elif AHEAD == 2:
                x2 = _input_chunk(x_ptr, x_rows, live, kc + 2, nw_ptr, rstd, KC, NORMED)
            else:
                x3 = _input_chunk(x_ptr, x_rows, live, kc + 3, nw_ptr, rstd, KC, NORMED)
        if FP8W:
            w = w.to(x.dtype)
        y = dot_qk(w, x, UPCAST, IEEE)  # [R, BP]
        acc = tl.where(j_of == jj, acc + y[None, :, :], acc)
        if kc == NKC - 1:
            y = tl.sum(tl.where(j_of == jj, acc, 0.0), axis=0)
            if FP8W:
                y = y * tl.load(layer_scales + unit_weight_rows(u, KIND, R, D, F))[:, None]
            if KIND == QKV:
                _qkv_epilogue(
                    y,
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
                _gate_up_epilogue(y, u, live, out_ptr, F, R, BP)
            else:
                _residual_epilogue(y, u, live, res_ptr, res_rows, out_ptr, ss_out_ptr, H, R, BP, NUP)
        if jj == mine - 1:  # the chunk's last unit: the ring moves one chunk on
            x, x1, x2 = x1, x2, x3
    if total == 0:
        end_phase(bar_ptr, b, P, trace_ptr, pid, TRACE, ASM)
