"""How fast can one persistent program per SM stream a decode layer's weights? (GPU only.)

The decode megakernel (kernels/decode_megakernel.py) spends most of a batch-1 token in matrix-vector
products y = W x over bf16 weights, one program per multiprocessor, a grid barrier after each phase. This
bench isolates that streaming: L stacked weight matrices of one shape (the layers), one launch that runs
y[l] = W[l] x for every l, with or without a grid barrier between layers, and two ways of
fetching the tiles:

  kloop  one flat loop over the program's (unit, K step) tiles [R, BK], software-pipelined by Triton
         over STAGES shared-memory buffers (cp.async), accumulated elementwise and reduced once a unit:
         the form of the megakernel's weight phases;
  tma    kloop with the tiles fetched by the tensor-memory accelerator (a tensor descriptor).

Beside them, in the same run: cuBLAS (torch.mv per layer, CUDA-graph replay) and the read bandwidth of
a large many-program reduction (the most a streaming kernel can hope for). Prints a table, writes
stream_<gpu>.json.

    python benchmarks/kernels/bench_stream.py [--shapes gate_up,down] [--variants kloop,tma] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl
from common import output_paths

SHAPES = {  # name: (N, K) of the Llama 3.2 1B decode products
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
}


@triton.jit
def _grid_barrier(count_ptr, target):
    """A grid barrier of the megakernel's kind: a CTA barrier, a gpu-scope release add (this program's
    stores are visible to whoever acquires the count), then acquire polls until `target` programs have
    arrived. The count only grows, so launch j's layer l waits for (j·L + l + 1)·P arrivals."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["base"])
def _stream_kloop(
    w_ptr,
    x_ptr,
    y_ptr,
    bar_ptr,
    base,
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
        if BARRIER:
            _grid_barrier(bar_ptr, base + (layer + 1) * P)


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


def configs(name: str, n: int, k: int, variants: set[str]):
    """(variant, R, BK, STAGES, warps) to try for one shape."""
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


def row(shape: str, variant: str, cfg: tuple, barrier: bool, t: float, layers: int, nbytes: int, **extra) -> dict:
    r, bk, stages, warps = cfg
    return dict(
        shape=shape,
        variant=variant,
        R=r,
        BK=bk,
        stages=stages,
        warps=warps,
        barrier=barrier,
        us_per_layer=t / layers * 1e6,
        tbps=nbytes / t / 1e12,
        **extra,
    )


def time_cublas(w: torch.Tensor, x: torch.Tensor, reps: int) -> float:
    """Seconds per step of torch.mv over every layer, as one CUDA-graph replay."""
    g = torch.cuda.CUDAGraph()
    ys = torch.empty(w.shape[0], w.shape[1], device=w.device, dtype=w.dtype)
    with torch.cuda.graph(g):
        for layer in range(w.shape[0]):
            torch.mv(w[layer], x, out=ys[layer])
    return time_launches(g.replay, reps)


def time_stream(w, x, y, ref, cfg: tuple, barrier: bool, sms: int, reps: int) -> tuple[float, float, float]:
    """(seconds per launch, max error relative to the largest output, first launch's seconds) of one
    variant; the first launch compiles."""
    variant, r, bk, stages, warps = cfg
    L, n, k = w.shape
    bar = torch.zeros(2, device=w.device, dtype=torch.int32)
    launches = [0]

    def run():
        base = launches[0] * L * sms  # the barrier counter only grows: each launch waits for its own count
        launches[0] += 1
        _stream_kloop[(sms,)](
            w, x, y, bar, base, L, N=n, K=k, R=r, BK=bk, STAGES=stages, BARRIER=barrier, TMA=variant == "tma",
            num_warps=warps,
        )  # fmt: skip

    y.zero_()
    t0 = time.time()
    run()
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    return time_launches(run, reps), err, compile_s


def bench_shape(name: str, layers: int, variants: set[str], sms: int, reps: int) -> list[dict]:
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    w = torch.randn(layers, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(layers, n, device=dev, dtype=torch.bfloat16)
    ref = w.float() @ x.float()
    nbytes = w.numel() * 2
    t = time_cublas(w, x, reps)
    rows = [row(name, "cublas", (0, 0, 0, 0), False, t, layers, nbytes, err=0.0)]
    print(
        f"{name:8s} cublas                        {rows[-1]['us_per_layer']:7.2f} µs/layer {rows[-1]['tbps']:5.2f} TB/s"
    )
    for cfg, barrier in itertools.product(configs(name, n, k, variants), (True, False)):
        try:
            t, err, compile_s = time_stream(w, x, y, ref, cfg, barrier, sms, reps)
        except Exception as e:  # a config the compiler rejects: record and go on
            print(f"{name:8s} {cfg}: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(row(name, cfg[0], cfg[1:], barrier, t, layers, nbytes, err=err, compile_s=compile_s))
        r = rows[-1]
        print(
            f"{name:8s} {cfg[0]:5s} R={r['R']:3d} BK={r['BK']:5d} S={r['stages']:2d} w={r['warps']} "
            f"bar={int(barrier)} {r['us_per_layer']:7.2f} µs/layer {r['tbps']:5.2f} TB/s  err {err:.1e}",
            flush=True,
        )
    return rows


def print_best(rows: list[dict], shapes: list[str]) -> None:
    print("\nbest per shape and variant:")
    for name in shapes:
        for variant, barrier in (("cublas", False), ("kloop", True), ("tma", True), ("kloop", False), ("tma", False)):
            vs = [r for r in rows if r["shape"] == name and r["variant"] == variant and r["barrier"] == barrier]
            if vs:
                b = min(vs, key=lambda r: r["us_per_layer"])
                print(
                    f"  {name:8s} {variant:6s} barrier={int(barrier)} {b['us_per_layer']:7.2f} µs {b['tbps']:5.2f} TB/s"
                    f" (R={b['R']} BK={b['BK']} S={b['stages']} w={b['warps']})"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="kloop,tma")
    ap.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    torch.manual_seed(0)
    out, _ = output_paths(args.out, "stream")
    read_bw = read_bandwidth(dev)
    print(f"read bandwidth (many programs): {read_bw / 1e12:.2f} TB/s")
    rows: list[dict] = []
    shapes = args.shapes.split(",")
    for name in shapes:
        rows += bench_shape(name, args.layers, set(args.variants.split(",")), sms, args.reps)
        write(out, rows, sms, args.layers, read_bw)  # after each shape, so that a time limit keeps the rest
    print_best(rows, shapes)


def write(out: Path, rows: list[dict], sms: int, layers: int, read_bw: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(device=torch.cuda.get_device_name(), sms=sms, layers=layers, read_tbps=read_bw / 1e12, rows=rows)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
