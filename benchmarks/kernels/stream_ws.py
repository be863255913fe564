"""A warp-specialised weight stream (Gluon, Hopper; GPU only): can a producer warp that never waits on
the grid barriers keep one program per SM streaming at the copy rate?

The decode megakernel's weight phases stream at most 3.83 TB/s with one program per SM (Triton's
cp.async pipeline, `bench_stream.py`'s `kloop`), and each phase's barrier stalls the stream: the loads
of the next phase can only be issued `stages − 1` tiles ahead, by the same warps that then wait.
Here one producer warp per program issues TMA copies of every tile the program will ever read, across
layers, into a ring of STAGES shared-memory slots (mbarriers: `ready[s]` completes when a slot's bytes
land, `empty[s]` when the consumers have read it); the consumer warps multiply, store, and pass the
grid barrier after every layer (BARRIER 1; 2-4: relaxed in part, for timing only), optionally spinning
DELAY cycles after it (the latency-bound phases of a real layer: attention, the o-projection, during
which the HBM idles). The producer is throttled only by the ring: while the consumers wait, it can fill
the ring with the next layer's tiles.

Measured on the H200 (docs/perf.md, v9): without barriers 4.29–4.33 TB/s for gate_up (96 % of the
many-program read rate, the best one-program-per-SM stream here); with a barrier per layer 3.91 TB/s
(4 % ahead of `kloop`), and a 5 µs busy wait after every barrier is not hidden (it is without barriers).
Why (v18, `bench_stream_trace.py`): the ring is already full when a layer starts, filled during the
previous barrier's own wait, so a ring hides at most its own size once per stall and an added wait counts
in full; the release arrival's fence costs ~1 µs per barrier and the acquire poll's L1 flush ~0.35.

Same maths as `bench_stream.py`: y[l] = W[l] x for L stacked [N, K] bf16 matrices.
Compiled only through Gluon (`triton.experimental.gluon`), which the Triton interpreter does not run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

TRACE_TILES = gl.constexpr(8)  # tiles per layer whose issue and ready times a traced launch records
TRACE_SLOTS = gl.constexpr(4 + 2 * TRACE_TILES.value)  # int64 words per (program, layer) in a traced launch


@gluon.jit
def _spin_cycles(cycles):
    """Busy-wait `cycles` SM clock cycles (a stand-in for a latency-bound phase)."""
    if cycles > 0:
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=gl.int64, is_pure=False, pack=1)
        t = t0
        while t - t0 < cycles:
            t = gl.inline_asm_elementwise(
                "mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=gl.int64, is_pure=False, pack=1
            )


@gluon.jit
def _sleep_cycles(cycles):
    """Wait `cycles` SM clock cycles mostly asleep (`nanosleep` in 200 ns steps): the warps issue
    almost nothing meanwhile, as warps stalled on memory would not."""
    if cycles > 0:
        t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=gl.int64, is_pure=False, pack=1)
        t = t0
        while t - t0 < cycles:
            t = gl.inline_asm_elementwise(
                "nanosleep.u32 200; mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=gl.int64, is_pure=False, pack=1
            )


@gluon.jit
def _now(x):
    """The global nanosecond timer (traced launches only)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _grid_barrier(bar_ptr, target, MODE: gl.constexpr):
    """Arrive and wait until `target` arrivals. MODE 1: a gpu-scope release arrival (SASS: MEMBAR.ALL.GPU,
    then the atomic) and acquire polls (LDG.STRONG.GPU + CCTL.IVALL: L1 emptied); 2: relaxed atomics both
    ways; 3: release arrival, relaxed polls; 4: relaxed arrival, acquire polls. Modes 2-4 do not order
    the data around the barrier: timing experiments only."""
    ARRIVE: gl.constexpr = "release" if MODE == 1 or MODE == 3 else "relaxed"
    POLL: gl.constexpr = "acquire" if MODE == 1 or MODE == 4 else "relaxed"
    gl.thread_barrier()
    gl.atomic_add(bar_ptr, 1, sem=ARRIVE, scope="gpu")
    seen = gl.atomic_add(bar_ptr, 0, sem=POLL, scope="gpu")
    while seen < target:
        seen = gl.atomic_add(bar_ptr, 0, sem=POLL, scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _producer(
    w_desc,
    ring,
    ready,
    empty,
    trace_ptr,
    L,
    pid,
    P,
    N: gl.constexpr,
    K: gl.constexpr,
    R: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TRACE: gl.constexpr,
):
    """Every tile [R, BK] of this program's units, layer after layer, into the ring (one warp). TRACE: the
    issue time of each layer's first TRACE_TILES tiles into trace[pid, layer, 4 + j]."""
    KSTEPS: gl.constexpr = K // BK
    my_units = gl.cdiv(N // R - pid, P)
    per_layer = my_units * KSTEPS
    for i in range(L * per_layer):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the slot's previous tile was read
        layer = i // per_layer
        j = i % per_layer
        u = pid + (j // KSTEPS) * P
        if TRACE:
            if j < TRACE_TILES:
                gl.store(trace_ptr + (pid * L + layer) * TRACE_SLOTS + 4 + j, _now(j))
        mbarrier.expect(ready.index(s), R * BK * 2)
        tma.async_copy_global_to_shared(w_desc, [layer * N + u * R, (j % KSTEPS) * BK], ready.index(s), ring.index(s))


@gluon.jit
def _consumer(
    x_ptr,
    y_ptr,
    bar_ptr,
    trace_ptr,
    base,
    delay,
    ring,
    ready,
    empty,
    L,
    pid,
    P,
    N: gl.constexpr,
    K: gl.constexpr,
    R: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    BARRIER: gl.constexpr,
    FENCE: gl.constexpr,
    ACC2D: gl.constexpr,
    SLEEP: gl.constexpr,
    XPF: gl.constexpr,
    TRACE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """y[l, rows] = W[l, rows] x for this program's units, a grid barrier (and `delay` cycles) per layer.
    FENCE: a proxy fence between reading a slot and releasing it (the Gluon tutorials' advice; CUTLASS's
    TMA pipelines release without one). ACC2D: products accumulated elementwise over a unit's K steps and
    reduced once per unit (fewer shuffles per tile, more registers) instead of reduced every tile.
    SLEEP: the delay spent in `nanosleep` rather than spinning on the clock. XPF: how the input's K
    chunks reach a step; a gpu-scope acquire (the barrier's poll) empties L1, so after every barrier a
    chunk's first load is an L2 round trip. 0: loaded in its step; 1: loaded one step ahead; 2: as 0, after
    all chunks were loaded at once at the layer's start (one round trip; L1 then holds them). TRACE: per
    layer, the times the layer started [0], its last store [1], the barrier opened [2], the delay ended
    [3], and each of its first TRACE_TILES tiles was ready [4 + TRACE_TILES + j] into trace[pid, layer, :]."""
    TPC: gl.constexpr = BK // 8 if BK // 8 < 32 else 32  # threads along a row, 8 elements (16 B) each
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPC, TPC], [num_warps, 1], [1, 0])
    KSTEPS: gl.constexpr = K // BK
    my_units = gl.cdiv(N // R - pid, P)
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    i = 0
    x_next = gl.load(x_ptr + cols)
    x_offs = gl.arange(0, K, layout=gl.BlockedLayout([8], [32], [num_warps], [0]))
    for layer in range(L):
        if TRACE:
            gl.store(trace_ptr + (pid * L + layer) * TRACE_SLOTS, _now(layer))
        if XPF == 2:  # every chunk's first load at once (one round trip), its sum waited for: L1 holds them after
            warm = gl.sum(gl.load(x_ptr + x_offs).to(gl.float32), axis=0)
            gl.store(trace_ptr, warm.to(gl.int64), mask=pid < 0)
        for t in range(my_units):
            u = pid + t * P
            acc = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, layout))
            acc2 = gl.zeros([R, BK], gl.float32, layout=layout)
            for kk in range(KSTEPS):
                s = i % STAGES
                if XPF == 1:
                    x = x_next
                    x_next = gl.load(x_ptr + ((kk + 1) % KSTEPS) * BK + cols)
                else:
                    x = gl.load(x_ptr + kk * BK + cols)
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if TRACE:
                    if t * KSTEPS + kk < TRACE_TILES:
                        gl.store(
                            trace_ptr + (pid * L + layer) * TRACE_SLOTS + 4 + TRACE_TILES + t * KSTEPS + kk, _now(kk)
                        )
                w = ring.index(s).load(layout)
                if FENCE:
                    fence_async_shared()
                mbarrier.arrive(empty.index(s), count=1)
                if ACC2D:
                    acc2 += w.to(gl.float32) * x.to(gl.float32)[None, :]
                else:
                    acc += gl.sum(w.to(gl.float32) * x.to(gl.float32)[None, :], axis=1)
                i += 1
            if ACC2D:
                acc = gl.sum(acc2, axis=1)
            gl.store(y_ptr + layer * N + u * R + rows, acc.to(y_ptr.dtype.element_ty))
        if TRACE:
            gl.store(trace_ptr + (pid * L + layer) * TRACE_SLOTS + 1, _now(layer))
        if BARRIER:
            _grid_barrier(bar_ptr, base + (layer + 1) * P, BARRIER)
        if TRACE:
            gl.store(trace_ptr + (pid * L + layer) * TRACE_SLOTS + 2, _now(layer))
        if SLEEP:
            _sleep_cycles(delay)
        else:
            _spin_cycles(delay)
        if TRACE:
            gl.store(trace_ptr + (pid * L + layer) * TRACE_SLOTS + 3, _now(layer))


@gluon.jit(do_not_specialize=["base", "delay"])
def stream_ws_kernel(
    w_ptr,
    x_ptr,
    y_ptr,
    bar_ptr,
    trace_ptr,
    base,
    delay,
    L,
    N: gl.constexpr,
    K: gl.constexpr,
    R: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    BARRIER: gl.constexpr,
    FENCE: gl.constexpr,
    ACC2D: gl.constexpr,
    SLEEP: gl.constexpr,
    num_warps: gl.constexpr,
    XPF: gl.constexpr = 0,
    TRACE: gl.constexpr = False,
):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    w_desc = tma.make_tensor_descriptor(
        w_ptr, shape=[L * N, K], strides=[K, 1], block_shape=[R, BK], layout=smem_layout
    )
    ring = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, R, BK], smem_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    x_ptr,
                    y_ptr,
                    bar_ptr,
                    trace_ptr,
                    base,
                    delay,
                    ring,
                    ready,
                    empty,
                    L,
                    pid,
                    P,
                    N,
                    K,
                    R,
                    BK,
                    STAGES,
                    BARRIER,
                    FENCE,
                    ACC2D,
                    SLEEP,
                    XPF,
                    TRACE,
                    num_warps,
                ),
            ),
            (_producer, (w_desc, ring, ready, empty, trace_ptr, L, pid, P, N, K, R, BK, STAGES, TRACE)),
        ],
        [1],
        [40],
    )
