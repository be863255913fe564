"""Register spills of a kernel compiled for the H200 (sm_90) without a GPU, and where they sit.

Compiles one launch for sm_90 (tests/kernels/sm90_compile.py: every launch becomes a compile), reads the
cubin's registers and stack frame (`cuobjdump -res-usage`; ptxas puts spilled registers in the stack,
which PTX does not show), then disassembles it with line information (`nvdisasm -gi`) and counts the
local-memory stores (STL) and loads (LDL) by source line: spills inside a kernel's hot loop cost a
local-memory round trip each iteration, spills of loop invariants a load now and then. Run it without
TRITON_INTERPRET, with the Triton the GPU runs (3.6) for the GPU's figures:

    python scripts/diag_spills.py megakernel --preset qwen3-0.6b [--field kv_align=1] [--fp8w] [--fp8kv]
    python scripts/diag_spills.py rows --preset llama-3.1-8b [--field num_warps=8]
    python scripts/diag_spills.py backward --head-dim 128 [--field dkdv_m=64 --field dkdv_ws=0]

`--field NAME=VALUE` sets a field of the kernel's config (MegakernelConfig, RowsConfig, or the
backward's long-sequence BackwardConfig entry); integers, 0 / 1 for booleans.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tests.kernels.sm90_compile import compile_only_for_sm90, resource_usage


def fields_of(pairs: list[str], config) -> dict:
    """{field: value} from NAME=VALUE pairs, each value of the config field's type."""
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in config._fields:
            raise SystemExit(f"{name!r} is not a field of {type(config).__name__}: {', '.join(config._fields)}")
        out[name] = type(getattr(config, name))(int(value))
    return out


def megakernel(ns) -> list:
    import tests.kernels.test_megakernel_codegen as codegen
    from tinyvllm.kernels.decode_megakernel import MegakernelConfig

    fields = fields_of(ns.field, MegakernelConfig())
    return [("decode_megakernel_kernel", codegen.real_shape_kernel(ns.preset, ns.fp8kv, fields, ns.fp8w))]


def rows(ns) -> list:
    import tests.kernels.test_rows_megakernel_codegen as codegen
    from tinyvllm.kernels.rows_megakernel import RowsConfig

    codegen._as_on_the_gpu()
    fields = fields_of(ns.field, RowsConfig())
    return [("rows_megakernel_kernel", codegen.real_shape_kernel(ns.preset, ns.fp8w, False, fields, ns.fp8kv))]


def backward(ns) -> list:
    from tinyvllm.kernels import flash_backward
    from tinyvllm.kernels.flash_attention_op import HOPPER_BACKWARD

    flash_backward.upcast_operands = lambda q: False  # as on the GPU: bf16 operands into the tensor cores
    base = HOPPER_BACKWARD[ns.head_dim][1]
    cfg = base._replace(**fields_of(ns.field, base))
    d, T, hq, hk = ns.head_dim, 256, 4, 2
    q, do, out = (torch.zeros(T, hq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(T, hk, d, dtype=torch.bfloat16) for _ in range(2))
    lse, cu = torch.zeros(hq, T), torch.tensor([0, 100, T], dtype=torch.int32)
    with compile_only_for_sm90() as launched:
        flash_backward.flash_backward(do, q, k, v, out, lse, cu, 156, d**-0.5, True, cfg)
    return launched


def spill_lines(compiled) -> collections.Counter:
    """{(STL or LDL, file:line): instructions} from the cubin's disassembly with line information."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(tool), "-c", "-gi", str(cubin)], capture_output=True, text=True, check=True).stdout
    found, where = collections.Counter(), "?"
    for line in text.splitlines():
        loc = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if loc:
            where = f"{os.path.basename(loc[1])}:{loc[2]}"
        elif op := re.search(r"\b(STL|LDL)\b", line):
            found[(op[1], where)] += 1
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=["megakernel", "rows", "backward"])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--field", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--fp8w", action="store_true", help="FP8 weights (the megakernels)")
    ap.add_argument("--fp8kv", action="store_true", help="an FP8 KV cache (the megakernels)")
    ap.add_argument("--lines", type=int, default=12, help="source lines to list per kernel")
    ns = ap.parse_args()
    import triton

    print(f"Triton {triton.__version__}, sm_90")
    for name, compiled in {"megakernel": megakernel, "rows": rows, "backward": backward}[ns.kernel](ns):
        usage = resource_usage(compiled)
        print(f"{name}: {usage['registers']} registers, {usage['stack']} bytes of stack a thread")
        for (op, where), n in spill_lines(compiled).most_common(ns.lines):
            print(f"  {n:4d} {op} {where}")


if __name__ == "__main__":
    main()
