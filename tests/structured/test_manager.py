"""The step's host work for constrained rows (structured/manager.py, utf8_guard.py): the bitmask a step
gets, whatever its buffer held before, against xgrammar's own per-row fill; the UTF-8 guard on a subset
of rows against a bytewise reference; token acceptance, termination and rejection against plain
xgrammar matchers; dead rows."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.sampling.bitmask import pack_bitmask, unpack_bitmask
from tinyvllm.structured.manager import StructuredOutputManager
from tinyvllm.structured.utf8_guard import Utf8Guard
from tinyvllm.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")

DEMO = Path(__file__).resolve().parents[2] / "tinyvllm" / "models" / "demo"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(DEMO)


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])


def _reference_row(manager, rid) -> np.ndarray:
    """xgrammar's own fill of one row into a fresh buffer, then the guard of that row alone."""
    grammar = manager.grammars[rid]
    ref = xgr.allocate_token_bitmask(1, manager.vocab_size)
    grammar.get_matcher().fill_next_token_bitmask(ref, 0)
    words = ref.numpy()
    manager.utf8_guard.apply(words, [0], [grammar.last_token])
    return words[0]


def test_fill_writes_whole_rows_and_leaves_others_all_ones(manager, tokenizer):
    rids = ["u0", "c1", "u2", "c3", "c4"]
    for rid, params in (("c1", SO(json=SCHEMA)), ("c3", SO(regex=r"[a-c]{2,5}x")), ("c4", SO(json=SCHEMA))):
        manager.add(rid, params).compiled.result()
    prefix = tokenizer.encode('{"a": "he', add_special_tokens=False)
    assert manager.accept_tokens([("c4", t, prefix[: i + 1]) for i, t in enumerate(prefix[:1])]) == ([], [])
    for i, t in enumerate(prefix[1:], 1):
        manager.accept_tokens([("c4", t, prefix[: i + 1])])
    rows = manager.constrained_rows(rids)
    assert rows == [1, 3, 4]
    for poison in (0, -1, 0x5A5A5A5A):
        out = torch.full((len(rids), manager.width), poison, dtype=torch.int32)
        manager.fill(rids, rows, out)
        view = out.numpy()
        assert np.all(view[[0, 2]] == -1)
        for i in rows:
            assert np.array_equal(view[i], _reference_row(manager, rids[i])), (poison, i)
    assert manager.take_dead() == []


def test_utf8_guard_on_a_subset_of_rows_matches_a_bytewise_reference():
    vocab = [b"a", b"\xed", b"\xa5x", b"\x85", b"\xed\xa0", b"\xe0", b"\x90z", b"", b"ok", b"\xf4"]
    guard = Utf8Guard(vocab)
    assert not guard.all_valid
    forbidden = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
    rng = np.random.default_rng(0)
    allowed = rng.random((4, len(vocab))) < 0.8
    words = pack_bitmask(allowed)
    rows, lasts = [0, 2, 3], [1, None, 9]  # after "\xed", nothing, after "\xf4"; row 1 untouched
    guard.apply(words, rows, lasts)
    got = unpack_bitmask(torch.from_numpy(words), len(vocab)).numpy()
    for r in range(4):
        for t, token in enumerate(vocab):
            want = allowed[r, t]
            if r in rows:
                ill = any(a in forbidden and forbidden[a][0] <= b <= forbidden[a][1] for a, b in pairwise(token))
                last = lasts[rows.index(r)]
                lead = None if last is None else vocab[last][-1]
                after = lead in forbidden and token and forbidden[lead][0] <= token[0] <= forbidden[lead][1]
                want = want and not ill and not after
            assert got[r, t] == want, (r, t)


