"""Grammar worker processes (structured/workers.py, shard.py, grammar_worker.py) against the engine-process
path: the same masks, rejections, completions and dead rows step by step, with some rows held in the
engine's process and some on workers; rollback; a worker that dies is an error, not a hang; and the
engine's tokens under async scheduling and preemption equal those of an engine without workers."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.sampling.bitmask import unpack_bitmask
from tinyvllm.structured.manager import StructuredOutputManager
from tinyvllm.structured.shard import empty_rows
from tinyvllm.structured.workers import WorkerError, default_num_workers
from tinyvllm.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")

DEMO = Path(__file__).resolve().parents[2] / "tinyvllm" / "models" / "demo"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}}}
CONSTRAINTS = [SO(json=SCHEMA), SO(regex=r"(ab|c){1,4}d"), SO(choice=["yes", "no", "maybe"]), SO(json=SCHEMA)]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(DEMO)


def _ready(manager: StructuredOutputManager) -> StructuredOutputManager:
    assert manager.wait_for_workers(120), "grammar workers did not start"
    manager.worker_min_sequences = 1  # a few sequences go to the workers too
    return manager


def _draw(words: np.ndarray, vocab: int, rng: np.random.Generator) -> int:
    allowed = np.flatnonzero(unpack_bitmask(torch.from_numpy(words[None].copy()), vocab)[0].numpy())
    return int(rng.choice(allowed)) if len(allowed) else 0


def test_default_worker_count():
    assert [default_num_workers(c) for c in (1, 2, 7, 8, 16, 32, 128)] == [0, 0, 0, 2, 4, 4, 4]


def test_workers_give_the_engine_process_masks_and_answers(tokenizer):
    """Seven constrained sequences and an unconstrained one, stepped through begin_fill / accept_tokens /
    finish_fill (and `fill`) by a manager without workers and one with two: three sequences start before
    the workers are up (in the engine's process; they move to the workers, their tokens replayed, once
    the workers are ready), four after. Every step's buffer, rejections, completions and dead rows are
    the same; a token the grammar forbids is rejected by both."""
    vocab, eos = tokenizer.vocab_size, [tokenizer.eos_token_id]
    plain = StructuredOutputManager(tokenizer, vocab, eos)
    pooled = StructuredOutputManager(tokenizer, vocab, eos, num_workers=2)
    try:
        rids = ["u"] + [f"c{i}" for i in range(7)]
        early, late = rids[1:4], rids[4:]
        bufs = {}
        for m in (plain, pooled):
            bufs[m] = m.host_masks(len(rids), False)
            for rid in early:
                m.add(rid, CONSTRAINTS[int(rid[1]) % 4]).compiled.result()
            m.fill(rids, m.constrained_rows(rids), bufs[m][0])  # places the early ones: no worker is ready
        assert all(pooled.grammars[r].worker is None for r in early)
        assert pooled.wait_for_workers(120)
        for m in (plain, pooled):  # the early ones accept a first token in this process
            items = [
                (r, _draw(bufs[m][0].numpy()[i + 1], vocab, np.random.default_rng(i)), []) for i, r in enumerate(early)
            ]
            assert m.accept_tokens([(r, t, [t]) for r, t, _ in items]) == ([], [])
        _ready(pooled)
        for m in (plain, pooled):
            for rid in late:
                m.add(rid, CONSTRAINTS[int(rid[1]) % 4]).compiled.result()
        rng = np.random.default_rng(0)
        outputs = {rid: list(plain.grammars[rid].accepted) if rid in early else [] for rid in rids}
        tokens: dict[str, int] = {}
        live = list(rids)
        for step in range(24):
            answers = {}
            for m in (plain, pooled):
                out = bufs[m][step % 2]
                out.fill_(0x5A5A5A5A)
                items = [(r, tokens[r], outputs[r]) for r in live if r in tokens and r != "u"]
                if step % 3 == 2:  # the engine's synchronous order: accept, then fill
                    answer = m.accept_tokens(items)
                    rows = m.constrained_rows(live)
                    m.fill(live, rows, out[: len(live)])
                else:
                    m.begin_fill(live, out[: len(live)])
                    answer = m.accept_tokens(items)
                    rows = m.finish_fill()
                answers[m] = (tuple(sorted(a) for a in answer), rows, sorted(m.take_dead()))
            assert answers[plain] == answers[pooled], step
            n = len(live)
            assert torch.equal(bufs[plain][step % 2][:n], bufs[pooled][step % 2][:n]), step
            (rejected, terminated), _, dead = answers[plain]
            live = [r for r in live if r not in set(rejected) | set(terminated) | set(dead)]
            view = bufs[plain][step % 2].numpy()
            tokens = {r: _draw(view[i], vocab, rng) for i, r in enumerate(live)}
            if step == 5:  # a token c1's grammar forbids: both reject it
                forbidden = np.flatnonzero(unpack_bitmask(bufs[plain][step % 2][1:2], vocab)[0].numpy() == 0)
                tokens["c1"] = int(forbidden[0])
            for r, t in tokens.items():
                outputs[r].append(t)
        assert all(pooled.grammars[r].worker is not None for r in pooled.grammars)  # the early ones moved
    finally:
        pooled.close()


def test_rollback_and_remove_on_a_worker(tokenizer):
    vocab, eos = tokenizer.vocab_size, [tokenizer.eos_token_id]
    pooled = _ready(StructuredOutputManager(tokenizer, vocab, eos, num_workers=1))
    plain = StructuredOutputManager(tokenizer, vocab, eos)
    try:
        ids = tokenizer.encode("yes", add_special_tokens=False) + eos
        for m in (plain, pooled):
            m.add("a", SO(choice=["yes", "no"])).compiled.result()
            m.fill(["a"], [0], m.host_masks(1, False)[0])
            for i, t in enumerate(ids):
                assert m.accept_tokens([("a", t, ids[: i + 1])]) == ([], ["a"] if i == len(ids) - 1 else [])
        assert pooled.grammars["a"].worker == 0 and pooled.grammars["a"].terminated
        for m in (plain, pooled):
            m.grammars["a"].rollback(1)  # the stop token undone: active again
            assert not m.grammars["a"].terminated and m.constrained_rows(["a"]) == [0]
        masks = [m.host_masks(1, False)[0] for m in (plain, pooled)]
        for m, out in zip((plain, pooled), masks):
            m.fill(["a"], [0], out)
        assert torch.equal(masks[0], masks[1])
        pooled.remove("a")
        assert pooled.pool.workers[0].load == 0
    finally:
        pooled.close()


def test_a_worker_that_dies_is_an_error(tokenizer):
    pooled = _ready(StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], num_workers=1))
    try:
        pooled.add("a", SO(regex="ab")).compiled.result()
        out = pooled.host_masks(1, False)[0]
        pooled.fill(["a"], [0], out)
        pooled.pool.workers[0].process.kill()
        pooled.pool.workers[0].process.wait()
        with pytest.raises(WorkerError, match="grammar worker 0"):
            pooled.fill(["a"], [0], out)
    finally:
        pooled.close()


def test_empty_rows_reads_whole_rows_only_where_needed():
    words = np.zeros((5, 100), np.int32)
    words[0, 3], words[2, 90], words[4, 63] = 1, -1, 4
    assert empty_rows(words, [0, 1, 2, 3, 4]) == [1, 3]
    assert empty_rows(words, [3, 1]) == [0, 1]
    assert empty_rows(words[:, :10], [0, 2]) == [1]


def test_engine_with_workers_gives_the_same_tokens(tmp_path):
    """Async scheduling, preemption, constrained and plain rows, greedy and seeded: an engine whose grammars
    run on two workers produces the tokens of one that runs them in its own process."""
    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    so = SO(json={"type": "array", "items": {"enum": ["abc", "de", 7]}, "minItems": 2, "maxItems": 6})
    prompts = [f"shared prefix {i} " * 2 for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=50, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=50, structured_outputs=so),
        SamplingParams(temperature=0.7, seed=9, max_tokens=50, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=50, structured_outputs=SO(regex="(ab|c)+d")),
        SamplingParams(temperature=1.0, seed=3, max_tokens=50, structured_outputs=SO(choice=["left", "right"])),
    ]
    runs = {}
    for workers in (None, 2):  # None: the default, no workers for an engine on the CPU
        llm = LLM(
            model=str(tmp_path),
            device="cpu",
            max_model_len=128,
            max_num_seqs=6,
            num_gpu_blocks_override=8,
            async_scheduling=True,
            structured_outputs_workers=workers,
        )
        if workers:  # the grammars on the workers from the first step
            _ready(llm.llm_engine.structured)
        runs[workers] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_metrics()["num_preemptions"] > 0
        assert (llm.llm_engine.structured.pool is None) == (workers is None)
        if workers:
            pool = llm.llm_engine.structured.pool
            assert any(w.keys for w in pool.workers)  # grammars were placed on them
            assert sum(w.load for w in pool.workers) == 0  # every finished sequence removed
            llm.llm_engine.shutdown()
    for ref, out in zip(runs[None], runs[2]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason


def test_a_worker_that_cannot_start_leaves_its_sequences_here(tokenizer, monkeypatch):
    """A worker whose process exits before it answers is left out: no wait for it, and the sequences
    stay in the engine's process with the masks they get there."""
    monkeypatch.setattr("sys.executable", "/bin/false")  # the worker's interpreter exits at once
    pooled = StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], num_workers=1)
    try:
        start = time.monotonic()
        assert not pooled.wait_for_workers(60)
        assert time.monotonic() - start < 30 and pooled.pool.workers[0].failed
        pooled.worker_min_sequences = 1
        pooled.add("a", SO(regex="ab")).compiled.result()
        out = pooled.host_masks(1, False)[0]
        pooled.fill(["a"], [0], out)
        assert pooled.grammars["a"].worker is None
        allowed = np.flatnonzero(unpack_bitmask(out, tokenizer.vocab_size)[0].numpy())
        assert len(allowed) and all(tokenizer.decode([int(t)]) in ("a", "ab") for t in allowed)
    finally:
        pooled.close()
