"""A machine other than 0 of a tensor-parallel group: it hosts workers only.

    python -m tinyvllm.distributed.headless -tp 4 --nnodes 2 --node-rank 1 \\
        --master-addr 10.0.0.1 --master-port 29500 [--device cuda]

starts this machine's ranks (node_rank·L .. node_rank·L + L − 1, L = tp / nnodes), which join the
rendezvous of machine 0 and take the model's arguments from its driver (the model directory must exist
at the same path here), then waits for them. It exits 0 when the driver shut them down, else with the
first failing worker's status. Engine flags other than the parallel ones and --device are accepted (so
every machine can run the same command line) and ignored: the driver's are used.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from tinyvllm.config import ParallelConfig
from tinyvllm.distributed.worker import WorkerSpec, spawn_worker
from tinyvllm.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli

logger = logging.getLogger(__name__)


def run_headless(args: EngineArgs) -> int:
    """Start this machine's workers and wait for them (module docstring); returns the exit status."""
    from tinyvllm.engine.llm_engine import resolve_device

    parallel: ParallelConfig = args.parallel_config()
    if parallel.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine (tinyvllm serve / LLM), not headless workers")
    device = resolve_device(args.device)
    if parallel.master_port is None:
        raise ValueError("headless workers need --master-port (the one machine 0 listens on)")
    per = parallel.ranks_per_node
    procs = [
        spawn_worker(
            WorkerSpec(parallel, parallel.master_port, rank, rank - parallel.node_rank * per, device.type, os.getpid())
        )
        for rank in parallel.node_ranks
    ]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinyvllm.distributed.headless", description=__doc__)
    add_engine_cli_args(parser)
    logging.basicConfig(level=logging.INFO)
    code = run_headless(engine_args_from_cli(parser.parse_args(argv)))
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
