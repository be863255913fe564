"""Diagnose host stalls inside engine steps on a GPU: implicit synchronisations and allocator growth.

Runs the shared-prefix (or throughput) workload once to warm up, then again with
`torch.cuda.set_sync_debug_mode("warn")`, and reports every distinct synchronising call site (from
the warnings' stacks), the caching allocator's new segments (cudaMalloc calls, which can stall), and
the engine's per-step timing by kind.

    python scripts/diag_host_syncs.py [--workload shared-prefix|throughput] [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.bench.workloads import shared_prefix_workload, throughput_workload
from tinyvllm.engine.step_timing import format_summary, summarize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "throughput"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ns = ap.parse_args()
    llm = LLM(model=ns.model, dtype="bfloat16", max_model_len=4096)
    make = shared_prefix_workload if ns.workload == "shared-prefix" else throughput_workload
    vocab = llm.llm_engine.model_config.vocab_size
    for seed, label in ((1, "warm-up"), (0, "measured")):
        w = make(ns.num_prompts, seed=seed)
        prompts = [{"prompt_token_ids": [t % vocab for t in p]} for p in w.prompts]
        params = [SamplingParams(temperature=w.temperature, max_tokens=m, ignore_eos=True) for m in w.max_tokens]
        timer = llm.llm_engine.step_timer
        timer.reset(keep_log=True)
        before = torch.cuda.memory_stats()
        stacks: collections.Counter[str] = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if label == "measured":
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            torch.cuda.set_sync_debug_mode(0)
        for wmsg in caught:
            if "synchroniz" in str(wmsg.message).lower():
                stacks[f"{wmsg.filename}:{wmsg.lineno}"] += 1
        after = torch.cuda.memory_stats()
        print(f"\n== {label}: {elapsed:.3f} s")
        print(format_summary(summarize(timer.log)))
        for key in ("segment.all.allocated", "num_alloc_retries", "num_device_alloc", "num_sync_all_streams"):
            if key in after:
                print(f"{key}: +{after[key] - before.get(key, 0)}")
        print(f"synchronising call sites: {sum(stacks.values())}")
        for site, n in stacks.most_common(15):
            print(f"  {n:6d}  {site}")


if __name__ == "__main__":
    main()
