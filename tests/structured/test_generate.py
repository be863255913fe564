"""Constrained generation end to end on a random-weight checkpoint (the model knows no JSON): every
output of a constrained request satisfies its constraint, whatever the weights.

A request that stops does so because its grammar completed (finish_reason "stop", the grammar
terminated on EOS) and its text validates (`jsonschema`, `re.fullmatch`, membership); a request cut by
max_tokens is a prefix the grammar accepts. Batched with unconstrained requests (whose tokens are those
they get alone), under preemption and with prefix caching."""

from __future__ import annotations

import json
import os
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyvllm import LLM, SamplingParams
from tinyvllm import StructuredOutputsParams as SO
from tinyvllm.models.checkpoint import make_config, write_dummy_checkpoint

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

SETTINGS = settings(
    max_examples=20, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_dummy_checkpoint(path, make_config("tiny"), seed=3, init_std=0.1, dtype="float32")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)


# ---------------------------------------------------------------- strategies: finite languages only
_names = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
_short = st.text(alphabet=string.ascii_letters + "é日 -", max_size=4)


def _leaf() -> st.SearchStrategy:
    integer = st.tuples(st.integers(-300, 300), st.integers(0, 50)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    string_len = st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n})
    string_pattern = st.sampled_from(["^[a-c]{1,3}$", "^[0-9]{2}-[xy]$", "^(ab|cd)$"]).map(
        lambda p: {"type": "string", "pattern": p}
    )
    enum = st.lists(st.one_of(_short, st.integers(-9, 9), st.booleans()), min_size=1, max_size=4, unique=True).map(
        lambda e: {"enum": e}
    )
    return st.one_of(integer, string_len, string_pattern, enum, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    array = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )

    def obj(props: dict, required_mask: list[bool]) -> dict:
        keys = list(props)
        required = [k for k, r in zip(keys, required_mask) if r]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    objects = st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(lambda m: obj(props, m))
    )
    return st.one_of(array, objects)


schemas = st.recursive(_leaf(), _extend, max_leaves=4)


def _regex_piece() -> st.SearchStrategy:
    atom = st.sampled_from(["a", "b", "[a-c]", r"\d", "[xyz]", "é", "(ab|c)", "-", r"\."])
    quant = st.sampled_from(["", "?", "{1,3}", "{2}", "+"])
    return st.tuples(atom, quant).map(lambda t: t[0] + t[1])


regexes = st.lists(_regex_piece(), min_size=1, max_size=5).map("".join)
choices = st.lists(
    st.text(alphabet=string.ascii_lowercase + ' é日😀"\\', min_size=1, max_size=6), min_size=1, max_size=5, unique=True
)


# ---------------------------------------------------------------- checks
def _accepts_prefix(llm, params: SO, token_ids: list[int]) -> bool:
    """Whether the constraint's grammar accepts these tokens (a cut output is a valid prefix)."""
    manager = llm.llm_engine.structured
    matcher = xgr.GrammarMatcher(manager.compiler.compile(params))
    return all(matcher.accept_token(t) for t in token_ids)


def _check(llm, params: SO, output, valid) -> bool:
    """Assert the output satisfies the constraint; returns whether it completed."""
    eos = set(llm.llm_engine.eos_token_ids)
    if output.finish_reason == "stop":
        assert output.token_ids[-1] in eos  # ended by the grammar's stop token
        assert _accepts_prefix(llm, params, output.token_ids)
        valid(output.text)
        return True
    assert output.finish_reason == "length", output
    assert _accepts_prefix(llm, params, output.token_ids)
    return False


def _json_valid(schema):
    return lambda text: jsonschema.validate(json.loads(text), schema)


@given(schema=schemas)
@SETTINGS
def test_json_schema_outputs_validate(llm, schema):
    so = SO(json=schema, disable_any_whitespace=True)
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=so)
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=200, structured_outputs=so)
    outs = llm.generate(["{", "Tell me"], [greedy, sampled], use_tqdm=False)
    for out in outs:
        assert _check(llm, so, out.outputs[0], _json_valid(schema)), f"{schema} not completed: {out.outputs[0]}"


