"""The offline API and the CLI against careless input (issue 35): text the tokenizer cannot take, malformed
arguments, extreme sampling values, the CPU KV cache sized to the work, the CLI's exit status."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine import model_runner
from tinyvllm.engine.kv_cache_size import size_for_work
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint
from tinyvllm.sampling.tensors import float32_scale
from tinyvllm.tokenizer import check_text

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Valid text that is easy to get wrong: NUL, a right-to-left override and Hebrew, combining marks
# (e + U+0301, and a stack of three), 4-byte emoji (a ZWJ family, a flag), a BOM, a non-character.
VALID_TEXTS = [
    "a\x00b",
    "\u202eabc\u202c \u05e9\u05dc\u05d5\u05dd",
    "e\u0301 a\u0300\u0301\u0302",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7",
    "\ufeffx\uffff",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=8)


# ------------------------------------------------------------------------- text validation


def test_check_text_names_the_argument_and_the_character():
    with pytest.raises(ValueError) as info:
        check_text("\ud800x", "prompt 3")
    assert str(info.value) == (
        "prompt 3 contains a lone surrogate at character 0 ('\\ud800'); text must be valid Unicode"
    )
    with pytest.raises(ValueError, match=r"at character 4 \('\\udcff'\).*byte 0xff"):
        check_text("abc\u00e9\udcff", "x")
    # A surrogate pair is two lone surrogates in a Python str (JSON decoders join them into one character).
    with pytest.raises(ValueError, match="at character 0"):
        check_text("\ud83d\ude00", "x")
    for text in [*VALID_TEXTS, "", "plain"]:
        check_text(text, "x")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12))
def test_check_text_rejects_exactly_what_tokenizers_rejects(llm, text):
    """The reference is the `tokenizers` library itself: it fails (TypeError) on the strings check_text
    rejects and on no other. The alphabet includes the surrogate category, which st.text leaves out by
    default."""
    backend = llm.get_tokenizer()._backend
    try:
        backend.encode(text)
        backend_ok = True
    except TypeError:
        backend_ok = False
    try:
        check_text(text, "x")
        ours_ok = True
    except ValueError:
        ours_ok = False
    assert ours_ok == backend_ok


def test_lone_surrogates_are_value_errors_naming_the_prompt_and_queue_nothing(llm):
    with pytest.raises(ValueError, match=r"^prompt contains a lone surrogate at character 0"):
        llm.generate("\ud800x", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[2\] contains a lone surrogate at character 1"):
        llm.generate(["fine", {"prompt": "ok"}, "a\udfffb"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[0\] contains a lone surrogate"):
        llm.generate([{"prompt": "\ud800", "prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content contains a lone surrogate"):
        llm.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": "\udc00"}], use_tqdm=False)
    part = [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\.content\[0\]\.text contains a lone surrogate"):
        llm.chat([[{"role": "user", "content": "ok"}], part], use_tqdm=False)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"^prompt contains a lone surrogate"):
        engine.add_request(None, "\ud800", GREEDY)
    assert not engine.has_unfinished_requests()


def test_valid_unicode_round_trips_through_generate_and_chat(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(VALID_TEXTS, GREEDY, use_tqdm=False)
    for text, out in zip(VALID_TEXTS, outs):
        assert out.error is None and len(out.outputs[0].token_ids) == 4
        assert out.prompt == text
        assert tok.decode(out.prompt_token_ids, skip_special_tokens=True) == text  # byte-level BPE is lossless
    (out,) = llm.chat([{"role": "user", "content": VALID_TEXTS[3]}], GREEDY, use_tqdm=False)
    assert VALID_TEXTS[3] in out.prompt and out.error is None


# ------------------------------------------------------------------------- malformed arguments


@pytest.mark.parametrize(
    "prompts, error, message",
    [
        (None, TypeError, r"^prompts must be a string, .* got NoneType"),
        (5, TypeError, r"^prompts must be .* got int"),
        (b"bytes", TypeError, r"^prompts must be .* got bytes"),
        ([], ValueError, r"^prompts is empty"),
        ([1, "a"], TypeError, r"^prompt: prompt_token_ids must be a list of ints; the one at position 1 is str"),
        ([[1, 2], 3], TypeError, r"^prompts\[1\] must be a string, a list of token ids or a dict"),
        (["a", 3.5], TypeError, r"^prompts\[1\] must be .* not float"),
        ([[1, True]], TypeError, r"^prompts\[0\]: .* position 1 is bool"),
        ([[1, 2.0]], TypeError, r"^prompts\[0\]: .* position 1 is float"),
        ([1, -1], ValueError, r"^prompt: token id -1 \(at position 1\) is outside the vocabulary \[0, 512\)"),
        ({"prompt_token_ids": [512]}, ValueError, r"^prompt: token id 512 \(at position 0\) is outside"),
        ({"prompt_token_ids": "1 2"}, TypeError, r"^prompt: prompt_token_ids must be a list of ints, not str"),
        ({}, ValueError, r"^prompt: a prompt dict needs 'prompt' .* or 'prompt_token_ids'"),
        ({"prompt": 5}, TypeError, r"^prompt: 'prompt' must be a string, not int"),
    ],
    ids=repr,
)
def test_malformed_prompts(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, error, message",
    [
        ({"temperature": 0}, TypeError, r"^sampling_params must be a SamplingParams, a list of them .* not dict"),
        ("greedy", TypeError, r"^sampling_params must be .* not str"),
        ([GREEDY], ValueError, r"^got 1 SamplingParams for 2 prompts; pass one or one per prompt"),
        ([GREEDY, None], TypeError, r"^sampling_params\[1\] must be a SamplingParams, not NoneType"),
    ],
    ids=repr,
)
def test_malformed_sampling_params(llm, params, error, message):
    with pytest.raises(error, match=message):
        llm.generate(["a", "b"], params, use_tqdm=False)
    with pytest.raises(error, match=message):
        llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], params, use_tqdm=False)


@pytest.mark.parametrize(
    "messages, error, message",
    [
        ([], ValueError, r"^messages is empty"),
        ([[]], ValueError, r"^messages\[0\] is an empty conversation"),
        ([[{"role": "user", "content": "a"}], []], ValueError, r"^messages\[1\] is an empty conversation"),
        ("hi", TypeError, r"^messages must be a conversation .* got str"),
        (None, TypeError, r"^messages must be a conversation .* got NoneType"),
        (["hi"], TypeError, r"^messages\[0\] must be a dict with 'role' and 'content', not str"),
        ([{"content": "x"}], ValueError, r"^messages\[0\] has no 'role'; expected one of system, developer, user"),
        ([{"role": "usr", "content": "x"}], ValueError, r"^messages\[0\]\.role 'usr' is not a known role"),
        ([{"role": 1, "content": "x"}], TypeError, r"^messages\[0\]\.role must be a string, not int"),
        ([{"role": "user"}], ValueError, r"^messages\[0\]\.content is missing"),
        ([{"role": "user", "content": None}], ValueError, r"^messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 3}], TypeError, r"^messages\[0\]\.content must be a string or a list of"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            ValueError,
            r"^messages\[0\]\.content\[0\] has type 'image_url'; only text parts are supported",
        ),
        ([{"role": "user", "content": ["x"]}], TypeError, r"^messages\[0\]\.content\[0\] must be a dict"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            TypeError,
            r"^messages\[0\]\.content\[0\]\.text must be a string",
        ),
        ([{"role": "user", "content": "a"}, "b"], TypeError, r"^messages\[1\] must be a dict"),
    ],
    ids=repr,
)
def test_malformed_messages(llm, messages, error, message):
    with pytest.raises(error, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_joins_text_parts_and_takes_tool_calls_without_content(llm):
    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    (out,) = llm.chat(parts, GREEDY, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}])
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    (out,) = llm.chat([{"role": "user", "content": "hi"}, call], GREEDY, use_tqdm=False)
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert "content" not in call  # the caller's dicts are not modified


# ------------------------------------------------------------------------- extreme sampling values


def test_huge_temperature_generates_without_warnings(llm):
    """temperature=1e308 used to overflow numpy's float32 cast (RuntimeWarning) in the fused sampler's plan;
    with min_tokens the torch sampler's -inf / inf made NaN probabilities."""
    vocab = llm.llm_engine.model_config.vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = llm.generate(
            ["a", "b"],
            [
                SamplingParams(temperature=1e308, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=1e308, max_tokens=6, min_tokens=6, seed=1),
            ],
            use_tqdm=False,
        )
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 6 and all(0 <= t < vocab for t in ids)
    assert float32_scale(1e308) == 1e20 and float32_scale(1e-300) == 1e-20 and float32_scale(0.7) == 0.7


