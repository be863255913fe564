"""What one request may ask of the server, and the checks that hold it to that before any costly work.

A request body is parsed here, on a worker thread (`parse_body`): JSON, then a walk over the whole value
that rejects nesting deeper than `max_json_depth` and any string the tokenizer cannot take (a lone
surrogate: JSON's `"\\ud800"` escape decodes to one, and UTF-8 cannot encode it), then pydantic. Every
refusal is an `APIError` naming the field in `param`, in the dotted form pydantic's errors use
(`messages.0.content`).

Why these limits: the API process has one event loop and one GIL. JSON parsing and pydantic hold the GIL
for their whole run (about 30 ms per MB of token ids), so the body limit bounds how long any request
can stall the others; tokenization runs on `encode_batch`, which releases the GIL, but takes ~2.5 us
per character on a CPU, so the prompt-character limit bounds the work a request can queue.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tinyvllm.entrypoints.errors import APIError

if TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")

MiB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of the HTTP server (each a `tinyvllm serve` flag, see serve_cli).

    max_prompt_chars None: derived from the tokenizer (`prompt_char_bound`), a bound that only
    rejects prompts which cannot fit in max_model_len anyway; 0: no limit.
    """

    max_body_bytes: int = 4 * MiB
    max_prompt_chars: int | None = None
    max_n: int = 128  # OpenAI's limit
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logprobs: int = 20  # vLLM's --max-logprobs default
    max_tools_bytes: int = 256 * 1024
    max_json_depth: int = 32
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_stop_strings", "max_stop_string_chars", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_logprobs", "max_tools_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 0:
            raise ValueError(f"max_prompt_chars must be at least 0 (0: no limit), got {self.max_prompt_chars}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("the header and body timeouts must be positive")


def limits_from_cli(ns: Any) -> ServerLimits:
    """ServerLimits from `tinyvllm serve`'s flags (serve_cli.add_limit_cli_args)."""
    return ServerLimits(
        max_body_bytes=ns.max_request_body_bytes,
        max_prompt_chars=ns.max_prompt_chars,
        max_n=ns.max_n,
        max_stop_strings=ns.max_stop_strings,
        max_stop_string_chars=ns.max_stop_string_chars,
        max_logprobs=ns.max_logprobs,
        max_tools_bytes=ns.max_tools_bytes,
        max_json_depth=ns.max_json_depth,
        header_timeout_s=ns.request_header_timeout,
        body_timeout_s=ns.request_body_timeout,
    )


def prompt_char_bound(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a prompt can have and still fit in `max_model_len` tokens, or None when no
    such bound follows from the tokenizer.

    For a byte-level BPE without a normalizer, the tokens of a text partition its UTF-8 bytes, and no
    token covers more than L bytes, L being the longest token's byte length. A text of C characters
    has at least C bytes, so at least C / L tokens: C > max_model_len * L cannot fit. A normalizer may
    shrink text (NFC composes characters), so then there is no bound.
    """
    backend = getattr(tokenizer, "_backend", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        return None
    longest = 1
    for token in backend.get_vocab(with_added_tokens=True):
        text = backend.decode([backend.token_to_id(token)], skip_special_tokens=False)
        longest = max(longest, len(text.encode("utf-8", "replace")))
    return max_model_len * longest


def check_value(value: Any, max_depth: int) -> None:
    """Reject nesting deeper than `max_depth` (the body itself is depth 1) and strings or keys that are
    not valid Unicode text (lone surrogates), naming the place. Iterative: no recursion limit."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > max_depth:
            raise APIError(
                400, f"the request is nested deeper than {max_depth} levels of JSON objects and arrays", _param(path)
            )
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                if isinstance(child, (str, dict, list)):
                    stack.append((child, (*path, key), depth + 1))
        else:
            for i, child in enumerate(item):
                if isinstance(child, (str, dict, list)):
                    stack.append((child, (*path, i), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        raise APIError(
            400,
            f"{_param(path) or 'the body'} is not valid Unicode text: it holds a lone surrogate U+{char:04X} at "
            f"character {e.start} (in JSON, a \\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)",
            _param(path),
        ) from None


def _param(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


# A lone surrogate can only come from a \ud800-\udfff escape (raw bytes encoding one are not UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(body: bytes, model: type[M], max_depth: int) -> M:
    """JSON bytes -> a validated `model`; runs on a worker thread. Raises APIError(400) for a body that
    is not UTF-8 JSON, is too deep or holds invalid text, and pydantic's ValidationError for the rest
    (the app turns it into a 400 naming the field)."""
    try:
        value = json.loads(body)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8: byte {e.start} is {body[e.start]:#04x}") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at character {e.pos}") from None
    except RecursionError:
        raise APIError(
            400, f"the request is nested deeper than {max_depth} levels of JSON objects and arrays"
        ) from None
    if _SURROGATE_ESCAPE.search(body) or body.count(b"[") + body.count(b"{") > max_depth:
        check_value(value, max_depth)  # else it cannot find anything: skip the walk (~50 ns an item)
    del body
    if not isinstance(value, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(value).__name__}")
    return model.model_validate(value)


def check_prompt_chars(text: str, limit: int | None, param: str) -> None:
    """A prompt (or rendered conversation) longer than `limit` characters is refused before tokenizing."""
    if limit and len(text) > limit:
        raise APIError(
            400,
            f"the prompt has {len(text)} characters; this server takes at most {limit} (--max-prompt-chars)",
            param,
        )


def check_stop(stop: str | list[str] | None, limits: ServerLimits) -> None:
    strings = [stop] if isinstance(stop, str) else (stop or [])
    if len(strings) > limits.max_stop_strings:
        raise APIError(400, f"stop has {len(strings)} strings; at most {limits.max_stop_strings} are allowed", "stop")
    for s in strings:
        if len(s) > limits.max_stop_string_chars:
            raise APIError(
                400,
                f"a stop string has {len(s)} characters; at most {limits.max_stop_string_chars} are allowed",
                "stop",
            )


def check_json_size(value: Any, limit: int, param: str) -> None:
    """`value` (tools, a schema) may take at most `limit` bytes as compact JSON."""
    if value is None:
        return
    size = len(json.dumps(value, separators=(",", ":")).encode())
    if size > limit:
        raise APIError(400, f"{param} takes {size} bytes of JSON; at most {limit} are allowed", param)