@given(pattern=regexes)
@settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_regex_outputs_fullmatch(llm, pattern):
    so = SO(regex=pattern)
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
        SamplingParams(temperature=0.9, seed=5, max_tokens=60, structured_outputs=so),
    ]
    for out in llm.generate(["x", "y"], params, use_tqdm=False):
        completed = _check(llm, so, out.outputs[0], lambda text: re.fullmatch(pattern, text) or pytest.fail(text))
        assert completed or "+" in pattern  # a finite language fits in 60 tokens


@given(options=choices)
@settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_choice_outputs_are_one_of_the_choices(llm, options):
    so = SO(choice=options)
    params = [SamplingParams(temperature=t, seed=1, max_tokens=40, structured_outputs=so) for t in (0, 1.0)]
    for out in llm.generate(["pick", "pick"], params, use_tqdm=False):
        assert _check(llm, so, out.outputs[0], lambda text: text in options or pytest.fail(text))


def test_json_object_and_grammar(llm):
    so_obj = SO(json_object=True)
    so_ebnf = SO(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "x"')
    params = [
        SamplingParams(temperature=0.7, seed=2, max_tokens=100, structured_outputs=so_obj),
        SamplingParams(temperature=0.7, seed=2, max_tokens=20, structured_outputs=so_ebnf),
    ]
    obj, ebnf = (o.outputs[0] for o in llm.generate(["a", "b"], params, use_tqdm=False))
    if _check(llm, so_obj, obj, lambda t: None):
        assert isinstance(json.loads(obj.text), dict)
    assert _check(llm, so_ebnf, ebnf, lambda t: re.fullmatch(r"\((\d|x)(,(\d|x))?\)", t) or pytest.fail(t))


def test_unconstrained_requests_are_unchanged_in_a_constrained_batch(llm):
    prompts = ["The list type is", "Hello", "a b c d e f", "JSON:"]
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in prompts]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    so = SO(json=schema, disable_any_whitespace=True)
    constrained = [SamplingParams(temperature=t, seed=4, max_tokens=60, structured_outputs=so) for t in (0, 1.0)]
    mixed = llm.generate(
        [prompts[0], "x", prompts[1], prompts[2], "y", prompts[3]],
        [plain[0], constrained[0], plain[1], plain[2], constrained[1], plain[3]],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 3, 5)] == alone
    for i in (1, 4):
        assert _check(llm, so, mixed[i].outputs[0], _json_valid(schema))


