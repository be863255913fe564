"""Which decode path is off with an FP8 KV cache on CUDA (float32 model, `llama-3.2-1b` shape).

Part 1 runs one decode step at each context through the megakernel (split and ticket phase C), the
fused layer-by-layer path, and the torch reference table (same dummy weights, same per-layer K/V scales
as tests/gpu/test_megakernel_gpu.py) and prints, for every pair, the relative error of the final hidden
state and the logits and the count of new K/V cache codes that differ per layer. Part 2 checks the
Triton decode attention alone over a random FP8 cache against the torch reference at several contexts
and split counts. Both need a GPU:

    python scripts/diag_fp8_kv.py [--contexts 1 333]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.test_megakernel_gpu import BLOCK, FP8_KV_SCALES, MAX_CTX, forward, fp8_setup, rel, step
from tinyvllm.config import ModelConfig
from tinyvllm.engine.paths.megakernel import DecodeMegakernel
from tinyvllm.kernels import get_ops
from tinyvllm.kernels.decode_attention import decode_attention_fwd
from tinyvllm.kernels.decode_megakernel import MegakernelConfig
from tinyvllm.kernels.reference import decode_attention as reference_decode_attention
from tinyvllm.models.checkpoint import make_config
from tinyvllm.models.loader import build_model


def torch_table_model() -> torch.nn.Module:
    """The float32 dummy model on the torch reference table, with the GPU test's K/V scales."""
    config = ModelConfig.from_dict(make_config("llama-3.2-1b"))
    model = build_model(
        config,
        get_ops("torch"),
        model_dir="",
        device=torch.device("cuda"),
        dtype=torch.float32,
        max_positions=MAX_CTX,
        load_format="dummy",
        seed=0,
    )
    for i, layer in enumerate(model.layers):
        j = i % 2 * 2
        layer.self_attn.k_scale, layer.self_attn.v_scale = FP8_KV_SCALES[j], FP8_KV_SCALES[j + 1]
    return model


@torch.no_grad()
def compare_paths(contexts: list[int]) -> None:
    model, _, kv = fp8_setup(torch.float32, False, True)
    reference = torch_table_model()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    print("same weights in both models:", same)
    paths = {
        "megakernel": (model, DecodeMegakernel(model)),
        "megakernel ticket": (model, DecodeMegakernel(model, MegakernelConfig(split_o=False))),
        "fused": (model, None),
        "torch table": (reference, None),
    }
    for ctx in contexts:
        ids, pos, meta, slot = step(ctx, kv.shape[2])
        at = (slice(None), slice(None), slot // BLOCK, slice(None), slot % BLOCK)
        out = {}
        for name, (m, mk) in paths.items():
            cache = kv.clone()
            hidden, logits = forward(m, mk, ids, pos, meta, cache)
            out[name] = (hidden.float(), logits.float(), cache[at].clone())
        names = list(out)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                (ha, la, ca), (hb, lb, cb) = out[a], out[b]
                codes = (ca.view(torch.uint8) != cb.view(torch.uint8)).flatten(1).sum(1).tolist()
                errors = f"hidden {rel(ha, hb):.2e}, logits {rel(la, lb):.2e}"
                print(f"ctx {ctx}, {a} vs {b}: {errors}, new K/V codes differing per layer {codes}")


@torch.no_grad()
def compare_decode_attention(contexts: list[int]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hk, d, bs, nb = 32, 8, 64, 16, 64
    k_cache = torch.randn(nb, hk, bs, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v_cache = torch.randn(nb, hk, bs, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, hq, d, device="cuda", generator=g).to(dtype)
        for ctx in contexts:
            table = torch.randperm(nb, device="cuda", generator=g)[None, : -(-ctx // bs)].to(torch.int32).contiguous()
            seq_lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
            scales = {"k_scale": 0.05, "v_scale": 0.02}
            ref = reference_decode_attention(q.float(), k_cache, v_cache, seq_lens, table, 0.125, ctx, **scales)
            row = []
            for splits in (1, 2, None):
                o = decode_attention_fwd(q, k_cache, v_cache, seq_lens, table, 0.125, ctx, num_splits=splits, **scales)
                row.append(f"splits {splits or 'auto'}: {rel(o, ref):.2e}")
            print(f"decode attention, {dtype}, ctx {ctx}: " + ", ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 333])
    ns = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    compare_paths(ns.contexts)
    compare_decode_attention(sorted({1, 2, 16, 17, 64, 65, *ns.contexts}))


if __name__ == "__main__":
    main()
