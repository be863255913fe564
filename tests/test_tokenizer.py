"""Tokenizer, chat templates and incremental detokenizer, checked against transformers and brute force."""

from __future__ import annotations

import json
import random
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyvllm.models.dummy_tokenizer import CHAT_TEMPLATE, write_tokenizer_files
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 4096  # enough for ~3.5k BPE merges: multi-byte tokens, not just bytes
BOS, EOT = VOCAB - 256, VOCAB - 247

TEXTS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; don't panic.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindent",
    "emoji 😀👍🏽 and CJK 中文字符 and accents éàü and Ω≈ç√",
    "specials inline <|eot_id|> and <|start_header_id|>user<|end_header_id|> text",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, VOCAB, model_max_length=2048)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


# --------------------------------------------------------------------------- Tokenizer vs transformers


def test_attributes_match_transformers(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf) == VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (BOS, EOT)
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert tok.all_special_ids == hf_special == set(range(VOCAB - 256, VOCAB))


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str, add_special_tokens: bool) -> None:
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    assert (ids[:1] == [BOS]) == add_special_tokens
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.decode(ids, skip_special_tokens=False) == ("<|begin_of_text|>" if add_special_tokens else "") + text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_random_ids_matches_transformers(tok: Tokenizer, hf, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        assert tok.decode(ids, skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def test_bad_input(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.convert_ids_to_tokens([VOCAB])
    with pytest.raises(TypeError):
        tok.encode(["not", "a", "string"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(Path("/nonexistent"))


def test_special_tokens_as_added_token_dicts_and_special_tokens_map(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<|begin_of_text|>", "special": True, "lstrip": False}
    del config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|eom_id|>"}}))
    t = Tokenizer.from_pretrained(tmp_path)
    assert (t.bos_token_id, t.eos_token_id) == (BOS, VOCAB - 248)
    assert t.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eom_id|>"}


# --------------------------------------------------------------------------- chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": 'Tell me a joke about <html> & "quotes".'},
        {"role": "assistant", "content": "Why did the chicken… 😀"},
        {"role": "user", "content": "Another, in 中文."},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]}],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city (°C).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CALL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": {"temperature": 21, "unit": "°C"}},
    {"role": "tool", "content": "plain text result"},
]

# Llama 3.1 Instruct's chat template, written from its known structure (tool calling in the
# first user message or the system prompt, built-in tools with ipython, date_string).
LLAMA_31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # the template's own long lines, as the model ships them  # noqa: E501

# Llama 3.2 takes today's date from strftime_now when date_string is not given.
LLAMA_32_TEMPLATE = LLAMA_31_TEMPLATE.replace(
    """{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}""",
    """{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}""",
)
assert LLAMA_32_TEMPLATE != LLAMA_31_TEMPLATE


def _hf_render(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_dummy_chat_template_matches_transformers(
    tok: Tokenizer, hf, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _hf_render(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ours.startswith("<|begin_of_text|><|start_header_id|>" + messages[0]["role"])
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt


LLAMA_31_CASES = [
    (CONVERSATIONS[1], {}),
    (CONVERSATIONS[2], {"date_string": "01 Jan 2025"}),
    (CONVERSATIONS[0], {"tools": TOOLS}),
    (CONVERSATIONS[1], {"tools": TOOLS, "tools_in_user_message": False}),
    (TOOL_CALL_CONVERSATION, {"tools": TOOLS}),
    (TOOL_CALL_CONVERSATION, {"builtin_tools": ["brave_search", "code_interpreter"]}),
    (
        [
            *CONVERSATIONS[0],
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "brave_search", "arguments": {"query": "llama", "n": "3"}}}],
            },
        ],
        {"builtin_tools": ["brave_search", "wolfram_alpha"]},
    ),
]


@pytest.mark.parametrize("template", [LLAMA_31_TEMPLATE, LLAMA_32_TEMPLATE], ids=["3.1", "3.2"])
@pytest.mark.parametrize("case", range(len(LLAMA_31_CASES)))
def test_llama3_instruct_template_matches_transformers(tok: Tokenizer, hf, template: str, case: int) -> None:
    messages, kwargs = LLAMA_31_CASES[case]
    tools = kwargs.get("tools")
    extra = {k: v for k, v in kwargs.items() if k != "tools"}
    ours = tok.apply_chat_template(messages, tools=tools, chat_template=template, **extra)
    theirs = _hf_render(hf, messages, tools=tools, chat_template=template, add_generation_prompt=True, **extra)
    assert ours == theirs
    if "date_string" not in kwargs:
        today = "26 Jul 2024" if template is LLAMA_31_TEMPLATE else datetime.now().strftime("%d %b %Y")
        assert f"Today Date: {today}\n\n" in ours


def test_template_errors_become_value_errors(tok: Tokenizer, hf) -> None:
    two_calls = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}],
        },
    ]
    with pytest.raises(ValueError, match="single tool-calls"):
        tok.apply_chat_template(two_calls, chat_template=LLAMA_31_TEMPLATE)
    with pytest.raises(Exception, match="single tool-calls"):  # transformers: jinja2.TemplateError
        _hf_render(hf, two_calls, chat_template=LLAMA_31_TEMPLATE)
    for unsafe in ("{{ messages.__class__.__mro__ }}", "{% set _ = messages.append(1) %}", "{{ messages[0].clear() }}"):
        with pytest.raises(ValueError, match="unsafe"):
            tok.apply_chat_template(CONVERSATIONS[0], chat_template=unsafe)
    with pytest.raises(ValueError, match="syntax"):
        tok.apply_chat_template(CONVERSATIONS[0], chat_template="{% if %}")
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(TypeError, match="tools"):
        tok.apply_chat_template(CONVERSATIONS[0], tools=[print])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages | tojson }}|{{ messages | tojson(indent=2) }}|{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=true) }}",
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% continue %}x{% endfor %}",
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}{{ eos_token }}",
        "  {% if add_generation_prompt %}\n    yes\n  {% endif %}\n"
        "{{ documents is none }} {{ custom | default('none') }}",
    ],
)
def test_jinja_environment_matches_transformers(tok: Tokenizer, hf, template: str) -> None:
    messages = CONVERSATIONS[2]
    kwargs = {"chat_template": template, "add_generation_prompt": True, "custom": "ü<b>"}
    assert tok.apply_chat_template(messages, **kwargs) == _hf_render(hf, messages, **kwargs)


