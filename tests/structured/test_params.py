"""StructuredOutputsParams: exactly one kind, types checked, a cache key by content, copies."""

from __future__ import annotations

import pytest

from tinyvllm import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind():
    with pytest.raises(ValueError, match=r"exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json and regex"):
        StructuredOutputsParams(json={"type": "string"}, regex="a+")
    with pytest.raises(ValueError, match="got choice and json_object"):
        StructuredOutputsParams(choice=["a"], json_object=True)
    assert StructuredOutputsParams(json_object=False, regex="x").kind == "regex"  # False is "not set"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"json": 5}, TypeError, "json must be a JSON schema"),
        ({"regex": 3}, TypeError, "regex must be a string"),
        ({"grammar": ["root"]}, TypeError, "grammar must be a string"),
        ({"choice": "yes"}, TypeError, "choice must be a list of strings"),
        ({"choice": ["a", 1]}, TypeError, "choice must hold only strings"),
        ({"choice": []}, ValueError, "choice is empty"),
        ({"json_object": 1}, TypeError, "json_object must be a bool"),
        ({"regex": "a", "disable_any_whitespace": "no"}, TypeError, "disable_any_whitespace must be a bool"),
        ({"json_object": True, "whitespace_pattern": r"\s*"}, ValueError, "whitespace_pattern is not supported"),
    ],
)
def test_wrong_types_and_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_checks_the_field_type():
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_key_is_canonical():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key and a.key[0] == "json"
    compact = StructuredOutputsParams(json=a.json, disable_any_whitespace=True)
    assert compact.key != a.key
    assert StructuredOutputsParams(choice=["a", "b"]).key != StructuredOutputsParams(choice=["b", "a"]).key
    assert StructuredOutputsParams(regex="a|b").key == ("regex", "a|b")
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")


def test_clone_replace_and_repr_keep_the_constraint():
    so = StructuredOutputsParams(choice=["yes", "no"])
    p = SamplingParams(temperature=0, structured_outputs=so)
    q = p.clone()
    assert q == p and q.structured_outputs is not so
    q.structured_outputs.choice.append("maybe")
    assert so.choice == ["yes", "no"]  # a deep copy
    r = p.replace(max_tokens=3)
    assert r.structured_outputs == so and r.max_tokens == 3
    assert "structured_outputs=StructuredOutputsParams(" in repr(p)
    assert "structured_outputs" not in repr(SamplingParams())
