"""`tools` and `tool_choice` of a chat request: checked, and turned into what the request needs.

* ``none``: the tools reach the chat template; the output is plain content.
* ``auto``: the server's ``--tool-call-parser`` finds calls in the model's text (needs
  ``--enable-auto-tool-choice``, as in vLLM). Without ``tool_choice`` in the request, tools mean
  ``auto`` when the server enables it and ``none`` otherwise.
* ``required``: the output is constrained to a JSON array of at least one
  ``{"name": <a tool's name>, "parameters": <that tool's arguments>}`` (vLLM's schema, one ``anyOf``
  branch per tool; at most one item when ``parallel_tool_calls`` is false).
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained
  to that function's ``parameters`` schema and is its one call's arguments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tinyvllm.entrypoints.errors import APIError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the output. `schema`: the constraint (required / named), else None."""

    mode: str  # "none" | "auto" | "required" | "named"
    names: tuple[str, ...] = ()
    function: str | None = None  # the named function
    schema: dict | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


def check_json_schema(schema: Any, param: str) -> None:
    """A JSON schema must be an object that is valid under its metaschema (jsonschema's check)."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object, not {type(schema).__name__}", param)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise APIError(
            400, f"{param} is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""), param
        ) from None


def tool_parameters(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """Each tool's name -> its parameters schema, checking the definitions.

    Raises:
        APIError(400): a tool that is not ``{"type": "function", "function": {"name", ...}}``, a bad
            or repeated name, or parameters that are not a JSON schema.
    """
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{param} must be an object with type 'function'", param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{param}.function must be an object with a name", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400,
                f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                f"{param}.function.name",
            )
        if name in out:
            raise APIError(400, f"tools define the function {name!r} twice", f"{param}.function.name")
        schema = fn.get("parameters")
        if schema is None:
            schema = _ANY_OBJECT
        else:
            check_json_schema(schema, f"{param}.function.parameters")
        out[name] = schema
    return out


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
) -> ToolPlan:
    """The ToolPlan of a request (see the module docstring).

    Raises:
        APIError(400): invalid tools, an unknown ``tool_choice``, one that names no defined tool,
            ``tool_choice`` other than none without tools, ``auto`` on a server without the flags.
    """
    params = tool_parameters(tools) if tools else {}
    if tool_choice is None:
        return ToolPlan("auto" if params and auto_enabled else "none", tuple(params))
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}", "tool_choice"
            )
        if tool_choice == "none":
            return ToolPlan("none", tuple(params))
        if not params:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if tool_choice == "auto":
            if not auto_enabled:
                raise APIError(
                    400,
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                    "tool_choice",
                )
            return ToolPlan("auto", tuple(params))
        return ToolPlan("required", tuple(params), schema=required_schema(params, parallel_tool_calls is not False))
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in params:
        known = ", ".join(params) or "none"
        raise APIError(
            400, f"tool_choice names the function {name!r}, which tools do not define (defined: {known})", "tool_choice"
        )
    return ToolPlan("named", tuple(params), function=name, schema=params[name])


def required_schema(params: dict[str, dict], parallel: bool) -> dict:
    """The JSON schema of "at least one call of the defined tools" (vLLM's shape)."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in params.items()
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