def test_no_template_and_named_templates(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(CONVERSATIONS[0])
    # chat_template.jinja + additional_chat_templates/, as transformers saves several templates.
    (tmp_path / "chat_template.jinja").write_text("default:{{ messages[0].content }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools:{{ tools | length }}")
    t = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": []}):
        assert t.apply_chat_template(CONVERSATIONS[0], **kwargs) == _hf_render(hf, CONVERSATIONS[0], **kwargs)
    assert t.apply_chat_template(CONVERSATIONS[0], tools=TOOLS) == "tools:1"


def test_dummy_template_is_llama3_style(tok: Tokenizer) -> None:
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# --------------------------------------------------------------------------- incremental detokenizer


def _pieces(tok: Tokenizer) -> list[int]:
    """Token ids that exercise the detokenizer: the single bytes of multi-byte characters (drawn
    out of order they are also lone continuation bytes), merged tokens, and special tokens."""
    multi = tok.encode("😀👍🏽中文字é€\u200d", add_special_tokens=False)
    return sorted(set(multi) | {5, 300, 1000, 2000, 3000, BOS, EOT, VOCAB - 1})


def _first_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the stop string that completes first in ``text`` (longest on ties) and the cut text."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


@st.composite
def _generation(draw: st.DrawFn, pool: list[int]) -> tuple[list[int], list[int]]:
    ids = draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, VOCAB - 1)), max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    return ids, cuts


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_matches_full_decode(tok: Tokenizer, data: st.DataObject) -> None:
    ids, cuts = data.draw(_generation(_pieces(tok)))
    skip = data.draw(st.booleans())
    prompt = data.draw(st.sampled_from([[], tok.encode("Hi there"), tok.encode("😀")[:-1]]))
    full = tok.decode(ids, skip_special_tokens=skip)
    # Stop strings: pieces of the real text (so they hit, often across token boundaries) and noise.
    spans = st.tuples(st.integers(0, max(len(full) - 1, 0)), st.integers(1, 6))
    stops = [full[i : i + n] for i, n in data.draw(st.lists(spans, max_size=3))]
    stops = [s for s in stops if s] + data.draw(st.lists(st.text(min_size=1, max_size=3), max_size=2))
    include = data.draw(st.booleans())
    expected_text, expected_stop = _first_stop(full, stops, include)

    det = IncrementalDetokenizer(
        tok,
        prompt,
        skip_special_tokens=skip,
        spaces_between_special_tokens=data.draw(st.booleans()),
        stop=stops,
        include_stop_str_in_output=include,
    )
    streamed, stop = "", None
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):
        stop = det.add_tokens(ids[start:end])
        sofar = tok.decode(ids[:end], skip_special_tokens=skip)
        if stop is None:
            assert sofar.startswith(det.output_text) and not det.output_text.endswith("\ufffd")
            assert sofar.rstrip("\ufffd") == det.output_text  # everything final is visible
        streamed += det.get_delta(finished=False)
        assert expected_text.startswith(streamed)  # streamed text is never taken back
        if stop is not None:
            assert _first_stop(sofar, stops, include)[1] == stop  # reported by the call that completed it
            break
    if stop is None:
        stop = det.finish()
    streamed += det.get_delta(finished=True)
    assert (det.output_text, stop) == (expected_text, expected_stop)
    assert streamed == expected_text


