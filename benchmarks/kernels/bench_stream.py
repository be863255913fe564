"""How fast can one persistent program per SM stream a decode layer's weights? (GPU only.)

The decode megakernel (kernels/decode_megakernel.py) spends most of a batch-1 token in matrix-vector
products y = W x over bf16 weights, one program per multiprocessor, a grid barrier after each. This
bench isolates that streaming: L stacked weight matrices of one shape (the layers), one launch that runs
y[l] = W[l] x for every l with (or without) a grid barrier between layers, and several ways for a
program to keep bytes in flight:

  reg2   a unit of R rows × all K loaded whole into registers, the next unit's tile loaded before this
         one is reduced (the megakernel's phases today);
  kloop  one flat loop over the program's (unit, K step) tiles [R, BK], software-pipelined by Triton
         over STAGES shared-memory buffers (cp.async), accumulated elementwise and reduced once a unit;
  tma    kloop with the tiles fetched by the tensor-memory accelerator (a tensor descriptor);
  ws     a producer warp fills a ring of shared-memory slots by TMA across layers, never waiting on a
         grid barrier, while the other warps multiply (warp specialisation, Gluon: `stream_ws.py`);
         ws_nf without the proxy fence before a slot's release, ws_nf_acc also reducing once per unit,
         ws_nf_acc_sleep also spending the delay asleep (nanosleep) instead of spinning.

With `--delay-us`, every layer's barrier (or end, without barriers) is followed by that long a busy wait in every program (a
stand-in for the latency-bound phases of a real decode layer: attention, the o-projection): a scheme
whose loads stop at the barrier pays it in full, one whose loads run ahead hides part of it.

Beside them, in the same run: cuBLAS (torch.mv per layer, CUDA-graph replay) and the read bandwidth of
a large many-program reduction (the "copy" roofline a streaming kernel can hope for). Prints a table,
writes JSON.

    python benchmarks/kernels/bench_stream.py --out benchmarks/results/stream_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
import triton.language as tl

from tinyvllm.kernels.decode_megakernel import _arrive, _wait

SHAPES = {  # name: (N, K) of the Llama 3.2 1B decode products
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
}


@triton.jit
def _spin_cycles(cycles):
    """Busy-wait `cycles` SM clock cycles."""
    if cycles > 0:
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=tl.int64, is_pure=False, pack=1)
        t = t0
        while t - t0 < cycles:
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %clock64;", "=l,r", [cycles], dtype=tl.int64, is_pure=False, pack=1
            )


@triton.jit
def _layer_end(bar_ptr, base, layer, P, delay, BARRIER: tl.constexpr):
    if BARRIER:
        _arrive(bar_ptr)
        _wait(bar_ptr, base + (layer + 1) * P)
    _spin_cycles(delay)


@triton.jit(do_not_specialize=["base", "delay"])
def _stream_reg2(
    w_ptr,
    x_ptr,
    y_ptr,
    bar_ptr,
    base,
    delay,
    L,
    N: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BARRIER: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_units = N // R
    rr = tl.arange(0, R)
    cc = tl.arange(0, K)
    x = tl.load(x_ptr + cc).to(tl.float32)[None, :]
    for layer in range(L):
        base_w = w_ptr + tl.cast(layer, tl.int64) * (N * K)
        rows = pid * R + rr
        w = tl.load(base_w + rows[:, None] * K + cc[None, :], mask=(rows < N)[:, None], other=0.0)
        for u in range(pid, n_units, P):
            rows_next = (u + P) * R + rr
            w_next = tl.load(base_w + rows_next[:, None] * K + cc[None, :], mask=(rows_next < N)[:, None], other=0.0)
            y = tl.sum(w.to(tl.float32) * x, axis=1)
            tl.store(y_ptr + layer * N + u * R + rr, y.to(y_ptr.dtype.element_ty))
            w = w_next
        _layer_end(bar_ptr, base, layer, P, delay, BARRIER)


@triton.jit(do_not_specialize=["base", "delay"])
def _stream_kloop(
    w_ptr,
    x_ptr,
    y_ptr,
    bar_ptr,
    base,
    delay,
    L,
    N: tl.constexpr,
    K: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    BARRIER: tl.constexpr,
    TMA: tl.constexpr,
):
    """The `kloop` variant; with TMA, the tiles come through a tensor descriptor (the `tma` variant)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    KSTEPS: tl.constexpr = K // BK
    n_units = N // R
    my_units = tl.cdiv(n_units - pid, P)
    rr = tl.arange(0, R)
    cc = tl.arange(0, BK)
    if TMA:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[L * N, K], strides=[K, 1], block_shape=[R, BK])
    for layer in range(L):
        base_w = w_ptr + tl.cast(layer, tl.int64) * (N * K)
        acc = tl.zeros([R, BK], tl.float32)
        for i in tl.range(0, my_units * KSTEPS, num_stages=STAGES):
            u = pid + (i // KSTEPS) * P
            k0 = (i % KSTEPS) * BK
            if TMA:
                w = desc.load([layer * N + u * R, k0])
            else:
                w = tl.load(base_w + (u * R + rr)[:, None] * K + k0 + cc[None, :])
            x = tl.load(x_ptr + k0 + cc)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            if i % KSTEPS == KSTEPS - 1:
                tl.store(y_ptr + layer * N + u * R + rr, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))
                acc = tl.zeros([R, BK], tl.float32)
        _layer_end(bar_ptr, base, layer, P, delay, BARRIER)


