"""The rows megakernel itself: every decoder layer of a decode step of a few rows in one launch.

The kernel body is the layer loop: five phases a layer (products.py's four weight phases and
attention.py's phase B), each followed by its barrier's arrival (decode_megakernel/grid_sync.py). The
package docstring describes the design.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.attention_phase import layer_kv_ptrs
from tinyvllm.kernels.decode_megakernel.grid_sync import arrive, end_phase, now, trace_arrival, trace_start
from tinyvllm.kernels.decode_megakernel.vectors import normed
from tinyvllm.kernels.rows_megakernel.attention import rows_attention_phase
from tinyvllm.kernels.rows_megakernel.products import DOWN, GATE_UP, OUT, QKV, embedding_rstd, product_phase


@triton.jit(do_not_specialize=["num_rows", "num_layers", "num_splits", "layer_stride", "v_offset", "bt_stride"])
def rows_megakernel_kernel(
    ids_ptr,
    pos_ptr,
    slot_ptr,
    seq_len_ptr,
    bt_ptr,
    bt_stride,
    emb_ptr,
    wqkv_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    sqkv_ptr,
    so_ptr,
    sgu_ptr,
    sd_ptr,
    kvs_ptr,
    n1_ptr,
    n2_ptr,
    nf_ptr,
    bias_ptr,
    qn_ptr,
    kn_ptr,
    sliding_ptr,
    cos_sin_ptr,
    kv_ptr,
    layer_stride,
    v_offset,
    stride_blk,
    stride_head,
    r_ptr,
    ss_ptr,
    q_ptr,
    attn_ptr,
    act_ptr,
    scratch_ptr,
    part_ptr,
    tickets_ptr,
    bar_ptr,
    out_ptr,
    trace_ptr,
    num_rows,
    num_layers,
    num_splits,
    eps,
    scale,
    window,
    H: tl.constexpr,
    F: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BP: tl.constexpr,
    RA: tl.constexpr,
    RC: tl.constexpr,
    RD: tl.constexpr,
    RE: tl.constexpr,
    KCA: tl.constexpr,
    KCC: tl.constexpr,
    KCD: tl.constexpr,
    KCE: tl.constexpr,
    MAXU_A: tl.constexpr,
    MAXU_C: tl.constexpr,
    MAXU_D: tl.constexpr,
    MAXU_E: tl.constexpr,
    SA: tl.constexpr,
    SC: tl.constexpr,
    SD: tl.constexpr,
    SE: tl.constexpr,
    NUP: tl.constexpr,
    KEYS: tl.constexpr,
    SM: tl.constexpr,
    BG: tl.constexpr,
    GP: tl.constexpr,
    PIPE: tl.constexpr,
    KV_STAGES: tl.constexpr,
    KV_ALIGN: tl.constexpr,
    TRACE: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    WINDOW: tl.constexpr,
    FP8W: tl.constexpr,
    FP8KV: tl.constexpr,
):
    """num_rows ≤ BP decode tokens through `num_layers` layers, final norm applied: out [num_rows, H].

    Per row: its token id, position, cache slot (−1: none), context length (with itself) and block-table
    row (bt_ptr + row · bt_stride). The stacked weights [L, ...], their FP8 row scales (FP8W), the cache
    scales [L, 2] (FP8KV), the norms, the biases [L, NQKV] (HAS_BIAS), the q/k norms [L, D] (QK_NORM), the
    sliding flags [L] (WINDOW 1)
    and the cos/sin table as in the batch-1 megakernel (decode_megakernel/kernel.py), as are the cache's
    layout and the barrier. Workspace (launch.RowsWorkspace): r [BP, H], ss [BP, NUP], q [BP, (HQ + HK)·D],
    attn [BP, HQ·D], act [BP, F], scratch [P, max M, BP] float32 (each program's products before their
    epilogues), the partials, tickets [BP, HK], barrier [2]; the trace (TRACE: the global timer as
    decode_megakernel/grid_sync.py lays it out, without phase B's inner points).

    Constexprs: shapes H, F, HQ, HK, D, BS; BP the rows of every product (≥ 16, tl.dot's N); per weight
    phase A, C, D, E its rows per unit R*, its K chunk KC*, its most units per program MAXU* (a program
    multiplies MAXU·R rows at once) and its K split S* (products.py); NUP the per-unit sums of squares a
    row keeps (≥ the units of phases C and E); KEYS, SM, BG, GP as in the batch-1 kernel; PIPE the
    weight pipeline's depth, KV_STAGES the key loop's; KV_ALIGN: layer_stride and v_offset are multiples
    of 16 elements (the K/V tiles then load as 16-byte vectors, pipelined by cp.async); WINDOW 0 none,
    1 the layers flagged in sliding_ptr, 2 every layer.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    if TRACE:  # noqa: SIM102 (a constexpr test apart: untraced kernels hold no trace code)
        if pid == 0:
            tl.store(trace_ptr, now(pid))
    if TRACE:
        trace_start(trace_ptr, pid)
    QD: tl.constexpr = HQ * D
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    rb = tl.arange(0, BP)
    live = rb < num_rows
    tok = tl.load(ids_ptr + rb, mask=live, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rb, mask=live, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + rb, mask=live, other=-1).to(tl.int64)
    kv_off = tl.where(slot >= 0, (slot // BS) * stride_blk + (slot % BS) * D, -1)
    emb_rows = tok * H
    own_rows = rb.to(tl.int64) * H
    rstd0 = embedding_rstd(emb_ptr, emb_rows, live, H, eps, BP, KCA)
    for layer in range(num_layers):
        b = 5 * layer  # barriers before this layer: 5 per layer
        k_ptr, v_ptr = layer_kv_ptrs(kv_ptr, layer, layer_stride, v_offset, KV_ALIGN)
        k_scale, v_scale = 1.0, 1.0
        if FP8KV:
            k_scale = tl.load(kvs_ptr + 2 * layer)
            v_scale = tl.load(kvs_ptr + 2 * layer + 1)
        windowed = WINDOW == 2
        if WINDOW == 1:
            windowed = tl.load(sliding_ptr + layer) != 0
        # A: the embedding rows in layer 0, the residual after that
        x_ptr, x_rows = r_ptr, own_rows
        if layer == 0:
            x_ptr, x_rows = emb_ptr, emb_rows
        product_phase(
            QKV, layer, pid, P, live, x_ptr, x_rows, n1_ptr + layer * H, rstd0, layer > 0, ss_ptr, H // RE,
            wqkv_ptr, sqkv_ptr, q_ptr, r_ptr, own_rows, ss_ptr, pos, kv_off, cos_sin_ptr, k_ptr, v_ptr,
            bias_ptr + tl.cast(layer, tl.int64) * NQKV, stride_head, k_scale, v_scale, eps, scratch_ptr, bar_ptr, b,
            trace_ptr, NQKV, H, H, F, HQ, HK, D, RA, KCA, BP, MAXU_A, SA, NUP, PIPE, True, TRACE, ASM,
            UPCAST, IEEE, HAS_BIAS, QK_NORM, FP8W, FP8KV, UPCAST,
        )  # fmt: skip
        arrive(bar_ptr, trace_ptr, pid, b + 1, TRACE)
        end_phase(bar_ptr, b + 1, P, trace_ptr, pid, TRACE, ASM)
        rows_attention_phase(
            layer, pid, P, num_rows, q_ptr, k_ptr, v_ptr, bt_ptr, bt_stride, seq_len_ptr, pos_ptr, slot_ptr,
            num_splits, part_ptr, tickets_ptr, attn_ptr, stride_blk, stride_head,
            scale * k_scale * 1.4426950408889634,  # log2(e): scores in the log2 domain; K's cache scale
            k_scale, v_scale, window, windowed, qn_ptr + layer * D, kn_ptr + layer * D, cos_sin_ptr, eps,
            HQ, HK, D, BS, KEYS, SM, BG, GP, UPCAST, IEEE, WINDOW, QK_NORM, FP8KV, UPCAST, KV_STAGES,
        )  # fmt: skip
        arrive(bar_ptr, trace_ptr, pid, b + 2, TRACE)
        # C: r ← round(round(Wo attn) + r) (the embedding rows are layer 0's residual)
        res_ptr, res_rows = r_ptr, own_rows
        if layer == 0:
            res_ptr, res_rows = emb_ptr, emb_rows
        product_phase(
            OUT, layer, pid, P, live, attn_ptr, rb.to(tl.int64) * QD, n2_ptr, rstd0, False, ss_ptr, 0,
            wo_ptr, so_ptr, r_ptr, res_ptr, res_rows, ss_ptr, pos, kv_off, cos_sin_ptr, k_ptr, v_ptr,
            bias_ptr, stride_head, k_scale, v_scale, eps, scratch_ptr, bar_ptr, b + 2,
            trace_ptr, H, QD, H, F, HQ, HK, D, RC, KCC, BP, MAXU_C, SC, NUP, PIPE, False, TRACE, ASM,
            UPCAST, IEEE, False, False, FP8W, FP8KV, UPCAST,
        )  # fmt: skip
        arrive(bar_ptr, trace_ptr, pid, b + 3, TRACE)
        # D: act = SwiGLU of the normed residual (its rstd from phase C's sums)
        product_phase(
            GATE_UP, layer, pid, P, live, r_ptr, own_rows, n2_ptr + layer * H, rstd0, True, ss_ptr, H // RC,
            wgu_ptr, sgu_ptr, act_ptr, r_ptr, own_rows, ss_ptr, pos, kv_off, cos_sin_ptr, k_ptr, v_ptr,
            bias_ptr, stride_head, k_scale, v_scale, eps, scratch_ptr, bar_ptr, b + 3,
            trace_ptr, 2 * F, H, H, F, HQ, HK, D, RD, KCD, BP, MAXU_D, SD, NUP, PIPE, True, TRACE, ASM,
            UPCAST, IEEE, False, False, FP8W, FP8KV, UPCAST,
        )  # fmt: skip
        arrive(bar_ptr, trace_ptr, pid, b + 4, TRACE)
        # E: r ← round(round(Wd act) + r)
        product_phase(
            DOWN, layer, pid, P, live, act_ptr, rb.to(tl.int64) * F, n2_ptr, rstd0, False, ss_ptr, 0,
            wd_ptr, sd_ptr, r_ptr, r_ptr, own_rows, ss_ptr, pos, kv_off, cos_sin_ptr, k_ptr, v_ptr,
            bias_ptr, stride_head, k_scale, v_scale, eps, scratch_ptr, bar_ptr, b + 4,
            trace_ptr, H, F, H, F, HQ, HK, D, RE, KCE, BP, MAXU_E, SE, NUP, PIPE, False, TRACE, ASM,
            UPCAST, IEEE, False, False, FP8W, FP8KV, UPCAST,
        )  # fmt: skip
        if layer < num_layers - 1:
            arrive(bar_ptr, trace_ptr, pid, b + 5, TRACE)
    # Leave (no barrier after the last layer): the last program out applies the final norm to every row
    # and resets the counters and tickets.
    if TRACE:
        trace_arrival(trace_ptr, pid, 5 * num_layers)
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        BH: tl.constexpr = triton.next_power_of_2(H)
        cols = tl.arange(0, BH)
        for row in range(num_rows):
            out = normed(r_ptr + row * H, r_ptr, nf_ptr, H, eps, BH, False)
            tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=cols < H)
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
        t = tl.arange(0, triton.next_power_of_2(BP * HK))
        tl.atomic_xchg(tickets_ptr + t, 0, mask=t < BP * HK, sem="relaxed", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 5 * num_layers, now(pid))