class _PlainDecoder:
    """A tokenizer without the shared per-id texts: the detokenizer's general path (a decode per window)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.decode = tok.decode


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_cached_texts_match_the_general_path(tok: Tokenizer, data: st.DataObject) -> None:
    """One token per step (the server's steady state: the window's texts come from the per-id cache and,
    with a ByteLevel decoder, by concatenation) streams what a decode per window streams."""
    assert tok.decodes_by_concatenation
    pool = _pieces(tok)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, VOCAB + 9)), max_size=60))
    skip = data.draw(st.booleans())
    prompt = data.draw(st.sampled_from([[], tok.encode("Hi there"), tok.encode("😀")[:-1]]))
    stops = data.draw(st.lists(st.sampled_from(["a", "lo", "😀", "\ufffd", "<|eot_id|>", "é€"]), max_size=2))
    include = data.draw(st.booleans())
    dets = [
        IncrementalDetokenizer(t, prompt, skip_special_tokens=skip, stop=stops, include_stop_str_in_output=include)
        for t in (tok, _PlainDecoder(tok))
    ]
    for t in ids:
        stop = [d.add_tokens([t]) for d in dets]
        assert stop[0] == stop[1]
        assert dets[0].output_text == dets[1].output_text
        assert dets[0].get_delta(finished=False) == dets[1].get_delta(finished=False)
        if stop[0] is not None:
            break
    assert dets[0].get_delta(finished=True) == dets[1].get_delta(finished=True)
    assert dets[0].output_text == dets[1].output_text


def test_byte_level_texts_concatenate(tok: Tokenizer) -> None:
    """What `decodes_by_concatenation` promises, on every pair of the test vocabulary's pieces and
    random ids (special and unknown ones included)."""
    rng = random.Random(0)
    ids = _pieces(tok) + [rng.randrange(VOCAB + 10) for _ in range(150)]
    for skip in (False, True):
        alone = {t: tok.decode([t], skip_special_tokens=skip) for t in ids}
        for a in ids:
            for b in ids:
                if "\ufffd" not in alone[a] + alone[b]:
                    assert tok.decode([a, b], skip_special_tokens=skip) == alone[a] + alone[b]


def test_split_emoji_is_released_whole(tok: Tokenizer) -> None:
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) == 4  # one byte token per UTF-8 byte
    det = IncrementalDetokenizer(tok, tok.encode("Q:"))
    deltas = []
    for t in tok.encode("a", add_special_tokens=False) + emoji + tok.encode("b", add_special_tokens=False):
        det.add_tokens([t])
        deltas.append(det.get_delta(finished=False))
    assert deltas == ["a", "", "", "", "😀", "b"]


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀 then STOP and more", add_special_tokens=False)
    assert "STOP" not in tok.convert_ids_to_tokens(ids)  # the stop string spans several tokens
    for include, expected in [(False, "ok 😀 then "), (True, "ok 😀 then STOP")]:
        det = IncrementalDetokenizer(tok, tok.encode("Q:"), stop=["STOP"], include_stop_str_in_output=include)
        deltas, stops = [], []
        for t in ids:
            stops.append(det.add_tokens([t]))
            deltas.append(det.get_delta(finished=False))
            if stops[-1]:
                break
        assert stops[-1] == "STOP" and stops[:-1] == [None] * (len(stops) - 1)
        assert "".join(deltas) + det.get_delta(finished=True) == det.output_text == expected
        assert not any("\ufffd" in d for d in deltas)


def test_get_delta_holds_back_possible_stop_prefix(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["abc", "zz"])
    det.add_tokens(tok.encode("xyab", add_special_tokens=False))
    assert det.get_delta(finished=False) == "xy"  # max(len(stop)) - 1 = 2 held: "ab" may become "abc"
    det.add_tokens(tok.encode("d", add_special_tokens=False))
    assert det.get_delta(finished=False) == "a"
    assert det.get_delta(finished=True) == "bd"
    assert det.output_text == "xyabd"


def test_finish_releases_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("a€", add_special_tokens=False)[:-1]  # "a" + 2 of the 3 bytes of "€"
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(ids)
    assert (det.output_text, det.get_delta(finished=False)) == ("a", "a")
    assert det.get_delta(finished=True) == tok.decode(ids)[1:] == "\ufffd"
    assert det.output_text == tok.decode(ids) and det.finished


def test_decode_cost_per_token_is_constant(tok: Tokenizer) -> None:
    class CountingTokenizer:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def decode(self, ids, skip_special_tokens=True):
            self.lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    counting = CountingTokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog, 中文 😀. " * 60, add_special_tokens=False)
    det = IncrementalDetokenizer(counting, tok.encode("prompt " * 50), stop=["never"])
    for t in ids:
        det.add_tokens([t])
    assert det.output_text == tok.decode(ids)
    assert len(ids) > 1000 and max(counting.lengths) <= 8


def test_detokenizer_input_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])
    det = IncrementalDetokenizer(tok, [], stop=["b"])
    assert det.add_tokens(tok.encode("ab", add_special_tokens=False)) == "b"
    with pytest.raises(RuntimeError, match="finished"):
        det.add_tokens([5])
