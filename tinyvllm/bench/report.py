"""Printing a table and writing JSON: every benchmark reports the same way."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path("benchmarks/results")

_NOT_A_MODEL = {"nvidia", "geforce", "tesla", "quadro"}  # brand words before the model name


def device_tag(name: str | None = None) -> str:
    """A short lowercase name of the machine for result file names (`<bench>_<tag>.json`): the GPU's model,
    e.g. "NVIDIA H200" → "h200", "NVIDIA GeForce RTX 4090" → "rtx4090", "NVIDIA A100-SXM4-80GB" → "a100";
    "cpu" without CUDA."""
    if name is None:
        if not torch.cuda.is_available():
            return "cpu"
        name = torch.cuda.get_device_name()
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w and w not in _NOT_A_MODEL]
    if not words:
        return "gpu"
    tag = words[0]
    if tag in ("rtx", "gtx") and len(words) > 1:  # the series word alone names no card
        tag += words[1]
    return re.sub(r"[^a-z0-9]+", "", tag) or "gpu"


def environment() -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    env["git"] = os.environ.get("TINYVLLM_GIT_COMMIT") or _git_head()
    return env


def _git_head() -> str | None:
    """The checkout's commit. A copy of the working tree on another machine may carry a stale `.git`:
    whoever starts the run there passes the real one in TINYVLLM_GIT_COMMIT."""
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def print_table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(f"\n{title}")
    print(line.format(*header))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*(str(x) for x in row)))


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")
    return path
