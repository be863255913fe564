"""Phase B of the decode megakernel: o = softmax(scale · q Kᵀ) V over the sequence's cached keys,
split-KV ("Flash-Decoding") through the FlashAttention-2 inner loop of the other attention kernels
(flash_tiles.py: tl.dot over KEYS-key tiles, scores in the log2 domain).

A unit is (KV head, split of the context): the GQA group's G query heads (padded to BG ≥ 16 rows for
tl.dot) against one split's keys, whole KEYS-key tiles of the context, none empty. Each unit stores its
partial (acc [G, D], m, l [G]) in the split-minor layout of `store_partial`; the merge
    o = Σₛ 2^(mₛ−M) accₛ / Σₛ 2^(mₛ−M) lₛ,   M = maxₛ mₛ
is `group_attention`, run by phase C's programs (`split_o`) or by the last split to take its KV head's
ticket.

A program's first unit takes its first key tile preloaded between phase A's arrival and wait: every key
but the newest was written by earlier steps (`preload_kv`); the newest, which phase A writes, is read
after the barrier (`attn_first_tile`). The pages of that tile are the same in every layer, so the block
table is read for it once per launch (`first_tile_rows`; twice where only some layers have a window).

Sliding window (WINDOW): a layer with a window of W keys attends keys kv_start = max(0, seq_len − W) ..
seq_len − 1. Its splits cover the KEYS-aligned range from `base` = the tile holding kv_start, so only the
first tile of the first split is masked, and keys below kv_start are never loaded (their cache blocks may
have been freed and handed to another sequence).

QK_NORM (Qwen3): phase A left q and k unrotated; each unit normalises and rotates its group's query heads
itself (`normed_rotated`, a few KB), and the unit whose split holds the new token's key computes that
key, writes it to the cache and folds it into its running softmax first, from registers; the key tiles
then stop before it (nothing reads the cache row this launch writes).

FP8KV (an FP8 cache, kernels/flash_tiles.py): tiles are converted exactly to q's dtype as they load; K's
scale is folded into qk_scale by the caller and V's into the normaliser each unit stores (l / v_scale),
so the merge Σ 2^(m−M) acc / Σ 2^(m−M) l / v_scale scales the output by v_scale once, as the decode
attention kernel does. QK_NORM's new key is written quantized (e4m3(k / k_scale)) and folded in as
read back from the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.grid_sync import now, trace_attention
from tinyvllm.kernels.flash_tiles import attn_inner, dot_pv, dot_qk
from tinyvllm.kernels.fp8_convert import cache_value


def kv_alignable(layer_stride: int, v_offset: int) -> bool:
    """Whether `layer_kv_ptrs` may mark the layer offsets aligned: both multiples of 16 elements."""
    return layer_stride % 16 == 0 and v_offset % 16 == 0


@triton.jit
def layer_kv_ptrs(kv_ptr, layer, layer_stride, v_offset, ALIGN: tl.constexpr):
    """(K, V) of `layer` in the caches' buffer: K at kv_ptr + layer·layer_stride elements, V at K +
    v_offset. ALIGN: both offsets are multiples of 16 elements (the launcher checks, `kv_alignable`). The two are
    unspecialised arguments, so without the hint the compiler cannot prove the K/V tiles' alignment and
    loads them 2 bytes at a time; the hint goes on an operation's result (one on an argument is dropped)."""
    k_off = tl.cast(layer, tl.int64) * layer_stride
    v_off = k_off + v_offset
    if ALIGN:
        k_off = tl.multiple_of(k_off, 16)
        v_off = tl.multiple_of(v_off, 16)
    return kv_ptr + k_off, kv_ptr + v_off


@triton.jit
def keys_per_split(num_keys, num_splits, KEYS: tl.constexpr):
    """Keys per split: whole KEYS tiles (each split starts at a multiple of KEYS from the range's start),
    enough for num_splits of them to cover num_keys."""
    return tl.cdiv(tl.cdiv(num_keys, KEYS), num_splits) * KEYS


