"""Happy paths through the official `openai` client against a live server on loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from tinyvllm import LLM

from .conftest import ENGINE_DEFAULTS, MODEL_NAME


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text per choice, finish_reason per choice, usage) of a streamed completion or chat."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_models_health_version(server, client):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.max_model_len == ENGINE_DEFAULTS["max_model_len"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_streamed_equals_non_streamed(client):
    kw = dict(
        model=MODEL_NAME,
        prompt="The list type",
        max_tokens=20,
        temperature=0.9,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20 and full.usage.total_tokens == full.usage.prompt_tokens + 20
    texts, reasons, usage = _stream_text(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: full.choices[0].text} and reasons == {0: "length"}
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_completion_tokens=16,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 16
    texts, reasons, usage = _stream_text(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: full.choices[0].message.content} and reasons == {0: "length"}
    assert usage.model_dump() == full.usage.model_dump()


def test_n_stop_and_vllm_extras(client):
    greedy = dict(model=MODEL_NAME, prompt="The", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**greedy).choices[0].text
    assert len(text) > 6
    stop = text[4:6]
    cut = client.completions.create(**greedy, stop=[stop]).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    many = client.completions.create(
        model=MODEL_NAME,
        prompt="Once",
        n=3,
        max_tokens=8,
        seed=5,
        temperature=1.0,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 4},
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == 24
    streamed, _, _ = _stream_text(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Once",
            n=3,
            max_tokens=8,
            seed=5,
            temperature=1.0,
            stream=True,
            extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 4},
        )
    )
    assert streamed == {c.index: c.text for c in many.choices}


def test_token_id_prompts_batches_and_stop_token_ids(server, client):
    ids = client.completions.create(
        model=MODEL_NAME, prompt=[[1, 2, 3], [4, 5]], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()
    out = client.completions.create(
        model=MODEL_NAME, prompt=tok["tokens"], max_tokens=6, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    same = client.completions.create(
        model=MODEL_NAME, prompt="hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == same.choices[0].text
    third = out.choices[0].logprobs.tokens[2]
    stop_id = httpx.post(server.url + "/tokenize", json={"prompt": third, "add_special_tokens": False}).json()["tokens"]
    if len(stop_id) == 1:  # a token that is its own text: stopping on its id ends before three tokens
        stopped = client.completions.create(
            model=MODEL_NAME,
            prompt="hello",
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "stop_token_ids": stop_id},
        )
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3


def test_logprobs_shapes(client):
    comp = client.completions.create(
        model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and top[tok] == val and val == max(top.values())  # greedy: the top token
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)


def test_tokenize_detokenize_round_trip(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == ENGINE_DEFAULTS["max_model_len"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"][1:]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


def test_64_concurrent_streams_match_llm_generate(server, model_dir):
    """Seeded streams, batched as they arrive, equal LLM.generate's batch: the two engines' logits may
    differ by rounding, which changes a seeded draw only at a near-tie (tests/helpers.py)."""
    prompts = [f"Request number {i} says" for i in range(64)]
    seeds = list(range(100, 164))

    async def one(client: openai.AsyncOpenAI, prompt: str, seed: int) -> tuple[str, str]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, reason = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason

    async def run_all() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in zip(prompts, seeds)))

    got = asyncio.run(run_all())
    llm = LLM(model=str(model_dir), **ENGINE_DEFAULTS)
    defaults = llm.get_default_sampling_params()  # generation_config.json's top_p, as the server uses
    want = llm.generate(
        prompts,
        [defaults.replace(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in seeds],
        use_tqdm=False,
    )
    assert got == [(w.outputs[0].text, "length") for w in want]


def test_metrics_count_a_streamed_request(server, client):
    """TTFT, ITL and e2e histograms and the token counters, computed from the per-step deltas and stats."""
    names = (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    )

    def counts() -> list[float]:
        return [server.metric(n) if n in httpx.get(server.url + "/metrics").text else 0.0 for n in names]

    before = counts()
    stream = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    after = counts()
    assert [a - b for a, b in zip(after, before)] == [1, 4, 1, 5, 3]


def test_choices_that_finish_at_different_steps_stream_one_finish_each(client, model_dir):
    """n=2 where a stop token ends choice 0 early: each choice's finish_reason is sent once, and the
    streamed texts equal the non-streamed ones. The stop token is picked from another engine's seeded
    draws, which the server's equal (a draw changes only at a near-tie, tests/helpers.py)."""
    llm = LLM(model=str(model_dir), **ENGINE_DEFAULTS)
    params = llm.get_default_sampling_params().replace(n=2, max_tokens=12, temperature=1.0, seed=21, ignore_eos=True)
    first, second = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs
    stop = next(t for t in first.token_ids[2:8] if t not in second.token_ids and t not in first.token_ids[:2])
    kw = dict(
        model=MODEL_NAME,
        prompt=[3, 4, 5],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=21,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop]},
    )
    full = client.completions.create(**kw)
    assert {c.index: c.finish_reason for c in full.choices} == {0: "stop", 1: "length"}
    finishes: list[tuple[int, str]] = []
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.append((c.index, c.finish_reason))
    assert sorted(finishes) == [(0, "stop"), (1, "length")]
    assert texts == {c.index: c.text for c in full.choices}