# ------------------------------------------------------------------------- KV cache sized to the work


def test_size_for_work_hand_computed():
    kw = dict(bytes_per_block=32768, block_size=16, max_num_seqs=256, max_model_len=1024)
    # 256 × ceil(1024 / 16) = 16,384 blocks = 512 MiB, within 1/4 of 4 GiB.
    size = size_for_work(**kw, memory_bytes=4 << 30, max_memory_fraction=0.25)
    assert size.num_blocks == 16384
    assert size.describe(16).startswith("16,384 blocks × 16 tokens (512.0 MiB): max_num_seqs 256 × max_model_len")
    # 1/4 of 1 GiB = 256 MiB = 8,192 blocks of 32 KiB: capped; 8,192 / 64 = 128 full-length sequences fit.
    capped = size_for_work(**kw, memory_bytes=1 << 30, max_memory_fraction=0.25)
    assert capped.num_blocks == 8192
    assert "capped at 0.25 of the 1.0 GiB memory" in capped.reason and "128 sequences" in capped.reason
    # max_model_len not a multiple of the block size: ceil(100 / 16) = 7 blocks a sequence.
    odd = size_for_work(**{**kw, "max_model_len": 100, "max_num_seqs": 3}, memory_bytes=None, max_memory_fraction=0.25)
    assert odd.num_blocks == 21 and "not capped" in odd.reason


