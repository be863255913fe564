"""Hugging Face transformers' `generate` on the same checkpoint: the anchor measured in the same run."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_hf(model_dir: str | Path, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """transformers' own class for the checkpoint's architecture (config.json `architectures`: Llama,
    Mistral, Qwen2, Qwen3), with its SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def hf_latency(model, prompts: list[list[int]], output_len: int, device: torch.device) -> dict[str, float]:
    """Greedy, one batch of equal-length prompts (no padding), dynamic cache: TTFT from a 1-token
    generate, the decode rate (tokens of every row per second) from the rest."""
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    def run(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(device)
        return time.perf_counter() - start

    run(4)  # warm-up
    ttft = run(1)
    total = run(output_len)
    rate = len(prompts) * (output_len - 1) / (total - ttft)
    return {"ttft_s": ttft, "decode_tokens_per_s": rate, "output_tokens": output_len * len(prompts)}


@torch.no_grad()
def hf_static_batch(
    model, prompts: list[list[int]], max_tokens: list[int], temperature: float, device: torch.device
) -> dict[str, float]:
    """One static batch, left-padded to the longest prompt, generating the longest max_tokens for every
    row; only each request's own max_tokens count as useful output."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    n = max(max_tokens)
    sample = (
        dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else dict(do_sample=False)
    )
    model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, pad_token_id=0, **sample)
    _sync(device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **sample)
    _sync(device)
    elapsed = time.perf_counter() - start
    useful = sum(max_tokens)
    return {
        "seconds": elapsed,
        "output_tokens": useful,
        "output_tokens_per_s": useful / elapsed,
        "num_requests": len(prompts),
    }
