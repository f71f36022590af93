"""What one HTTP request may hold of the server: `RequestLimits`, the outermost ASGI middleware.

- **Concurrent requests** (`limit_concurrency`, uvicorn's `--limit-concurrency`): beyond the cap
  a request is answered 503 with `Retry-After` at once, before its body is read. The monitoring
  routes (`/health`, `/ping`, `/metrics`) are never counted nor refused, so a load balancer still sees a
  live server while the cap is full.
- **Header count** (`h11_max_header_count`, vLLM's flag): more headers than that is a 431.
  (Their total size is bounded earlier, by Hypercorn: `--h11-max-incomplete-event-size`.)
- **Body deadline** (`request_body_timeout`): the whole body must arrive within this many
  seconds of the request's start, or the request is answered 408 and its connection closed;
  a client that sends its body a byte every few seconds holds nothing for long. Only the body
  is timed: once it is complete, `receive()` waits as long as the response runs (that is how a
  streaming response sees the client leave).
- **An answer before the body** (a 401, 408, 413, 431 or 503 sent while the client may still be
  sending) carries `Connection: close`. Hypercorn closes such a connection after the response
  (h11 cannot start the next request mid-body); without the header a keep-alive client would
  send its next request on it and see "Server disconnected without sending a response".

What is *not* bounded here, and why: an ASGI app sees requests, not connections, so a connection
that never completes its headers never reaches this middleware. Hypercorn bounds those in time,
not in number: its keep-alive timer (`--timeout-keep-alive`) runs from the moment a connection
opens (or its last response ends) until a request's headers are complete, trickled bytes do not
reset it, and at the end the connection is closed. Hypercorn's own `read_timeout` is left off:
it times each read, so it would cut a client that waits silently for a long response.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from triollm.api.openai_errors import APIError

__all__ = ["UNCOUNTED_PATHS", "RequestLimits"]

# Routes that are never counted against `limit_concurrency` nor refused by it.
UNCOUNTED_PATHS = frozenset({"/health", "/ping", "/metrics"})


class RequestLimits:
    """See the module docstring. `limit_concurrency` None: no cap."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit_concurrency: int | None,
        max_header_count: int,
        body_timeout: float,
    ) -> None:
        self.app = app
        self.limit = limit_concurrency
        self.max_header_count = max_header_count
        self.body_timeout = body_timeout
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive, send = _close_if_unread(scope, receive, send)
        if len(scope["headers"]) > self.max_header_count:
            error = APIError(
                431, f"Too many request headers: {len(scope['headers'])} (limit {self.max_header_count}, "
                "--h11-max-header-count)",
            )
            await error.response()(scope, receive, send)
            return
        if scope.get("path", "").rstrip("/") in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.limit is not None and self.in_flight >= self.limit:
            error = APIError(
                503, f"The server is at its limit of {self.limit} concurrent requests "
                "(--limit-concurrency); retry later",
            )
            error.headers["Retry-After"] = "1"
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, _timed_body(receive, self.body_timeout), send)
        finally:
            self.in_flight -= 1


def _close_if_unread(scope: Scope, receive: Receive, send: Send) -> tuple[Receive, Send]:
    """`receive` and `send` that add `Connection: close` to a response started while the
    request's body (declared by Content-Length or Transfer-Encoding) is not wholly received."""
    headers = dict(scope["headers"])
    unread = headers.get(b"content-length", b"0").strip() not in (b"", b"0") or b"transfer-encoding" in headers

    async def tracked_receive() -> Message:
        nonlocal unread
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            unread = False
        return message

    async def closing_send(message: Message) -> None:
        if unread and message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await send(message)

    return tracked_receive, closing_send


def _timed_body(receive: Receive, timeout: float) -> Receive:
    """`receive` with a deadline, `timeout` seconds from now, on the body's messages; a 408
    `APIError` when it passes (the endpoints render it)."""
    deadline = anyio.current_time() + timeout
    body_done = False

    async def timed_receive() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            with anyio.fail_after(max(deadline - anyio.current_time(), 0.0)):
                message = await receive()
        except TimeoutError:
            raise APIError(
                408, f"The request body did not arrive within {timeout:g} s (--request-body-timeout)"
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return timed_receive
