"""SamplingParams: vLLM's defaults, normalisations and validation rules."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults_are_vllms():
    p = SamplingParams()
    expected = dict(
        n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
        top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
        max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, skip_special_tokens=True,
        spaces_between_special_tokens=True, include_stop_str_in_output=False, detokenize=True,
        output_kind=RequestOutputKind.CUMULATIVE, structured_outputs=None, logit_bias=None,
        allowed_token_ids=None, bad_words=None,
    )  # fmt: skip
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == expected
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("n", 0, ValueError),
        ("n", 1.0, TypeError),
        ("n", True, TypeError),
        ("presence_penalty", 2.5, ValueError),
        ("presence_penalty", -2.01, ValueError),
        ("presence_penalty", "0.1", TypeError),
        ("frequency_penalty", -3.0, ValueError),
        ("frequency_penalty", math.nan, ValueError),
        ("repetition_penalty", 0.0, ValueError),
        ("repetition_penalty", -1.0, ValueError),
        ("repetition_penalty", math.inf, ValueError),
        ("temperature", -0.1, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", None, TypeError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_k", -2, ValueError),
        ("top_k", 5.0, TypeError),
        ("top_k", 2.5, TypeError),
        ("min_p", -0.1, ValueError),
        ("min_p", 1.1, ValueError),
        ("seed", 1.5, TypeError),
        ("seed", 2**64, ValueError),
        ("stop", [""], ValueError),
        ("stop", ["ok", 3], TypeError),
        ("stop", 3, TypeError),
        ("stop_token_ids", [1, 2.0], TypeError),
        ("stop_token_ids", [-1], ValueError),
        ("stop_token_ids", "12", TypeError),
        ("ignore_eos", 1, TypeError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", 16.0, TypeError),
        ("min_tokens", -1, ValueError),
        ("min_tokens", 17, ValueError),  # > max_tokens=16
        ("logprobs", -1, ValueError),
        ("logprobs", 2.0, TypeError),
        ("prompt_logprobs", -1, ValueError),
        ("skip_special_tokens", None, TypeError),
        ("detokenize", "yes", TypeError),
    ],
)
def test_bad_field_raises_and_names_it(field, value, error):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_stop_needs_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_greedy_needs_n_1():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(temperature=0.0, n=2)
    assert SamplingParams(temperature=0.5, n=2).n == 2


def test_normalisations():
    p = SamplingParams(top_k=-1, seed=-1, stop="END", stop_token_ids=(5, 6), logprobs=True, prompt_logprobs=True)
    assert p.top_k == 0 and p.seed is None
    assert p.stop == ["END"] and p.stop_token_ids == [5, 6]
    assert p.logprobs == 1 and p.prompt_logprobs == 1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    # a top_k past int32 keeps every token of any vocabulary: disabled (the samplers hold int32)
    assert SamplingParams(top_k=2**70).top_k == 0 and SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    # ints are accepted for float fields and stored as floats
    q = SamplingParams(temperature=1, top_p=1)
    assert isinstance(q.temperature, float) and isinstance(q.top_p, float)


def test_greedy_resets_filters_and_sampling_type():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2, seed=3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY and p.is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM


def test_tiny_positive_temperature_is_raised_like_vllm(caplog):
    p = SamplingParams(temperature=1e-3, top_k=5)
    assert p.temperature == 0.01 and p.top_k == 5 and not p.is_greedy
    assert "temperature" in caplog.text
    assert SamplingParams(temperature=0.01).temperature == 0.01


def test_replace_validates_and_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[7], top_k=3)
    q = p.replace(temperature=0.5, max_tokens=4)
    assert (q.temperature, q.max_tokens, q.top_k, q.stop) == (0.5, 4, 3, ["a"])
    assert (p.temperature, p.max_tokens) == (1.0, 16)
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0.0)
    with pytest.raises(TypeError, match="bogus"):
        p.replace(bogus=1)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")
    c.stop_token_ids.append(8)
    assert p.stop == ["a"] and p.stop_token_ids == [7]


def test_repr_shows_the_fields_that_differ_from_defaults():
    assert repr(SamplingParams()) == "SamplingParams()"
    r = repr(SamplingParams(temperature=0.5, stop="x", max_tokens=None))
    assert r == "SamplingParams(temperature=0.5, stop=['x'], max_tokens=None)"


@given(
    temperature=st.floats(0.0, 5.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0.0, 1.0),
    penalties=st.tuples(st.floats(-2.0, 2.0), st.floats(-2.0, 2.0), st.floats(0.01, 5.0)),
    max_tokens=st.one_of(st.none(), st.integers(1, 100)),
)
def test_valid_values_always_construct(temperature, top_p, top_k, min_p, penalties, max_tokens):
    presence, frequency, repetition = penalties
    p = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition, max_tokens=max_tokens,
    )  # fmt: skip
    assert p.top_k >= 0
    assert p.is_greedy == (temperature < 1e-5)
    if p.is_greedy:
        assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    else:
        assert p.temperature >= 0.01
        assert (p.top_p, p.top_k, p.min_p) == (top_p, max(top_k, 0), min_p)


FLOAT_FIELDS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"]
INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_rejects_non_finite_values(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_field_rejects_bools(field):
    with pytest.raises(TypeError, match=f"{field} must be a number"):
        SamplingParams(**{field: True})


@pytest.mark.parametrize(
    "field, value",
    [
        (field, value)
        for field in INT_FIELDS
        for value in (True, 1.0, 1.5, "1")
        # vLLM's logprobs=True means 1 (test_normalisations)
        if not (field in ("logprobs", "prompt_logprobs") and value is True)
    ],
)
def test_every_int_field_rejects_bools_floats_and_strings(field, value):
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        SamplingParams(**{field: value})


def test_huge_finite_values_are_kept_or_rejected_by_range():
    """1e308 is finite: a temperature or repetition penalty that large is valid (the sampler computes it
    at its float32 bound, tests/engine/test_sampler.py); the bounded fields name their range."""
    assert SamplingParams(temperature=1e308).temperature == 1e308
    assert SamplingParams(repetition_penalty=1e308).repetition_penalty == 1e308
    for field, message in [
        ("top_p", r"top_p must be in \(0, 1\]"),
        ("min_p", r"min_p must be in \[0, 1\]"),
        ("presence_penalty", r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", r"frequency_penalty must be in \[-2, 2\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**{field: 1e308})


def test_logit_bias_allowed_token_ids_and_bad_words_are_normalised():
    p = SamplingParams(logit_bias={"3": 500, 4: -1e9, 5: 0.25}, allowed_token_ids=(7, 2), bad_words=("ab", " c"))
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 0.25}  # OpenAI's [-100, 100]
    assert p.allowed_token_ids == [7, 2] and p.bad_words == ["ab", " c"]
    p.bad_words_token_ids = [[1, 2]]
    q = p.replace(seed=4)
    assert q.logit_bias == p.logit_bias and q.logit_bias is not p.logit_bias
    assert q.bad_words_token_ids == [[1, 2]]  # the engine's tokenization travels with copies
    assert p.replace(bad_words=["x"]).bad_words_token_ids is None


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"logit_bias": [1, 2]}, TypeError, "logit_bias must be a dict"),
        ({"logit_bias": {"x": 1}}, ValueError, "logit_bias keys must be token ids"),
        ({"logit_bias": {1.5: 1}}, TypeError, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1}}, ValueError, "logit_bias holds token id -1"),
        ({"logit_bias": {1: math.nan}}, ValueError, r"logit_bias\[1\] must be a finite number"),
        ({"logit_bias": {1: "hi"}}, TypeError, r"logit_bias\[1\] must be a number"),
        ({"allowed_token_ids": []}, ValueError, "allowed_token_ids is empty"),
        ({"allowed_token_ids": [1, -4]}, ValueError, "allowed_token_ids holds token id -4"),
        ({"allowed_token_ids": [True]}, TypeError, "allowed_token_ids must contain only ints"),
        ({"allowed_token_ids": 3}, TypeError, "allowed_token_ids must be a list"),
        ({"bad_words": "word"}, TypeError, "bad_words must be a list"),
        ({"bad_words": ["ok", ""]}, ValueError, "bad_words cannot contain an empty"),
        ({"bad_words": [3]}, TypeError, "bad_words must contain only strings"),
    ],
)
def test_logit_processor_fields_reject_bad_values(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kw)