def test_invalid_constraints_raise_before_anything_is_queued(llm):
    engine = llm.llm_engine
    for so in [
        SO(json={"type": "integer", "minimum": 3, "maximum": 1}),
        SO(json={"enum": []}),
        SO(regex="(a"),
        SO(grammar="root ::= ("),
    ]:
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["ok", "fine"], SamplingParams(structured_outputs=so), use_tqdm=False)
        with pytest.raises(ValueError, match="structured_outputs"):
            engine.add_request("r", "ok", SamplingParams(structured_outputs=so))
        assert not engine.has_unfinished_requests()
    good = SamplingParams(max_tokens=2, structured_outputs=SO(regex="a+"))
    bad = SamplingParams(structured_outputs=SO(json={"type": "array", "minItems": 2, "maxItems": 1}))
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: invalid structured_outputs.json: minItems"):
        llm.generate(["ok", "fine"], [good, bad], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_preemption_and_prefix_caching_keep_outputs_valid(model_dir):
    """A KV cache of 16 blocks of 16 tokens for 4 requests that grow to ~80 tokens: requests are
    preempted and recomputed; their grammar state is their accepted tokens, so every output still
    validates, and greedy outputs equal those of an engine with room for all."""
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"enum": ["abc", "de", 7]}}, "required": ["k"]},
        "minItems": 3,
        "maxItems": 4,
    }
    so = SO(json=schema, disable_any_whitespace=True)
    prompt = "shared prefix " * 3
    prompts = [prompt + s for s in ("one", "two", "three", "four")]
    params = [SamplingParams(temperature=0, max_tokens=70, structured_outputs=so) for _ in prompts]
    small = LLM(model=str(model_dir), device="cpu", max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=16)
    outs = small.generate(prompts, params, use_tqdm=False)
    metrics = small.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["prefix_cache_hit_tokens"] > 0
    roomy = LLM(model=str(model_dir), device="cpu", max_model_len=256, max_num_seqs=4)
    reference = roomy.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, reference):
        assert _check(small, so, out.outputs[0], _json_valid(schema))
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_async_scheduling_gives_the_synchronous_outputs(model_dir):
    """With async scheduling a step with constrained rows processes the in-flight step from inside its
    own launch (after the forward is enqueued, before the bitmask is filled): constrained and plain
    requests, greedy and seeded, under preemption, give the synchronous engine's tokens exactly."""
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"enum": ["abc", "de", 7]}}, "required": ["k"]},
        "minItems": 2,
        "maxItems": 5,
    }
    so = SO(json=schema, disable_any_whitespace=True)
    prompts = [f"shared prefix {i} " * 2 for i in range(6)]
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=60, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, max_tokens=60, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(regex="(ab|c)+d")),
    ]
    runs = {}
    for overlap in (False, True):
        engine = LLM(
            model=str(model_dir),
            device="cpu",
            max_model_len=128,
            max_num_seqs=6,
            num_gpu_blocks_override=8,  # 128 tokens for six requests that grow to ~70 each: preemption
            async_scheduling=overlap,
        )
        runs[overlap] = engine.generate(prompts, params, use_tqdm=False)
        assert engine.get_metrics()["num_preemptions"] > 0
    for sync, overlapped in zip(runs[False], runs[True]):
        assert overlapped.outputs[0].token_ids == sync.outputs[0].token_ids
        assert overlapped.outputs[0].finish_reason == sync.outputs[0].finish_reason
    for i in (0, 2, 4):
        assert _check(engine, so, runs[True][i].outputs[0], _json_valid(schema))
    assert re.fullmatch(r"(ab|c)+d", runs[True][5].outputs[0].text)


def test_core_requests_compile_off_the_loop_and_fail_alone(llm):
    """`add_core_request` (the multi-process core's entry) does not compile before queueing: a grammar
    that fails there ends its own request with the compile error; the others run."""
    engine = llm.llm_engine
    engine.add_core_request("bad", "x", SamplingParams(max_tokens=4, structured_outputs=SO(regex="[z-a]")))
    engine.add_core_request("good", "x", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outs = {}
    for _ in range(20):
        for out in engine.core_step():
            outs.setdefault(out.request_id, []).append(out)
        if not engine.has_unfinished_requests():
            break
    bad, good = outs["bad"][-1], outs["good"][-1]
    assert bad.finish_reason == "error" and "structured_outputs.regex" in bad.error
    assert good.finish_reason == "length" and sum(len(o.new_token_ids) for o in outs["good"]) == 4


def test_triton_samplers_apply_the_bitmask(model_dir):
    """The Triton ops table (the interpreter on a CPU): constrained greedy and temperature rows go through
    the fused kernel with the bitmask, a top-k row through the full sampler with it, beside an
    unconstrained fused row."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter")
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=4, kernel_backend="triton")
    pattern = r"(ab|c)[0-9]{1,2}-(x|yz)"
    so = SO(regex=pattern)
    params = [
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs=so),
        SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=16, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    outs = [o.outputs[0] for o in llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)]
    for out in outs[:3]:
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out
    assert len(outs[3].token_ids) == 6
