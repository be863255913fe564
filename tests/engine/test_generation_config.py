"""Engine-wide defaults a user sets (vLLM's --generation-config, --override-generation-config and
--chat-template): where the default SamplingParams come from, and which chat template renders."""

from __future__ import annotations

import json

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli
from tinyvllm.engine.async_llm import EngineInfo
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_dummy_checkpoint(path, make_config("tiny"), seed=0, dtype="float32")
    return path


def _defaults(model_dir, **kw) -> SamplingParams:
    return LLM(model=str(model_dir), **ENGINE, **kw).get_default_sampling_params()


def test_generation_config_sources(model_dir, tmp_path):
    written = json.loads((model_dir / "generation_config.json").read_text())
    assert (written["temperature"], written["top_p"]) == (0.6, 0.9)  # the Llama instruct defaults
    auto = _defaults(model_dir)
    assert (auto.temperature, auto.top_p) == (0.6, 0.9)
    plain = SamplingParams()
    vllm = _defaults(model_dir, generation_config="vllm")
    assert (vllm.temperature, vllm.top_p, vllm.top_k) == (plain.temperature, plain.top_p, plain.top_k)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7, "max_new_tokens": 5}))
    from_dir = _defaults(model_dir, generation_config=str(other))
    assert (from_dir.temperature, from_dir.top_k, from_dir.max_tokens, from_dir.top_p) == (0.3, 7, 5, plain.top_p)


def test_max_new_tokens_sets_the_server_s_default_and_cap_of_max_tokens(model_dir, tmp_path):
    """EngineInfo's (default_max_tokens, max_tokens_cap), what the OpenAI server gives a request without
    max_tokens and the most it lets any request have: the generation config's max_new_tokens wherever it
    comes from is the default; it is also the cap when given on the command line (a --generation-config
    directory, --override-generation-config), as with vLLM, not when the checkpoint's own
    generation_config.json holds it. (None, None) where none is set or the config's sampling defaults are
    dropped as invalid."""

    def limits(model=model_dir, **kw) -> tuple[int | None, int | None]:
        engine = LLM(model=str(model), **ENGINE, **kw).llm_engine
        info = EngineInfo.of(engine)
        assert (info.default_max_tokens, info.max_tokens_cap) == (engine.default_max_tokens, engine.max_tokens_cap)
        return engine.default_max_tokens, engine.max_tokens_cap

    assert "max_new_tokens" not in json.loads((model_dir / "generation_config.json").read_text())
    assert limits() == (None, None)
    assert limits(override_generation_config={"max_new_tokens": 9}) == (9, 9)
    assert limits(generation_config="vllm", override_generation_config={"max_new_tokens": 4}) == (4, 4)
    for value, expected in ((5, (5, 5)), (0, (None, None))):  # 0 is no valid max_tokens: the defaults are dropped
        other = tmp_path / f"other{value}"
        other.mkdir()
        (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": value}))
        assert limits(generation_config=str(other)) == expected
    own = tmp_path / "own"  # the test model, its generation_config.json setting max_new_tokens
    own.mkdir()
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (own / f.name).symlink_to(f)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (own / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 6}))
    assert limits(own) == (6, None)
    assert limits(own, override_generation_config={"max_new_tokens": 3}) == (3, 3)
    assert limits(own, generation_config="vllm") == (None, None)


def test_override_generation_config_lies_over_its_source(model_dir):
    over = _defaults(model_dir, override_generation_config={"temperature": 0.25, "top_k": 3})
    assert (over.temperature, over.top_k, over.top_p) == (0.25, 3, 0.9)  # top_p still the model's
    only = _defaults(model_dir, generation_config="vllm", override_generation_config={"do_sample": False})
    assert only.temperature == 0.0 and only.top_p == SamplingParams().top_p
    greedy = LLM(model=str(model_dir), **ENGINE, override_generation_config={"do_sample": False})
    a = greedy.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids
    b = greedy.generate([[1, 2, 3]], SamplingParams(temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(generation_config="/no/such/dir"), "generation_config.json"),
        (dict(override_generation_config={"temprature": 0.5}), "temprature"),
        (dict(override_generation_config={"temperature": -1.0}), "override_generation_config"),
        (dict(chat_template="/no/such/template.jinja"), "no such file"),
        (dict(chat_template="{% for m in messages %}{{ m.content }"), "syntax error"),
    ],
)
def test_bad_engine_defaults_raise_at_start(model_dir, kw, words):
    with pytest.raises(ValueError, match=words):
        LLM(model=str(model_dir), **ENGINE, **kw)


TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
    "{% if add_generation_prompt %}=>{% endif %}"
)


def test_chat_template_option_replaces_the_model_s(model_dir, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    for value in (TEMPLATE, str(path)):
        llm = LLM(model=str(model_dir), **ENGINE, chat_template=value)
        tok = llm.get_tokenizer()
        assert tok.apply_chat_template(messages) == "<<user:hi>>=>"
        out = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.prompt_token_ids == tok.encode("<<user:hi>>=>", add_special_tokens=False)
        # a call's own template still wins
        assert tok.apply_chat_template(messages, chat_template="[{{ messages[0]['content'] }}]") == "[hi]"
    model_s = LLM(model=str(model_dir), **ENGINE).get_tokenizer().apply_chat_template(messages)
    assert model_s != "<<user:hi>>=>" and "hi" in model_s


def test_cli_flags_reach_the_engine_args():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(
        ["--generation-config", "vllm", "--override-generation-config", '{"top_k": 4}', "--chat-template", "t.jinja"]
    )
    args = engine_args_from_cli(ns)
    assert args == EngineArgs(
        generation_config="vllm", override_generation_config={"top_k": 4}, chat_template="t.jinja"
    )
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--override-generation-config", bad])
