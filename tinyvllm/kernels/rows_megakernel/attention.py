"""Phase B of the rows megakernel: each row's new query against its own cached keys, split-KV.

A unit is (row, KV head, split of the row's context): the GQA group's query heads (padded to BG ≥ 16
rows for tl.dot) against whole KEYS-key tiles of one split, through the FlashAttention-2 inner loop
(flash_tiles.attn_inner) over the row's block table. Each unit stores its partial (acc, m, l) in its
row's region of the partials (the batch-1 megakernel's split-minor layout, decode_megakernel/
attention_phase.py), then takes its (row, KV head)'s ticket; the last split to take it merges the
partials by logsumexp into the attention output [BP, HQ·D] in split order, whichever split that is, so
the result does not depend on the programs' timing.

Splits: each row's context is cut into at most `num_splits` splits of whole tiles, none empty
(`row_splits`), counted from the lowest first key of any layer, so every layer of a row has the same
number of splits and the tickets, which only grow within a launch, reach (layer + 1) · splits − 1 at
each layer's last split. A window (WINDOW) moves a layer's keys' start to max(0, seq_len − window);
its splits then cover the tiles from the one holding that key (some may be empty: stored as l = 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.attention_phase import (
    fold_new_key,
    group_attention,
    keys_per_split,
    normed_rotated,
    store_partial,
)
from tinyvllm.kernels.flash_tiles import attn_inner


@triton.jit
def window_start(seq_len, window, on):
    """The first visible key of a row of seq_len keys (the new token's included) under a window of
    `window` keys where `on`, else 0."""
    return tl.where(on, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def row_splits(seq_len, num_splits, base, KEYS: tl.constexpr):
    """Splits of a row's keys base .. seq_len − 1: at most num_splits, each whole KEYS tiles, none empty
    (one at seq_len 0, a CUDA graph's padding row)."""
    tiles = tl.maximum(tl.cdiv(seq_len - base, KEYS), 1)
    return tl.cdiv(tiles, tl.cdiv(tiles, num_splits))


@triton.jit
def rows_attention_phase(
    layer,
    pid,
    P,
    num_rows,
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    bt_stride,
    seq_len_ptr,
    pos_ptr,
    slot_ptr,
    num_splits,
    part_ptr,
    tickets_ptr,
    attn_ptr,
    stride_blk,
    stride_head,
    qk_scale,
    k_scale,
    v_scale,
    window,
    windowed,
    qn_ptr,
    kn_ptr,
    cos_sin_ptr,
    eps,
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
    WINDOW: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8KV: tl.constexpr,
    EMULATE: tl.constexpr,
    KV_STAGES: tl.constexpr,
):
    """Phase B of `layer` (the caller has waited at its barrier): q [BP, HQ·D] (rotated, phase A's), the
    layer's caches k_ptr, v_ptr, each row's block table at bt_ptr + row · bt_stride and its context
    length; the merged output into attn [BP, HQ·D]. qk_scale: softmax scale · log2(e) (· k_scale for an
    FP8 cache, whose v_scale joins the normaliser). WINDOW: 0 none, else this layer has a window of
    `window` keys where `windowed`; every row's splits count from the lowest first key of any layer
    (all_windowed = WINDOW 2: the window's). QK_NORM (Qwen3): q [BP, (HQ + HK)·D] holds phase A's
    unrotated q and k heads; each unit normalises (this layer's qn_ptr, kn_ptr [D]) and rotates its group's
    query heads at its row's position, and the unit whose split holds the row's new key computes that
    key, writes it to the cache at the row's slot (k_scale: an FP8 cache's) and folds it into its softmax
    from registers; its key tiles stop before it. KV_STAGES: the key loop's software pipeline depth (the
    kernel runs unpipelined, and at 16 rows a unit holds a row's whole context)."""
    G: tl.constexpr = HQ // HK
    QD: tl.constexpr = HQ * D
    QS: tl.constexpr = (HQ + HK * QK_NORM) * D  # a row of q (products.py)
    PART_ROW: tl.constexpr = HK * G * (D + 2) * SM
    g = tl.arange(0, GP)
    rows_g = tl.arange(0, BG)
    d = tl.arange(0, D)
    for u in range(pid, num_rows * HK * num_splits, P):
        row = u // (HK * num_splits)
        kvh = (u // num_splits) % HK
        split = u % num_splits
        seq_len = tl.load(seq_len_ptr + row)
        kv_start = 0
        base0 = 0
        if WINDOW != 0:
            kv_start = window_start(seq_len, window, windowed)
            if WINDOW == 2:
                base0 = (kv_start // KEYS) * KEYS
        splits = row_splits(seq_len, num_splits, base0, KEYS)
        if split < splits:
            base = (kv_start // KEYS) * KEYS
            split_keys = keys_per_split(seq_len - base, splits, KEYS)
            lo = base + split * split_keys
            hi = tl.minimum(lo + split_keys, seq_len)
            q_row = q_ptr + row * QS
            m_i = tl.full([BG], float("-inf"), tl.float32)
            l_i = tl.zeros([BG], tl.float32)
            acc = tl.zeros([BG, D], tl.float32)
            kv_end = seq_len  # the key tiles' end: QK_NORM folds the new key from registers instead
            if QK_NORM:
                cs_row = cos_sin_ptr + tl.load(pos_ptr + row).to(tl.int64) * D
                q = normed_rotated(q_row, kvh * G + rows_g, rows_g < G, qn_ptr, cs_row, eps, D)
                slot = tl.load(slot_ptr + row).to(tl.int64)
                kv_end = tl.where(slot >= 0, seq_len - 1, seq_len)
                if (slot >= 0) & (lo < hi) & (hi == seq_len):  # this split holds the new key
                    kv_off = (slot // BS) * stride_blk + (slot % BS) * D
                    acc, l_i, m_i = fold_new_key(
                        q, q_row, kvh, k_ptr, v_ptr, kv_off, stride_head, kn_ptr, cs_row, eps, k_scale, qk_scale,
                        HQ, D, BG, FP8KV, EMULATE,
                    )  # fmt: skip
            else:
                q = tl.load(
                    q_row + (kvh * G + rows_g)[:, None] * D + d[None, :],
                    mask=(rows_g < G)[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
            q_pos = tl.full([BG], 0, tl.int32) + seq_len - 1
            acc, l_i, m_i = attn_inner(
                acc,
                l_i,
                m_i,
                q,
                q_pos,
                k_ptr + kvh * stride_head,
                v_ptr + kvh * stride_head,
                bt_ptr + tl.cast(row, tl.int64) * bt_stride,
                lo,
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
                kv_start,
                tl.where(windowed, window, seq_len + 1),
                WINDOW != 0,
                NUM_STAGES=KV_STAGES,
            )
            m_i = tl.where(l_i > 0, m_i, float("-inf"))  # an empty split
            if FP8KV:  # V's scale joins the normaliser: the merge's output is then v_scale · Σ acc / Σ l
                l_i = l_i / v_scale
            row_part = part_ptr + tl.cast(row, tl.int64) * PART_ROW
            store_partial(row_part, kvh, split, splits, acc, m_i, l_i, rows_g, HK, G, D, SM)
            tl.debug_barrier()
            ticket = tl.atomic_add(tickets_ptr + row * HK + kvh, 1, sem="acq_rel", scope="gpu")
            if ticket == (layer + 1) * splits - 1:  # the last split of this layer's (row, KV head)
                out = group_attention(row_part, kvh, splits, attn_ptr.dtype.element_ty, HK, G, GP, D, SM)
                tl.store(attn_ptr + row * QD + (kvh * G + g)[:, None] * D + d[None, :], out, mask=(g < G)[:, None])
