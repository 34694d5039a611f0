"""OpenAI's error body, and the response that carries it."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# A validation error lists at most this many problems: a body of 200,000 bad items gets a short
# answer, built in no time.
MAX_REPORTED_ERRORS = 3
_MAX_MESSAGE_CHARS = 300
# pydantic names the member of a union a value failed in its location: 'str', 'list[int]', ...
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped, so that a message quoting client text (a
    lone surrogate included) always encodes."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_body(message: str, kind: str, param: str | None = None, code: int | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str, param: str | None = None):
    headers = {"Retry-After": "1"} if status == 503 else None
    return _AsciiJSONResponse(error_body(message, kind, param, status), status, headers=headers)


# Anthropic's error type for each status its SDK maps to an exception.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)


def error_response_for(path: str, status: int, message: str, kind: str, param: str | None = None):
    """The error in the shape of the API the path belongs to: Anthropic's for /v1/messages
    (a field named in the message), OpenAI's elsewhere."""
    if not path.startswith(ANTHROPIC_PATHS):
        return error_response(status, message, kind, param)
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    if param is not None and param not in message:
        message = f"{param}: {message}"
    headers = {"Retry-After": "1"} if status == 503 else None
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return _AsciiJSONResponse(body, status, headers=headers)


def validation_message(error, skip: tuple[str, ...] = (), within: str = "") -> tuple[str, str]:
    """(message, param) of a pydantic ValidationError or FastAPI's RequestValidationError: the
    first few problems, each 'field: what is wrong', and the first field named. skip: location
    parts left out of field names (FastAPI's 'body'); within: the field holding the validated
    object, which names start from."""
    parts, param = [], None
    if isinstance(error, ValidationError):
        details = error.errors(include_url=False, include_input=False, include_context=False)
    else:
        details = error.errors()
    for detail in details[:MAX_REPORTED_ERRORS]:
        location = [str(p) for p in detail.get("loc", ()) if p not in skip]
        location = [p for p in location if not _UNION_MEMBER.match(p)]
        name = ".".join([within, *location] if within else location) or "body"
        param = param or name
        message = str(detail.get("msg")).removeprefix("Value error, ")
        parts.append(f"{name}: {message}"[:_MAX_MESSAGE_CHARS])
    if len(details) > MAX_REPORTED_ERRORS:
        parts.append(f"and {len(details) - MAX_REPORTED_ERRORS} more")
    return "; ".join(parts), param
