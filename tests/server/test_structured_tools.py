"""Structured outputs, tool calls and reasoning through a live server.

Random weights know no JSON, so constrained outputs are valid only because the grammar makes them so:
every one is parsed and validated here (pydantic, jsonschema, re.fullmatch). Outputs the model must
write by itself (tool_choice "auto", `<think>` blocks) come from a scripted engine (tests/server/
scripted.py): the real server path parses text that the engine emitted token by token.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from tests.server.conftest import MODEL_NAME  # noqa: E402
from tests.server.scripted import scripted_engine  # noqa: E402
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint  # noqa: E402

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}

LLAMA_SCRIPTS = {
    "call": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "celsius": true}}',
    "two": '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
    '{"city": "Paris", "celsius": false}}',
    "broken": '{"name": "get_weather", "parameters": {"city": Rome}}',
    "text": "It is sunny in Rome.",
}
QWEN_SCRIPTS = {
    "think": "<think>\nThe user greets me.\n</think>\n\nHello there.",
    "think_call": '<think>I need the time.</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
    "\n</tool_call>",
}


# Random weights would write JSON's optional whitespace forever: constrain it away (an option that
# rides along with response_format and forced tool calls, as in vLLM).
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llama(make_server):
    return make_server(
        "thread",
        engine_factory=functools.partial(scripted_engine, scripts=LLAMA_SCRIPTS),
        max_model_len=2048,  # Llama's tool prompt is long in the tiny vocabulary
        server_kw={"tool_call_parser": "llama3_json", "enable_auto_tool_choice": True},
    )


@pytest.fixture(scope="module")
def qwen(make_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    write_dummy_checkpoint(path, make_config("tiny-qwen3"), seed=3, dtype="float32")
    return make_server(
        "thread",
        model=str(path),
        engine_factory=functools.partial(scripted_engine, scripts=QWEN_SCRIPTS),
        reasoning_parser="qwen3",
        max_model_len=2048,
        server_kw={"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3"},
    )


def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)


def post(live, body, path="/v1/chat/completions"):
    return httpx.post(live.url + path, json={"model": MODEL_NAME, **body}, timeout=120)


def stream_chunks(live, body):
    with httpx.stream(
        "POST", live.url + "/v1/chat/completions", json={"model": MODEL_NAME, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assemble(chunks):
    """The message the streamed deltas of choice 0 add up to, and its finish_reason."""
    content, reasoning, calls, finish = "", "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", []):
                if call["index"] == len(calls):
                    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                    calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                else:
                    assert "name" not in call["function"]
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content or None, reasoning or None, calls, finish


def check_calls(calls, expect_name=None):
    assert calls
    for c in calls:
        name, args = (c["name"], c["arguments"]) if "name" in c else (c["function"]["name"], c["function"]["arguments"])
        assert expect_name in (None, name)
        jsonschema.validate(json.loads(args), SCHEMAS[name])


# ---------------------------------------------------------------------- response_format, structured_outputs
class Answer(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sunny: bool
    tags: list[Literal["a", "b"]] = pydantic.Field(max_length=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_openai_parse_with_a_pydantic_model(llama, seed):
    completion = client(llama).chat.completions.parse(
        model=MODEL_NAME,
        messages=user("weather?"),
        response_format=Answer,
        max_tokens=120,
        seed=seed,
        extra_body=COMPACT,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Answer)
    assert Answer.model_validate_json(message.content) == message.parsed


def test_json_object_and_json_schema_streamed(llama):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    body = {"messages": user("n?"), "max_tokens": 60, "seed": 4, **COMPACT}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    content, _, _, finish = assemble(stream_chunks(llama, {**body, "response_format": rf}))
    assert finish == "stop"
    jsonschema.validate(json.loads(content), schema)
    r = post(llama, {**body, "max_tokens": 120, "response_format": {"type": "json_object"}}).json()
    if r["choices"][0]["finish_reason"] == "stop":  # any object may be long: only a finished one must parse
        assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)


def test_structured_outputs_on_completions_and_chat(llama):
    r = post(
        llama,
        {"prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": r"[0-9]{3}-[a-c]{2}"}},
        "/v1/completions",
    )
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.json()["choices"][0]["text"])
    r = post(
        llama, {"messages": user("pick"), "max_tokens": 20, "n": 3, "structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert {c["message"]["content"] for c in r.json()["choices"]} <= {"yes", "no"}
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    r = post(
        llama,
        {"prompt": "x", "max_tokens": 40, "temperature": 0, "structured_outputs": {"grammar": grammar}},
        "/v1/completions",
    )
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", choice["text"])
    else:
        assert re.fullmatch(r"\([1-9](\+[1-9])*", choice["text"])


def test_vllm_guided_fields_constrain_as_structured_outputs(llama):
    """vLLM's pre-0.12 `guided_*` fields (which vLLM now ignores silently) constrain here."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    r = post(llama, {"prompt": "x", "max_tokens": 20, "guided_regex": r"[0-9]{3}-[a-c]{2}"}, "/v1/completions")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.json()["choices"][0]["text"])
    r = post(llama, {"messages": user("pick"), "max_tokens": 20, "n": 3, "guided_choice": ["yes", "no"]})
    assert {c["message"]["content"] for c in r.json()["choices"]} <= {"yes", "no"}
    completion = client(llama).chat.completions.create(
        model=MODEL_NAME,
        messages=user("n?"),
        max_tokens=60,
        seed=5,
        extra_body={"guided_json": json.dumps(schema), "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content), schema)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    r = post(llama, {"prompt": "x", "max_tokens": 40, "temperature": 0, "guided_grammar": grammar}, "/v1/completions")
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)?", r.json()["choices"][0]["text"])


# ---------------------------------------------------------------------- tool_choice required / named / none
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(llama, stream):
    body = {"messages": user("go"), "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    body.update(max_tokens=100, seed=7, **COMPACT)
    if stream:
        content, _, calls, finish = assemble(stream_chunks(llama, body))
    else:
        choice = post(llama, body).json()["choices"][0]
        content, calls, finish = choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert finish == "tool_calls" and content is None and len(calls) == 1
    check_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice(llama, stream):
    body = {"messages": user("go"), "tools": TOOLS, "max_tokens": 60, "seed": 3, **COMPACT}
    body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    if stream:
        chunks = stream_chunks(llama, body)
        content, _, calls, finish = assemble(chunks)
    else:
        choice = post(llama, body).json()["choices"][0]
        content, calls, finish = choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls" and content is None and len(calls) == 1
    check_calls(calls, "get_time")


def test_openai_client_tool_calls(llama):
    completion = client(llama).chat.completions.create(
        model=MODEL_NAME,
        messages=user("go"),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        seed=11,
        extra_body=COMPACT,
    )
    (call,) = completion.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_renders_tools_but_parses_nothing(llama):
    r = post(llama, {"messages": user("SCRIPT[call]"), "tools": TOOLS, "tool_choice": "none", "max_tokens": 80})
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == LLAMA_SCRIPTS["call"].removeprefix("<|python_tag|>")
    with_tools = post(llama, {"messages": user("hi"), "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
    without = post(llama, {"messages": user("hi"), "max_tokens": 1})
    assert with_tools.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"] + 50


def test_tool_results_in_the_conversation(llama):
    messages = [
        *user("weather in Rome?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "celsius": true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21 degrees"},
    ]
    r = post(llama, {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = llama.engine.info.tokenizer.apply_chat_template(
        [
            messages[0],
            {
                **messages[1],
                "content": "",
                "tool_calls": [
                    {
                        **messages[1]["tool_calls"][0],
                        "function": {"name": "get_weather", "arguments": {"city": "Rome", "celsius": True}},
                    }
                ],
            },
            messages[2],
        ],
        tools=TOOLS,
    )
    assert '{"name": "get_weather", "parameters": {"city": "Rome", "celsius": true}}<|eot_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees<|eot_id|>" in prompt
    assert r.json()["usage"]["prompt_tokens"] == len(
        llama.engine.info.tokenizer.encode(prompt, add_special_tokens=False)
    )


# ---------------------------------------------------------------------- tool_choice auto (scripted output)
AUTO_CASES = [
    ("call", None, [("get_weather", {"city": "Rome", "celsius": True})]),
    ("two", None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris", "celsius": False})]),
    ("broken", LLAMA_SCRIPTS["broken"], []),
    ("text", LLAMA_SCRIPTS["text"], []),
]


@pytest.mark.parametrize(("script", "content", "calls"), AUTO_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_text(llama, stream, script, content, calls):
    body = {"messages": user(f"SCRIPT[{script}]"), "tools": TOOLS, "max_tokens": 300}  # no tool_choice: auto
    if stream:
        got_content, _, got_calls, finish = assemble(stream_chunks(llama, body))
    else:
        choice = post(llama, body).json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        got_content = message["content"]
        got_calls = [c["function"] for c in message.get("tool_calls", [])]
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    assert finish == ("tool_calls" if calls else "stop")


# ---------------------------------------------------------------------- reasoning (scripted output)
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content(qwen, stream):
    body = {"messages": user("SCRIPT[think]"), "max_tokens": 80}
    if stream:
        chunks = stream_chunks(qwen, body)
        content, reasoning, _, finish = assemble(chunks)
        kinds = [k for c in chunks for ch in c["choices"] for k in ch["delta"] if k in ("content", "reasoning_content")]
        assert kinds.index("reasoning_content") < max(i for i, k in enumerate(kinds) if k == "content")
    else:
        choice = post(qwen, body).json()["choices"][0]
        content, reasoning, finish = (
            choice["message"]["content"],
            choice["message"]["reasoning_content"],
            choice["finish_reason"],
        )
    assert (reasoning, content, finish) == ("\nThe user greets me.\n", "Hello there.", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_hermes_tool_call(qwen, stream):
    body = {"messages": user("SCRIPT[think_call]"), "tools": TOOLS, "tool_choice": "auto", "max_tokens": 80}
    if stream:
        content, reasoning, calls, finish = assemble(stream_chunks(qwen, body))
    else:
        choice = post(qwen, body).json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        content, reasoning, calls = (
            message["content"],
            message["reasoning_content"],
            [c["function"] for c in message["tool_calls"]],
        )
    assert (content, reasoning, finish) == (None, "I need the time.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "CET"})]


def test_enable_thinking_false_is_passed_to_the_template(qwen):
    r = post(qwen, {"messages": user("hi"), "chat_template_kwargs": {"enable_thinking": False}}, "/tokenize")
    tokens = r.json()["tokens"]
    text = qwen.engine.info.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------- bad input
ERRORS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format.json_schema.schema",
        "objekt",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"json": {"type": "string", "minLength": 5, "maxLength": 2}}}, "structured_outputs", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "both"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "tool",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice", "get_time"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "bad name!"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
        "tools.0.function.parameters",
        "not a valid JSON schema",
    ),
    ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "twice"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one of"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex", "both"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "both"),
    ({"guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    (
        {"guided_json": {"type": "object"}, "guided_decoding_backend": "xgrammar:fast"},
        "guided_decoding_backend",
        "fast",
    ),
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_regex", "whitespace_pattern"),
]


@pytest.mark.parametrize(("extra", "param", "words"), ERRORS)
def test_bad_constraints_and_tools_are_400s_naming_the_field(llama, extra, param, words):
    r = post(llama, {"messages": user("x"), "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_auto_without_the_server_flags_is_a_400(qwen, make_server):
    live = make_server("thread", max_model_len=2048)
    r = post(live, {"messages": user("x"), "tools": TOOLS, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = post(live, {"messages": user("SCRIPT[x]"), "tools": TOOLS, "max_tokens": 3})  # no tool_choice: none here
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
