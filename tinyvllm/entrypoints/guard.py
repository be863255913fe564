"""The server's edge: what every HTTP request passes before any handler runs.

`RequestGuard` (pure ASGI, the app's outermost middleware):
- while the server drains (see `tinyvllm.entrypoints.shutdown`), answers every new request 503;
- refuses a body over `max_body_bytes`: at once when Content-Length says so (nothing is read), else
  as soon as the bytes received pass the limit (a chunked body is cut there), with 413;
- gives the whole body `body_timeout_s` seconds to arrive (slow clients), else 408;
- turns an unexpected exception into one logged line and a 500 in OpenAI's shape on a connection
  that stays open (Starlette's own handler logs it twice and drops the connection);
- counts the requests in flight for the drain;
- hands the route the send it received, as `scope[BODY_SEND]`: a response that streams many body
  messages (SSE) sends its start through the middlewares inside this one and its body messages
  straight to this send. Those middlewares (CORS, the API key check, Starlette's exception
  middleware and the route's wrapper) look at a response's start only, and each would cost an await
  per SSE event. A middleware added inside this one that reads or rewrites response bodies must not
  be skipped: it must then drop the key from the scope.

`header_timeout_protocol(seconds)`: uvicorn's httptools protocol with a deadline on the request line
and headers (uvicorn has none: a client sending one header byte a minute holds a connection forever).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tinyvllm.entrypoints.errors import APIError, error_json
from tinyvllm.entrypoints.limits import ServerLimits
from tinyvllm.entrypoints.shutdown import Drain

logger = logging.getLogger(__name__)

_CLOSE = {"Connection": "close"}
BODY_SEND = "tinyvllm.body_send"  # scope key: the send RequestGuard received (see the module docstring)


async def send_error(send: Any, status: int, message: str, param: str | None = None, close: bool = False) -> None:
    body = error_json(status, message, param).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)", None, _CLOSE)


class RequestGuard:
    def __init__(self, app: Any, limits: ServerLimits, drain: Drain) -> None:
        self.app = app
        self.limits = limits
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.drain.refused += 1
            await send_error(send, 503, self.drain.reason, close=True)
            return
        limit = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            e = body_too_large(limit)
            await send_error(send, 413, e.message, close=True)
            return
        started = False
        received = 0
        more_body = True
        loop = asyncio.get_running_loop()
        body_deadline = loop.time() + self.limits.body_timeout_s

        async def guarded_receive() -> Any:
            nonlocal received, more_body
            if not more_body:
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s (--request-body-timeout)",
                    None,
                    _CLOSE,
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more_body = message.get("more_body", False)
                if received > limit:
                    more_body = False
                    raise body_too_large(limit)
            else:
                more_body = False
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        scope[BODY_SEND] = send
        self.drain.active += 1
        try:
            await self.app(scope, guarded_receive, tracking_send)
        except asyncio.CancelledError:
            if not self.drain.draining:
                raise
            self.drain.cut += 1  # uvicorn cancels what is left at the very end of a shutdown
        except Exception as e:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, 500, f"internal error: {type(e).__name__}: {e}", close=more_body)
        finally:
            self.drain.active -= 1


def header_timeout_protocol(seconds: float) -> Any:
    """uvicorn's httptools protocol class whose connections close (after a 408) when a request's line
    and headers are not complete `seconds` after the connection opened or the request began; None when
    httptools is not installed (uvicorn then uses h11, without this deadline)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm()  # a response is under way: the next request's headers can wait for it
                return
            body = error_json(408, f"the request headers did not arrive within {seconds:g} s").encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            self.transport.close()

    return HeaderTimeoutProtocol
