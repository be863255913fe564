"""The offline API's contract: input forms, output order, n, seeds, stops, logprobs, errors."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import LOGPROB_ATOL, assert_greedy_is_decided, record_cascade_prefixes
from tinyvllm import LLM, SamplingParams
from tinyvllm.bench.parity import teacher_forced_logits
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=7, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", max_model_len=256, max_num_batched_tokens=64)


def test_prompt_forms_and_input_order(llm):
    tok = llm.get_tokenizer()
    text = "The list type is"
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([text, {"prompt_token_ids": ids}, {"prompt": text}, ids], params, use_tqdm=False)
    assert len(outs) == 4
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert all(o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    single = llm.generate(text, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    # Text equals the detokenized tokens.
    o = outs[0].outputs[0]
    assert o.text == tok.decode(o.token_ids) and o.finish_reason == "length"
    # Outputs come back in input order even when lengths differ.
    ps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 1, 5)]
    outs = llm.generate(["a", "b", "c"], ps, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5]
    assert [o.prompt for o in outs] == ["a", "b", "c"]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    """In a batch the request's logits round differently, which changes a seeded draw only at a near-tie
    (tests/helpers.py): the tokens are compared exactly."""
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Hello", p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["x y z", "Hello", "more text here"], [others, p, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("Hello", p.replace(seed=43), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate("Once", p, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate("Once", p, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_stop_strings_cut_the_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The", greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate("The", greedy.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("The", greedy.replace(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[
        0
    ]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = llm.generate("The", greedy, use_tqdm=False)[0].outputs[0].token_ids
    target = ids[4]
    first = ids.index(target)
    out = llm.generate("The", greedy.replace(stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == target


def test_eos_from_generation_config_stops_unless_ignored(llm, model_dir, tmp_path):
    """Make the 3rd greedy token an EOS id (through generation_config.json) and check both behaviours."""
    import json
    import shutil

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = llm.generate("The", greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = ids[2]
    first = ids.index(eos)
    shutil.copytree(model_dir, tmp_path / "m")
    gen_path = tmp_path / "m" / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [eos]
    gen_path.write_text(json.dumps(gen))
    other = LLM(model=str(tmp_path / "m"), device="cpu", max_model_len=256)
    assert_greedy_is_decided(llm, ["The"], 10)  # so the other engine's greedy tokens are the same
    out = other.generate("The", greedy.replace(ignore_eos=False), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == other.get_tokenizer().decode(ids[:first])  # the EOS token's text is not emitted
    assert other.generate("The", greedy, use_tqdm=False)[0].outputs[0].token_ids == ids
    # min_tokens holds EOS back: it is banned until 5 tokens are out.
    held = other.generate("The", greedy.replace(ignore_eos=False, min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert eos not in held.token_ids[:5]


def test_logprobs(llm):
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    o = llm.generate("Hi", p, use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4
    total = 0.0
    for tok, entry in zip(o.token_ids, o.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        ranked = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert all(lp.logprob <= 0 for lp in ranked)
        total += entry[tok].logprob
    assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-6)


def test_logprobs_match_a_float64_softmax(llm, model_dir):
    """The reported logprob of each greedy token equals log_softmax of the model's logits, computed
    again here for the whole sequence at once: equal up to rounding (LOGPROB_ATOL, tests/helpers.py)."""
    engine = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True)
    out = llm.generate("Hello there", p, use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    logits = teacher_forced_logits(engine, ids, [len(ids)]).double()
    ref = torch.log_softmax(logits, -1)
    n = len(out.prompt_token_ids)
    for i, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        assert math.isclose(entry[tok].logprob, ref[n - 1 + i, tok].item(), abs_tol=LOGPROB_ATOL)


def test_too_long_prompt_fails_alone(llm):
    ok = "short prompt"
    too_long = {"prompt_token_ids": [1] * 300}
    outs = llm.generate(
        [ok, too_long, ok], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert outs[1].error and "at most 255" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 3
    assert outs[2].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.get_metrics()["num_free_kv_blocks"] == llm.get_metrics()["num_kv_blocks"]


def test_malformed_input_raises_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [1, 10**9]}], use_tqdm=False)
    with pytest.raises(TypeError):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(model="x", not_an_option=1)


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
    assert direct.outputs[0].token_ids == out.outputs[0].token_ids


def test_default_sampling_params_come_from_generation_config(llm):
    gen = llm.llm_engine.generation_config
    d = llm.get_default_sampling_params()
    if "temperature" in gen:
        assert d.temperature == gen["temperature"]
    if "top_p" in gen:
        assert d.top_p == gen["top_p"]


@pytest.mark.parametrize("blocks", [None, 12])
def test_async_scheduling_gives_the_same_outputs(model_dir, blocks):
    """Overlapping step N+1's scheduling with step N (placeholders for in-flight tokens) changes
    nothing: greedy, seeded sampling, stop strings and n, with and without preemption. The two engines'
    logits may differ by rounding, which decides no greedy token (checked) and changes a seeded draw only
    at a near-tie (tests/helpers.py)."""
    prompts = ["The list type", "Once upon a time there", "x", "a b c d e f g h i j k l"]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, stop=["e"], ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True),
    ]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(model_dir),
            device="cpu",
            max_model_len=48,
            block_size=4,
            num_gpu_blocks_override=blocks,
            max_num_batched_tokens=16,
            async_scheduling=async_scheduling,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outs])
        m = llm.get_metrics()
        assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
        if blocks:
            assert m["num_preemptions"] > 0
    assert_greedy_is_decided(llm, [prompts[0], prompts[2]], 25)
    assert results[0] == results[1]


def test_triton_backend_matches_torch_backend(model_dir):
    """The engine on our Triton kernels (the interpreter on a CPU) gives the torch reference's greedy
    tokens, and its fused greedy sampler the same argmax. The backends' logits differ by rounding, which
    decides no greedy token here (checked)."""
    prompts = ["The list type", "Once upon a time there was"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend, fused in (("torch", True), ("triton", True), ("triton", False)):
        # max_num_batched_tokens 8: every step is small enough for the fused matrix-vector path
        llm = LLM(
            model=str(model_dir),
            device="cpu",
            max_model_len=64,
            block_size=4,
            kernel_backend=backend,
            max_num_batched_tokens=8,
            fused_gemv=fused,
        )
        outs[backend, fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "torch":
            assert_greedy_is_decided(llm, prompts, 6)
    assert outs["triton", True] == outs["torch", True] == outs["triton", False]


def test_prefix_shared_within_one_step(model_dir):
    """Requests admitted in the same step share a prefix that none of them has computed yet: block_size
    4, three prompts of 13 tokens whose first 12 agree, all admitted in the first step. The first
    computes everything; the second and third find its 3 full blocks, offered when it was scheduled
    (12 hit tokens each), and their greedy continuations equal those of an engine without caching (whose
    logits differ by rounding, which decides no greedy token here: checked)."""
    shared = list(range(30, 42))
    prompts = [{"prompt_token_ids": [*shared, t]} for t in (5, 6, 7)]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=64, enable_prefix_caching=caching)
        res = llm.generate(prompts, p, use_tqdm=False)
        outs[caching] = [o.outputs[0].token_ids for o in res]
        if caching:
            assert [o.num_cached_tokens for o in res] == [0, 12, 12]
            assert llm.get_metrics()["prefix_cache_hit_tokens"] == 24
    assert_greedy_is_decided(llm, prompts, 4)
    assert outs[True] == outs[False]


def test_prefix_cache_hit_count_is_the_hand_computed_one(model_dir):
    """block_size 4. A: 14 tokens → after it ran, blocks 0-2 (12 tokens) are cached. B shares A's first
    10 tokens: 2 full blocks hit (8 tokens). C equals A: 3 blocks would hit, but the last token must be
    computed, and 14 - 1 = 13 tokens cover 3 full blocks: 12 tokens. D = A + 2: 16 tokens, (16-1)//4 = 3
    blocks of A's (its 4th block was never full in A): 12 tokens."""
    llm = LLM(model=str(model_dir), device="cpu", block_size=4, max_model_len=64)
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    a = list(range(10, 24))
    hits = []
    for prompt in (a, [*a[:10], 50, 51, 52], list(a), [*a, 60, 61]):
        before = llm.get_metrics()["prefix_cache_hit_tokens"]
        out = llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
        hits.append(llm.get_metrics()["prefix_cache_hit_tokens"] - before)
        assert out.num_cached_tokens == hits[-1]
    assert hits == [0, 8, 12, 12]
    m = llm.get_metrics()
    assert m["prefix_cache_queried_tokens"] == 14 + 13 + 14 + 16
    assert llm.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": a}, p, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # forgotten


