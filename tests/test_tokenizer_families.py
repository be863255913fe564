"""Qwen2.5 / Qwen3 / Mistral tokenizers and chat templates (the dummy checkpoints' files), checked
against transformers reading the same files, and the template environment's transformers-5 details."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tinyvllm.chat_template import merge_template_kwargs
from tinyvllm.models.dummy_tokenizer import (
    QWEN3_ADDED_TOKENS,
    generation_token_ids,
    special_token_ids,
    tokenizer_family,
    write_dummy_tokenizer,
)
from tinyvllm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 2048
TEXTS = [
    "",
    "Hello world!",
    "  leading  and trailing  ",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindent 1234567",
    "emoji 😀👍🏽 and CJK 中文字符, accents éàü, NFC e\u0301 \u212b",
    "specials <|im_start|>user\nhi<|im_end|>\n<think>x</think><tool_call>{}</tool_call>",
    "<s>[INST] q [/INST] a</s> [INST] q2 [/INST]<unk>",
]


def _config(model_type: str, vocab_size: int = VOCAB, **extra) -> dict:
    return {"model_type": model_type, "vocab_size": vocab_size, "max_position_embeddings": 4096, **extra}


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "mistral"])
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    d = tmp_path_factory.mktemp(request.param)
    write_dummy_tokenizer(d, _config(request.param))
    return request.param, d


@pytest.fixture(scope="module")
def pair(family_dir):
    model_type, d = family_dir
    return model_type, Tokenizer.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)


def test_special_tokens_match_transformers(pair) -> None:
    model_type, tok, hf = pair
    assert tok.vocab_size == len(hf) == VOCAB
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.all_special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    ids = special_token_ids(VOCAB, model_type)
    if model_type == "mistral":
        assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) == (ids["bos_token_id"], ids["eos_token_id"])
        assert tok.encode("x")[0] == 1  # BOS added
    else:
        assert tok.bos_token_id is None  # Qwen adds no BOS
        assert tok.encode("x") == tok.encode("x", add_special_tokens=False)
        base = VOCAB - (26 if model_type == "qwen3" else 22)
        assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [base, base + 1, base + 2]
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (base, base + 2) == (base, tok.eos_token_id)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text: str) -> None:
    _, tok, hf = pair
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_random_ids_matches_transformers(pair) -> None:
    _, tok, hf = pair
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("legacy", [True, False, None])
def test_sentencepiece_pipeline_follows_transformers(tmp_path: Path, legacy: bool | None) -> None:
    """transformers 5 rebuilds LlamaTokenizer's pre-tokenizer from ``legacy`` (▁ before every piece
    between added tokens, or the first only); ours must give the same ids for either setting."""
    import json

    write_dummy_tokenizer(tmp_path, _config("mistral"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if legacy is None:
        del config["legacy"]
    else:
        config["legacy"] = legacy
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in [*TEXTS, "</s> [INST] turn two", " x<s> y"]:
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_full_size_qwen3_has_the_real_ids(tmp_path: Path) -> None:
    """At Qwen3's vocab_size (151,936) the tokenizer has Qwen3's 151,669 tokens, each special one at its
    published id, and 267 embedding rows without a token."""
    write_dummy_tokenizer(tmp_path, _config("qwen3", 151936))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.vocab_size == 151669
    real = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657}
    real |= {"</tool_call>": 151658, "<think>": 151667, "</think>": 151668}
    for token, i in real.items():
        assert tok.encode(token) == [i], token
    assert [t for t, _ in QWEN3_ADDED_TOKENS] == [tok.token_texts([151643 + k])[0] for k in range(26)]
    assert tok.eos_token_id == 151645 and tok.bos_token_id is None
    assert special_token_ids(151936, "qwen3") == {"bos_token_id": 151643, "eos_token_id": 151645}
    gen = generation_token_ids(151936, "qwen3")
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643
    # <think> is not special: it survives skip_special_tokens, <|im_end|> does not.
    assert tok.decode([151667, 151645], skip_special_tokens=True) == "<think>"
    assert tok.token_texts([151668, 151669, 151935, 10**9]) == ["</think>", "", "", ""]


def test_unknown_model_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"gpt2.*supported"):
        tokenizer_family("gpt2")


# --------------------------------------------------------------------------- chat templates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city (°C)",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"}],
    [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning": "an alias of reasoning_content"},
    ],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "21C"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny, 21C.", "tool_calls": None},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ],
]
KWARGS = [{}, {"tools": TOOLS}, {"enable_thinking": False}, {"enable_thinking": True}]


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(pair, conversation: int) -> None:
    model_type, tok, hf = pair
    messages = CONVERSATIONS[conversation]
    for kwargs in KWARGS:
        for add_generation_prompt in (True, False):
            try:
                want = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
                )
            except Exception as e:  # the template rejects the conversation (Mistral: roles must alternate)
                assert model_type == "mistral" and "alternate" in str(e)
                with pytest.raises(ValueError, match="alternate"):
                    tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
                continue
            got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            assert got == want, (kwargs, add_generation_prompt)
            assert tok.encode(got, add_special_tokens=False) == hf.encode(got, add_special_tokens=False)


def test_chat_templates_render_the_published_formats(pair) -> None:
    """Hand-written expectations of the published formats."""
    model_type, tok, _ = pair
    hi = [{"role": "user", "content": "Hi!"}]
    if model_type == "qwen3":
        assert tok.apply_chat_template(hi) == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        off = tok.apply_chat_template(hi, enable_thinking=False)
        assert off == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        # Reasoning is kept only after the last user query.
        text = tok.apply_chat_template(CONVERSATIONS[3], add_generation_prompt=False)
        assert "old thoughts" not in text
        assert text.endswith(
            "<|im_start|>assistant\n<think>\nan alias of reasoning_content\n</think>\n\nA2<|im_end|>\n"
        )
        tools = tok.apply_chat_template(CONVERSATIONS[4], add_generation_prompt=False, tools=TOOLS)
        assert tools.startswith("<|im_start|>system\nsys\n\n# Tools\n\nYou may call one or more functions")
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tools
        assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response>\n<tool_response>\nsunny\n" in tools
    elif model_type == "qwen2":
        assert tok.apply_chat_template(hi) == (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        # transformers' output for Mistral-7B-Instruct-v0.1's template (as published in mistral.rs's tests).
        assert tok.apply_chat_template(CONVERSATIONS[5]) == (
            "<s>[INST] Hello [/INST]Hi there</s> [INST] Who are you [/INST]   I am an assistant   </s> "
            "[INST] Another question [/INST]"
        )


def test_template_environment_details_match_transformers(pair) -> None:
    """transformers 5 drops None-valued message keys, aliases reasoning fields, has `dict`, and refuses
    underscore names on a namespace."""
    _, tok, hf = pair
    template = (
        "{% for m in messages %}[{{ m.role }}|{{ 'tool_calls' in m }}|{{ m.reasoning_content }}|{{ m.thinking }}]"
        "{% endfor %}{% set d = dict(a=1, b=[2]) %}{{ d | tojson }}{{ dict.fromkeys(['x']) | tojson }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    )
    messages = [
        {"role": "user", "content": "u", "tool_calls": None},
        {"role": "assistant", "content": "a", "reasoning": "r", "tool_calls": [TOOL_CALL]},
    ]
    got = tok.apply_chat_template(messages, chat_template=template)
    assert got == hf.apply_chat_template(messages, tokenize=False, chat_template=template, add_generation_prompt=True)
    assert got.startswith("[user|False||][assistant|True|r|r]")
    bad = "{% set ns = namespace(_secret=1) %}{{ ns }}"
    with pytest.raises(ValueError, match="underscore"):
        tok.apply_chat_template(messages, chat_template=bad)
    with pytest.raises(Exception, match="underscore"):
        hf.apply_chat_template(messages, tokenize=False, chat_template=bad)


def test_merge_template_kwargs() -> None:
    base = {"add_generation_prompt": True, "tools": None}
    assert merge_template_kwargs(base, None) == base
    merged = merge_template_kwargs(base, {"enable_thinking": False, "add_generation_prompt": False})
    assert merged == {"add_generation_prompt": False, "tools": None, "enable_thinking": False}
    for key in ("chat_template", "tokenize", "messages"):
        with pytest.raises(ValueError, match=key):
            merge_template_kwargs(base, {key: "x"})
    with pytest.raises(TypeError):
        merge_template_kwargs(base, ["enable_thinking"])  # type: ignore[arg-type]
