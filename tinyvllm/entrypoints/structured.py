"""A request's output constraint: `response_format` (OpenAI), `structured_outputs` (vLLM's extra
field) or a tool choice that forces a call, as one `StructuredOutputsParams`, checked before the
request is queued.

vLLM's request fields before its 0.12, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
and `guided_whitespace_pattern`, are read as the `structured_outputs` they stand for
(`structured_outputs_of`): vLLM 0.12 dropped them and ignores them since, so that a client written for
the older server gets unconstrained output and no error; here they constrain, and sending them beside
`structured_outputs` is a 400. `guided_decoding_backend` may name only "xgrammar" (or "auto"), as a
vLLM server started with xgrammar required.

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
_LEGACY_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = ("xgrammar", "auto")


def structured_outputs_of(req: Any) -> tuple[StructuredOutputs | None, str]:
    """The request's `structured_outputs` and the name its errors use: the field itself, or the one its
    legacy `guided_*` fields make (module docstring), named after the field that was sent. A
    `structured_outputs` that sets no kind still adds its options; `guided_decoding_backend`
    "xgrammar:disable-any-whitespace" (vLLM's spelling of that option then) sets disable_any_whitespace.

    Raises:
        APIError(400): a `guided_*` kind beside a `structured_outputs` kind, two legacy kinds, or a
            `guided_decoding_backend` other than xgrammar or with an option other than that one.
    """
    disable_ws = _legacy_backend(req.guided_decoding_backend)
    given = [f for f in _LEGACY_KINDS if getattr(req, f) is not None]
    if req.guided_whitespace_pattern is not None:
        given.append("guided_whitespace_pattern")
    so = req.structured_outputs
    if not given and not disable_ws:
        return so, "structured_outputs"
    name = given[0] if given else "guided_decoding_backend"
    if _has_kind(so):
        raise APIError(400, f"{name} and structured_outputs cannot both be sent; send structured_outputs", name)
    kinds = [f for f in given if f in _LEGACY_KINDS]
    if len(kinds) > 1:
        raise APIError(400, f"send one of {', '.join(_LEGACY_KINDS)}; got {', '.join(kinds)}", kinds[1])
    so = StructuredOutputs() if so is None else so.model_copy()
    if kinds:
        setattr(so, "json_schema" if kinds[0] == "guided_json" else _LEGACY_KINDS[kinds[0]], getattr(req, kinds[0]))
    if req.guided_whitespace_pattern is not None:
        so.whitespace_pattern = req.guided_whitespace_pattern
    so.disable_any_whitespace = so.disable_any_whitespace or disable_ws
    return so, name


def _legacy_backend(backend: str | None) -> bool:
    """Whether vLLM's `guided_decoding_backend` asks for compact JSON; APIError(400) for a backend or an
    option we do not have."""
    if backend is None:
        return False
    name, _, options = backend.partition(":")
    if name not in _BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available: structured outputs run on xgrammar; "
            "drop the field or send 'xgrammar'",
            "guided_decoding_backend",
        )
    unknown = [o for o in options.split(",") if o and o != "disable-any-whitespace"]
    if unknown:
        raise APIError(
            400,
            f"guided_decoding_backend option {unknown[0]!r} is not supported (only disable-any-whitespace)",
            "guided_decoding_backend",
        )
    return "disable-any-whitespace" in options.split(",")


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


def _from_structured_outputs(so: StructuredOutputs, name: str = "structured_outputs") -> dict[str, Any]:
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
            f"{name} must set exactly one of {', '.join(_KINDS)}; got " + (", ".join(given) if given else "none"),
            name,
        )
    kind = given[0]
    value = values[kind]
    if kind == "json":
        field = name if name.startswith("guided_") else f"{name}.json"
        schema = value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise APIError(400, f"{field} is not valid JSON: {e}", field) from None
        check_json_schema(schema, field)
        value = schema
    return {kind: value, **_options(so)}


def structured_params(
    ctx: Any,
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    tools: ToolPlan | None = None,
    structured_outputs_name: str = "structured_outputs",
) -> Any:
    """The request's `StructuredOutputsParams`, compiled once to check it; None when unconstrained.
    `structured_outputs_name`: the field `structured_outputs` came from, for errors (`structured_outputs_of`).

    Raises:
        APIError(400): conflicting fields, an invalid or unsatisfiable constraint (`param` names the
            field), a schema or pattern over the server's size limit.
    """
    from_rf = _from_response_format(response_format) if response_format is not None else None
    has_kind = _has_kind(structured_outputs)
    so_name = structured_outputs_name
    if from_rf is not None and has_kind:
        raise APIError(400, f"response_format and {so_name} cannot both constrain a request; send one", so_name)
    if tools is not None and tools.forces_call and (from_rf is not None or has_kind):
        field = "response_format" if from_rf is not None else so_name
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
        kwargs, param = _from_structured_outputs(structured_outputs, so_name), so_name
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
