"""What the server checks before any handler runs: the API key, from the headers alone, then the
body's size while it is read. A request without the key costs no body read and no parsing; a body
beyond the limit is refused as soon as its length is known or its bytes pass the limit."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import error_response_for

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_KEYED_PATHS = ("/v1", "/tokenize", "/detokenize", "/engine")


class RequestGuard:
    """ASGI middleware: the API's paths (/v1, /tokenize, /detokenize, /engine) need
    `Authorization: Bearer KEY` or `x-api-key: KEY` when a key is set
    (compared in constant time); every body is read here, up to max_body_bytes (413 beyond), and
    handed on whole."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.expected is not None and scope["path"].startswith(_KEYED_PATHS):
            # Anthropic's clients send the key as x-api-key; both are compared, in constant time.
            bearer = headers.get("authorization", "").encode("latin-1")
            key = headers.get("x-api-key", "").encode("latin-1")
            by_bearer = hmac.compare_digest(bearer, self.expected)
            by_key = hmac.compare_digest(key, self.api_key)
            if not (by_bearer or by_key):
                response = error_response_for(
                    scope["path"], 401, "missing or wrong API key", "authentication_error"
                )
                await response(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and not (
            declared.isascii() and declared.isdigit() and int(declared) <= self.max_body_bytes
        ):
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body exceeds {self.max_body_bytes} bytes (--max-request-bytes)"
        response = error_response_for(scope["path"], 413, message, "invalid_request_error")
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read already, then what the client sends next (its
    disconnect, which handlers watch for)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
