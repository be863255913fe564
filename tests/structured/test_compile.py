"""Compiling constraints: errors a user can act on, unsatisfiable constraints, the cache, vocabulary
types, the per-request grammar state and the reasoning gate."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.structured import submit_validation, validate
from tinyvllm.structured.compiler import choice_grammar, compiler_for, length_bounds_as_patterns
from tinyvllm.structured.matcher import RequestGrammar
from tinyvllm.structured.reasoning_gate import (
    REASONING_END_TEXT,
    end_token_ids,
    prompt_closed_thinking,
    reasoning_ended,
    start_token_ids,
)
from tinyvllm.structured.vocab import vocab_type
from tinyvllm.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")

DEMO = Path(__file__).resolve().parents[2] / "tinyvllm" / "models" / "demo"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(DEMO)


@pytest.mark.parametrize(
    "params, match",
    [
        (SO(json='{"type": '), r"invalid structured_outputs.json: .*JSON"),
        (SO(json={"type": 5}), r"structured_outputs.json: Type should be a string"),
        (SO(json={"type": "foo"}), r"structured_outputs.json: Unsupported type"),
        (SO(regex="a(b"), r"structured_outputs.regex: Regex parsing error .*parenthesis"),
        (SO(grammar='root ::= "a" |'), r"structured_outputs.grammar: EBNF parser error"),
        (SO(grammar='start ::= "a"'), r"structured_outputs.grammar: .*root"),
        # unsatisfiable: an empty language
        (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), r"minimum greater than maximum"),
        (SO(json={"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}), r"enum .*empty"),
        (SO(json={"type": "array", "minItems": 3, "maxItems": 1}), r"minItems is greater than maxItems"),
        (SO(json="false"), r"cannot accept any value"),
        (SO(regex=r"[^\x00-\U0010FFFF]"), r"structured_outputs.regex cannot be satisfied"),
    ],
)
def test_invalid_and_unsatisfiable_constraints_raise_value_error(tokenizer, params, match):
    with pytest.raises(ValueError, match=match):
        validate(params, tokenizer)


def test_valid_constraints_compile_once_and_are_cached(tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    validate(SO(json=schema), tokenizer)
    first = submit_validation(SO(json=schema), tokenizer)
    same = submit_validation(SO(json=json.dumps(dict(reversed(schema.items())))), tokenizer)
    assert first is same and first.done()
    assert compiler_for(tokenizer) is compiler_for(tokenizer)
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        validate({"json": schema}, tokenizer)
    for params in [SO(regex=r"\d+"), SO(choice=["a", 'b"c']), SO(grammar='root ::= "x"+'), SO(json_object=True)]:
        validate(params, tokenizer)


def test_compilation_runs_off_the_caller_thread(tokenizer):
    """submit returns before a large schema has compiled (a few ms here; the caller must not wait)."""
    props = {f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"} for i in range(60)}
    t0 = time.perf_counter()
    future = submit_validation(SO(json={"type": "object", "properties": props}), tokenizer)
    submit_s = time.perf_counter() - t0
    future.result()
    total_s = time.perf_counter() - t0
    assert submit_s < total_s


def test_choice_grammar_escapes():
    choices = ['a"b', "back\\slash", "new\nline", "ünï 😀", "tab\t"]
    compiled = xgr.Grammar.from_ebnf(choice_grammar(choices))
    assert compiled is not None


def test_vocab_type_from_the_decoder():
    assert vocab_type({"type": "ByteLevel"}) == ("BYTE_LEVEL", False)
    mistral = {
        "type": "Sequence",
        "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip"}],
    }
    assert vocab_type(mistral) == ("BYTE_FALLBACK", True)
    assert vocab_type({"type": "Metaspace"}) == ("BYTE_FALLBACK", True)
    assert vocab_type({"type": "WordPiece"}) == ("RAW", False)
    assert vocab_type(None) == ("RAW", False)


def test_tokenizer_info_decodes_the_vocabulary_and_hides_special_tokens(tokenizer):
    compiler = compiler_for(tokenizer, tokenizer.vocab_size + 7, [tokenizer.eos_token_id])
    info = compiler.tokenizer_info
    assert info.vocab_size == tokenizer.vocab_size + 7
    decoded = info.decoded_vocab
    for token_id in tokenizer.encode("Hello, world! é", add_special_tokens=False):
        assert decoded[token_id] == tokenizer._backend.decode([token_id]).encode() or "\ufffd" in tokenizer.decode(
            [token_id]
        )
    assert set(tokenizer.all_special_ids) <= set(info.special_token_ids) | set(info.stop_token_ids)
    assert info.stop_token_ids == [tokenizer.eos_token_id]


def test_request_grammar_accepts_rolls_back_and_terminates(tokenizer):
    compiler = compiler_for(tokenizer)
    grammar = RequestGrammar(compiler.submit(SO(choice=["yes", "no"])))
    grammar.compiled.result()
    assert grammar.is_ready() and grammar.failure() is None
    ids = tokenizer.encode("yes", add_special_tokens=False)
    for i, t in enumerate(ids):
        assert grammar.accept(t, ids[: i + 1])
    assert grammar.num_accepted == len(ids) and not grammar.is_terminated()
    grammar.rollback(len(ids))
    no = tokenizer.encode("no", add_special_tokens=False)
    assert all(grammar.accept(t, no[: i + 1]) for i, t in enumerate(no))
    assert not grammar.accept(no[0], no)  # past the end: only EOS fits
    assert grammar.accept(tokenizer.eos_token_id, [*no, tokenizer.eos_token_id]) and grammar.is_terminated()


def test_reasoning_gate(tokenizer):
    assert REASONING_END_TEXT == {"qwen3": "</think>", "deepseek_r1": "</think>"}
    end = end_token_ids(tokenizer, "qwen3")
    assert tokenizer.decode(list(end)) == "</think>"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        end_token_ids(tokenizer, "nope")
    assert reasoning_ended([5, *end, 9], end) == 1 + len(end)
    assert reasoning_ended([5, 9], end) is None
    compiler = compiler_for(tokenizer)
    grammar = RequestGrammar(compiler.submit(SO(regex="ab")), reasoning_end_ids=end)
    thought = tokenizer.encode("hmm zz", add_special_tokens=False)
    out = []
    for t in [*thought, *end]:
        out.append(t)
        assert not grammar.gate_open
        assert grammar.accept(t, out)  # anything goes while thinking
    assert grammar.gate_open and grammar.is_active
    ab = tokenizer.encode("ab", add_special_tokens=False)
    assert all(grammar.accept(t, out) for t in ab) and grammar.num_accepted == len(ab)


def test_a_prompt_that_closed_its_thinking_opens_the_gate(tokenizer):
    """Qwen3's template with enable_thinking=False ends the prompt with an empty closed block: the
    constraint applies from the first output token. A prompt that opens thinking, or shows none, keeps
    the gate closed until the model closes it; an earlier turn's closed block does not count."""
    start, end = start_token_ids(tokenizer, "qwen3"), end_token_ids(tokenizer, "qwen3")
    assert tokenizer.decode(list(start)) == "<think>"
    user = tokenizer.encode("user: hi", add_special_tokens=False)
    nl = tokenizer.encode("\n\n", add_special_tokens=False)
    assert prompt_closed_thinking([*user, *start, *nl, *end, *nl], start, end)
    assert not prompt_closed_thinking([*user, *start, *nl], start, end)
    assert not prompt_closed_thinking(user, start, end)
    assert not prompt_closed_thinking([*start, *end, *user, *start], start, end)
    compiler = compiler_for(tokenizer)
    grammar = RequestGrammar(compiler.submit(SO(regex="ab")), reasoning_end_ids=end, prompt_closed_thinking=True)
    assert grammar.gate_open
    ab = tokenizer.encode("ab", add_special_tokens=False)
    assert all(grammar.accept(t, ab[: i + 1]) for i, t in enumerate(ab)) and grammar.num_accepted == len(ab)


