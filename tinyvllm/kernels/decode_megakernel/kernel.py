"""The decode megakernel itself: every decoder layer of one batch-1 decode token in one launch.

The phases are separate @triton.jit functions (qkv_phase.py, attention_phase.py, residual_phases.py,
gate_up_phase.py), which Triton inlines into this one kernel. The kernel stays one long function: its
body is the layer loop, each phase followed by its barrier's arrival, in the order the barrier counts
depend on; its length is the phases' argument lists (a Triton function takes no structs). The package
docstring describes the design.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel.attention_phase import (
    attention_phase,
    first_tile_rows,
    layer_kv_ptrs,
    preload_kv,
)
from tinyvllm.kernels.decode_megakernel.gate_up_phase import gate_up_phase
from tinyvllm.kernels.decode_megakernel.grid_sync import arrive, end_phase, now, trace_arrival, trace_start
from tinyvllm.kernels.decode_megakernel.qkv_phase import qkv_phase
from tinyvllm.kernels.decode_megakernel.residual_phases import o_group_phase, residual_phase
from tinyvllm.kernels.decode_megakernel.vectors import normed, residual_at


@triton.jit(do_not_specialize=["num_layers", "num_splits", "layer_stride", "v_offset"])
def decode_megakernel_kernel(
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
    window,
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
    GP: tl.constexpr,
    MAXU_C: tl.constexpr,
    MAXU_E: tl.constexpr,
    TRACE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    PIPE: tl.constexpr,
    ASM: tl.constexpr,
    DOT_D: tl.constexpr,
    CW: tl.constexpr,
    SPLIT_O: tl.constexpr,
    E_PIPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    WINDOW: tl.constexpr,
    FP8W: tl.constexpr,
    FP8KV: tl.constexpr,
    KV_ALIGN: tl.constexpr,
):
    """One token through `num_layers` layers, final norm applied: out = RMSNorm(r; nf) [H].

    Pointers: the token's id, position, cache slot and context length (with itself), its block table;
    the embedding, the stacked weights [L, ...], their row scales [L, N] (FP8W), the cache scales
    [L, 2] (k_scale, v_scale per layer; FP8KV) and the norms; the cos/sin table; layer 0's K cache (layer l's
    K at + l·layer_stride, its V at + v_offset), a cache block's and a KV head's stride; the workspace
    (launch.Workspace: r, r2, o sums, q, attn, act, partials, tickets, barrier counters); out; the trace.

    Shapes (constexpr): H hidden, F intermediate, HQ / HK query / KV heads, D head dim, BS cache block
    size; RQ, RO, RG, RD rows per unit of phases A, C, D, E; KEYS keys per attention tile; SM slots per
    run of the partials; BG the query rows per attention tile; GP the query heads per KV head rounded up to a
    power of two (a group that is not one is padded, masked); MAXU_C, MAXU_E a program's most units in C
    (unsplit) and E; CW phase D's chunk width (DOT_D: on the tensor cores). Launch choices: TRACE, STAGES /
    PIPE / E_PIPE the pipeline depths of phase D / A and C / E, SPLIT_O, ASM (CUDA: the asm wait), UPCAST
    (interpreter: bf16 dots in float32), IEEE (float32: exact dots), KV_ALIGN (layer_stride and v_offset
    are multiples of 16 elements: the K/V tiles load as 16-byte vectors, `layer_kv_ptrs`).

    Families: HAS_BIAS adds the stacked q/k/v biases [L, (HQ + 2·HK)·D] in phase A; QK_NORM normalises
    every q and k head by the stacked weights qn, kn [L, D] before RoPE (phase B does it); WINDOW: 0 no
    layer has a sliding window, 1 the layers l with sliding[l] ≠ 0 have one of `window` keys, 2 every layer
    has it.

    FP8 (docs/fp8.md): FP8W, the four stacked weights are float8_e4m3fn with one float32 scale per row,
    dequantized in registers (each phase multiplies its rows' float32 sums by their scales; the
    activations stay in the model's dtype); FP8KV, the cache is float8_e4m3fn holding K / k_scale and
    V / v_scale (phase A writes it so, phase B folds the scales into the softmax and its normaliser).
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    BH: tl.constexpr = triton.next_power_of_2(H)
    BF: tl.constexpr = triton.next_power_of_2(F)
    QD: tl.constexpr = HQ * D
    BQ: tl.constexpr = triton.next_power_of_2(QD)
    BHK: tl.constexpr = triton.next_power_of_2(HK)

    if TRACE:  # noqa: SIM102 (a constexpr test apart: untraced kernels hold no trace code)
        if pid == 0:
            tl.store(trace_ptr, now(pid))
    tok = tl.load(ids_ptr).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    slot = tl.load(slot_ptr).to(tl.int64)
    seq_len = tl.load(seq_len_ptr)
    # context splits per KV head: at most num_splits, each a whole number of KEYS tiles, none empty (one,
    # without keys, at seq_len 0: a CUDA graph's padded row)
    # The window's first visible key and the tile holding it (WINDOW); the splits cover keys from base0,
    # the lowest first key of any layer.
    kv_win = 0
    if WINDOW != 0:
        kv_win = tl.maximum(seq_len - window, 0)
    base_win = (kv_win // KEYS) * KEYS
    kv0 = 0
    if WINDOW == 2:
        kv0 = kv_win
    base0 = (kv0 // KEYS) * KEYS
    tiles = tl.maximum(tl.cdiv(seq_len - base0, KEYS), 1)
    splits = tl.cdiv(tiles, tl.cdiv(tiles, num_splits))
    cols = tl.arange(0, BH)
    if TRACE:
        trace_start(trace_ptr, pid)
    if pid == 0:  # r ← the token's embedding row (first read in layer 0's phase D, three barriers on)
        e = tl.load(emb_ptr + tok * H + cols, mask=cols < H, other=0.0)
        tl.store(r_ptr + cols, e, mask=cols < H)
    rows_pre = first_tile_rows(pid, bt_ptr, seq_len, splits, stride_blk, base0, kv0, HK, D, BS, KEYS)
    rows_win = rows_pre
    if WINDOW == 1:  # the windowed layers' first tiles
        rows_win = first_tile_rows(pid, bt_ptr, seq_len, splits, stride_blk, base_win, kv_win, HK, D, BS, KEYS)
    cs_row = cos_sin_ptr + pos * D
    # Each weight phase starts with the wait of the barrier before it, after issuing its first weight
    # tiles (they do not depend on the barrier), so they stream while the other programs arrive. Layer 0's
    # phase A has no barrier before it: each program normalises the embedding row itself.
    for layer in range(num_layers):
        b = 5 * layer  # barriers before this layer: 5 per layer
        k_ptr, v_ptr = layer_kv_ptrs(kv_ptr, layer, layer_stride, v_offset, KV_ALIGN)
        x_ptr = r_ptr  # phase A's input: the residual stream, or the embedding row in layer 0
        if layer == 0:
            x_ptr = emb_ptr + tok * H
        kv_start, base, rows = kv0, base0, rows_pre  # this layer's first visible key, split base, first tile
        k_scale, v_scale = 1.0, 1.0
        if FP8KV:
            k_scale = tl.load(kvs_ptr + 2 * layer)
            v_scale = tl.load(kvs_ptr + 2 * layer + 1)
        if WINDOW == 1:
            sliding = tl.load(sliding_ptr + layer) != 0
            kv_start = tl.where(sliding, kv_win, 0)
            base = tl.where(sliding, base_win, 0)
            rows = tl.where(sliding, rows_win, rows_pre)
        qkv_phase(
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
            bias_ptr,
            sqkv_ptr,
            stride_blk,
            stride_head,
            k_scale,
            v_scale,
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
            TRACE,
            ASM,
            HAS_BIAS,
            QK_NORM,
            FP8W,
            FP8KV,
            UPCAST,
        )
        arrive(bar_ptr, trace_ptr, pid, b + 1, TRACE)
        kp, vp = preload_kv(pid, k_ptr, v_ptr, rows, seq_len, splits, stride_head, base, kv_start, HK, D, KEYS)
        end_phase(bar_ptr, b + 1, P, trace_ptr, pid, TRACE, ASM)
        attention_phase(
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
            scale * k_scale * 1.4426950408889634,  # log2(e): scores in the log2 domain; K's cache scale
            kp,
            vp,
            rows,
            trace_ptr,
            3 + 5 * num_layers + 3 * layer,
            base,
            kv_start,
            slot,
            (slot // BS) * stride_blk + (slot % BS) * D,
            qn_ptr + layer * D,
            kn_ptr + layer * D,
            cs_row,
            eps,
            k_scale,
            v_scale,
            HQ,
            HK,
            D,
            BS,
            KEYS,
            SM,
            BG,
            GP,
            UPCAST,
            IEEE,
            TRACE,
            SPLIT_O,
            WINDOW != 0,
            QK_NORM,
            FP8KV,
            UPCAST,
        )
        arrive(bar_ptr, trace_ptr, pid, b + 2, TRACE)
        o_ptr = osum_ptr + (layer % 2) * H  # SPLIT_O: this layer's sums (zeroed in phase E two layers back)
        if SPLIT_O:
            o_group_phase(
                layer,
                pid,
                P,
                part_ptr,
                splits,
                wo_ptr,
                so_ptr,
                o_ptr,
                bar_ptr,
                b + 2,
                trace_ptr,
                H,
                HQ,
                HK,
                D,
                GP,
                RO,
                SM,
                PIPE,
                TRACE,
                ASM,
                r_ptr.dtype.element_ty,
                FP8W,
            )
        else:
            residual_phase(
                layer,
                pid,
                P,
                attn_ptr,
                wo_ptr,
                so_ptr,
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
                TRACE,
                ASM,
                FP8W,
            )
        arrive(bar_ptr, trace_ptr, pid, b + 3, TRACE)
        gate_up_phase(
            layer,
            pid,
            P,
            r_ptr,
            o_ptr,
            n2_ptr,
            wgu_ptr,
            sgu_ptr,
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
            TRACE,
            ASM,
            DOT_D,
            CW,
            UPCAST,
            IEEE,
            SPLIT_O,
            FP8W,
        )
        if SPLIT_O:  # noqa: SIM102 (a constexpr test apart) -- the residual after attention, for phase E
            if pid == P - 1:  # a program with the fewest phase-D units
                tl.store(r2_ptr + cols, residual_at(r_ptr, o_ptr, cols, cols < H, True), mask=cols < H)
        arrive(bar_ptr, trace_ptr, pid, b + 4, TRACE)
        e_res_ptr = r2_ptr if SPLIT_O else r_ptr  # SPLIT_O: the residual after attention, stored in phase D
        residual_phase(
            layer,
            pid,
            P,
            act_ptr,
            wd_ptr,
            sd_ptr,
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
            TRACE,
            ASM,
            FP8W,
        )
        if SPLIT_O:  # noqa: SIM102 (a constexpr test apart)
            if pid == P - 1:  # every program has read this layer's sums in phase D: zero them for layer + 2
                tl.store(o_ptr + cols, tl.zeros([BH], tl.int64), mask=cols < H)
        if layer < num_layers - 1:
            arrive(bar_ptr, trace_ptr, pid, b + 5, TRACE)
    # Leave: no barrier after the last layer. The last program out (its gpu-scope acquire of the leave
    # count follows every program's release of it, each after its stores of phase E) applies the final
    # norm and resets the counters and tickets (every program has passed every barrier).
    if TRACE:
        trace_arrival(trace_ptr, pid, 5 * num_layers)
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        out = normed(r_ptr, r_ptr, nf_ptr, H, eps, BH, False)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=cols < H)
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(tickets_ptr + tl.arange(0, BHK), 0, mask=tl.arange(0, BHK) < HK, sem="relaxed", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 5 * num_layers, now(pid))
