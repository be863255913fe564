"""The chat output stage without a server: tool plans and the parsing of required / named outputs."""

import json

import jsonschema
import pytest

from tinyvllm.entrypoints.chat_output import ChoiceOutput, OutputPlan
from tinyvllm.entrypoints.errors import APIError
from tinyvllm.entrypoints.tools import plan_tools

P = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": P}},
    {"type": "function", "function": {"name": "g"}},
]


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = plan_tools(TOOLS, "required", None, False).schema
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {}}], [{"name": "f"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(TOOLS, "required", False, False).schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}] * 2, single)


def test_auto_needs_the_server_flags_and_defaults_follow_them():
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(TOOLS, "auto", None, False)
    assert plan_tools(TOOLS, None, None, False).mode == "none"
    assert plan_tools(TOOLS, None, None, True).mode == "auto"


def test_required_output_cut_short_is_content_not_an_error():
    plan = OutputPlan(plan_tools(TOOLS, "required", None, False))
    out = ChoiceOutput(plan, None)
    assert out.message('[{"name": "f", "parameters": {"x": 1') == {
        "role": "assistant",
        "content": '[{"name": "f", "parameters": {"x": 1',
    }
    assert out.finish_reason("length") == "length"
    done = ChoiceOutput(plan, None)
    message = done.message('[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("f", {"x": 1}),
        ("g", {}),
    ]
    assert message["content"] is None and done.finish_reason("stop") == "tool_calls"


def test_named_arguments_stream_as_they_come():
    out = ChoiceOutput(
        OutputPlan(plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None, False)), None
    )
    first = out.feed('{"x"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"x"'}
    assert out.feed(": 2}") == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 2}"}}]}]
