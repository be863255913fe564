"""Every error case in OpenAI's JSON shape with its status code, through raw httpx; none stops the engine."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ENGINE_DEFAULTS, MODEL_NAME

LIMIT = ENGINE_DEFAULTS["max_model_len"]
CHAT = [{"role": "user", "content": "hi"}]


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_k": -3}, "top_k"),
        ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"512": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias.5"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": [3, 600]}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "x", "allowed_token_ids": ["3"]}, "allowed_token_ids.0"),
        ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words"),
        ("/v1/completions", {"prompt": "x", "bad_words": "word"}, "bad_words"),
        ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [-2]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1000": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [-1]]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "", "add_special_tokens": False}, "prompt"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "usr", "content": "x"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ],
)
def test_invalid_field_is_a_400_naming_it(server, path, body, param):
    err = _error(httpx.post(server.url + path, json=body, timeout=30), 400)
    assert err["param"] == param, err


def test_malformed_bodies_are_400s(server):
    for content in (b"{not json", b"[1, 2]", b"", b'"a string"'):
        _error(
            httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}),
            400,
        )


def test_too_long_prompt_gives_both_numbers(server):
    err = _error(httpx.post(server.url + "/v1/completions", json={"prompt": [1] * (LIMIT + 5)}), 400)
    assert str(LIMIT) in err["message"] and str(LIMIT + 5) in err["message"] and err["param"] == "prompt"
    err = _error(
        httpx.post(
            server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 400}]}
        ),
        400,
    )
    assert str(LIMIT) in err["message"] and err["param"] == "messages"
    err = _error(httpx.post(server.url + "/v1/completions", json={"prompt": [1] * 10, "max_tokens": LIMIT}), 400)
    assert str(LIMIT) in err["message"] and "10" in err["message"] and err["param"] == "max_tokens"


def test_unknown_model_is_a_404(server):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = _error(httpx.post(server.url + path, json={**body, "model": "gpt-4"}), 404)
        assert "gpt-4" in err["message"] and err["param"] == "model"
    _error(httpx.get(server.url + "/v1/nothing-here"), 404)
    _error(httpx.get(server.url + "/v1/completions"), 405)


def test_the_engine_survives_all_of_it(server):
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3


def test_api_key(make_server):
    live = make_server(api_key="s3cret")
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    _error(httpx.post(live.url + "/v1/completions", json=body), 401)
    _error(httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
    _error(httpx.get(live.url + "/v1/models"), 401)
    good = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert httpx.get(live.url + "/health").status_code == 200  # only /v1/* is protected, as in vLLM


def test_cors_preflight_and_headers(make_server):
    """A page of another origin may call the API (vLLM's defaults: every origin); the preflight needs
    no key, and a 401 carries the CORS headers so that the page can read it."""
    live = make_server(api_key="s3cret")
    origin = {"Origin": "https://app.example"}
    pre = httpx.options(
        live.url + "/v1/chat/completions",
        headers={**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"},
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] in ("*", "https://app.example")
    assert "POST" in pre.headers["access-control-allow-methods"]
    denied = httpx.get(live.url + "/v1/models", headers=origin)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    ok = httpx.get(live.url + "/v1/models", headers={**origin, "Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


def test_a_stream_gets_the_cors_headers(make_server):
    """An SSE response's body messages skip the middlewares that only look at a response's start
    (`guard.BODY_SEND`): the start still passes them (the key check, the CORS headers)."""
    live = make_server(api_key="s3cret")
    headers = {"Origin": "https://app.example", "Authorization": "Bearer s3cret"}
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    denied = httpx.post(live.url + "/v1/completions", json=body, headers={"Origin": "https://app.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"


def test_cors_restricted_to_the_allowed_origins(make_server):
    live = make_server(server_kw={"allowed_origins": ["https://good.example"]})
    pre = {"Access-Control-Request-Method": "POST"}
    bad = httpx.options(live.url + "/v1/completions", headers={"Origin": "https://evil.example", **pre})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    good = httpx.options(live.url + "/v1/completions", headers={"Origin": "https://good.example", **pre})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "https://good.example"
    plain = httpx.get(live.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_cors_flags_parse_json_lists():
    from tinyvllm.entrypoints.cli import build_parser, extra_subcommands

    parser = build_parser(extra_subcommands())
    ns = parser.parse_args(["serve", "--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    assert ns.allowed_origins == ["https://a.example"] and ns.allow_credentials and ns.allowed_methods == ["*"]
    for bad in ('"https://a.example"', "[1]", "not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--allowed-origins", bad])
