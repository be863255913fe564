"""`tinyvllm bench <name>`: benchmarks as sub-commands, one module each.

To add one, write a module with
    HELP: str                                         one line for `tinyvllm bench -h`
    add_cli_args(parser: argparse.ArgumentParser)     its flags
    run(ns: argparse.Namespace) -> int                the exit status
that imports its heavy dependencies inside `run`, and name it in BENCHMARKS.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, str] = {
    "latency": "tinyvllm.bench.latency",  # batch 1: TTFT and decode tokens/s
    "throughput": "tinyvllm.bench.throughput",  # the 256-request offline set
    "shared-prefix": "tinyvllm.bench.shared_prefix",  # prefix caching on vs off
    "startup": "tinyvllm.bench.startup",  # process start to first token, by phase, cold and warm
    "serve": "tinyvllm.entrypoints.bench_serve",  # the `serving` workload against a running server
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` with one sub-command per entry of BENCHMARKS."""
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    names = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = names.add_parser(
            name, help=module.HELP, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_cli_args(p)
        p.set_defaults(func=module.run)
