"""Errors in OpenAI's JSON shape, as vLLM writes them:

{"error": {"message": "...", "type": "BadRequestError", "param": "temperature", "code": 400}}
"""

from __future__ import annotations

import json

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised by handlers; the app turns it into a JSON error response with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param, "code": status}}


def error_json(status: int, message: str, param: str | None = None) -> str:
    return json.dumps(error_body(status, message, param))
