"""The FlashAttention-2 inner loop over K/V tiles gathered from the paged cache, shared by the prefill,
decode and megakernel attention (Dao 2023, "FlashAttention-2", Algorithm 1 lines 8-10; notation of the
Triton fused-attention tutorial: m_i running max, l_i running sum, acc unnormalised output).

Scores live in the log2 domain: with qk_scale = scale · log2(e), s = qk_scale · q·k and
exp(scale · q·k − m) = exp2(s − m₂), so one exp2 per score. Per KV tile of BLOCK_N keys:
    m_new = max(m_i, rowmax(s));  p = exp2(s − m_new);  α = exp2(m_i − m_new)
    l_i ← α·l_i + rowsum(p);  acc ← α·acc + p·V;  m_i ← m_new
and the caller divides acc by l_i once at the end (FA2 §3.1.1: rescaling deferred).

An FP8 cache (float8_e4m3fn) is converted to q's dtype as it is loaded (exactly: e4m3 ⊂ bf16/fp16); its
per-tensor scales never touch a tile: K's is folded into qk_scale by the launcher and V's divides l_i
in the caller's epilogue (out = acc / (l_i / v_scale), the same bits as acc / l_i when v_scale = 1).

Invariant that keeps -inf out of the arithmetic: the first tile a row sees contains at least one key
it may attend to (key 0 for prefill rows, the split's first key for decode), so m_i is finite after
it and a later fully-masked row of a tile gives p = exp2(−inf) = 0, α = 1.

Sliding window (HAS_WINDOW, a constexpr: without it the code is the plain causal loop): the row at
position p sees keys p − window + 1 .. p only. Keys below `kv_start` (the lowest key any row of the
program may see) are neither loaded nor attended: the cache blocks that hold only such keys may have
been freed and handed to another sequence (core.kv_cache_manager). A row may now see nothing in its
first tiles, so masked tiles subtract max(m, 0 if m = −inf) instead of m: p = 0 and α = 0 there while
m_i stays −inf, and the row starts counting at its first visible key.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ordered_dot(a, b, acc):
    """acc + a [M, K] · b [K, N] (or a batch of them, [S, M, K] · [S, K, N]) in float32: the interpreter's
    product (UPCAST). Its `tl.dot` is numpy's matmul, whose BLAS sums K in an order that depends on M and N
    on some CPUs (OpenBLAS 0.3.31 on an AMD EPYC), so a row's bits would change with the tile's shape,
    where the GPU's tensor-core products do not (the batch-invariant kernels pick tiles by M). A broadcast
    product summed over K adds each element's products in k order whatever M and N; used up to the
    interpreter's largest tensor (2²⁰ elements), numpy's matmul beyond it."""
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    k_axis: tl.constexpr = len(a.shape) - 1  # [.., M, K, 1] · [.., 1, K, N], summed over K
    if a.numel * b.shape[-1] <= 1048576:
        acc = acc + tl.sum(tl.expand_dims(a, k_axis + 1) * tl.expand_dims(b, k_axis - 1), axis=k_axis)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def dot_qk(q, k, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """q [M, D] · kᵀ ([N, D] → [D, N]) in float32; IEEE: exact float32 products (no TF32).

    UPCAST (CPU interpreter only, see launch.upcast_dot): in float32 by `ordered_dot`."""
    if UPCAST:
        qk = ordered_dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32))
    elif IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    return qk


@triton.jit
def dot_pv(p, v, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + p [M, N] · v [N, D] in float32 (UPCAST, IEEE as in `dot_qk`)."""
    if UPCAST:
        acc = ordered_dot(p, v, acc)
    elif IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p, v, acc)
    return acc


@triton.jit
def _kv_rows(
    bt_row_ptr,
    start,
    offs_n,
    kv_end,
    stride_kb,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    MASKED: tl.constexpr,
    kv_start=0,
    HAS_WINDOW: tl.constexpr = False,
):
    """int64 offsets of the cache rows holding positions start + offs_n of one sequence (one KV head).

    PAGE_TILE: the tile lies inside one page (BLOCK_SIZE % BLOCK_N == 0 and start % BLOCK_N == 0), so
    one block-table entry serves it and its rows are contiguous. Otherwise each position looks up
    its page (the entries of one tile share cache lines, so these loads hit L1). MASKED: positions from
    kv_end on (and with HAS_WINDOW below kv_start) read no table entry.
    """
    if PAGE_TILE:
        blk = tl.load(bt_row_ptr + start // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_kb + ((start % BLOCK_SIZE) + offs_n) * stride_kt
    else:
        pos = start + offs_n
        if MASKED and HAS_WINDOW:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=(pos < kv_end) & (pos >= kv_start), other=0)
        elif MASKED:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos < kv_end, other=0)
        else:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE)
        rows = blk.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
    return rows


@triton.jit
def _e4m3_byte_to_f16(w, SHIFT: tl.constexpr):
    """Byte SHIFT/8 of int32 words holding four e4m3 codes → float16, exact, with integer operations (the
    CPU interpreter's path): the code's sign, 4 exponent and 3 mantissa bits placed at float16's sign and
    the top of its exponent and mantissa give the value · 2⁻⁸ (the biases differ by 8; e4m3's subnormals
    land on float16 subnormals of the same scaling)."""
    b = (w >> SHIFT) & 0xFF
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def queries_for_cache(q, k_ptr):
    """q as the products over the cache at k_ptr want it: bf16 queries become float16 over an FP8 cache
    (exact below 65,504), whose codes `load_e4m3_as_f16` widens to float16; otherwise q unchanged."""
    if k_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


