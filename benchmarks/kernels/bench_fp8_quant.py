"""Per-token FP8 activation quantization on the batched path: fused into RMSNorm and SwiGLU
(kernels/rms_norm.py `add_rms_norm_fp8`, kernels/activation.py `silu_and_mul_fp8`) against the unfused
op followed by `quantize_per_token` (kernels/fp8_quant.py), and the two layer pieces they feed, against
bf16, at one preset's shape and M token rows:

    norm:     add_rms_norm → quantize_per_token          vs  add_rms_norm_fp8          (bf16: add_rms_norm)
    swiglu:   silu_and_mul → quantize_per_token          vs  silu_and_mul_fp8          (bf16: silu_and_mul)
    attn_in:  add_rms_norm, quantize, qkv _scaled_mm     vs  fused norm, qkv _scaled_mm (bf16: norm, F.linear)
    mlp:      add_rms_norm, quantize, gate_up _scaled_mm, silu_and_mul, quantize, down _scaled_mm
              vs the fused norm and SwiGLU around the same two products   (bf16: the same with F.linear)

Times are CUDA-graph replays (as the engine runs its steps) over two copies of every input and weight,
so the weights do not stay in the 50 MB L2 (common.bench_graph).

    python benchmarks/kernels/bench_fp8_quant.py [--preset llama-3.2-1b] [--rows 8 32 64 128 256] [--out DIR]

Writes fp8_quant_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from common import bench_graph, device_info, output_paths, print_table, require_cuda, write_json

from tinyvllm.kernels.activation import silu_and_mul, silu_and_mul_fp8
from tinyvllm.kernels.fp8_quant import quantize_per_token
from tinyvllm.kernels.rms_norm import add_rms_norm, add_rms_norm_fp8
from tinyvllm.quantization.fp8 import quantize_rows
from tinyvllm.quantization.linear import Fp8Activations, Fp8Linear

BF16 = torch.bfloat16
EPS = 1e-5


def fp8_layer(n: int, k: int, weight: torch.Tensor) -> Fp8Linear:
    """An Fp8Linear [n, k] holding `weight` quantized per row (dynamic per-token activations)."""
    with torch.device(weight.device):
        layer = Fp8Linear(k, n, bias=False, dtype=BF16)
    q, s = quantize_rows(weight.float())
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    return layer


def one_copy(shape: dict, rows: int, device: torch.device, seed: int) -> dict:
    """Inputs and weights (bf16 and FP8) of one layer at `rows` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(BF16)

    H, F_, N_qkv = shape["hidden"], shape["intermediate"], shape["qkv"]
    w = {"qkv": randn(N_qkv, H, scale=0.02), "gate_up": randn(2 * F_, H, scale=0.02), "down": randn(H, F_, scale=0.02)}
    return {
        "x": randn(rows, H),
        "r": randn(rows, H),
        "norm": 1 + randn(H, scale=0.1),
        "gate_up_in": randn(rows, 2 * F_),
        "bf16": w,
        "fp8": {name: fp8_layer(*t.shape, t) for name, t in w.items()},
    }


def variants(c: dict) -> dict:
    """{(piece, variant): a call on copy c}."""
    x, r, nw, gu, w, fp8 = c["x"], c["r"], c["norm"], c["gate_up_in"], c["bf16"], c["fp8"]

    def mlp_bf16() -> None:
        h, _ = add_rms_norm(x, r, nw, EPS)
        F.linear(silu_and_mul(F.linear(h, w["gate_up"])), w["down"])

    def mlp_unfused() -> None:
        h, _ = add_rms_norm(x, r, nw, EPS)
        fp8["down"](silu_and_mul(fp8["gate_up"](h)))

    def mlp_fused() -> None:
        q, s, _ = add_rms_norm_fp8(x, r, nw, EPS)
        gate_up = fp8["gate_up"].forward_quantized(Fp8Activations(q, s))
        fp8["down"].forward_quantized(Fp8Activations(*silu_and_mul_fp8(gate_up)))

    return {
        ("norm", "bf16"): lambda: add_rms_norm(x, r, nw, EPS),
        ("norm", "fp8 unfused"): lambda: quantize_per_token(add_rms_norm(x, r, nw, EPS)[0]),
        ("norm", "fp8 fused"): lambda: add_rms_norm_fp8(x, r, nw, EPS),
        ("swiglu", "bf16"): lambda: silu_and_mul(gu),
        ("swiglu", "fp8 unfused"): lambda: quantize_per_token(silu_and_mul(gu)),
        ("swiglu", "fp8 fused"): lambda: silu_and_mul_fp8(gu),
        ("attn_in", "bf16"): lambda: F.linear(add_rms_norm(x, r, nw, EPS)[0], w["qkv"]),
        ("attn_in", "fp8 unfused"): lambda: fp8["qkv"](add_rms_norm(x, r, nw, EPS)[0]),
        ("attn_in", "fp8 fused"): lambda: fp8["qkv"].forward_quantized(
            Fp8Activations(*add_rms_norm_fp8(x, r, nw, EPS)[:2])
        ),
        ("mlp", "bf16"): mlp_bf16,
        ("mlp", "fp8 unfused"): mlp_unfused,
        ("mlp", "fp8 fused"): mlp_fused,
    }


def check_fused_bits(c: dict) -> None:
    """The fused kernels' codes and scales are the unfused composition's, on the GPU too."""
    q, s, _ = add_rms_norm_fp8(c["x"], c["r"], c["norm"], EPS)
    q_ref, s_ref = quantize_per_token(add_rms_norm(c["x"], c["r"], c["norm"], EPS)[0])
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s = silu_and_mul_fp8(c["gate_up_in"])
    q_ref, s_ref = quantize_per_token(silu_and_mul(c["gate_up_in"]))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def main() -> None:
    from tinyvllm.models.presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    dev = require_cuda()
    p = PRESETS[ns.preset]
    head_dim = p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"]
    shape = {
        "hidden": p["hidden_size"],
        "intermediate": p["intermediate_size"],
        "qkv": (p["num_attention_heads"] + 2 * p["num_key_value_heads"]) * head_dim,
    }
    results = []
    for rows in ns.rows:
        copies = [one_copy(shape, rows, dev, seed) for seed in (0, 1)]
        check_fused_bits(copies[0])
        calls = [variants(c) for c in copies]
        timed = {key: bench_graph([v[key] for v in calls]) * 1e3 for key in calls[0]}
        for (piece, variant), us in timed.items():
            unfused = timed[(piece, "fp8 unfused")]
            results.append(
                {
                    "rows": rows,
                    "piece": piece,
                    "variant": variant,
                    "us": us,
                    "vs_unfused": unfused / us,
                    "vs_bf16": timed[(piece, "bf16")] / us,
                }
            )
        del copies, calls
        torch.cuda.empty_cache()
    print_table(
        f"FP8 activation quantization, {ns.preset} ({shape}), µs per call (graph replays)",
        results,
        [
            ("rows", "rows", "d"),
            ("piece", "piece", "s"),
            ("variant", "variant", "s"),
            ("us", "µs", ".2f"),
            ("vs_unfused", "× vs fp8 unfused", ".2f"),
            ("vs_bf16", "× vs bf16", ".2f"),
        ],
    )
    json_path, _ = output_paths(ns.out, "fp8_quant")
    write_json(json_path, {"device": device_info(dev), "preset": ns.preset, "shape": shape, "results": results})


if __name__ == "__main__":
    main()
