"""Prompt logprobs through the server: completions' `echo` with `logprobs` (the prompt's tokens first in
OpenAI's legacy logprobs shape, streamed and not) and vLLM's `prompt_logprobs` extra field on completions
and chat, each equal (up to rounding) to what LLM.generate returns for the same prompt."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.helpers import LOGPROB_ATOL
from tinyvllm import LLM, SamplingParams

from .conftest import ENGINE_DEFAULTS, MODEL_NAME

PROMPT = "The list type is a"


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), **ENGINE_DEFAULTS)


def offline(llm: LLM, prompt, k: int, logprobs: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, logprobs=logprobs)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def token_text(llm: LLM, token_id: int) -> str:
    return llm.get_tokenizer().decode([token_id], skip_special_tokens=False)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=LOGPROB_ATOL)


def check_echo_logprobs(lp: dict, want, llm: LLM, k: int, streamed: bool = False) -> None:
    """The legacy logprobs of an echoed completion against LLM.generate's output `want`: the prompt's
    tokens first (the first one's logprob and top_logprobs null), then the generated ones; text_offset
    the running length of the token texts (streamed: up to the first generated token; a stream's later
    chunks start at the length of the text sent before them, which leaves out special tokens)."""
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    texts = [token_text(llm, t) for t in ids]
    assert lp["tokens"] == texts
    n = len(want.prompt_token_ids) + 1 if streamed else len(ids)
    assert lp["text_offset"][:n] == [sum(map(len, texts[:i])) for i in range(n)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        assert close(lp["token_logprobs"][i], entry[ids[i]].logprob), i
        top = lp["top_logprobs"][i]
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]
        want_top = {token_text(llm, t): v.logprob for t, v in ranked}
        want_top.setdefault(texts[i], entry[ids[i]].logprob)
        assert top.keys() == want_top.keys(), i
        assert all(close(top[t], want_top[t]) for t in top)


def sse_choices(text: str) -> list[dict]:
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return [c for chunk in chunks for c in chunk["choices"]]


def test_echo_with_logprobs_streamed_and_not(server, llm):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body.update(echo=True, logprobs=2)
    want = offline(llm, PROMPT, 2, logprobs=2)
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["text"] == PROMPT + want.outputs[0].text
    check_echo_logprobs(choice["logprobs"], want, llm, 2)
    assert "prompt_logprobs" not in choice  # the field only when asked for

    streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for c in sse_choices(streamed.text):
        text += c["text"]
        for key in merged:
            merged[key] += c["logprobs"][key]
    assert text == choice["text"]
    check_echo_logprobs(merged, want, llm, 2, streamed=True)


def test_prompt_logprobs_field_on_completions_and_chat(server, llm):
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}},
    the prompt token and the k most likely; with echo's logprobs asking for fewer, each gets its k."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(server.url + "/v1/completions", json={**body, "prompt_logprobs": 3, "echo": True, "logprobs": 1})
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    want = offline(llm, PROMPT, 3, logprobs=1)
    check_echo_logprobs(choice["logprobs"], want, llm, 1)
    check_field(choice["prompt_logprobs"], want.prompt_token_ids, want.prompt_logprobs, 3)

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
    resp = httpx.post(server.url + "/v1/chat/completions", json={**chat, "prompt_logprobs": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    want = llm.chat(chat["messages"], params, use_tqdm=False)[0]
    assert len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    check_field(out["prompt_logprobs"], want.prompt_token_ids, want.prompt_logprobs, 0)


def check_field(got: list, ids: list[int], want: list, k: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert str(ids[i]) in entry and len(entry) in (k, k + 1)
        for t, v in entry.items():
            w = want[i][int(t)]
            assert close(v["logprob"], w.logprob) and v["rank"] == w.rank and v["decoded_token"] == w.decoded_token
            assert int(t) == ids[i] or v["rank"] <= k


@pytest.mark.parametrize(
    "path, extra",
    [
        ("/v1/completions", {"prompt_logprobs": -1}),
        ("/v1/completions", {"prompt_logprobs": 21}),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"prompt_logprobs": 99}),
        ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}),
    ],
)
def test_bad_prompt_logprobs_are_400s_naming_the_field(server, path, extra):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    resp = httpx.post(server.url + path, json={**body, **extra}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_logprobs"


def test_echo_logprobs_above_the_limit_is_a_400(server):
    resp = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 21}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"
