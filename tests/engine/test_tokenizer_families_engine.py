"""The engine with a Qwen-style tokenizer that is smaller than the model's vocabulary (as Qwen3's 151,669
tokens for 151,936 embedding rows): ids past the tokenizer decode to "" in text and logprobs and never
fail a step; EOS comes from tokenizer, config.json and generation_config.json together; chat template
kwargs reach the template through LLM.chat and the server."""

from __future__ import annotations

import json

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.models.dummy_tokenizer import generation_token_ids, special_token_ids, write_dummy_tokenizer

ROWS = 640  # the model's vocab_size
TOKENS = 512  # the tokenizer's size: ids 512..639 have no token
ENDOFTEXT, IM_END = TOKENS - 26, TOKENS - 24  # Qwen3's layout: <|endoftext|>, <|im_start|>, <|im_end|>, ...


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with ROWS embedding rows and a Qwen3-style tokenizer of TOKENS tokens; config.json and
    generation_config.json carry Qwen's token ids (eos <|im_end|>; generation eos [<|im_end|>, <|endoftext|>])."""
    path = tmp_path_factory.mktemp("padded-vocab")
    config = make_config("tiny", vocab_size=ROWS)
    write_dummy_checkpoint(path, config, seed=3, init_std=0.02, dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink()
    write_dummy_tokenizer(path, {**config, "model_type": "qwen3", "vocab_size": TOKENS})
    config.update(special_token_ids(TOKENS, "qwen3"))
    (path / "config.json").write_text(json.dumps(config))
    generation = json.loads((path / "generation_config.json").read_text())
    generation.update(generation_token_ids(TOKENS, "qwen3"))
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", max_model_len=256, max_num_batched_tokens=128)


def test_ids_past_the_tokenizer_decode_to_nothing(llm):
    tok = llm.get_tokenizer()
    assert tok.vocab_size == TOKENS and llm.llm_engine.model_config.vocab_size == ROWS
    base = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=5)
    params = [
        base.replace(seed=1),  # FINAL_ONLY without stop strings: decoded once at the end
        base.replace(seed=2, stop=["\x00never"]),  # stop strings: the incremental detokenizer
        base.replace(seed=3, n=2),
    ]
    outs = llm.generate(["Hello", "The list type", "x"], params, use_tqdm=False)
    past = 0
    for out in outs:
        for o in out.outputs:
            ids = o.token_ids
            assert len(ids) == 32 and o.finish_reason == "length"
            past += sum(i >= TOKENS for i in ids)
            assert o.text == tok.decode(ids) == tok.decode([i for i in ids if i < TOKENS])
            assert len(o.logprobs) == 32
            for entry in o.logprobs:
                for token_id, lp in entry.items():
                    want = "" if token_id >= TOKENS else tok.decode([token_id], skip_special_tokens=False)
                    assert lp.decoded_token == want
    assert past > 0  # the model did produce ids the tokenizer lacks (near-uniform over 640 ids)


def test_eos_list_combines_tokenizer_config_and_generation_config(llm):
    """<|im_end|> (tokenizer, config.json) and <|endoftext|> (generation_config.json only) both end a
    completion: a run stops at the first of them that the same seeded run without EOS produces."""
    engine = llm.llm_engine
    assert set(engine.eos_token_ids) == {IM_END, ENDOFTEXT}
    # Seeds whose runs meet <|im_end|> (seed 7) and <|endoftext|> (seed 13) first, found by a search.
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in (7, 13)]
    free = [o.outputs[0].token_ids for o in llm.generate(["Hi"] * len(params), params, use_tqdm=False)]
    firsts = {}
    for s, ids in enumerate(free):
        hit = next((k for k, i in enumerate(ids) if i in (IM_END, ENDOFTEXT)), None)
        if hit is not None:
            firsts.setdefault(ids[hit], (s, hit))
    assert set(firsts) == {IM_END, ENDOFTEXT}  # precondition: each id comes first in one run
    for token, (s, hit) in firsts.items():
        (out,) = llm.generate("Hi", params[s].replace(ignore_eos=False), use_tqdm=False)
        o = out.outputs[0]
        assert o.token_ids == free[s][: hit + 1] and o.token_ids[-1] == token
        assert o.finish_reason == "stop" and o.stop_reason is None


def test_chat_template_kwargs_reach_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi!"}]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (thinking,) = llm.chat(messages, params, use_tqdm=False)
    (off,) = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert thinking.prompt == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert off.prompt == thinking.prompt + "<think>\n\n</think>\n\n"
    assert off.prompt_token_ids == tok.encode(off.prompt, add_special_tokens=False)
    # As in vLLM, the kwargs override add_generation_prompt; they cannot pick the template.
    (bare,) = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    assert bare.prompt == "<|im_start|>user\nHi!<|im_end|>\n"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    (with_tools,) = llm.chat(messages, params, use_tqdm=False, tools=tools)
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in with_tools.prompt
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(messages, params, use_tqdm=False, chat_template_kwargs={"chat_template": "{{ 1 }}"})


def test_server_chat_template_kwargs_and_logprobs_past_the_tokenizer(model_dir):
    pytest.importorskip("fastapi")
    from tests.server.conftest import ENGINE_DEFAULTS, start_server
    from tinyvllm.engine.args import EngineArgs
    from tinyvllm.engine.async_llm import AsyncLLMEngine
    from tinyvllm.engine.llm_engine import LLMEngine

    core = LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))
    tok = core.tokenizer
    live = start_server(AsyncLLMEngine(core).start())
    try:
        with live.client() as c:
            messages = [{"role": "user", "content": "Hi!"}]
            prompt = tok.apply_chat_template(messages, enable_thinking=False)
            body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
            r = c.post("/tokenize", json=body)
            assert r.status_code == 200 and r.json()["tokens"] == tok.encode(prompt, add_special_tokens=False)
            request = {
                **body,
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": 5,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 5,
            }
            r = c.post("/v1/chat/completions", json=request)
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
            content = data["choices"][0]["logprobs"]["content"]
            assert len(content) == 40
            items = [item for pos in content for item in [pos, *pos["top_logprobs"]]]
            assert any(item["token"] == "" and item["bytes"] == [] for item in items)  # ids past the tokenizer
            r = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        live.stop()
