"""A request's output constraint: `response_format` (OpenAI), `structured_outputs` (vLLM's extra
field) or a tool choice that forces a call, as one `StructuredOutputsParams`, checked before the
request is queued.

Only one source may constrain a request: `response_format` with a `structured_outputs` kind, or either
with `tool_choice` required / a named function, is a 400 naming both fields. A `structured_outputs`
that sets no kind carries only options (`disable_any_whitespace`, `whitespace_pattern`) for the
constraint that `response_format` or the tool choice makes, as vLLM merges them. The constraint is compiled
here (`tinyvllm.structured.validate`, on the server's worker pool, cached for the engine), so an
invalid or unsatisfiable schema, regex, grammar or choice is a 400 naming the field, never an
engine error.
"""

from __future__ import annotations

import json
from typing import Any

from tinyvllm.entrypoints.errors import APIError
from tinyvllm.entrypoints.limits import check_json_size
from tinyvllm.entrypoints.protocol import ResponseFormat, StructuredOutputs
from tinyvllm.entrypoints.tools import ToolPlan, check_json_schema

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(rf: ResponseFormat) -> dict[str, Any] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    spec = rf.json_schema
    if spec is None or "schema" not in spec:
        raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format.json_schema")
    check_json_schema(spec["schema"], "response_format.json_schema.schema")
    return {"json": spec["schema"]}


def _options(so: StructuredOutputs | None) -> dict[str, Any]:
    if so is None:
        return {}
    out: dict[str, Any] = {"disable_any_whitespace": so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        out["whitespace_pattern"] = so.whitespace_pattern
    return out


def _has_kind(so: StructuredOutputs | None) -> bool:
    if so is None:
        return False
    return any(v not in (None, False) for v in (so.json_schema, so.regex, so.choice, so.grammar, so.json_object))


def _from_structured_outputs(so: StructuredOutputs) -> dict[str, Any]:
    values = {
        "json": so.json_schema,
        "regex": so.regex,
        "choice": so.choice,
        "grammar": so.grammar,
        "json_object": so.json_object,
    }
    given = [k for k in _KINDS if values[k] not in (None, False)]
    if len(given) != 1:
        raise APIError(
            400,
            f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
            + (", ".join(given) if given else "none"),
            "structured_outputs",
        )
    kind = given[0]
    value = values[kind]
    if kind == "json":
        schema = value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise APIError(
                    400, f"structured_outputs.json is not valid JSON: {e}", "structured_outputs.json"
                ) from None
        check_json_schema(schema, "structured_outputs.json")
        value = schema
    return {kind: value, **_options(so)}


def structured_params(
    ctx: Any,
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    tools: ToolPlan | None = None,
) -> Any:
    """The request's `StructuredOutputsParams`, compiled once to check it; None when unconstrained.

    Raises:
        APIError(400): conflicting fields, an invalid or unsatisfiable constraint (`param` names the
            field), a schema or pattern over the server's size limit.
    """
    from_rf = _from_response_format(response_format) if response_format is not None else None
    has_kind = _has_kind(structured_outputs)
    if from_rf is not None and has_kind:
        raise APIError(
            400,
            "response_format and structured_outputs cannot both constrain a request; send one",
            "structured_outputs",
        )
    if tools is not None and tools.forces_call and (from_rf is not None or has_kind):
        field = "response_format" if from_rf is not None else "structured_outputs"
        raise APIError(
            400,
            f"tool_choice {tools.mode if tools.mode == 'required' else repr(tools.function)} constrains the output "
            f"to a tool call; {field} cannot constrain it too",
            field,
        )
    if from_rf is not None:
        kwargs, param = {**from_rf, **_options(structured_outputs)}, "response_format"
    elif tools is not None and tools.schema is not None:
        kwargs, param = {"json": tools.schema, **_options(structured_outputs)}, "tools"
    elif structured_outputs is not None:
        kwargs, param = _from_structured_outputs(structured_outputs), "structured_outputs"
    else:
        return None
    check_json_size(kwargs, ctx.limits.max_tools_bytes, param)
    from tinyvllm.sampling_params import StructuredOutputsParams
    from tinyvllm.structured import validate

    try:
        params = StructuredOutputsParams(**kwargs)
        validate(params, ctx.tokenizer, ctx.vocab_size)
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{param}: {e}", param) from None
    return params