def test_length_bounded_strings_allow_no_control_characters(tokenizer):
    """xgrammar's own length rule lets U+0008 in unescaped; ours compiles them to a pattern that does not."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 3}}}
    rewritten = length_bounds_as_patterns(schema)
    pattern = rewritten["properties"]["s"]["pattern"]
    for text, ok in [("ab", True), ("", False), ("abcd", False), ("a\x08", False), ('a"', False), ("é日", True)]:
        assert bool(re.fullmatch(pattern, text)) is ok
    compiled = compiler_for(tokenizer).compile(SO(json=schema))
    for text, ok in [('{"s": "ab"}', True), ('{"s": "a\x08"}', False), ('{"s": ""}', False)]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) is ok
    with pytest.raises(ValueError, match="minLength 5 is greater than maxLength 2"):
        validate(SO(json={"type": "string", "minLength": 5, "maxLength": 2}), tokenizer)


def test_reasoning_parser_is_an_engine_flag():
    import argparse

    from tinyvllm.engine.args import add_engine_cli_args, engine_args_from_cli

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    assert (
        engine_args_from_cli(parser.parse_args(["--reasoning-parser", "deepseek_r1"])).reasoning_parser == "deepseek_r1"
    )
    assert engine_args_from_cli(parser.parse_args([])).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])