def test_fused_sampler_seeded_rows_ignore_batch_changes(model_dir):
    """The fused sampler keeps per-row constants while the batch's rows stay the same and rebuilds them
    when they change: a seeded request's tokens must not depend on that. Request A (seeded, T=0.8) alone
    equals A beside a greedy request that finishes after 2 tokens (the rows change mid-run), an unseeded
    one, one under min_tokens and one with top-p and logprobs: those two take the full sampler (the
    latter for every step, the former until its min_tokens), which must not move A to it."""
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        kernel_backend="triton",
        max_num_batched_tokens=64,
    )
    a = (
        {"prompt_token_ids": [3, 14, 15, 92, 65]},
        SamplingParams(temperature=0.8, seed=5, max_tokens=7, ignore_eos=True),
    )
    others = [
        ({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
        ({"prompt_token_ids": [7, 7]}, SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)),
        ({"prompt_token_ids": [9, 8, 7, 6]}, SamplingParams(temperature=0.8, max_tokens=5, min_tokens=3)),
        (
            {"prompt_token_ids": [5, 6]},
            SamplingParams(temperature=0.9, top_p=0.8, max_tokens=6, logprobs=2, ignore_eos=True),
        ),
    ]
    alone = llm.generate([a[0]], [a[1]], use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [o[0] for o in others[:1]] + [a[0]] + [o[0] for o in others[1:]],
        [o[1] for o in others[:1]] + [a[1]] + [o[1] for o in others[1:]],
        use_tqdm=False,
    )
    assert len(alone) == 7 and mixed[1].outputs[0].token_ids == alone
    assert len(mixed[0].outputs[0].token_ids) == 2
    assert len(mixed[3].outputs[0].token_ids) >= 3
    top_p = mixed[4].outputs[0]
    assert len(top_p.token_ids) == 6 and len(top_p.logprobs) == 6
    assert all(t in lp and len(lp) >= 2 for t, lp in zip(top_p.token_ids, top_p.logprobs))


def test_cascade_attention_in_the_engine_equals_the_torch_backend(model_dir):
    """Decode steps whose rows share a cached prefix use cascade attention (thresholds lowered so the
    tiny model qualifies): greedy tokens equal the torch reference backend's, and cascade did run. The
    backends' logits differ by rounding, which decides no greedy token here (checked)."""
    shared = [(7 * i) % 500 + 3 for i in range(70)]  # 4 full blocks of 16 shared, then per-prompt tails
    prompts = [{"prompt_token_ids": [*shared, 11 + j, 40 + j]} for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(model_dir), device="cpu", max_model_len=128, kernel_backend=backend, max_num_batched_tokens=512
        )
        builder = llm.llm_engine.runner.builder
        if backend == "triton":
            assert builder.cascade is not None
            builder.cascade = (2, 64, 64)
            used = record_cascade_prefixes(builder)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "torch":
            assert_greedy_is_decided(llm, prompts, 5)
    assert outs["triton"] == outs["torch"]
    assert 64 in used, used


def test_cascade_attention_off_for_sliding_window_models(tmp_path, caplog):
    """Cascade attention attends the shared prefix once for every row, but a row with a sliding window
    sees only its own window of it: a model with any windowed layer (here Qwen2's layer 1 of 2) never gets
    the cascade prefix, and the runner says why once (test_cascade_attention_in_the_engine_... above: a
    model without a window keeps it)."""
    import logging

    write_dummy_checkpoint(tmp_path, make_config("tiny-qwen2"), seed=0)
    with caplog.at_level(logging.INFO, logger="tinyvllm.engine.model_runner"):
        llm = LLM(model=str(tmp_path), device="cpu", max_model_len=128, kernel_backend="triton")
    assert llm.llm_engine.runner.builder.cascade is None
    assert caplog.text.count("cascade attention off: the model has sliding-window layers") == 1


def test_a_top_k_past_int32_samples_like_no_top_k(tmp_path):
    """top_k = 2**40 (a client's "no limit") keeps every token: the same seeded draws as top_k 0, and
    the engine keeps running (it once died converting it to int32)."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

    write_dummy_checkpoint(tmp_path, make_config("tiny"), seed=0, dtype="float32")
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    base = dict(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    huge = llm.generate([[1, 2, 3]], SamplingParams(top_k=2**40, **base), use_tqdm=False)[0].outputs[0].token_ids
    none = llm.generate([[1, 2, 3]], SamplingParams(top_k=0, **base), use_tqdm=False)[0].outputs[0].token_ids
    assert huge == none and len(huge) == 8
