"""Output processing (detokenization, stop strings, output kinds) against a reference computed from
the tokenizer.

Reference: the request's token ids without stop strings (the same greedy or seeded request), and
`tokenizer.decode` of their prefixes: a stop string ends a completion at the first token whose prefix
text contains it, the text is cut before it (after it with include_stop_str_in_output), a stop token's
text is left out. Checked through both paths: `LLMEngine.step()` and the API side's (the core's
token-level outputs through RequestStates, with the core hearing of a stop late). Cases: stop strings
spanning tokens, multi-byte characters split across tokens, include_stop_str_in_output, n=2 with a
stop in one completion, FINAL_ONLY, special tokens, stop token ids, logprobs. Also: the live server
equals `LLM.generate`; a stop string frees the request's KV blocks; the API-side modules import no
torch.
"""

from __future__ import annotations

import asyncio
import math
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
from tinyvllm.engine.messages import CompletionDelta, OutputAccumulator, RequestDelta
from tinyvllm.engine.output_processor import RequestState, process_outputs
from tinyvllm.outputs import RequestOutput
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


def _expected(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple:
    """(text, token ids, finish_reason, stop_reason) of a completion whose token ids without stop
    strings and stop token ids are `ids` (ignore_eos, min_tokens 0), from tokenizer.decode alone."""
    include = params.include_stop_str_in_output
    texts = [
        engine.tokenizer.decode(ids[:k], skip_special_tokens=params.skip_special_tokens) for k in range(len(ids) + 1)
    ]
    end, finish, reason = len(ids), "length", None
    stop_token = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
    if stop_token is not None:
        end, finish, reason = stop_token + 1, "stop", ids[stop_token]
    seen = end if finish == "length" or include else end - 1  # the stop token's text is never seen
    for k in range(1, seen + 1):
        hits = [(texts[k].index(s) + len(s), -len(s), s) for s in params.stop if s in texts[k]]
        if hits:
            stop_end, _, stop = min(hits)  # the earliest end; for equal ends the longest
            cut = stop_end if include else stop_end - len(stop)
            return texts[k][:cut], ids[:k], "stop", stop
    return texts[seen], ids[:end], finish, reason


def _final(engine: LLMEngine, deltas: list, n: int) -> list[tuple]:
    """The merged RequestDeltas of one request as (text, token ids, finish_reason, stop_reason) per
    completion; checks that each completion's logprobs cover its ids and sum to its cumulative one."""
    out = OutputAccumulator("r").extend(deltas).output()
    assert out.finished and len(out.outputs) == n
    for o in out.outputs:
        if o.logprobs is not None:
            assert len(o.logprobs) == len(o.token_ids)
            total = sum(entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs))
            assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)
    return [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs]


def _run_api_side(engine: LLMEngine, prompt: str, params: SamplingParams, lag: int) -> list:
    """The request through the core (`add_core_request` / `core_step`) and a RequestState, as the
    server runs it, the abort commands reaching the core `lag` steps late: its RequestDeltas."""
    ids = engine.tokenizer.encode(prompt)
    engine.add_core_request("r", {"prompt": prompt, "prompt_token_ids": ids}, params)
    state = RequestState("r", params, engine.tokenizer, prompt, ids)
    got, pending = [], []
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.core_step()
        if not state.finished:
            for _, delta in process_outputs([state] * len(outputs), outputs):
                got.append(delta)
            pending += [(step + lag, c) for c in state.aborts]
            state.aborts = ()
        for _, command in [p for p in pending if p[0] <= step]:
            engine.abort(command)
        pending = [p for p in pending if p[0] > step]
        step += 1
    assert not engine.scheduler.requests  # everything ended and freed its blocks
    return got