@triton.jit
def _tile_rows(bt_ptr, keys, live, stride_blk, D: tl.constexpr, BS: tl.constexpr):
    """Cache-row offsets (within a layer's K or V, head 0) of positions `keys`; block-table entries only
    where `live` (others: row offsets of block 0, never loaded)."""
    blk = tl.load(bt_ptr + keys // BS, mask=live, other=0).to(tl.int64)
    return blk * stride_blk + (keys % BS) * D


@triton.jit
def first_tile_rows(
    pid,
    bt_ptr,
    seq_len,
    num_splits,
    stride_blk,
    base,
    kv_start,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    KEYS: tl.constexpr,
):
    """Cache-row offsets [KEYS] (within a layer's K or V, head 0) of the first key tile of this program's
    first unit (unit `pid`), the splits covering keys base .. seq_len − 1, keys from kv_start on read."""
    split = pid % num_splits
    keys = base + split * keys_per_split(seq_len - base, num_splits, KEYS) + tl.arange(0, KEYS)
    mine = keys * 0 + pid < HK * num_splits
    return _tile_rows(bt_ptr, keys, (keys < seq_len) & (keys >= kv_start) & mine, stride_blk, D, BS)


@triton.jit
def preload_kv(
    pid,
    k_ptr,
    v_ptr,
    rows,
    seq_len,
    num_splits,
    stride_head,
    base,
    kv_start,
    HK: tl.constexpr,
    D: tl.constexpr,
    KEYS: tl.constexpr,
):
    """The first key tile of this program's first unit (`rows` from `first_tile_rows`), every key from
    kv_start on but the newest: (K [KEYS, D], V [KEYS, D]). The newest key's row is masked (its cache line
    is not touched: a D-element row is whole 128-byte lines at D·size ≥ 128) and read after the barrier
    by `attn_first_tile`."""
    kvh = pid // num_splits
    keys = base + (pid % num_splits) * keys_per_split(seq_len - base, num_splits, KEYS) + tl.arange(0, KEYS)
    ptrs = kvh * stride_head + rows[:, None] + tl.arange(0, D)[None, :]
    old = ((keys < seq_len - 1) & (keys >= kv_start) & (keys * 0 + pid < HK * num_splits))[:, None]
    return tl.load(k_ptr + ptrs, mask=old, other=0.0), tl.load(v_ptr + ptrs, mask=old, other=0.0)


@triton.jit
def normed_rotated(x_ptr, heads, live, w_ptr, cs_row, eps, D: tl.constexpr):
    """RoPE(RMSNorm(x_h; w)) of the head vectors x_h = x_ptr[h·D .. h·D + D) for h in `heads` [n] (rows
    not `live` are zero), in ops.rms_norm's and ops.rope's roundings: n = round(w ⊙ round(x · rstd)),
    rstd = 1 / sqrt(mean(x²) + eps) over the head's D features, then round([n₁c − n₂s, n₂c + n₁s]) with
    c, s = cs_row[:D/2], cs_row[D/2:]. Each element's rotation partner is loaded by its own address, so the
    rotation needs no exchange between threads. Returns [n, D] in x's dtype."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    partner = (d + HALF) % D
    row = heads[:, None] * D
    x = tl.load(x_ptr + row + d[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    xp = tl.load(x_ptr + row + partner[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + partner).to(tl.float32)
    n = (w[None, :] * (xf * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    np_ = (wp[None, :] * (xpf * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    c = tl.load(cs_row + d % HALF)
    s = tl.load(cs_row + HALF + d % HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    return (n * c[None, :] + sign[None, :] * np_ * s[None, :]).to(x.dtype)


@triton.jit
def _attn_first_tile(
    acc,
    l_i,
    m_i,
    q,
    kp,
    vp,
    rows,
    k_head_ptr,
    v_head_ptr,
    lo,
    seq_len,
    kv_start,
    kv_end,
    qk_scale,
    D: tl.constexpr,
    KEYS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """`attn_inner`'s masked step over keys lo .. lo+KEYS−1 from the preloaded tile (kp, vp), the keys
    kv_start .. kv_end − 1 visible, the newest key's row (where visible) read now from L2 (phase A wrote
    it, possibly on another SM)."""
    keys = lo + tl.arange(0, KEYS)
    newest = ((keys == seq_len - 1) & (keys < kv_end))[:, None]
    ptrs = rows[:, None] + tl.arange(0, D)[None, :]
    k_new = tl.load(k_head_ptr + ptrs, mask=newest, other=0.0, cache_modifier=".cg").to(q.dtype)
    v_new = tl.load(v_head_ptr + ptrs, mask=newest, other=0.0, cache_modifier=".cg").to(q.dtype)
    k = tl.where(newest, k_new, kp.to(q.dtype))  # an FP8 cache: exact in q's dtype
    v = tl.where(newest, v_new, vp.to(q.dtype))
    qk = dot_qk(q, k, UPCAST, IEEE)
    visible = ((keys >= kv_start) & (keys < kv_end))[None, :]
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = dot_pv(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
    return acc, l_i, m_ij


@triton.jit
def _store_in_runs(
    part_ptr, kvh, split, acc, m_i, l_i, rows_g, HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SM: tl.constexpr
):
    """One split's partial (acc [BG, D], m_i, l_i [BG]; rows ≥ G are padding) at its slot of the split-minor
    layout, runs of SM slots: acc[kvh, g, d, split], then m[kvh, g, split], then l[kvh, g, split]."""
    real = rows_g < G
    row = kvh * G + rows_g
    d = tl.arange(0, D)
    tl.store(part_ptr + (row[:, None] * D + d[None, :]) * SM + split, acc, mask=real[:, None])
    tl.store(part_ptr + HK * G * D * SM + row * SM + split, m_i, mask=real)
    tl.store(part_ptr + HK * G * (D + 1) * SM + row * SM + split, l_i, mask=real)


@triton.jit
def store_partial(
    part_ptr,
    kvh,
    split,
    num_splits,
    acc,
    m_i,
    l_i,
    rows_g,
    HK: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SM: tl.constexpr,
):
    """`_store_in_runs` in the runs `group_attention` reads: of 4 slots at ≤ 4 splits (a narrow merge),
    else of SM."""
    if num_splits <= 4:
        _store_in_runs(part_ptr, kvh, split, acc, m_i, l_i, rows_g, HK, G, D, 4)
    else:
        _store_in_runs(part_ptr, kvh, split, acc, m_i, l_i, rows_g, HK, G, D, SM)


@triton.jit
def fold_new_key(
    q,
    qk_ptr,
    kvh,
    k_ptr,
    v_ptr,
    kv_off,
    stride_head,
    kn_ptr,
    cs_row,
    eps,
    k_scale,
    qk_scale,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BG: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """QK_NORM: the running softmax state (acc [BG, D], l_i, m_i [BG]) after the new key alone. The key is
    normalised and rotated from phase A's unrotated k head HQ + kvh at qk_ptr (`normed_rotated`), written
    to its cache row (kv_off: the new token's slot, KV head kvh at stride_head) of k_ptr (e4m3(k / k_scale)
    with FP8KV) and used as every later step reads it back; its value is phase A's, read from the cache
    (L2)."""
    k_head = HQ + kvh + tl.zeros([1], tl.int32)
    k_new = normed_rotated(qk_ptr, k_head, k_head >= 0, kn_ptr, cs_row, eps, D)  # [1, D]
    kv_row = kv_off + kvh * stride_head + tl.arange(0, D)[None, :]
    k_cached = cache_value(k_new.to(tl.float32), k_scale, q.dtype, FP8KV, EMULATE)
    tl.store(k_ptr + kv_row, k_cached)
    v_new = tl.load(v_ptr + kv_row, cache_modifier=".cg").to(tl.float32)  # [1, D], phase A's
    k_new = k_cached.to(q.dtype)  # the key as every later step reads it from the cache
    m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
    l_i = tl.full([BG], 1.0, tl.float32)
    acc = tl.zeros([BG, D], tl.float32) + v_new
    return acc, l_i, m_i


@triton.jit
def _merge_partials(
    part_ptr, kvh, num_splits, HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SM: tl.constexpr
):
    """The attention output [GP, D] of KV head kvh's query heads (rows ≥ G, the padding of a group that is
    not a power of two, are 0) from its num_splits partials
    (`store_partial`'s layout, runs of SM slots; m in the log2 domain): Σₛ 2^(mₛ−M) accₛ / Σₛ 2^(mₛ−M) lₛ
    with M = maxₛ mₛ, 0 where no split had keys.

    Each thread loads the SM-long runs of its (query head, column) pairs as 16-byte vectors and reduces
    them itself, so the merge exchanges nothing between warps. m and l are loaded in the same [G, D, SM]
    shape (repeated along D) so that every operand shares one layout. The loads are unmasked (a mask
    would split the vectors): the slots beyond num_splits hold earlier launches' partials or zeros, all
    finite, and are masked here; padding rows are masked along the head axis only, which keeps the vectors."""
    g = tl.arange(0, GP)[:, None, None]
    d = tl.arange(0, D)[None, :, None]
    sp = tl.arange(0, SM)[None, None, :]
    have = sp < num_splits
    row = kvh * G + g  # [GP, 1, 1]
    if GP == G:
        accs = tl.load(part_ptr + (row * D + d) * SM + sp, cache_modifier=".cg")
        ms = tl.load(part_ptr + HK * G * D * SM + row * SM + sp + d * 0, cache_modifier=".cg")
        ls = tl.load(part_ptr + HK * G * (D + 1) * SM + row * SM + sp + d * 0, cache_modifier=".cg")
    else:
        real = g < G
        accs = tl.load(part_ptr + (row * D + d) * SM + sp, mask=real, other=0.0, cache_modifier=".cg")
        m_at = part_ptr + HK * G * D * SM + row * SM + sp + d * 0
        ms = tl.load(m_at, mask=real, other=0.0, cache_modifier=".cg")
        ls = tl.load(m_at + HK * G * SM, mask=real, other=0.0, cache_modifier=".cg")
        have = have & real
    accs = tl.where(have, accs, 0.0)
    ms = tl.where(have, ms, float("-inf"))
    ls = tl.where(have, ls, 0.0)
    mx = tl.max(ms, axis=2)  # [G, D]; −inf where no split had keys
    wgt = tl.where(ms == float("-inf"), 0.0, tl.math.exp2(ms - mx[:, :, None]))
    num = tl.sum(wgt * accs, axis=2)
    den = tl.sum(wgt * ls, axis=2)
    return tl.where(den > 0, num / den, 0.0)


@triton.jit
def group_attention(
    part_ptr,
    g,
    num_splits,
    dtype: tl.constexpr,
    HK: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    SM: tl.constexpr,
):
    """KV group g's attention output [GP, D] (GP = G rounded up to a power of two; padding rows 0) merged
    from its split partials, rounded to dtype. Partials are stored in runs of 4 slots at ≤ 4 splits (a
    narrower merge), else of SM slots."""
    if num_splits <= 4:
        o_g = _merge_partials(part_ptr, g, num_splits, HK, G, GP, D, 4)
    else:
        o_g = _merge_partials(part_ptr, g, num_splits, HK, G, GP, D, SM)
    return o_g.to(dtype)


@triton.jit
def attention_phase(
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
    base,
    kv_start,
    slot,
    kv_off,
    qn_ptr,
    kn_ptr,
    cs_row,
    eps,
    k_scale,
    v_scale,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    KEYS: tl.constexpr,
    SM: tl.constexpr,
    BG: tl.constexpr,
    GP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    TRACE: tl.constexpr,
    SPLIT_O: tl.constexpr,
    WINDOW: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Phase B of `layer` (the caller has waited at its barrier). (kp, vp, rows_pre): the first tile of
    unit `pid` from `preload_kv`. With SPLIT_O the units only store their partials (phase C merges them);
    without, the last split of a KV head to take its ticket merges the head's partials into attn. The
    tickets only grow within a launch (layer l's last split sees (l + 1)·num_splits − 1): nothing resets
    them on the merger's critical path.

    The splits cover keys base .. seq_len − 1 and keys kv_start .. seq_len − 1 are visible (base = 0 =
    kv_start without a window; WINDOW: some layer may have one, so a unit's first tile may start below
    kv_start). QK_NORM (module docstring): qn_ptr, kn_ptr this layer's q/k norm weights [D], cs_row the
    token's cos/sin row, eps the norms' epsilon; the new key goes to the cache at kv_off (slot ≥ 0; with
    slot −1 it is read from the cache as every other key). FP8KV: the cache is e4m3 with this layer's
    scales k_scale (already in qk_scale; used here to write QK_NORM's new key) and v_scale (module
    docstring); EMULATE: the interpreter's e4m3 rounding."""
    G: tl.constexpr = HQ // HK
    g = tl.arange(0, GP)
    rows_g = tl.arange(0, BG)
    d = tl.arange(0, D)
    split_keys = keys_per_split(seq_len - base, num_splits, KEYS)
    kv_end = seq_len  # the key tiles' end: QK_NORM folds the new key from registers instead
    if QK_NORM:
        kv_end = tl.where(slot >= 0, seq_len - 1, seq_len)
    for u in range(pid, HK * num_splits, P):
        kvh = u // num_splits
        split = u % num_splits
        if QK_NORM:
            q = normed_rotated(q_ptr, kvh * G + rows_g, rows_g < G, qn_ptr, cs_row, eps, D)
        else:
            q = tl.load(
                q_ptr + (kvh * G + rows_g)[:, None] * D + d[None, :],
                mask=(rows_g < G)[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
        q_pos = tl.full([BG], 0, tl.int32) + seq_len  # the new token sees every key
        m_i = tl.full([BG], float("-inf"), tl.float32)
        l_i = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, D], tl.float32)
        lo = base + split * split_keys
        hi = tl.minimum(lo + split_keys, seq_len)
        start = lo
        if QK_NORM:  # noqa: SIM102 (a constexpr test apart) -- the unit holding the new key folds it first
            if (kv_end < seq_len) & (lo < hi) & (hi == seq_len):
                acc, l_i, m_i = fold_new_key(
                    q, q_ptr, kvh, k_ptr, v_ptr, kv_off, stride_head, kn_ptr, cs_row, eps, k_scale, qk_scale,
                    HQ, D, BG, FP8KV, EMULATE,
                )  # fmt: skip
        if u == pid:  # the preloaded first tile
            if lo < hi:
                acc, l_i, m_i = _attn_first_tile(
                    acc,
                    l_i,
                    m_i,
                    q,
                    kp,
                    vp,
                    rows_pre,
                    k_ptr + kvh * stride_head,
                    v_ptr + kvh * stride_head,
                    lo,
                    seq_len,
                    kv_start,
                    kv_end,
                    qk_scale,
                    D,
                    KEYS,
                    UPCAST,
                    IEEE,
                )
            start = lo + KEYS
        elif WINDOW:  # noqa: SIM102 (a constexpr test apart) -- a first tile that starts below the window
            if lo < kv_start:
                keys = lo + tl.arange(0, KEYS)
                rows = _tile_rows(bt_ptr, keys, (keys >= kv_start) & (keys < seq_len), stride_blk, D, BS)
                ptrs = kvh * stride_head + rows[:, None] + d[None, :]
                old = ((keys >= kv_start) & (keys < seq_len - 1))[:, None]
                acc, l_i, m_i = _attn_first_tile(
                    acc,
                    l_i,
                    m_i,
                    q,
                    tl.load(k_ptr + ptrs, mask=old, other=0.0),
                    tl.load(v_ptr + ptrs, mask=old, other=0.0),
                    rows,
                    k_ptr + kvh * stride_head,
                    v_ptr + kvh * stride_head,
                    lo,
                    seq_len,
                    kv_start,
                    kv_end,
                    qk_scale,
                    D,
                    KEYS,
                    UPCAST,
                    IEEE,
                )
                start = lo + KEYS
        acc, l_i, m_i = attn_inner(
            acc,
            l_i,
            m_i,
            q,
            q_pos,
            k_ptr + kvh * stride_head,
            v_ptr + kvh * stride_head,
            bt_ptr,
            start,
            hi,
            tl.minimum(hi, kv_end),
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
        if TRACE:  # noqa: SIM102 (a constexpr test apart: untraced kernels hold no trace code)
            if u == pid:
                trace_attention(trace_ptr, pid, layer, tb, 0, now(pid))
        m_i = tl.where(l_i > 0, m_i, float("-inf"))  # an empty split
        if FP8KV:  # V's scale joins the normaliser: the merge's output is then v_scale · Σ acc / Σ l
            l_i = l_i / v_scale
        store_partial(part_ptr, kvh, split, num_splits, acc, m_i, l_i, rows_g, HK, G, D, SM)
        if SPLIT_O:
            if TRACE:  # noqa: SIM102 (constexpr tests apart) -- no ticket, no merge: both at the unit's time
                if u == pid:
                    t = now(pid)
                    trace_attention(trace_ptr, pid, layer, tb, 1, t)
                    trace_attention(trace_ptr, pid, layer, tb, 2, t)
        else:
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + kvh, 1, sem="acq_rel", scope="gpu")
            if TRACE:  # noqa: SIM102 (a constexpr test apart)
                if u == pid:
                    trace_attention(trace_ptr, pid, layer, tb, 1, now(ticket))
            if ticket == (layer + 1) * num_splits - 1:  # the last split of this layer's KV head
                out = group_attention(part_ptr, kvh, num_splits, attn_ptr.dtype.element_ty, HK, G, GP, D, SM)
                tl.store(attn_ptr + (kvh * G + g)[:, None] * D + d[None, :], out, mask=(g < G)[:, None])
            if TRACE:  # noqa: SIM102 (a constexpr test apart)
                if u == pid:
                    trace_attention(trace_ptr, pid, layer, tb, 2, now(pid))
