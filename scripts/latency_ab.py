"""A/B of engine settings on the `latency` workload: `tinyvllm bench latency --profile` run in fresh
processes, one per variant in turn for each round, so that every variant meets the same machine state
(docs/perf.md: an A/B is only read within one call). A variant sets module-level constants:

    M=tinyvllm.engine.model_runner
    python scripts/latency_ab.py --rounds 2 --out-dir benchmarks/results --name latency_v15 \\
        --variant "v14:$M.GRAPH_IO_MAX_ROWS=0;$M.SAMPLE_IN_LM_HEAD=False" --variant "default:"

A variant may end in `|` and more arguments for `tinyvllm bench latency` (engine flags):
`--variant "full:|--no-pruned-lm-head"`. It
writes NAME_<variant>_r<round>.json per run (the bench's own JSON) and prints one line per run: decode
tok/s (best of the bench's iterations), the profiled step and its idle device time; then a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

_RUN = """import importlib, sys
for target, value in {assignments!r}:
    module_name, attr = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    assert hasattr(module, attr), "no such constant: " + target
    setattr(module, attr, eval(value))
from tinyvllm.entrypoints.cli import main
sys.exit(main({argv!r}))
"""


def parse_variant(text: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """'name:pkg.mod.CONST=value;pkg.mod.OTHER=value|--flag ...' → (name, [(target, value literal), ...],
    [extra bench arguments])."""
    name, _, body = text.partition(":")
    body, _, extra = body.partition("|")
    assignments = []
    for item in filter(None, body.split(";")):
        target, sep, value = item.partition("=")
        if not sep or "." not in target:
            raise SystemExit(f"bad assignment {item!r} in variant {name!r}: want pkg.module.CONSTANT=value")
        assignments.append((target.strip(), value.strip()))
    return name, assignments, extra.split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME:pkg.module.CONSTANT=value;... (Python literals); repeat for each variant",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--name", default="latency_ab")
    p.add_argument("bench_args", nargs="*", help="more arguments for `tinyvllm bench latency` (after --)")
    ns = p.parse_args()
    variants = [parse_variant(v) for v in ns.variant]
    rows = []
    for rnd in range(ns.rounds):
        for vname, assignments, extra in variants:
            name = f"{ns.name}_{vname}_r{rnd}"
            argv = ["bench", "latency", "--profile", "--out-dir", ns.out_dir, "--name", name, *ns.bench_args, *extra]
            rc = subprocess.call([sys.executable, "-c", _RUN.format(assignments=assignments, argv=argv)])
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
