"""Schema fuzzing: schemathesis draws bodies from the app's own OpenAPI document, both ones that fit it
and ones that do not; no request may yield a 5xx, and the engine must be healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

POST = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")]
GET = [("GET", "/v1/models"), ("GET", "/version"), ("GET", "/health"), ("GET", "/metrics")]
CASES = (
    [(m, p, GenerationMode.POSITIVE, 60) for m, p in POST]
    + [(m, p, GenerationMode.NEGATIVE, 60) for m, p in POST]
    + [(m, p, GenerationMode.POSITIVE, 3) for m, p in GET]
)  # GETs take no parameters: nothing to violate


@pytest.fixture(scope="module")
def fuzz_server(make_server):
    return make_server(max_model_len=64)  # every generation is short, whatever max_tokens and n say


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@pytest.mark.parametrize("method, path, mode, examples", CASES, ids=lambda x: str(x))
def test_no_request_is_a_server_error(api_schema, fuzz_server, method, path, mode, examples):
    @given(case=api_schema[path][method].as_strategy(mode))
    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:500]}"
        )

    check()


def test_still_healthy_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    assert not fuzz_server.engine.is_dead


_EXTREME_FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1e-30, 1e-5, 0.009, 1.0, 2.0, 1e30, -0.0, -1e-30]),
)
_EXTREME_INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 20, 21, 127, 128, 511, 512, 2**63 - 1, 2**64 - 1, -(2**63)]),
)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": _EXTREME_FLOATS,
        "top_p": _EXTREME_FLOATS,
        "min_p": _EXTREME_FLOATS,
        "repetition_penalty": _EXTREME_FLOATS,
        "presence_penalty": _EXTREME_FLOATS,
        "frequency_penalty": _EXTREME_FLOATS,
        "top_k": _EXTREME_INTS,
        "seed": _EXTREME_INTS,
        "n": st.integers(1, 8),
        "max_tokens": st.one_of(st.none(), st.integers(1, 70)),
        "min_tokens": _EXTREME_INTS,
        "logprobs": st.integers(0, 21),
        "stop_token_ids": st.lists(_EXTREME_INTS, max_size=3),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "stream": st.booleans(),
        "echo": st.booleans(),
    },
)


@given(fields=SAMPLING, prompt=st.one_of(st.text(max_size=40), st.lists(st.integers(0, 511), min_size=1, max_size=70)))
@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_extreme_sampling_values_never_break_the_engine(fuzz_server, fields, prompt):
    """Values SamplingParams accepts (huge penalties, top_k past the vocabulary, 64-bit seeds, ...) must
    run, and the others must be 400s; either way the engine lives on."""
    resp = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": prompt, **fields}, timeout=60)
    assert resp.status_code in (200, 400), resp.text[:500]
    if resp.status_code == 200 and fields.get("stream"):
        assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text, resp.text[-500:]
    assert not fuzz_server.engine.is_dead


# Strings a careless or hostile client sends: lone surrogates (which JSON can carry as \ud800 escapes
# but UTF-8 cannot encode), NUL and control characters, bidi overrides, stacks of combining marks,
# emoji whose bytes span several tokens, noncharacters, astral planes.
_SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
_EDGE_CHARS = st.sampled_from(
    ["\x00", "\x1b", "\u202e", "\u200f", "\u0301", "\ufeff", "\ufffe", "\U0010ffff", "😀", "👩‍👧"]
)
HOSTILE_TEXT = st.lists(st.one_of(st.characters(), _EDGE_CHARS, _SURROGATES), max_size=12).map("".join)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@given(
    text=HOSTILE_TEXT,
    where=st.sampled_from(["prompt", "stop", "chat", "chat_part", "tokenize", "tokenize_chat"]),
    stream=st.booleans(),
)
@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_hostile_strings_are_served_or_a_400_naming_the_field(fuzz_server, text, where, stream):
    """Text the tokenizer can take is served; text it cannot (a lone surrogate) is a 400 that names the
    field, never a 500, and the keep-alive connection stays usable."""
    msgs = [{"role": "user", "content": text}]
    path, body, param = {
        "prompt": ("/v1/completions", {"prompt": text}, "prompt"),
        "stop": ("/v1/completions", {"prompt": "x", "stop": [text or "s"]}, "stop.0"),
        "chat": ("/v1/chat/completions", {"messages": msgs}, "messages.0.content"),
        "chat_part": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
            "messages.0.content.0.text",
        ),
        "tokenize": ("/tokenize", {"prompt": text}, "prompt"),
        "tokenize_chat": ("/tokenize", {"messages": msgs}, "messages.0.content"),
    }[where]
    if path != "/tokenize":
        body = {**body, "max_tokens": 2, "stream": stream}
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        # json.dumps escapes a lone surrogate as \udXXX, as a JavaScript client would send it
        resp = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        if _has_surrogate(json.loads(json.dumps(text))):  # (a high + low pair decodes to one character)
            assert resp.status_code == 400, resp.text[:300]
            assert resp.json()["error"]["param"] == param, resp.text[:300]
        else:  # (an empty prompt still has its BOS token)
            assert resp.status_code == 200, resp.text[:300]
            if stream and path != "/tokenize":
                assert resp.text.rstrip().endswith("data: [DONE]") and '"error"' not in resp.text, resp.text[-300:]
        assert client.get("/health").status_code == 200  # the same connection
    assert not fuzz_server.engine.is_dead
