"""logit_bias, allowed_token_ids and bad_words through the OpenAI-compatible API (completions and chat).

Hand-computed cases on the byte-level tokenizer of the tiny checkpoint (one letter, one token): a +100
bias on a letter's token makes greedy decoding repeat that letter; allowed letters are the only ones
in the text; a bad word beats a +100 bias on its own token. Error cases are in test_errors.py."""

from __future__ import annotations

import re

import httpx

CHAT = [{"role": "user", "content": "hi"}]


def _token(server, letter: str) -> int:
    resp = httpx.post(server.url + "/tokenize", json={"prompt": letter, "add_special_tokens": False}, timeout=30)
    (token,) = resp.json()["tokens"]
    return token


def _complete(server, path: str, **body) -> str:
    base = {"prompt": "hello"} if path == "/v1/completions" else {"messages": CHAT}
    body = {**base, "temperature": 0, "max_tokens": 6, "ignore_eos": True, **body}
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def test_logit_bias_and_allowed_token_ids(server):
    q = _token(server, "q")
    a, b = _token(server, "a"), _token(server, "b")
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert _complete(server, path, logit_bias={str(q): 100}) == "q" * 6
        text = _complete(server, path, allowed_token_ids=[a, b], temperature=1.0, seed=1)
        assert re.fullmatch("[ab]{6}", text), text


def test_bad_words_beat_a_bias(server):
    q, z = _token(server, "q"), _token(server, "z")
    for path in ("/v1/completions", "/v1/chat/completions"):
        text = _complete(server, path, logit_bias={str(q): 100, str(z): 90}, bad_words=["q"])
        assert text == "z" * 6, text