def _full_length_run(model_dir, caplog, **kwargs):
    """Three greedy sequences that each reach max_model_len = 40 tokens (4-token prompts + 36)."""
    with caplog.at_level(logging.INFO, logger="tinyvllm.engine.llm_engine"):
        llm = LLM(model=str(model_dir), device="cpu", max_model_len=40, max_num_seqs=3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 36 for o in outs)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_cpu_cache_default_holds_max_num_seqs_full_sequences(model_dir, caplog):
    llm, _ = _full_length_run(model_dir, caplog)
    assert llm.llm_engine.num_blocks == 3 * 3  # 3 sequences × ceil(40 / 16) blocks
    assert llm.get_metrics()["num_preemptions"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1 and lines[0].startswith("KV cache: 9 blocks × 16 tokens (")
    assert "max_num_seqs 3 × max_model_len 40 needs 9 blocks" in lines[0]


def test_cpu_cache_capped_by_memory_preempts_and_gives_the_same_tokens(llm, model_dir, caplog, monkeypatch):
    _, reference = _full_length_run(model_dir, caplog)
    per_block = llm.llm_engine.runner.bytes_per_block(16)
    monkeypatch.setattr(model_runner, "total_memory_bytes", lambda: 4 * 5 * per_block)  # 1/4: 5 blocks
    capped, tokens = _full_length_run(model_dir, caplog)
    assert capped.llm_engine.num_blocks == 5
    assert capped.llm_engine.scheduler_config.max_model_len == 40
    assert capped.get_metrics()["num_preemptions"] > 0
    assert tokens == reference
    assert any("capped at 0.25" in r.getMessage() for r in caplog.records)


def test_explicit_sizes_override_the_cpu_default(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=64, num_gpu_blocks_override=10)
    assert llm.llm_engine.num_blocks == 10
    per_block = llm.llm_engine.runner.bytes_per_block(16)
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=64, kv_cache_memory_bytes=7 * per_block + 1)
    assert llm.llm_engine.num_blocks == 7


# ------------------------------------------------------------------------- the CLI


def _cli(*args: str, model_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = ["--model", str(model_dir), "--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "4"]
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "generate", *args, *engine]
    return subprocess.run(cmd, capture_output=True, env=env, timeout=120)


def test_cli_generate_exit_status(model_dir, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_bytes(b"from the file\n\xff\xfe not utf-8\n")
    too_long = " ".join(["word"] * 80)
    run = _cli("Once upon", too_long, "--prompts-file", str(prompts_file), "--max-tokens", "3", model_dir=model_dir)
    stdout, stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert stdout.count("-" * 40) == 2  # the two good prompts printed their outputs
    assert stdout.startswith("Once upon") and "from the file" in stdout
    assert "prompt 2: the prompt has" in stderr and "at most 63 tokens" in stderr
    assert f"{prompts_file} line 2 contains a lone surrogate at character 0" in stderr and "byte 0xff" in stderr
    assert "2 of 4 prompts failed" in stderr

    ok = _cli("Once upon", "--max-tokens", "2", model_dir=model_dir)
    assert ok.returncode == 0 and ok.stderr.decode().count("error") == 0
    bad_flag = _cli("x", "--max-tokens", "many", model_dir=model_dir)
    assert bad_flag.returncode == 2 and b"invalid int value" in bad_flag.stderr
    bad_value = _cli("x", "--temperature", "-1", model_dir=model_dir)
    assert bad_value.returncode == 2 and b"temperature must be non-negative" in bad_value.stderr
    assert b"Traceback" not in bad_value.stderr