@triton.jit
def load_e4m3_as_f16(ptrs_row, mask_row, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr):
    """The e4m3 rows at ptrs_row [N] (HEAD_DIM codes each, 4-byte aligned) as float16 [N, HEAD_DIM], exact.

    Loaded as int32 words and widened in the load's own layout, two codes per `cvt.rn.f16x2.e4m3x2`
    (EMULATE, the interpreter: integer operations): a float8 tile converted as a dot operand compiles to
    byte-wide shared-memory reads in the MMA layout instead."""
    offs_w = tl.arange(0, HEAD_DIM // 4)
    words = ptrs_row.to(tl.pointer_type(tl.int32))[:, None] + offs_w[None, :]
    if MASKED:
        w = tl.load(words, mask=mask_row[:, None], other=0)
    else:
        w = tl.load(words)
    if EMULATE:
        e0 = _e4m3_byte_to_f16(w, 0)
        e1 = _e4m3_byte_to_f16(w, 8)
        e2 = _e4m3_byte_to_f16(w, 16)
        e3 = _e4m3_byte_to_f16(w, 24)
    else:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }""",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    x = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [N, HEAD_DIM / 4, 2, 2]: element 4j + 2i + a
    return tl.reshape(x, [ptrs_row.shape[0], HEAD_DIM])


@triton.jit
def attn_inner(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    lo,
    hi,
    kv_end,
    qk_scale,
    stride_kb,
    stride_kt,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    kv_start=0,
    window=0,
    HAS_WINDOW: tl.constexpr = False,
    NUM_STAGES: tl.constexpr = None,
):
    """Fold keys lo .. hi−1 (lo a multiple of BLOCK_N) into the running (acc, l_i, m_i).

    Args:
        acc, l_i, m_i: [M, HEAD_DIM], [M], [M] float32, the state so far (m_i in the log2 domain).
        q: [M, HEAD_DIM] query rows; q_pos: [M] their absolute positions.
        k_ptr, v_ptr: the caches offset to this KV head; bt_row_ptr: the sequence's block-table row.
        kv_end: the sequence's length; keys from it on are masked (MASKED tiles only).
        qk_scale: softmax scale · log2(e), positive.
        MASKED: mask keys ≥ kv_end and keys after a row's position (causal), and with HAS_WINDOW keys
            below kv_start or at least `window` before a row's position. Unmasked tiles must lie wholly
            below every row's diagonal and below kv_end, and inside every row's window.
        kv_start, window: HAS_WINDOW only (module docstring): keys below kv_start are not loaded, and
            the row at q_pos sees keys q_pos − window + 1 .. q_pos.
        NUM_STAGES: the key loop's software pipeline depth (None: the kernel's num_stages); a kernel
            launched without pipelining (the megakernels) sets it for this loop alone.

    Returns:
        The updated (acc, l_i, m_i).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start = tl.multiple_of(start, BLOCK_N)
        rows = _kv_rows(
            bt_row_ptr, start, offs_n, kv_end, stride_kb, stride_kt, BLOCK_SIZE, PAGE_TILE, MASKED, kv_start, HAS_WINDOW
        )
        kv_ptrs = rows[:, None] + offs_d[None, :]
        kv_valid = (start + offs_n) < kv_end  # used by MASKED tiles only
        if MASKED and HAS_WINDOW:
            kv_valid = kv_valid & ((start + offs_n) >= kv_start)
        if k_ptr.dtype.element_ty == tl.float8e4nv:  # q is float16 then; the scale is folded into qk_scale
            k = load_e4m3_as_f16(k_ptr + rows, kv_valid, HEAD_DIM, MASKED, UPCAST)
        elif MASKED:
            k = tl.load(k_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_ptrs)
        k = k.to(q.dtype)
        qk = dot_qk(q, k, UPCAST, IEEE)
        if MASKED:
            visible = ((start + offs_n)[None, :] <= q_pos[:, None]) & kv_valid[None, :]
            if HAS_WINDOW:
                visible = visible & ((start + offs_n)[None, :] > (q_pos - window)[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_ij
            if HAS_WINDOW:  # a row that has seen no key yet: subtract 0, so p = 0 and α = 0 (not NaN)
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            qk = qk - m_sub[:, None]
        else:
            # qk_scale > 0 (checked by the launchers), so max commutes with the scaling: one FMA per score.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
            m_sub = m_ij
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if v_ptr.dtype.element_ty == tl.float8e4nv:  # its scale multiplies the output in the caller's epilogue
            v = load_e4m3_as_f16(v_ptr + rows, kv_valid, HEAD_DIM, MASKED, UPCAST)
        elif MASKED:
            v = tl.load(v_ptr + kv_ptrs, mask=kv_valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + kv_ptrs)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = dot_pv(p.to(v.dtype), v, acc, UPCAST, IEEE)
        m_i = m_ij
    return acc, l_i, m_i