def test_accept_tokens_reports_rejections_and_completions_as_xgrammar_does(manager, tokenizer):
    so = SO(choice=["yes", "no"])
    for rid in ("a", "b", "c"):  # "b" gets no token
        manager.add(rid, so).compiled.result()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    no = tokenizer.encode("no", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    reference = xgr.GrammarMatcher(manager.grammars["a"].compiled.result())
    outs = {"a": [], "c": []}

    def step(items):
        for rid, t in items:
            outs[rid].append(t)
        return manager.accept_tokens([(rid, t, list(outs[rid])) for rid, t in items])

    for t in yes:
        assert step([("a", t)]) == ([], [])
        assert reference.accept_token(t)
    rejected, done = step([("a", eos), ("c", no[0])])
    assert reference.accept_token(eos) and reference.is_terminated()
    assert done == ["a"] and rejected == [] and manager.grammars["a"].terminated
    assert manager.constrained_rows(["a", "b", "c"]) == [1, 2]
    assert not manager.any_constrained(["a", "u"]) and manager.any_constrained(["a", "u", "c"])
    manager.grammars["a"].rollback(1)  # the stop token undone: active again
    assert not manager.grammars["a"].terminated and manager.constrained_rows(["a"]) == [0]
    assert manager.any_constrained(["a"])
    rejected, done = step([("c", yes[0])])
    assert rejected == ["c"] and done == []


def test_a_row_that_allows_nothing_is_reported_dead(manager):
    for rid in ("x", "y", "z"):
        manager.add(rid, SO(choice=["ok", "no"])).compiled.result()
    out = torch.empty((4, manager.width), dtype=torch.int32)
    manager.fill(["x", "u", "y", "z"], [0, 2, 3], out)
    assert manager.take_dead() == []
    # a guard over a vocabulary of ill-formed tokens only: whatever the grammar allows is removed
    manager.utf8_guard = Utf8Guard([b"\xed\xa0"] * manager.vocab_size)
    manager.fill(["x", "u", "y", "z"], [0, 3], out)
    assert manager.take_dead() == ["x", "z"] and manager.take_dead() == []
    assert not out[0].any() and not out[3].any() and torch.all(out[1:3] == -1)


@pytest.mark.parametrize("chunks,threads", [(1, 1), (4, 3)], ids=["2-chunks-1-thread", "5-chunks-3-threads"])
def test_fill_overlapped_with_accept_equals_fill_after_it(tokenizer, chunks, threads):
    """begin_fill / accept_tokens / finish_fill (the rows filled on the worker threads, chunk by chunk, as
    their tokens are accepted, several chunks at once with several threads) give the mask that accepting
    all, then `fill`, gives: over chunks · 32 + 8 rows (the last chunk a part), with a row that completes,
    rows that get no token and a row not in the step."""
    from tinyvllm.structured.manager import FILL_CHUNK

    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], fill_threads=threads)
    n = chunks * FILL_CHUNK + 8
    rng = np.random.default_rng(1)
    schema_so, yes_no = SO(json=SCHEMA), SO(choice=["yes", "no"])
    outs: dict[str, list[int]] = {}
    for twin in ("s", "o"):  # sequential, overlapped: the same grammars, fed the same tokens
        for i in range(n):
            manager.add(f"{twin}{i}", yes_no if i == 5 else schema_so).compiled.result()
            outs[f"{twin}{i}"] = []
        manager.add(f"{twin}-other", schema_so).compiled.result()  # accepts tokens, not in the step
        outs[f"{twin}-other"] = []
    yes = tokenizer.encode("yes", add_special_tokens=False)
    masks = {}
    tokens: dict[int, int] = {}
    for step in range(6):
        for twin in ("s", "o"):
            rids = [f"{twin}{i}" for i in range(n)]
            fed = [i for i in range(n) if i in tokens and i % 7 != 3]  # rows 3, 10, ... get no token
            items = []
            for i in fed:
                outs[rids[i]].append(tokens[i])
                items.append((rids[i], tokens[i], list(outs[rids[i]])))
            outs[f"{twin}-other"].append(tokens.get(0, 0))
            items.insert(FILL_CHUNK // 2, (f"{twin}-other", outs[f"{twin}-other"][-1], outs[f"{twin}-other"]))
            out = torch.full((n, manager.width), 0x33, dtype=torch.int32)
            if twin == "s" or step == 0:
                if step:
                    manager.accept_tokens(items)
                manager.fill(rids, manager.constrained_rows(rids), out)
            else:
                manager.begin_fill(rids, out)
                manager.accept_tokens(items)
                manager.finish_fill()
            masks[twin] = out.numpy().copy()
        assert np.array_equal(masks["s"], masks["o"]), step
        assert manager.take_dead() == []
        view = masks["s"]
        for i in range(n):  # the next tokens: row 5 spells "yes" then stops; the others draw allowed tokens
            if i == 5:
                tokens[i] = yes[step] if step < len(yes) else tokenizer.eos_token_id
            else:
                bits = np.unpackbits(view[i].view(np.uint8), bitorder="little")
                tokens[i] = int(rng.choice(np.flatnonzero(bits)))
    assert len(yes) + 2 <= 6  # "yes" and its stop token were accepted: row 5 is free again
    assert manager.grammars["s5"].terminated and manager.grammars["o5"].terminated and np.all(masks["o"][5] == -1)
