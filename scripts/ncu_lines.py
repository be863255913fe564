"""Nsight Compute's warp-stall samples of one kernel, per line of its Python (Triton) source.

    python scripts/ncu_lines.py --sass-csv mk_sass.csv.gz --cubin _decode_megakernel.cubin \
        --duration-us 692 --per 16 [--top 40] [--json out.json]

Inputs: `ncu --import REPORT --page source --csv --print-source sass` (one row per SASS instruction, with
its warp-stall samples by reason; optionally gzipped) and the kernel's cubin as the profiled process
compiled it (Triton's cache: ~/.triton/cache/*/<kernel>.cubin; given several, the best match is used).
`nvdisasm -g` (Triton's bundled copy) gives each instruction's source line; the two listings are aligned
instruction by instruction (an exact match when the cubin is the profiled one, else by longest common
runs of opcodes, and the lines are approximate).

A sample is one warp seen in one state; with every warp resident for the whole kernel, a line's share
of all samples is its share of the programs' time, so share × duration / `per` is the mean µs per
`per` (e.g. per layer) that a program spends on that line: issuing it or stalled at it (a stall is
charged to the instruction that waits, e.g. the one after a CTA barrier). docs/perf.md reads the decode
megakernel's profile this way (`STEPS=ncu bash scripts/gpu_session.sh` runs the whole chain).
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import gzip
import io
import json
import re
import subprocess
from pathlib import Path

import triton


def nvdisasm() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def sass_lines(cubin: str) -> list[tuple[str, str, int]]:
    """(opcode text, source file, line) per instruction of the cubin, in address order."""
    text = subprocess.run([nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, where = [], ("?", 0)
    for line in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((m.group(2), *where))
    return out


def opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def read_csv(path: str) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as raw:
        rows = list(csv.reader(io.StringIO(raw.read())))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1 :]


def number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text not in ("", "-") else 0.0


def per_line(sass_csv: str, cubins: list[str]) -> tuple[dict, float, str, float]:
    """({(file, line): Counter(stall reason → samples, "instructions" → count)}, total samples, the cubin
    whose instructions match the profiled ones best, and that match's ratio (1.0: the same code))."""
    header, rows = read_csv(sass_csv)
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    b = [opcode(r[col["Source"]].strip()) for r in rows]
    best = None
    for cubin in cubins:
        listing = sass_lines(cubin)
        a = [opcode(t) for t, _, _ in listing]
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        ratio = 1.0 if a == b else matcher.ratio()
        if best is None or ratio > best[0]:
            best = (ratio, cubin, listing, a, matcher)
    ratio, cubin, listing, a, matcher = best
    match = [0] * len(b)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            match[j] = min(i1 + (j - j1) if tag == "equal" else max(i1, min(i1 + j - j1, i2 - 1)), len(a) - 1)
    lines: dict = collections.defaultdict(collections.Counter)
    total = 0.0
    for j, row in enumerate(rows):
        _, path, line = listing[match[j]]
        key = (Path(path).name, line)
        lines[key]["instructions"] += 1
        for reason in reasons:
            samples = number(row[col[reason]])
            lines[key][reason[len("stall_") :]] += samples
            total += samples
    return lines, total, cubin, ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sass-csv", required=True)
    ap.add_argument(
        "--cubin",
        nargs="+",
        required=True,
        help="the kernel's cubin; given several (e.g. every one in Triton's cache), the one whose "
        "instructions match the profiled ones best",
    )
    ap.add_argument("--duration-us", type=float, required=True, help="the kernel's duration (ncu's Duration)")
    ap.add_argument("--per", type=float, default=1.0, help="divide times by this (e.g. the layer count)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    lines, total, cubin, ratio = per_line(ns.sass_csv, ns.cubin)
    print(
        f"source lines from {cubin} (instruction match {ratio:.3f}"
        + ("" if ratio == 1.0 else "; not the profiled code: lines are approximate")
        + ")"
    )
    scale = ns.duration_us / ns.per / max(total, 1.0)
    table = []
    for (name, line), counts in lines.items():
        samples = sum(v for k, v in counts.items() if k != "instructions")
        reasons = sorted(((v * scale, k) for k, v in counts.items() if k != "instructions" and v), reverse=True)
        table.append(
            {
                "file": name,
                "line": line,
                "us": samples * scale,
                "instructions": counts["instructions"],
                "reasons": {k: round(v, 3) for v, k in reasons[:4]},
            }
        )
    table.sort(key=lambda r: -r["us"])
    for r in table[: ns.top]:
        print(
            f"{r['us']:6.2f} µs  {r['file']}:{r['line']:<5d} ({r['instructions']:4d} instr)  "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["reasons"].items())
        )
    if ns.json:
        Path(ns.json).write_text(
            json.dumps(
                {"duration_us": ns.duration_us, "per": ns.per, "cubin": cubin, "match": ratio, "lines": table}, indent=1
            )
        )


if __name__ == "__main__":
    main()
