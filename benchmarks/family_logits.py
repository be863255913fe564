"""bf16 teacher-forced logit error of each family against transformers' own class on the same files.

For each preset: a random prompt (longer than the sliding window where the model has one) is run
teacher-forced through our engine in bf16 (chunked like a chunked prefill) and through transformers'
class in bf16 and in float32. Reported per preset:
    rel_vs_hf_bf16  = ‖ours − hf_bf16‖ / ‖hf_bf16‖
    rel_vs_hf_fp32  = ‖ours − hf_fp32‖ / ‖hf_fp32‖   beside   hf_bf16_vs_fp32 (transformers' own bf16 error)
    argmax_agree    = the fraction of positions where ours and hf_fp32 pick the same token
Our error against float32 should be of the order of transformers' own bf16 error.

    python benchmarks/family_logits.py --presets qwen3-0.6b qwen2.5-1.5b mistral-7b --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from tinyvllm import LLM
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.config import ModelConfig
from tinyvllm.models.checkpoint import resolve_model

DEFAULT_PRESETS = ["llama-3.2-1b", "qwen3-0.6b", "qwen2.5-1.5b", "mistral-7b"]


def prompt_for(config: ModelConfig, length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    margin = min(1000, config.vocab_size // 4)  # clear of the special tokens at both ends
    return [rng.randrange(margin, config.vocab_size - margin) for _ in range(length)]


@torch.no_grad()
def hf_logits(model_dir: str, prompt: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    logits = model(torch.tensor([prompt], device=device)).logits[0].float().cpu()
    del model
    free_memory()
    return logits


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(preset: str, prompt_len: int | None, chunk: int, device: str) -> dict:
    model_dir = str(resolve_model(f"dummy:{preset}"))
    config = ModelConfig.from_dir(model_dir)
    length = prompt_len or (config.sliding_window + 904 if config.has_sliding_window else 1024)
    prompt = prompt_for(config, length)
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="bfloat16", device=device, max_model_len=length + 16, gpu_memory_utilization=0.5)
    chunks = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
    ours = teacher_forced_logits(llm.llm_engine, prompt, chunks).float().cpu()
    del llm
    free_memory()
    ref_bf16 = hf_logits(model_dir, prompt, torch.bfloat16, device)
    ref_fp32 = hf_logits(model_dir, prompt, torch.float32, device)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return {
        "preset": preset,
        "architecture": config.architecture,
        "sliding_window": config.sliding_window if config.has_sliding_window else None,
        "prompt_len": length,
        "chunk": chunk,
        "rel_vs_hf_bf16": rel(ours, ref_bf16),
        "rel_vs_hf_fp32": rel(ours, ref_fp32),
        "hf_bf16_vs_fp32": rel(ref_bf16, ref_fp32),
        "argmax_agree": (ours.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item(),
        "hf_bf16_argmax_agree": (ref_bf16.argmax(-1) == ref_fp32.argmax(-1)).float().mean().item(),
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--prompt-len", type=int, default=None, help="default: window + 904, or 1024 without one")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens) of our teacher-forced run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    ns = p.parse_args()
    rows = []
    print(f"{'preset':<16}{'window':>8}{'len':>7}{'vs hf bf16':>12}{'vs fp32':>10}{'hf bf16':>10}{'argmax':>8}")
    for preset in ns.presets:
        r = measure(preset, ns.prompt_len, ns.chunk, ns.device)
        rows.append(r)
        print(
            f"{preset:<16}{r['sliding_window'] or '-':>8}{r['prompt_len']:>7}{r['rel_vs_hf_bf16']:>12.4f}"
            f"{r['rel_vs_hf_fp32']:>10.4f}{r['hf_bf16_vs_fp32']:>10.4f}{r['argmax_agree']:>8.3f}",
            flush=True,
        )
    if ns.out:
        with open(ns.out, "w") as f:
            gpu = torch.cuda.get_device_name() if ns.device.startswith("cuda") else "cpu"
            json.dump({"gpu": gpu, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
