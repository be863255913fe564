"""Where the engine loop's wall time goes, step by step: host work versus waiting for the device.

`LLMEngine.step()` does three host phases (schedule the next batch, launch it, process a finished
one) and, inside processing, waits for the device's sampled ids. With async scheduling the device
runs step N+1 while the host processes step N, so a step whose wait is ~0 was host-bound (the device
idled for part of it) and one with a large wait was device-bound. Recording costs four clock reads a
step; the per-step log is kept only when asked for (`StepTimer(keep_log=True)`), since a server runs
for ever.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepRecord:
    """One engine step. Times in seconds; `num_tokens` and `num_seqs` describe the batch launched in
    this step (0 when nothing was launched), so decode-only steps have num_tokens == num_seqs."""

    num_tokens: int
    num_seqs: int
    schedule_s: float
    launch_s: float
    process_s: float  # processing the finished step's outputs, waits excluded
    wait_s: float  # blocked on the device for the finished step's sampled ids

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.launch_s + self.process_s

    @property
    def wall_s(self) -> float:
        return self.host_s + self.wait_s


@dataclass
class StepTimer:
    """Accumulates StepRecords (see the module docstring)."""

    keep_log: bool = False
    log: list[StepRecord] = field(default_factory=list)

    def record(self, rec: StepRecord) -> None:
        if self.keep_log:
            self.log.append(rec)

    def reset(self, keep_log: bool | None = None) -> None:
        self.log = []
        if keep_log is not None:
            self.keep_log = keep_log


def summarize(log: list[StepRecord]) -> dict[str, Any]:
    """Per step kind (decode-only batches, batches with prefill tokens, steps that launched nothing):
    step count, mean host ms by phase, mean wait ms, and total seconds. A kind whose mean wait is near
    zero ran host-bound."""
    kinds: dict[str, list[StepRecord]] = {"decode": [], "prefill": [], "idle": []}
    for r in log:
        kind = "idle" if r.num_seqs == 0 else "decode" if r.num_tokens == r.num_seqs else "prefill"
        kinds[kind].append(r)
    out: dict[str, Any] = {}
    for kind, recs in kinds.items():
        if not recs:
            continue
        out[kind] = {
            "steps": len(recs),
            "mean_batch": statistics.fmean(r.num_seqs for r in recs),
            "mean_ms": {
                name: 1e3 * statistics.fmean(getattr(r, f"{name}_s") for r in recs)
                for name in ("schedule", "launch", "process", "wait", "host", "wall")
            },
            "total_s": {
                "host": sum(r.host_s for r in recs),
                "wait": sum(r.wait_s for r in recs),
                "wall": sum(r.wall_s for r in recs),
            },
            "host_bound_fraction": sum(r.wait_s < 1e-4 for r in recs) / len(recs),
        }
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """One line per step kind, for the bench's console output."""
    lines = []
    for kind, s in summary.items():
        ms = s["mean_ms"]
        lines.append(
            f"{kind:>7}: {s['steps']} steps, batch {s['mean_batch']:.0f}, host {ms['host']:.2f} ms "
            f"(schedule {ms['schedule']:.2f}, launch {ms['launch']:.2f}, process {ms['process']:.2f}), "
            f"wait {ms['wait']:.2f} ms, {s['total_s']['wall']:.2f} s in all, "
            f"{100 * s['host_bound_fraction']:.0f}% of steps host-bound"
        )
    return "\n".join(lines)