@triton.jit
def _read_sum(w_ptr, out_ptr, BLOCK: tl.constexpr):
    """Read bandwidth anchor: each of many programs sums one block."""
    pid = tl.program_id(0)
    offs = tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + pid, tl.sum(tl.load(w_ptr + offs).to(tl.float32), axis=0))


def time_launches(fn, reps: int) -> float:
    """Mean seconds per call of fn over reps calls (after two warm-up calls)."""
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def read_bandwidth(dev: torch.device) -> float:
    """Bytes per second that many programs, each summing one 32 KB block, read from a 1 GiB tensor."""
    big = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
    out = torch.empty(big.numel() // 16384, device=dev, dtype=torch.float32)
    t = time_launches(lambda: _read_sum[(out.numel(),)](big, out, BLOCK=16384), 10)
    return big.numel() * 2 / t


@triton.jit
def _spin_kernel(cycles):
    _spin_cycles(cycles)


def sm_clock_hz(dev: torch.device) -> float:
    """The SM clock under a busy wait (cycles per second of one program spinning 20 M cycles)."""
    cycles = 20_000_000
    t = time_launches(lambda: _spin_kernel[(1,)](cycles), 3)
    return cycles / t


def configs(name: str, n: int, k: int, variants: set[str]):
    """(variant, R, BK, STAGES, warps) to try for one shape."""
    if "reg2" in variants:
        yield ("reg2", max(1, 16384 // k), k, 1, 8)
        yield ("reg2", max(1, 32768 // k), k, 1, 8)
    tiles = [(8, 1024), (16, 512), (32, 256), (4, 2048), (16, 1024), (64, 256), (8, 2048)]
    for (r, bk), (stages, warps) in itertools.product(tiles, ((3, 8), (4, 8), (6, 8), (4, 4))):
        if n % r or k % bk or r * bk * 2 * stages > 200_000:
            continue
        if n // r < 128 and name != "o":  # fewer units than SMs: the shape cannot spread
            continue
        if "kloop" in variants:
            yield ("kloop", r, bk, stages, warps)
        if bk <= 256 and "tma" in variants:
            yield ("tma", r, bk, stages, warps)
    for ws in sorted(v for v in variants if v.startswith("ws")):  # rings of ~192 or ~96 KB, slots of R × BK
        for r, bk in ((64, 256), (32, 256), (16, 256), (8, 256), (128, 128)):
            if n % r or k % bk or n // r < 128:
                continue
            for ring_kb, warps in ((192, 4), (192, 8), (96, 4)):
                stages = ring_kb * 1024 // (r * bk * 2)
                if 2 <= stages <= 64:
                    yield (ws, r, bk, stages, warps)


def best_kloop(name: str) -> tuple:
    """The kloop configuration measured fastest per shape on the H200 (stream_h200.json)."""
    return {
        "gate_up": ("kloop", 32, 256, 4, 4),
        "down": ("kloop", 8, 1024, 4, 4),
        "qkv": ("kloop", 8, 1024, 3, 8),
        "o": ("kloop", 8, 1024, 3, 8),
    }[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="reg2,kloop,tma,ws")
    ap.add_argument(
        "--delay-us",
        type=float,
        nargs="*",
        default=[],
        help="also run the best kloop and every ws config with this busy wait after each barrier",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/stream.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    torch.manual_seed(0)
    rows = []
    variants = set(args.variants.split(","))

    read_bw = read_bandwidth(dev)
    clock = sm_clock_hz(dev)
    print(f"read bandwidth (many programs): {read_bw / 1e12:.2f} TB/s; SM clock while spinning {clock / 1e9:.2f} GHz")
    meta = dict(read_tbps=read_bw / 1e12, sm_clock_ghz=clock / 1e9)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        L = args.layers
        w = torch.randn(L, n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(L, n, device=dev, dtype=torch.bfloat16)
        ref = w.float() @ x.float()
        nbytes = w.numel() * 2

        g = torch.cuda.CUDAGraph()
        ys = torch.empty_like(y)
        with torch.cuda.graph(g):
            for layer in range(L):
                torch.mv(w[layer], x, out=ys[layer])
        t = time_launches(g.replay, args.reps)
        rows.append(
            dict(
                shape=name,
                variant="cublas",
                R=0,
                BK=0,
                stages=0,
                warps=0,
                barrier=False,
                delay_us=0.0,
                us_per_layer=t / L * 1e6,
                tbps=nbytes / t / 1e12,
                err=0.0,
            )
        )
        print(f"{name:8s} cublas                         {t / L * 1e6:7.2f} µs/layer {nbytes / t / 1e12:5.2f} TB/s")

        bar = torch.zeros(2, device=dev, dtype=torch.int32)
        no_trace = torch.zeros(1, device=dev, dtype=torch.int64)
        cands = list(configs(name, n, k, variants))
        runs = [(c, True, 0.0) for c in cands] + [
            (c, False, 0.0) for c in cands if c[0] == "reg2" or c[0].startswith("ws")
        ]
        for delay in args.delay_us:
            for barrier in (True, False, 2):
                runs += [(c, barrier, delay) for c in [best_kloop(name)] + [c for c in cands if c[0].startswith("ws")]]
        for (variant, r, bk, stages, warps), barrier, delay_us in runs:
            launches = [0]
            delay = int(delay_us * 1e-6 * clock)

            def run():
                base = launches[0] * L * sms
                launches[0] += 1
                if variant == "reg2":
                    _stream_reg2[(sms,)](w, x, y, bar, base, delay, L, N=n, K=k, R=r, BARRIER=barrier, num_warps=warps)
                elif barrier == 2 and not variant.startswith("ws"):
                    raise ValueError("relaxed barriers: ws variants only")
                elif variant.startswith("ws"):
                    from benchmarks.kernels.stream_ws import stream_ws_kernel

                    stream_ws_kernel[(sms,)](
                        w,
                        x,
                        y,
                        bar,
                        no_trace,
                        base,
                        delay,
                        L,
                        N=n,
                        K=k,
                        R=r,
                        BK=bk,
                        STAGES=stages,
                        BARRIER=int(barrier),
                        FENCE="_nf" not in variant,
                        ACC2D="acc" in variant,
                        SLEEP="sleep" in variant,
                        num_warps=warps,
                        maxnreg=256 if warps == 4 else 168,
                    )
                else:
                    _stream_kloop[(sms,)](
                        w,
                        x,
                        y,
                        bar,
                        base,
                        delay,
                        L,
                        N=n,
                        K=k,
                        R=r,
                        BK=bk,
                        STAGES=stages,
                        BARRIER=barrier,
                        TMA=variant == "tma",
                        num_warps=warps,
                    )

            try:
                bar.zero_()
                y.zero_()
                t0 = time.time()
                run()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t = time_launches(run, args.reps)
            except Exception as e:  # a config the compiler rejects: record and go on
                print(f"{name:8s} {variant:5s} R={r} BK={bk} S={stages} w={warps}: {type(e).__name__}: {str(e)[:300]}")
                bar.zero_()
                continue
            row = dict(
                shape=name,
                variant=variant,
                R=r,
                BK=bk,
                stages=stages,
                warps=warps,
                barrier=barrier,
                delay_us=delay_us,
                us_per_layer=t / L * 1e6,
                tbps=nbytes / t / 1e12,
                err=err,
                compile_s=compile_s,
            )
            rows.append(row)
            print(
                f"{name:8s} {variant:5s} R={r:3d} BK={bk:5d} S={stages:2d} w={warps} bar={int(barrier)} "
                f"delay={delay_us:4.1f}µs {row['us_per_layer']:7.2f} µs/layer {row['tbps']:5.2f} TB/s  err {err:.1e}",
                flush=True,
            )
        write(args, rows, sms, meta)

    print("\nbest per shape (with barrier), per delay:")
    for name in args.shapes.split(","):
        for delay_us in [0.0] + list(args.delay_us):
            cand = [
                r
                for r in rows
                if r["shape"] == name and r["delay_us"] == delay_us and (r["barrier"] or r["variant"] == "cublas")
            ]
            for variant in ("cublas", "reg2", "kloop", "tma", "ws", "ws_nf", "ws_nf_acc", "ws_nf_acc_sleep"):
                vs = [r for r in cand if r["variant"] == variant]
                if vs:
                    b = min(vs, key=lambda r: r["us_per_layer"])
                    print(
                        f"  {name:8s} delay {delay_us:4.1f} {variant:6s} {b['us_per_layer']:7.2f} µs {b['tbps']:5.2f} TB/s "
                        f"(R={b['R']} BK={b['BK']} S={b['stages']} w={b['warps']})"
                    )
    write(args, rows, sms, meta)
    print(f"wrote {args.out}")


def write(args, rows: list[dict], sms: int, meta: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), sms=sms, layers=args.layers, **meta, rows=rows), indent=1)
    )


if __name__ == "__main__":
    main()
