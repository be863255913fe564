"""FP8 accuracy: the demo model's validation loss, and teacher-forced logit error at a real model's shape.

1. The shipped demo model (tinyvllm/models/demo) on its held-out split (data/demo_corpus/val.txt.gz,
   tokenized and packed as scripts/train_demo_model.py packs it: `<|begin_of_text|> page
   <|end_of_text|>` per page, consecutive windows of --seq-len tokens), teacher-forced through our
   engine in bf16 with: bf16 weights and cache; FP8 weights (quantized at load); an FP8 KV cache; both.
   The issue asks each FP8 loss to be within 1 % of bf16's.
2. At a preset's shape (llama-3.2-1b; --smoke: tiny), random weights, one prompt teacher-forced:
   rel(FP8, bf16) = ‖logits_fp8 − logits_bf16‖ / ‖logits_bf16‖ beside rel(bf16, fp32), bf16's own error
   against float32, for FP8 weights, FP8 KV and both.

    python benchmarks/fp8_accuracy.py                       # CPU: demo model + the tiny shape
    python benchmarks/fp8_accuracy.py --preset llama-3.2-1b --device cuda   # on the GPU
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import platform
import random
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from tinyvllm import LLM
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.models.checkpoint import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
VAL = ROOT / "data" / "demo_corpus" / "val.txt.gz"
DOC_SEPARATOR = "<|end_of_text|>"  # scripts/prepare_demo_corpus.py joins pages with "\n<sep>\n"
VARIANTS = {  # name → engine kwargs
    "bf16": {},
    "fp8_weights": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8_both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def validation_stream() -> list[int]:
    """The held-out split as one token stream, packed as the training script packs it."""
    from tokenizers import Tokenizer

    with gzip.open(VAL, "rt", encoding="utf-8") as f:
        text = f.read()
    docs = [d.strip("\n") for d in text.split(f"\n{DOC_SEPARATOR}\n") if d.strip()]
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    bos, eos = config["bos_token_id"], config["eos_token_id"][0]
    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return ids


def make_llm(model: str, device: str, max_len: int, **kw) -> LLM:
    return LLM(
        model=model,
        device=device,
        dtype="bfloat16",
        max_model_len=max_len,
        num_gpu_blocks_override=-(-max_len // 16) + 1,
        **kw,
    )


@torch.no_grad()
def demo_losses(device: str, seq_len: int, max_windows: int | None) -> dict:
    stream = torch.tensor(validation_stream())
    n = (len(stream) - 1) // seq_len
    n = n if max_windows is None else min(n, max_windows)
    windows = [stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]
    out = {"windows": n, "seq_len": seq_len, "tokens": n * seq_len}
    for name, kw in VARIANTS.items():
        llm = make_llm(str(DEMO_MODEL_DIR), device, seq_len, **kw)
        t0 = time.perf_counter()
        total = 0.0
        for w in windows:
            logits = teacher_forced_logits(llm.llm_engine, w[:-1].tolist(), [seq_len])
            total += float(F.cross_entropy(logits.float().cpu(), w[1:], reduction="sum"))
        out[name] = {"val_loss": total / (n * seq_len), "seconds": round(time.perf_counter() - t0, 1)}
        print(f"demo {name:12s} val loss {out[name]['val_loss']:.5f}", flush=True)
        del llm
        gc.collect()
    base = out["bf16"]["val_loss"]
    for name in VARIANTS:
        out[name]["rel_to_bf16"] = out[name]["val_loss"] / base - 1
        out[name]["within_1pct"] = abs(out[name]["rel_to_bf16"]) <= 0.01
    return out


@torch.no_grad()
def shape_errors(preset: str, device: str, length: int) -> dict:
    from tinyvllm.models.checkpoint import resolve_model

    model = str(resolve_model(f"dummy:{preset}"))
    rng = random.Random(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompt = [rng.randrange(vocab // 4, vocab - vocab // 4) for _ in range(length)]
    chunks = [length // 2, length - length // 2]

    def logits(dtype: str, **kw) -> torch.Tensor:
        llm = LLM(
            model=model,
            device=device,
            dtype=dtype,
            max_model_len=length,
            num_gpu_blocks_override=-(-length // 16) + 1,
            **kw,
        )
        result = teacher_forced_logits(llm.llm_engine, prompt, chunks).float().cpu()
        del llm
        gc.collect()
        return result

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    fp32 = logits("float32")
    bf16 = logits("bfloat16")
    out = {"preset": preset, "prompt_tokens": length, "bf16_vs_fp32": rel(bf16, fp32)}
    for name, kw in list(VARIANTS.items())[1:]:
        x = logits("bfloat16", **kw)
        out[name] = {
            "vs_bf16": rel(x, bf16),
            "vs_fp32": rel(x, fp32),
            "argmax_agree_bf16": float((x.argmax(-1) == bf16.argmax(-1)).float().mean()),
        }
        print(
            f"{preset} {name:12s} rel vs bf16 {out[name]['vs_bf16']:.4f} (bf16 vs fp32 {out['bf16_vs_fp32']:.4f})",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset", default=None, help="shape for the logit error (default: llama-3.2-1b on CUDA, tiny on CPU)"
    )
    p.add_argument("--smoke", action="store_true", help="the tiny shape for the logit error, whatever the device")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=1024, help="validation window (the training script's)")
    p.add_argument("--max-windows", type=int, default=None, help="at most this many validation windows")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    preset = "tiny" if args.smoke else args.preset or ("llama-3.2-1b" if args.device.startswith("cuda") else "tiny")
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    }
    if not args.skip_demo:
        result["demo"] = demo_losses(args.device, args.seq_len, args.max_windows)
    result["shape"] = shape_errors(preset, args.device, args.prompt_tokens)
    tag = "h200" if args.device.startswith("cuda") else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / f"fp8_accuracy_{tag}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if "demo" in result and not all(result["demo"][k]["within_1pct"] for k in VARIANTS):
        raise SystemExit("an FP8 validation loss is more than 1 % from bf16's")
    assert math.isfinite(result["shape"]["bf16_vs_fp32"])


if __name__ == "__main__":
    main()
