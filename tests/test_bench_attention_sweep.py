"""benchmarks/kernels/attention_backward_sweep.py without a GPU: the compile pool counts a job whose worker
dies (a compiler abort) as failed instead of waiting for it forever, and the candidate lists hold the
Hopper options (descriptor loads, warp-specialised loops) beside the pointer-load grid, within the
compile budget, none that `BackwardLaunch` refuses, and the tables' entries. The sweep itself runs end
to end in `bench_attention_backward.py --smoke --sweep`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))

import attention_backward_sweep as sweep  # noqa: E402

from tinyvllm.kernels.flash_attention_op import (  # noqa: E402
    HOPPER_BACKWARD,
    HOPPER_BACKWARD_ATOMIC,
    HOPPER_FORWARD,
    BackwardConfig,
    ForwardConfig,
)


def job_that_may_die(job: int) -> str | None:
    """A pool job: 0 dies without an answer (as an abort in a compiler pass), odd ones report an error."""
    if job == 0:
        os._exit(134)
    return f"error {job}" if job % 2 else None


def test_pool_counts_a_dead_worker_as_failed():
    failed = sweep.pool_errors(job_that_may_die, {f"j{i}": i for i in range(5)}, workers=2, stall_s=5)
    assert set(failed) == {"j0", "j1", "j3"}
    assert "died" in failed["j0"] and failed["j1"] == "error 1"


def test_candidates_hold_the_hopper_options():
    for d in (64, 128):
        cs = sweep.candidates(d)
        grid = sweep._tile_candidates(d)
        fwd = sweep.forward_candidates(d)
        total, base = sum(map(len, cs.values())) + len(fwd), sum(map(len, grid.values()))
        assert base < total <= 1.5 * base  # the options and the forward add at most half the compiles again
        assert fwd[0] == HOPPER_FORWARD[d] and len(set(fwd)) == len(fwd)
        for kind, field in (("dkdv", "dkdv_tma"), ("dkdv", "dkdv_ws"), ("dq", "dq_tma"), ("dq", "dq_ws"),
                            ("atomic", "dkdv_tma"), ("ordered", "dkdv_tma")):  # fmt: skip
            assert any(getattr(c, field) for c in cs[kind]), (d, kind, field)
        assert not any(c.dkdv_ws for c in cs["ordered"])
        for kind, configs in cs.items():
            assert len(set(configs)) == len(configs), kind
        tables = {*HOPPER_BACKWARD[d], *HOPPER_BACKWARD_ATOMIC[d]}
        for c in tables:  # each table entry's kernels are among the candidates, with its options
            if c.dq_mode == "separate":
                assert any(x[:4] == c[:4] and x[10:12] == c[10:12] for x in cs["dkdv"]), c
                assert any(x[4:8] == c[4:8] and x[12:14] == c[12:14] for x in cs["dq"]), c
            else:
                assert any(x[:4] == c[:4] and x[10:12] == c[10:12] for x in cs[c.dq_mode]), c


def test_pasted_literal_keeps_the_options():
    """The winners' tables are printed as Python: the Hopper options survive the round trip."""
    fwd = ForwardConfig(128, 64, 8, 3)
    assert eval(sweep._fwd_literal(fwd), {"ForwardConfig": ForwardConfig}) == fwd
    for c in (
        BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3, 64, dkdv_tma=True, dq_ws=True),
        BackwardConfig(64, 128, 8, 3, 0, 0, 0, 0, 64, "atomic", dkdv_tma=True, dkdv_ws=True),
        BackwardConfig(32, 64, 4, 3, 64, 32, 4, 3, 64),
    ):
        assert eval(sweep._cfg_literal(c), {"BackwardConfig": BackwardConfig}) == c
