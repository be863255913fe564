"""Tool-call parsers on hand-written model outputs: whole text against hand-computed calls, and
every split of the text into deltas reassembling to the same result."""

import json

import pytest

from tinyvllm.tool_parsers import (
    Content,
    ParsedCall,
    check_tool_call_parser,
    extract_tool_calls,
    make_tool_call_stream,
)


def call(name, **args):
    return ParsedCall(name, json.dumps(args))


WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
HERMES_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

CASES = [
    # (parser, output, content, calls)
    ("llama3_json", WEATHER, None, [call("get_weather", city="Paris", unit="c")]),
    ("llama3_json", "<|python_tag|>" + WEATHER, None, [call("get_weather", city="Paris", unit="c")]),
    (
        "llama3_json",
        '  {"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; {"name": "b", "arguments": {}}',
        None,
        [call("a", x=[1, {"y": "}"}]), call("b")],
    ),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),  # cut off
    ("llama3_json", '{"name": "a", "parameters": {"x": tru}}', '{"name": "a", "parameters": {"x": tru}}', []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # no name: not a call
    ("llama3_json", '{"name": "a", "parameters": "{\\"x\\": 2}"}', None, [call("a", x=2)]),  # arguments as a string
    (
        "llama3_json",
        '{"name": "a", "parameters": {}}; oops {"name": "b"}',
        'oops {"name": "b"}',
        [call("a")],
    ),
    ("hermes", HERMES_WEATHER, None, [call("get_weather", city="Paris", unit="c")]),
    (
        "hermes",
        "Let me check.\n\n" + HERMES_WEATHER + "\n" + HERMES_TIME,
        "Let me check.",
        [call("get_weather", city="Paris", unit="c"), call("get_time")],
    ),
    ("hermes", "No tools needed: 2 < 3 and <tool is fine.", "No tools needed: 2 < 3 and <tool is fine.", []),
    (
        "hermes",
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n{not json}\n</tool_call>",
        [],
    ),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [call("get_time")]),  # EOS before close
    ("hermes", '<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
    (
        "hermes",
        "before " + HERMES_TIME + " between\n<tool_call>[1]</tool_call> after",
        "before between\n<tool_call>[1]</tool_call> after",
        [call("get_time")],
    ),
]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
def test_whole_output(parser, output, content, calls):
    assert extract_tool_calls(parser, output) == (content, calls)


def _splits(text):
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
def test_every_split_into_deltas_reassembles(parser, output, content, calls):
    for split in _splits(output):
        stream = make_tool_call_stream(parser)
        events = [e for piece in split for e in stream.feed(piece)] + stream.finish()
        got_content = "".join(e.text for e in events if isinstance(e, Content)) or None
        assert (got_content, [e for e in events if isinstance(e, ParsedCall)]) == (content, calls), split


def test_content_is_released_before_the_call_completes():
    stream = make_tool_call_stream("hermes")
    assert stream.feed("Checking the weather. <tool") == [Content("Checking the weather.")]
    assert stream.feed('_call>{"name": "get_time", "arguments": {}') == []
    assert stream.feed("}</tool_call>") == [call("get_time")]


def test_plain_llama_text_is_released_once_it_cannot_be_a_call():
    stream = make_tool_call_stream("llama3_json")
    assert stream.feed("  ") == []
    assert stream.feed("<|py") == []
    assert stream.feed("x") == [Content("<|pyx")]


def test_unknown_parser_lists_choices():
    with pytest.raises(ValueError, match="llama3_json, hermes"):
        check_tool_call_parser("mistral")
