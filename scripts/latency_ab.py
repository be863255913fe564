"""A/B of engine settings on the `latency` workload: `tinyvllm bench latency --profile` run in fresh
processes, one per variant in turn for each round, so that every variant meets the same machine state (an
A/B is only read within one call). A variant is a name and engine flags (every EngineArgs field has one):

    python scripts/latency_ab.py --rounds 2 --out-dir benchmarks/results --name latency_ab \
        --variant "no-io:--graph-io-max-rows 0 --no-sample-in-lm-head" --variant "default:"

It writes NAME_<variant>_r<round>.json per run (the bench's own JSON) and prints one line per run: decode
tok/s (best of the bench's iterations), the profiled step and its idle device time; then a table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name:--flag value --other' → (name, [engine flags])."""
    name, sep, flags = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"bad variant {text!r}: want NAME:--engine-flag ...")
    return name, shlex.split(flags)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME:--engine-flag value ...; repeat for each variant",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default="latency_ab")
    p.add_argument("bench_args", nargs="*", help="more arguments for `tinyvllm bench latency` (after --)")
    ns = p.parse_args()
    variants = [parse_variant(v) for v in ns.variant]
    rows = []
    for rnd in range(ns.rounds):
        for vname, extra in variants:
            name = f"{ns.name}_{vname}_r{rnd}"
            argv = ["bench", "latency", "--profile", "--out-dir", ns.out_dir, "--name", name, *ns.bench_args, *extra]
            rc = subprocess.call([sys.executable, "-m", "tinyvllm.entrypoints.cli", *argv])
            path = Path(ns.out_dir) / f"{name}.json"
            if rc or not path.exists():
                print(f"{name}: failed (rc {rc})", flush=True)
                continue
            d = json.loads(path.read_text())
            prof = d.get("profile") or {}
            idle = prof.get("ms_per_step", {}).get("host/launch gaps", float("nan")) * 1e3
            best = max(r["decode_tokens_per_s"] for r in d["runs"])
            rows.append((vname, rnd, best, prof.get("wall_ms_per_step", float("nan")) * 1e3, idle))
            print(
                f"{vname} round {rnd}: {best:,.1f} tok/s, profiled step {rows[-1][3]:.1f} us, idle {idle:.1f} us",
                flush=True,
            )
    print("\n| variant | round | decode tok/s | profiled step µs | idle µs |\n|---|---|---|---|---|")
    for vname, rnd, best, step, idle in rows:
        print(f"| {vname} | {rnd} | {best:,.1f} | {step:.1f} | {idle:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