def _run(engine: LLMEngine, prompt: str, params: SamplingParams, lag: int = 0) -> list[tuple]:
    """The request through `LLMEngine.step()` and through the API side (lag `lag`); both must give
    the same completions, and each DELTA stream only ever extends its text. Returns them."""
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert not engine.scheduler.requests
    from_step = _final(engine, [_delta(o) for o in outs], params.n)
    if params.output_kind is FINAL_ONLY:
        assert len(outs) == 1
    from_api = _final(engine, _run_api_side(engine, prompt, params, lag), params.n)
    assert from_step == from_api
    return from_step


def _delta(out: RequestOutput) -> RequestDelta:
    completions = [
        CompletionDelta(o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason)
        for o in out.outputs
    ]
    return RequestDelta(out.request_id, out.finished, completions, out.error, out.num_cached_tokens)


FOX = "The quick brown fox"  # its greedy text has ASCII characters from different tokens
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, output_kind=DELTA)
SEEDED = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True, output_kind=DELTA)


def _check(engine: LLMEngine, prompt: str, params: SamplingParams, lag: int = 0) -> list[tuple]:
    """Run the request both ways (`_run`) and compare each completion with `_expected` of its token
    ids without stops (the same request with no stop strings and no stop token ids)."""
    free = _generate(engine, prompt, params.replace(stop=[], stop_token_ids=[]))
    got = _run(engine, prompt, params, lag)
    assert got == [_expected(engine, o.token_ids, params) for o in free.outputs]
    return got


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("lag", [0, 2])
def test_stop_string_spanning_tokens(engine, include, lag):
    ids = _generate(engine, FOX, GREEDY).outputs[0].token_ids
    stop = _boundary_stop(engine, ids)
    params = GREEDY.replace(stop=[stop, "never matches"], include_stop_str_in_output=include)
    ((text, token_ids, finish, reason),) = _check(engine, FOX, params, lag)
    assert (finish, reason) == ("stop", stop) and text.endswith(stop) == include and len(token_ids) < len(ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("prompt,max_tokens", [("Once upon", 30), ("abc", 200)])
def test_stop_string_with_a_multibyte_character_split_across_tokens(engine, include, prompt, max_tokens):
    params = SEEDED.replace(max_tokens=max_tokens)
    stop = _multibyte_stop(engine, _generate(engine, prompt, params).outputs[0].token_ids)
    params = params.replace(stop=[stop], include_stop_str_in_output=include, logprobs=2)
    ((_, _, finish, reason),) = _check(engine, prompt, params, lag=1)
    assert (finish, reason) == ("stop", stop)


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
        got = _check(engine, "hello", params.replace(stop=[stop], logprobs=1), lag)
        assert [c[2] for c in got] == ["stop", "length"]


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
    ((text, token_ids, finish, reason),) = _check(engine, FOX, params)
    if case.startswith("stop-token-id"):
        assert (finish, reason) == ("stop", token_ids[-1]) and token_ids[-1] == token
        kept = engine.tokenizer.decode(token_ids[:-1])
        assert text == (engine.tokenizer.decode(token_ids) if case.endswith("included") else kept)
    elif case in ("final-only", "plain-delta"):
        assert (text, finish) == (engine.tokenizer.decode(ids), "length")
    else:
        assert (finish, reason) == ("stop", stop)


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
        "import sys, tinyvllm.engine.output_processor, tinyvllm.engine.messages, tinyvllm.engine.async_llm, "
        "tinyvllm.engine.mp_client, tinyvllm.entrypoints.serving_completions, "
        "tinyvllm.entrypoints.serving_chat; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_final_only_stream_with_stop_strings_yields_one_output(model_dir, engine, llm):
    """The core sends DELTA outputs for it (stop strings are matched every step); the stream merges
    them into the one finished output that LLM.generate returns.

    Two engines compute it: `engine` has FOX's first block cached (earlier tests ran it) and prefills
    only the rest, the new one prefills all of it. Their logprobs differ by rounding; their greedy
    tokens cannot, as no choice is near a tie (tests/helpers.py)."""
    from tinyvllm.engine.async_llm import AsyncLLMEngine

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
