"""Checks shared by SamplingParams, the engine and the server: each names the field it refuses."""

from __future__ import annotations

import math
import struct


class FieldError(ValueError):
    """A request value refused, with the request field it came from (the server's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def as_float32(field: str, value: float) -> float:
    """value rounded to float32, the precision the sampler computes in; FieldError when float32
    holds it only as infinity."""
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        rounded = math.inf
    if math.isinf(rounded):
        raise FieldError(field, f"{field} {value} is beyond float32's range")
    return rounded


def check_unicode(field: str, text: str) -> None:
    """FieldError when text holds a lone surrogate: valid in JSON's \\u escapes, yet no character,
    and the tokenizer cannot encode it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise FieldError(
                field,
                f"{field} is not valid Unicode: lone surrogate {text[error.start]!r} at "
                f"character {error.start}",
            ) from None
