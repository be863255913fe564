"""Batch-1 decode step: the one-launch megakernel against the layer-by-layer fused path, per model shape.

    python benchmarks/kernels/bench_megakernel.py [--preset llama-3.2-1b] [--contexts 128 640 2048] [--out DIR]
        [--fp8] [--fp8-kv] [--variant FIELD=VALUE,...]

    # the default against phase B's K/V tiles as 16-byte vector loads (MegakernelConfig.kv_align)
    python benchmarks/kernels/bench_megakernel.py --contexts 640 4096 --no-traces --no-fp32 --variant kv_align=1
    # ... and against 4 phase-D stages with 2 in phases A and C
    python benchmarks/kernels/bench_megakernel.py --variant stages=4,ace_stages=2 --variant kv_align=true

A random-weight model of the preset's shape (default `llama-3.2-1b`, bf16) on the GPU, one sequence
whose context is each of `--contexts` keys. Timed as CUDA-graph replays of a whole step (decoder
layers + final norm + LM head, no sampling), as the engine's batch-1 graph runs it:
  * `layered`: the fused small-batch path (the layer loop of models/decoder.py: ~9 kernels per layer);
  * `mk <tile>/<warps>w/<stages>st/ace<stages>/<splitO|ticket>`: the megakernel per config.
The layers alone (without the LM head) are timed too. Floor: the weight bytes read per step (layers,
LM head) at the copy bandwidth measured at the start. Correctness: each megakernel's hidden state and
logits against the layered path's (relative error), in bf16 and (`--fp32`, default on) in float32.
Traced launches give each phase's time per layer (program 0's clock) and every program's arrival at
each barrier. Writes megakernel_<gpu>.json.

`--fp8`: the decoder's linear layers quantized per output row from the random weights (Fp8Linear:
float8_e4m3fn, a float32 scale per row), so the megakernel and the layered path (the fused path's FP8
matrix-vector kernels) read half the weight bytes; the floor counts those bytes. `--fp8-kv`: the KV cache
in float8_e4m3fn (scales 1). Either adds `_fp8` / `_fp8kv` to the results' name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from common import (
    bench_graph,
    copy_bandwidth,
    device_info,
    output_paths,
    print_table,
    rel_err,
    require_cuda,
    write_json,
)

from tinyvllm.config import ModelConfig, RunnerConfig
from tinyvllm.engine.paths.executor import ModelExecutor
from tinyvllm.engine.paths.megakernel import DecodeMegakernel
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.attention_metadata import AttnMetadata
from tinyvllm.kernels.decode_megakernel import MegakernelConfig
from tinyvllm.models.checkpoint import make_config
from tinyvllm.models.loader import build_model

BLOCK = 16
C = MegakernelConfig
# (config, context splits per KV head; None: the default): the default; phase C unsplit with the ticket
# merge (bitwise reproducible); the default with 4 pipeline stages in phase D.
VARIANTS = [(C(), None), (C(split_o=False), None), (C(stages=4), None)]
PHASES = ["A norm+qkv+rope", "B attention", "C o+residual", "D norm+gate_up+silu", "E down+residual"]
B_PARTS = ["unit", "ticket", "merge", "barrier"]  # program 0 in phase B: its unit, ticket, merge, the wait after


NAMED_FIELDS = {
    "tile",
    "num_warps",
    "stages",
    "ace_stages",
    "split_o",
}  # spelled out by name_of; any other field is appended as field=value when not its default


def name_of(cfg: MegakernelConfig, splits: int | None = None) -> str:
    """A variant's label: the main fields always, then every other field that differs from its default (so
    that a new MegakernelConfig field never yields two variants of the same name)."""
    others = "".join(
        f"/{k}={v}" for k, v in cfg._asdict().items() if k not in NAMED_FIELDS and v != C._field_defaults[k]
    )
    return (
        f"mk {cfg.tile}/{cfg.num_warps}w/{cfg.stages}st/ace{cfg.ace_stages}"
        + ("/splitO" if cfg.split_o else "/ticket")
        + others
        + (f"/{splits}sp" if splits else "")
    )


BOOLS = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def parse_config(text: str) -> MegakernelConfig:
    """`field=value,...` → MegakernelConfig (each value converted to the field's default's type; a bool
    from 1/0, true/false, yes/no or on/off)."""
    fields = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        kind = type(getattr(C(), key))
        if kind is bool:
            if value.lower() not in BOOLS:
                raise ValueError(f"{key}={value}: not a boolean ({', '.join(BOOLS)})")
            fields[key] = BOOLS[value.lower()]
        else:
            fields[key] = kind(value)
    return C(**fields)


def phase_trace(model, mk: DecodeMegakernel, ids, pos, meta, kv, reps: int = 20) -> dict:
    """Mean ns per phase (program 0's view: its work plus the wait at the barrier that ends the phase),
    averaged over the middle layers (not the first and last, whose ends differ) and `reps` launches,
    from the kernel's global-timer trace; layer 0's phase A from the launch's start and the last layer's
    phase E to the exit (the final norm included) apart; phase B also split at program 0's points inside
    it (its unit computed, its ticket taken, its merge done)."""
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    L = kv.shape[0]
    sums = torch.zeros(3 + 8 * L, dtype=torch.float64)
    for _ in range(reps):
        mk(ids, pos, meta, views, trace=True)
        t = mk.workspace.trace.double().cpu()[: 3 + 8 * L]
        sums += t - t[0]
    t = sums / reps
    b_points = t[3 + 5 * L :].reshape(L, 3)
    t = t[: 1 + 5 * L]  # [0] start, [5l + k + 1] after phase k of layer l, [5L] the exit
    per_layer = torch.stack([t[1 + 5 * i : 6 + 5 * i] - t[5 * i : 5 + 5 * i] for i in range(L)])
    b_start, b_end = t[1 : 5 * L : 5], t[2 : 5 * L : 5]  # barrier exits before and after phase B
    b_parts = (
        torch.stack(
            [
                b_points[:, 0] - b_start,
                b_points[:, 1] - b_points[:, 0],
                b_points[:, 2] - b_points[:, 1],
                b_end - b_points[:, 2],
            ],
            1,
        ).mean(0)
        / 1e3
    )
    out = {
        "layer0_A_from_start_us": float(per_layer[0, 0]) / 1e3,
        "last_E_to_exit_us": float(per_layer[-1, -1]) / 1e3,
        "total_us": float(t[-1]) / 1e3,
    }
    middle = per_layer[1:-1] if L > 2 else per_layer
    for name, v in zip(PHASES, middle.mean(0).tolist()):
        out[name + " us"] = v / 1e3
    for name, v in zip(B_PARTS, b_parts.tolist()):
        out["B " + name + " us"] = v
    return out


def program_trace(mk: DecodeMegakernel, ids, pos, meta, kv, reps: int = 10) -> dict:
    """Every program's view of the barriers (µs, means over layers and `reps` launches): per phase, from
    the barrier that starts it opening (its first program leaving the wait; layer 0's phase A: the
    programs' start) to the median and the last program's arrival at the barrier that ends it, and from
    that last arrival to the barrier opening (its propagation; none after the last phase, which ends at
    the exit); the programs that arrived last; phase B: every unit computed, ticket taken, merge done
    (median / last), from the same opening."""
    from tinyvllm.kernels.decode_megakernel import TRACE_BASE, TRACE_BLOCK

    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    L, P = kv.shape[0], mk.workspace.programs
    acc: dict[str, float] = {}
    counts: dict[str, int] = {}
    last_programs: dict[str, list[int]] = {p: [] for p in "ABCDE"}
    for _ in range(reps):
        mk(ids, pos, meta, views, trace=True)
        t = mk.workspace.trace[TRACE_BASE:].view(P, TRACE_BLOCK).double().cpu() / 1e3  # µs
        waits, arrivals, attn = t[:, :400], t[:, 400:800], t[:, 800 : 800 + 3 * L].reshape(P, L, 3)
        for layer in range(L):
            for k, phase in enumerate("ABCDE"):
                b = 5 * layer + k  # the barrier that opens phase `phase` (0: the start); b + 1 ends it (5L: exit)
                opened = waits[:, b].min()
                arr = arrivals[:, b + 1]
                rows = {f"{phase} median arrival": arr.median() - opened, f"{phase} last arrival": arr.max() - opened}
                if b + 1 < 5 * L:
                    rows[f"{phase} propagation"] = waits[:, b + 1].min() - arr.max()
                if phase == "B":
                    mine = attn[:, layer]
                    done = mine[mine[:, 0] > 0]  # programs with a unit
                    for i, what in enumerate(("unit", "ticket", "merge")):
                        rows[f"B {what} median"] = done[:, i].median() - opened
                        rows[f"B {what} last"] = done[:, i].max() - opened
                for key, value in rows.items():
                    acc[key] = acc.get(key, 0.0) + float(value)
                    counts[key] = counts.get(key, 0) + 1
                last_programs[phase].append(int(arr.argmax()))
    out: dict = {key: value / counts[key] for key, value in acc.items()}
    out["last programs"] = {p: sorted(set(v))[:12] for p, v in last_programs.items()}
    return out


def setup(
    dev: torch.device,
    dtype: torch.dtype,
    max_ctx: int,
    preset: str = "llama-3.2-1b",
    fp8: bool = False,
    fp8_kv: bool = False,
):
    """The random model (`fp8`: its linear layers quantized, `quantize_layers`) and a KV buffer of random
    values (`fp8_kv`: float8_e4m3fn, scales 1)."""
    config = ModelConfig.from_dict(make_config(preset))
    model = build_model(
        config,
        get_ops("triton"),
        model_dir="",
        device=dev,
        dtype=dtype,
        max_positions=max_ctx + 16,
        load_format="dummy",
        seed=0,
    )
    c = config
    num_blocks = max_ctx // BLOCK + 2
    gen = torch.Generator(device=dev).manual_seed(1)
    kv = torch.randn(
        (c.num_hidden_layers, 2, num_blocks, c.num_key_value_heads, BLOCK, c.head_dim),
        generator=gen,
        device=dev,
        dtype=torch.float32,
    ).to(torch.float8_e4m3fn if fp8_kv else dtype)
    if fp8:
        quantize_layers(model)
    return model, kv


def quantize_layers(model) -> None:
    """Replace every decoder linear layer by an Fp8Linear holding its weight quantized per output row."""
    from tinyvllm.quantization.fp8 import quantize_rows
    from tinyvllm.quantization.linear import Fp8Linear

    dtype = model.embed_tokens.weight.dtype
    for layer in model.layers:
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            old = getattr(parent, name)
            with torch.device(old.weight.device):
                new = Fp8Linear(old.in_features, old.out_features, bias=old.bias is not None, dtype=dtype)
            q, scale = quantize_rows(old.weight.float())
            new.weight.copy_(q)
            new.weight_scale.copy_(scale)
            if old.bias is not None:
                new.bias.copy_(old.bias)
            setattr(parent, name, new)
    torch.cuda.empty_cache()


def step_inputs(dev: torch.device, ctx: int, num_blocks: int):
    pages = -(-ctx // BLOCK)
    table = torch.randperm(num_blocks, device=dev)[:pages].to(torch.int32)
    pos = ctx - 1
    slot = int(table[pos // BLOCK]) * BLOCK + pos % BLOCK
    i32 = torch.int32
    meta = AttnMetadata(
        slot_mapping=torch.tensor([slot], device=dev),
        num_decode_tokens=1,
        decode_seq_lens=torch.tensor([ctx], dtype=i32, device=dev),
        decode_block_tables=table[None, :],
        max_decode_seq_len=ctx,
        num_prefills=0,
        prefill_cu_seqlens_q=torch.zeros(1, dtype=i32, device=dev),
        prefill_seq_lens=torch.zeros(0, dtype=i32, device=dev),
        prefill_block_tables=table[None, :0],
        max_prefill_q_len=0,
        max_prefill_seq_len=0,
    )
    return torch.tensor([17], device=dev), torch.tensor([pos], device=dev), meta


def run(model, mk, ids, pos, meta, kv, logits: bool = True):
    """One decode step through the megakernel `mk`, or with None the layer-by-layer fused path."""
    paths = ModelExecutor(model, RunnerConfig(decode_megakernel=False, pruned_lm_head=False), kv.device.type)
    paths.megakernel = mk
    views = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    hidden = paths.hidden_states(ids, pos, meta, views)
    return (hidden, paths.lm_head.logits(hidden, dtype=None)) if logits else (hidden, None)


@torch.no_grad()
def check(
    model,
    kv: torch.Tensor,
    base: DecodeMegakernel,
    contexts: list[int],
    variants: list[tuple[MegakernelConfig, int | None]],
) -> list[dict]:
    dev, dtype = kv.device, model.embed_tokens.weight.dtype
    rows = []
    for ctx in contexts:
        ids, pos, meta = step_inputs(dev, ctx, kv.shape[2])
        kv_ref = kv.clone()
        slot = int(meta.slot_mapping[0])
        at = (slice(None), slice(None), slot // BLOCK, slice(None), slot % BLOCK)
        h_ref, l_ref = run(model, None, ids, pos, meta, kv_ref)
        for cfg, splits in variants:
            kv_mk = kv.clone()
            h, lg = run(model, base.variant(cfg, splits), ids, pos, meta, kv_mk)
            rows.append(
                {
                    "dtype": str(dtype).replace("torch.", ""),
                    "context": ctx,
                    "variant": name_of(cfg, splits),
                    "hidden_rel_err": rel_err(h, h_ref),
                    "logits_rel_err": rel_err(lg, l_ref),
                    "kv_rel_err": rel_err(kv_mk[at], kv_ref[at]),
                    "argmax_equal": bool((lg.argmax(-1) == l_ref.argmax(-1)).all()),
                }
            )
            kv_mk[at] = kv_ref[at]
            rows[-1]["rest_of_cache_equal"] = bool(torch.equal(kv_mk, kv_ref))
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", help="the model shape (tinyvllm.models.presets)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 640, 2048])
    ap.add_argument("--traces", action=argparse.BooleanOptionalAction, default=True, help="per-phase traces")
    ap.add_argument("--fp32", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=[],
        help="time the default configuration as is and with at most this many context splits per KV "
        "head (instead of the other variants)",
    )
    ap.add_argument(
        "--warps",
        type=int,
        nargs="*",
        default=[],
        help="time the default configuration as is and with this many warps per program (instead "
        "of the other variants; with --splits, both lists)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE,...",
        help="time the default configuration and this one (MegakernelConfig fields, e.g. "
        "stages=4,ace_stages=2; repeatable) instead of the other variants",
    )
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (per-row scales) from the random bf16 ones")
    ap.add_argument("--fp8-kv", action="store_true", help="an FP8 (e4m3) KV cache")
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    return ap.parse_args()


def variants_from(ns: argparse.Namespace) -> list[tuple[MegakernelConfig, int | None]]:
    """The default first, then either the command line's variants or VARIANTS' others."""
    if not (ns.splits or ns.warps or ns.variant):
        return VARIANTS
    return (
        [VARIANTS[0]]
        + [(C(), s) for s in ns.splits]
        + [(C(num_warps=w), None) for w in ns.warps]
        + [(parse_config(v), None) for v in ns.variant]
    )


def time_steps(model, base, kv, contexts: list[int], variants, copy: float) -> list[dict]:
    """Step and layer times of the layered path and each variant (CUDA-graph replays), against the floor:
    the bytes a step must read (layers' weights and K/V, then the LM head) at the copy bandwidth."""
    dev = kv.device
    layer_bytes = sum(
        t.numel() * t.element_size()
        for t in (base.weights.qkv, base.weights.o, base.weights.gate_up, base.weights.down)
    )
    head_bytes = model.lm_head_weight.numel() * model.lm_head_weight.element_size()
    cfg = model.config
    rows = []
    for ctx in contexts:
        ids, pos, meta = step_inputs(dev, ctx, kv.shape[2])
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ctx * cfg.head_dim * kv.element_size()
        floor_layers = (layer_bytes + kv_bytes) / copy * 1e6
        floor_step = floor_layers + head_bytes / copy * 1e6
        for name, mk in [("layered", None)] + [(name_of(c, sp), base.variant(c, sp)) for c, sp in variants]:
            step_us = bench_graph([lambda mk=mk: run(model, mk, ids, pos, meta, kv)], calls=32, replays=9) * 1e3
            layers_us = (
                bench_graph([lambda mk=mk: run(model, mk, ids, pos, meta, kv, logits=False)], calls=32, replays=9) * 1e3
            )
            rows.append(
                {
                    "context": ctx,
                    "path": name,
                    "step_us": step_us,
                    "layers_us": layers_us,
                    "tok_per_s": 1e6 / step_us,
                    "floor_step_us": floor_step,
                    "of_floor": floor_step / step_us,
                    "layers_of_floor": floor_layers / layers_us,
                }
            )
            print(rows[-1], flush=True)
    for r in rows:
        lay = next(x for x in rows if x["context"] == r["context"] and x["path"] == "layered")
        r["speedup"] = lay["step_us"] / r["step_us"]
    return rows


def traces(model, base, kv, contexts: list[int], variants) -> tuple[list[dict], list[dict]]:
    """Program 0's phase times and every program's barrier times, per context and variant."""
    phases, programs = [], []
    for ctx in contexts:
        ids, pos, meta = step_inputs(kv.device, ctx, kv.shape[2])
        for cfg, splits in variants:
            mk = base.variant(cfg, splits)
            head = {"context": ctx, "variant": name_of(cfg, splits)}
            phases.append({**head, **phase_trace(model, mk, ids, pos, meta, kv)})
            programs.append({**head, **program_trace(mk, ids, pos, meta, kv)})
            print(programs[-1], flush=True)
    return phases, programs


CHECK_COLUMNS = [
    ("dtype", "dtype", ""),
    ("context", "ctx", "d"),
    ("variant", "variant", ""),
    ("hidden_rel_err", "hidden err", ".2e"),
    ("logits_rel_err", "logits err", ".2e"),
    ("kv_rel_err", "new K/V err", ".2e"),
    ("argmax_equal", "argmax =", ""),
    ("rest_of_cache_equal", "rest of cache =", ""),
]
PHASE_COLUMNS = (
    [("context", "ctx", "d"), ("variant", "variant", "")]
    + [(p + " us", p.split()[0], ".2f") for p in PHASES]
    + [("B " + p + " us", "B " + p, ".2f") for p in B_PARTS]
    + [
        ("layer0_A_from_start_us", "start", ".2f"),
        ("last_E_to_exit_us", "end", ".2f"),
        ("total_us", "total", ".1f"),
    ]
)
STEP_COLUMNS = [
    ("context", "ctx", "d"),
    ("path", "path", ""),
    ("step_us", "step µs", ".1f"),
    ("layers_us", "layers µs", ".1f"),
    ("tok_per_s", "tok/s", ".0f"),
    ("speedup", "× layered", ".2f"),
    ("floor_step_us", "floor µs", ".1f"),
    ("of_floor", "of floor", ".2f"),
    ("layers_of_floor", "layers of floor", ".2f"),
]


@torch.no_grad()
def main() -> None:
    ns = parse_args()
    variants = variants_from(ns)
    dev = require_cuda()
    info = device_info(dev)
    copy = copy_bandwidth(dev)
    print(f"{info}\ncopy bandwidth {copy / 1e12:.2f} TB/s")

    checks = []
    if ns.fp32:  # float32 shows the schemes' arithmetic apart from bf16 rounding
        model, kv = setup(dev, torch.float32, max(ns.contexts), ns.preset, ns.fp8, ns.fp8_kv)
        checks += check(model, kv, DecodeMegakernel(model), ns.contexts, variants[:2])
        del model, kv
        torch.cuda.empty_cache()
    model, kv = setup(dev, torch.bfloat16, max(ns.contexts), ns.preset, ns.fp8, ns.fp8_kv)
    base = DecodeMegakernel(model)
    checks += check(model, kv, base, ns.contexts, variants)
    print_table("correctness against the layered path", checks, CHECK_COLUMNS)

    rows = time_steps(model, base, kv, ns.contexts, variants, copy)
    phases, programs = traces(model, base, kv, ns.contexts, variants) if ns.traces else ([], [])
    print_table(
        "per-layer phase times (µs; program 0: its work + its wait at the phase's barrier)", phases, PHASE_COLUMNS
    )
    what = "bf16" + (", FP8 weights" if ns.fp8 else "") + (", FP8 KV cache" if ns.fp8_kv else "")
    print_table(f"batch-1 decode step, {ns.preset} shape, {what} ({info['gpu']})", rows, STEP_COLUMNS)
    name = "megakernel" if ns.preset == "llama-3.2-1b" else f"megakernel_{ns.preset}"
    name += ("_fp8" if ns.fp8 else "") + ("_fp8kv" if ns.fp8_kv else "")
    json_path, _ = output_paths(ns.out, name)
    payload = {
        "preset": ns.preset,
        "fp8_weights": ns.fp8,
        "fp8_kv_cache": ns.fp8_kv,
        "device": info,
        "copy_bandwidth": copy,
        "checks": checks,
        "timings": rows,
        "phase_traces": phases,
        "program_traces": programs,
    }
    write_json(json_path, payload)


if __name__ == "__main__":
    main()
