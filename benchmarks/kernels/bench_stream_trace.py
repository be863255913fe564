"""Where does a warp-specialised weight stream lose a wait that every program takes at once? (GPU only.)

docs/perf.md v9 measured `stream_ws.py` (a producer warp filling a ring of shared-memory slots by TMA,
never waiting on the grid barriers): a busy wait after every layer's barrier cost its full length
(5 µs → +5.2 µs per layer, 10 → +10), whatever the ring's depth, although the ring holds ~6 µs of HBM
time and the same wait without barriers cost 0.5 µs. Its model said the next layer's first tiles land
during the wait; the timings said none were in flight. This bench reads the clocks instead of
guessing: a traced launch records, per program and layer, when the producer issued each of the
layer's first 8 tiles, when the consumers found each ready, when the layer started and ended, and
when the barrier and the wait ended (`stream_ws.py`'s TRACE). It also times the variant with the
input's K chunks loaded one step ahead (XPF 1) or all at once at each layer's start (XPF 2): a gpu-scope
acquire (the barrier's poll, `ld.acquire.gpu`, is LDG.STRONG.GPU + CCTL.IVALL in the SASS) empties L1,
so after each barrier every chunk of the input is an L2 round trip inside the consumer's step.

    python benchmarks/kernels/bench_stream_trace.py --out benchmarks/results/stream_trace.json

Prints, per configuration, µs per layer (untraced launches) and the traced medians over programs and
layers 1..L-1 (µs): issue time of tile j after the previous barrier opened, ready time of tile j after
the layer started, the layer's work (start to last store), and the barrier's wait.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton

from benchmarks.kernels.bench_stream import SHAPES, sm_clock_hz, time_launches


def summarise(trace: torch.Tensor, tiles: int) -> dict:
    """Medians (µs) over programs and layers ≥ 1 of a traced launch's [P, L, 4 + 2·tiles] timer words."""
    t = trace.double() / 1e3  # ns → µs
    start, last_store, bar_open, delay_end = t[:, 1:, 0], t[:, 1:, 1], t[:, 1:, 2], t[:, 1:, 3]
    prev_open = t[:, :-1, 2]
    issue = t[:, 1:, 4 : 4 + tiles] - prev_open[..., None]
    ready = t[:, 1:, 4 + tiles : 4 + 2 * tiles] - start[..., None]
    med = lambda x: round(x.median().item(), 3)  # noqa: E731
    return dict(
        issue_after_prev_open=[med(issue[..., j]) for j in range(tiles)],
        ready_after_start=[med(ready[..., j]) for j in range(tiles)],
        start_after_prev_open=med(start - prev_open),
        work=med(last_store - start),
        work_max=round((last_store - start).max().item(), 3),
        barrier_wait=med(bar_open - last_store),
        delay=med(delay_end - bar_open),
        layer=med(bar_open - prev_open),
    )


def main() -> None:
    from benchmarks.kernels.stream_ws import TRACE_SLOTS, TRACE_TILES, stream_ws_kernel

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", default="gate_up")
    ap.add_argument("--delay-us", type=float, nargs="*", default=[0.0, 5.0, 10.0])
    ap.add_argument("--stages", type=int, nargs="*", default=[6, 3])
    ap.add_argument(
        "--barriers",
        type=int,
        nargs="*",
        default=[1, 2, 0],
        help="stream_ws.py _grid_barrier modes: 1 release/acquire, 2 relaxed, 3 release/relaxed, "
        "4 relaxed/acquire; 0 none",
    )
    ap.add_argument("--xpf", type=int, nargs="*", default=[0, 1, 2], help="stream_ws.py's XPF modes to run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/stream_trace.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    torch.manual_seed(0)
    n, k = SHAPES[args.shape]
    L, R, BK, warps = args.layers, 64, 256, 4
    w = torch.randn(L, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(L, n, device=dev, dtype=torch.bfloat16)
    ref = w.float() @ x.float()
    bar = torch.zeros(2, device=dev, dtype=torch.int32)
    tiles, slots = int(TRACE_TILES), int(TRACE_SLOTS)
    trace = torch.zeros(sms, L, slots, device=dev, dtype=torch.int64)
    clock = sm_clock_hz(dev)
    rows = []
    for stages in args.stages:
        for barrier in args.barriers:
            for delay_us in args.delay_us:
                for xpf in args.xpf:
                    launches = [0]

                    def run(traced: bool = False):
                        base = launches[0] * L * sms
                        launches[0] += 1
                        stream_ws_kernel[(sms,)](
                            w,
                            x,
                            y,
                            bar,
                            trace,
                            base,
                            int(delay_us * 1e-6 * clock),
                            L,
                            N=n,
                            K=k,
                            R=R,
                            BK=BK,
                            STAGES=stages,
                            BARRIER=barrier,
                            FENCE=False,
                            ACC2D=True,
                            SLEEP=False,
                            num_warps=warps,
                            maxnreg=256,
                            XPF=xpf,
                            TRACE=traced,
                        )

                    bar.zero_()
                    y.zero_()
                    run()
                    torch.cuda.synchronize()
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    t = time_launches(run, args.reps)
                    run(traced=True)
                    torch.cuda.synchronize()
                    row = dict(
                        stages=stages,
                        barrier=barrier,
                        delay_us=delay_us,
                        xpf=xpf,
                        us_per_layer=t / L * 1e6,
                        err=err,
                        **summarise(trace.cpu(), tiles),
                    )
                    rows.append(row)
                    print(
                        f"S={stages} bar={barrier} delay={delay_us:4.1f} xpf={xpf}: {row['us_per_layer']:6.2f} µs/layer"
                        f" (traced {row['layer']:6.2f}) work {row['work']:6.2f} (max {row['work_max']:6.2f})"
                        f" bar.wait {row['barrier_wait']:5.2f} err {err:.1e}\n"
                        f"   issue after prev open {row['issue_after_prev_open']}\n"
                        f"   ready after start     {row['ready_after_start']}",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(),
                sms=sms,
                layers=L,
                shape=args.shape,
                R=R,
                BK=BK,
                warps=warps,
                sm_clock_ghz=clock / 1e9,
                rows=rows,
            ),
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