def test_engine_chat_template_and_generation_config_reach_the_api_process(make_server, tmp_path):
    """--chat-template and --override-generation-config set in the engine's process hold in the API
    process too: the chat prompt it renders, and the defaults a request without sampling fields gets
    (greedy here, against the model's own temperature 0.6)."""
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    live = make_server("process", chat_template=str(path), override_generation_config={"temperature": 0.0})
    body = {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}
    ids = httpx.post(live.url + "/tokenize", json=body).json()["tokens"]
    assert httpx.post(live.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "<<hi>>"

    def tokens(**fields):
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 16, "seed": 1, "ignore_eos": True, **fields}
        r = httpx.post(live.url + "/v1/completions", json={**body, "logprobs": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens() == tokens(temperature=0.0) != tokens(temperature=0.6)


def _with_generation_config(model_dir: Path, out: Path, **fields) -> str:
    """A checkpoint that is the test model (its files linked) with `fields` added to its
    generation_config.json."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return str(out)


def _generated(url: str, route: str, **body) -> tuple[int, str]:
    """(completion_tokens, finish_reason) of one request that ignores EOS (it stops on a length only)."""
    r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL_NAME, "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]


def test_a_request_without_max_tokens_gets_the_generation_config_s_max_new_tokens(make_server, model_dir, tmp_path):
    """The checkpoint's generation_config.json sets max_new_tokens: it is the max_tokens of a request
    that sets none, as with vLLM's server (and `LLM`); a request's own value wins, /v1/completions keeps
    OpenAI's default of 16 unless max_tokens is null, and the end of the context still stops generation."""
    default = 7
    live = make_server("process", model=_with_generation_config(model_dir, tmp_path / "model", max_new_tokens=default))
    messages = [{"role": "user", "content": "hi"}]
    assert _generated(live.url, "chat/completions", messages=messages) == (default, "length")
    assert _generated(live.url, "chat/completions", messages=messages, max_tokens=None) == (default, "length")
    assert _generated(live.url, "chat/completions", messages=messages, max_tokens=11) == (11, "length")
    assert _generated(live.url, "chat/completions", messages=messages, max_completion_tokens=3) == (3, "length")
    assert _generated(live.url, "completions", prompt="x") == (16, "length")
    assert _generated(live.url, "completions", prompt="x", max_tokens=None) == (default, "length")
    assert _generated(live.url, "completions", prompt="x", max_tokens=12) == (12, "length")
    room = 4  # fewer tokens left in the context than the default
    prompt = [5] * (ENGINE_DEFAULTS["max_model_len"] - room)
    assert _generated(live.url, "completions", prompt=prompt, max_tokens=None) == (room, "length")


def test_a_max_new_tokens_given_on_the_command_line_caps_every_request(make_server):
    """--override-generation-config '{"max_new_tokens": N}' (or a --generation-config directory whose
    config sets it) is the default max_tokens and, as with vLLM's server, a cap on the request's own."""
    cap = 5
    live = make_server("process", override_generation_config={"max_new_tokens": cap})
    messages = [{"role": "user", "content": "hi"}]
    assert _generated(live.url, "chat/completions", messages=messages) == (cap, "length")
    assert _generated(live.url, "chat/completions", messages=messages, max_tokens=11) == (cap, "length")
    assert _generated(live.url, "chat/completions", messages=messages, max_completion_tokens=3) == (3, "length")
    assert _generated(live.url, "completions", prompt="x") == (cap, "length")  # OpenAI's 16, capped
    assert _generated(live.url, "completions", prompt="x", max_tokens=2) == (2, "length")
