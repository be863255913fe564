"""API-side detokenization and stop strings (output_processor) against the engine's own.

Reference: the same seeded request run by the engine with detokenization on (what the offline `LLM`
does). Checked: the processed token-id Deltas equal the engine's Deltas step by step (stop strings
spanning tokens, multi-byte characters split across tokens, include_stop_str_in_output, n=2 with a
stop in one completion, FINAL_ONLY, special tokens, stop token ids, logprobs, a core that hears of the
stop late); the live server equals `LLM.generate`; a stop string frees the request's KV blocks; the
API-side modules import no torch.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.helpers import assert_equal_up_to_rounding, assert_greedy_is_decided
from tinyvllm import LLM
from tinyvllm.engine.args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.entrypoints.deltas import encode_outputs, merge_deltas
from tinyvllm.entrypoints.output_processor import RequestProcessor, core_params
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

from .conftest import ENGINE_DEFAULTS, MODEL_NAME

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))


def _generate(engine: LLMEngine, prompt: str, params: SamplingParams):
    engine.add_request("probe", prompt, params.replace(output_kind=FINAL_ONLY))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1]


def _prefix_texts(engine: LLMEngine, ids: list[int]) -> list[str]:
    return [engine.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]


def _boundary_stop(engine: LLMEngine, ids: list[int]) -> str:
    """Two characters of the text that come from two different tokens (a stop string spanning
    tokens), at their first occurrence."""
    texts = _prefix_texts(engine, ids)
    text = texts[-1]
    for k in range(1, len(ids)):
        cut = texts[k]
        if cut and not cut.endswith(FFFD) and len(cut) < len(text) and text.startswith(cut):
            stop = text[len(cut) - 1 : len(cut) + 1]
            if FFFD not in stop and text.index(stop) == len(cut) - 1:
                return stop
    raise AssertionError(f"no stop string spanning tokens in {text!r}")


def _multibyte_stop(engine: LLMEngine, ids: list[int]) -> str:
    """A non-ASCII character whose UTF-8 bytes come from several tokens, and the character after it."""
    texts = _prefix_texts(engine, ids)
    text = texts[-1]
    for k in range(1, len(ids)):
        if texts[k].endswith(FFFD):
            i = len(texts[k].rstrip(FFFD))
            if i + 1 < len(text) and not text[i].isascii() and text[i] != FFFD and text[i + 1] != FFFD:
                return text[i : i + 2]
    raise AssertionError(f"no split multi-byte character in {text!r}")


def _run(engine: LLMEngine, prompt: str, params: SamplingParams, lag: int = 0) -> tuple[list, list]:
    """The request twice in one engine, stepped together: "ref" detokenized by the engine, "core" with
    `core_params` through a RequestProcessor whose abort commands reach the engine `lag` steps late.
    Returns (the engine's Deltas, the processed Deltas) as (request_id "r", finished, completions).
    For FINAL_ONLY with stop strings the core sends DELTA outputs: the processed ones are merged
    (as RequestStream does) into the one Delta the engine sends.

    The two are rows of the same batches, but not the same row: compare them with
    `assert_equal_up_to_rounding` (tests/helpers.py), as a matrix product may round two rows differently."""
    engine.add_request("ref", prompt, params)
    engine.add_request("core", prompt, core_params(params))
    processor = RequestProcessor(engine.tokenizer, params)
    prompt_ids = engine.tokenizer.encode(prompt)
    ref, got, pending = [], [], []
    step = 0
    while engine.has_unfinished_requests():
        for delta in encode_outputs(engine.step()):
            if delta[0] == "ref":
                ref.append(("r", *delta[1:3]))
            elif not processor.finished:
                out, commands = processor.process(delta, prompt_ids)
                got.append(("r", *out[1:3]))
                pending += [(step + lag, c) for c in commands]
        for _, command in [p for p in pending if p[0] <= step]:
            if len(command) == 3:
                engine.abort_child(command[1], command[2])
            else:
                engine.abort_request(command[1])
        pending = [p for p in pending if p[0] > step]
        step += 1
    assert not engine.scheduler.requests  # everything ended and freed its blocks
    if params.output_kind is FINAL_ONLY:
        merged = merge_deltas([(*d, None, None) for d in got])
        got = [
            (
                "r",
                merged.finished,
                [
                    (o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason)
                    for o in merged.outputs
                ],
            )
        ]
    return ref, got


FOX = "The quick brown fox"  # its greedy text has ASCII characters from different tokens
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, output_kind=DELTA)
SEEDED = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True, output_kind=DELTA)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("lag", [0, 2])
def test_stop_string_spanning_tokens(engine, include, lag):
    ids = _generate(engine, FOX, GREEDY).outputs[0].token_ids
    stop = _boundary_stop(engine, ids)
    params = GREEDY.replace(stop=[stop, "never matches"], include_stop_str_in_output=include)
    ref, got = _run(engine, FOX, params, lag)
    assert_equal_up_to_rounding(got, ref)
    assert ref[-1][2][0][5:] == ("stop", stop)
    assert "".join(d[2][0][1] for d in ref).endswith(stop) == include


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("prompt,max_tokens", [("Once upon", 30), ("abc", 200)])
def test_stop_string_with_a_multibyte_character_split_across_tokens(engine, include, prompt, max_tokens):
    params = SEEDED.replace(max_tokens=max_tokens)
    stop = _multibyte_stop(engine, _generate(engine, prompt, params).outputs[0].token_ids)
    params = params.replace(stop=[stop], include_stop_str_in_output=include, logprobs=2)
    ref, got = _run(engine, prompt, params, lag=1)
    assert_equal_up_to_rounding(got, ref)
    assert ref[-1][2][0][5:] == ("stop", stop)


def test_n2_stop_in_one_completion_only(engine):
    params = SEEDED.replace(n=2, seed=21, max_tokens=24)
    first, second = _generate(engine, "hello", params).outputs
    text0, text1 = first.text, second.text
    stop = next(
        text0[i : i + 2]
        for i in range(2, len(text0) - 2)
        if FFFD not in text0[i : i + 2] and text0[i : i + 2] not in text1
    )
    for lag in (0, 3):
        ref, got = _run(engine, "hello", params.replace(stop=[stop], logprobs=1), lag)
        assert_equal_up_to_rounding(got, ref)
        finals = {c[0]: c[5] for c in ref[-1][2]}
        assert finals == {0: "stop", 1: "length"}


@pytest.mark.parametrize(
    "case",
    ["final-only", "final-only-stop", "special-tokens", "stop-token-id", "stop-token-id-included", "plain-delta"],
)
def test_other_output_kinds_and_stopping_rules(engine, case):
    params = GREEDY
    ids = _generate(engine, FOX, GREEDY).outputs[0].token_ids
    stop = _boundary_stop(engine, ids)
    if case == "final-only":
        params = GREEDY.replace(output_kind=FINAL_ONLY)
    elif case == "final-only-stop":
        params = GREEDY.replace(output_kind=FINAL_ONLY, stop=[stop])
    elif case == "special-tokens":
        params = GREEDY.replace(skip_special_tokens=False, stop=[stop])
    elif case.startswith("stop-token-id"):
        # a token with text of its own, first sampled after a few others: the text must lose it
        token = next(
            t
            for k, t in enumerate(ids)
            if k >= 2 and t not in ids[:k] and engine.tokenizer.decode([t]) not in ("", FFFD)
        )
        params = GREEDY.replace(
            stop_token_ids=[token], stop=["never matches"], include_stop_str_in_output=case.endswith("included")
        )
    ref, got = _run(engine, FOX, params)
    assert_equal_up_to_rounding(got, ref)
    if case == "final-only":
        assert len(ref) == 1


# ---------------------------------------------------------------------- through the live server
@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), **ENGINE_DEFAULTS)


def _stream(client: openai.OpenAI, **kw) -> dict[int, tuple[str, str, object]]:
    texts: dict[int, str] = {}
    finals: dict[int, tuple] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finals[c.index] = (c.finish_reason, c.stop_reason)
    return {i: (texts[i], *finals[i]) for i in texts}


def test_server_stop_strings_equal_llm_generate(server, llm, engine):
    """The server's texts equal LLM.generate's. Three engines compute them (`engine` picks the stop
    strings): the greedy case is compared exactly because no greedy choice is near a tie (checked), the
    seeded ones because a seeded draw changes only at a near-tie, once in a million draws (tests/helpers.py)."""
    assert_greedy_is_decided(llm, [FOX], 40)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    defaults = llm.get_default_sampling_params()
    greedy_ids = _generate(engine, FOX, GREEDY).outputs[0].token_ids
    seeded_ids = _generate(engine, "Once upon", SEEDED).outputs[0].token_ids
    cases = [
        (FOX, dict(temperature=0, max_tokens=40), [_boundary_stop(engine, greedy_ids)]),
        ("Once upon", dict(temperature=1.0, seed=3, max_tokens=30), [_multibyte_stop(engine, seeded_ids)]),
        ("hello", dict(temperature=1.0, seed=21, max_tokens=24, n=2), None),
    ]
    for prompt, kw, stop in cases:
        if stop is None:  # n=2: a string of completion 0 that completion 1 never produces
            first, second = llm.generate([prompt], defaults.replace(**kw, ignore_eos=True), use_tqdm=False)[0].outputs
            stop = [
                next(
                    first.text[i : i + 2]
                    for i in range(2, len(first.text) - 2)
                    if FFFD not in first.text[i : i + 2] and first.text[i : i + 2] not in second.text
                )
            ]
        for include in (False, True):
            params = defaults.replace(**kw, stop=stop, include_stop_str_in_output=include, ignore_eos=True)
            (want,) = llm.generate([prompt], params, use_tqdm=False)
            expected = {o.index: (o.text, o.finish_reason, o.stop_reason) for o in want.outputs}
            request = dict(
                model=MODEL_NAME,
                prompt=prompt,
                stop=stop,
                **kw,
                extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
            )
            full = client.completions.create(**request)
            assert {c.index: (c.text, c.finish_reason, c.stop_reason) for c in full.choices} == expected
            assert full.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
            assert _stream(client, **request) == expected
    assert [o.finish_reason for o in want.outputs] == ["stop", "length"]  # n=2: one stopped on the string


def test_a_stop_string_frees_the_requests_blocks(server, engine):
    """The request stops at the string, not at max_tokens: its blocks are back in the pool at once and
    the engine generated only a few tokens past the stop (the abort travels while the core steps)."""
    ids = _generate(engine, FOX, GREEDY.replace(max_tokens=200)).outputs[0].token_ids
    stop = _boundary_stop(engine, ids[:40])
    total = server.metric("tinyvllm:kv_cache_blocks")
    before = server.metric("vllm:generation_tokens_total")
    out = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json=dict(model=MODEL_NAME, prompt=FOX, max_tokens=200, temperature=0, stop=[stop], ignore_eos=True),
    ).json()
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    used = out["usage"]["completion_tokens"]
    assert used < 40
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("tinyvllm:kv_cache_free_blocks") == total and server.metric("vllm:num_requests_running") == 0:
            break
        time.sleep(0.02)
    assert server.metric("tinyvllm:kv_cache_free_blocks") == total
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:generation_tokens_total") - before < 150  # not the 200 of max_tokens


def test_the_api_side_imports_no_torch():
    code = (
        "import sys, tinyvllm.entrypoints.output_processor, tinyvllm.entrypoints.async_engine, "
        "tinyvllm.entrypoints.mp_engine, tinyvllm.entrypoints.serving_completions, "
        "tinyvllm.entrypoints.serving_chat; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_final_only_stream_with_stop_strings_yields_one_output(model_dir, engine, llm):
    """The core sends DELTA outputs for it (stop strings are matched every step); the stream merges
    them into the one finished output that LLM.generate returns.

    Two engines compute it: `engine` has FOX's first block cached (earlier tests ran it) and prefills
    only the rest, the new one prefills all of it. Their logprobs differ by rounding; their greedy
    tokens cannot, as no choice is near a tie (tests/helpers.py)."""
    from tinyvllm.entrypoints.async_engine import AsyncLLMEngine

    assert_greedy_is_decided(llm, [FOX], 40)
    stop = _boundary_stop(engine, _generate(engine, FOX, GREEDY).outputs[0].token_ids)
    params = GREEDY.replace(stop=[stop], output_kind=FINAL_ONLY, logprobs=1)
    want = _generate(engine, FOX, params)
    client = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_DEFAULTS))).start()
    try:

        async def main():
            return [o async for o in client.generate("f", FOX, params)]

        (out,) = asyncio.run(main())
    finally:
        client.shutdown()
    assert out.finished and out.outputs[0].stop_reason == stop
    assert_equal_up_to_rounding(out.outputs, want.outputs)
