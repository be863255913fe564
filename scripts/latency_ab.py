"""A/B of engine settings on the `latency` workload: `tinyvllm bench latency --profile` run in fresh
processes, alternating the values given for module-level constants, so that every variant meets the same
machine state in turn (docs/perf.md: an A/B is only read within one call).

    python scripts/latency_ab.py --set tinyvllm.engine.model_runner.GRAPH_IO_MAX_ROWS=8,0 --rounds 2 \\
        --out-dir benchmarks/results --name latency_v15_io

writes NAME_<constant>_<value>_r<round>_<gpu>.json per run (the bench's own JSON) and prints one line per
run: decode tok/s (best of the bench's iterations), the profiled step and its idle device time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_RUN = """import importlib, sys
module = importlib.import_module({module!r})
assert hasattr(module, {attr!r}), "no such constant: {module}.{attr}"
setattr(module, {attr!r}, {value})
from tinyvllm.entrypoints.cli import main
sys.exit(main({argv!r}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", required=True, help="package.module.CONSTANT=value1,value2,... (Python literals)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default="latency_ab")
    p.add_argument("bench_args", nargs="*", help="more arguments for `tinyvllm bench latency` (after --)")
    ns = p.parse_args()
    target, values = ns.set.split("=", 1)
    module, attr = target.rsplit(".", 1)
    rows = []
    for rnd in range(ns.rounds):
        for value in values.split(","):
            name = f"{ns.name}_{attr}_{value}_r{rnd}"
            argv = ["bench", "latency", "--profile", "--out-dir", ns.out_dir, "--name", name, *ns.bench_args]
            code = _RUN.format(module=module, attr=attr, value=value, argv=argv)
            rc = subprocess.call([sys.executable, "-c", code])
            path = Path(ns.out_dir) / f"{name}.json"
            if rc or not path.exists():
                print(f"{name}: failed (rc {rc})", flush=True)
                continue
            d = json.loads(path.read_text())
            prof = d.get("profile") or {}
            idle = prof.get("ms_per_step", {}).get("host/launch gaps", float("nan")) * 1e3
            best = max(r["decode_tokens_per_s"] for r in d["runs"])
            rows.append((attr, value, rnd, best, prof.get("wall_ms_per_step", float("nan")) * 1e3, idle))
            print(f"{attr}={value} round {rnd}: {best:,.1f} tok/s, profiled step {rows[-1][4]:.1f} us, "
                  f"idle {idle:.1f} us", flush=True)
    print("\n| setting | round | decode tok/s | profiled step µs | idle µs |\n|---|---|---|---|---|")
    for attr, value, rnd, best, step, idle in rows:
        print(f"| {attr}={value} | {rnd} | {best:,.1f} | {step:.1f} | {idle:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
