"""A chat completion's streamed chunks (the SSE text the chat path writes) read back as events, for
the APIs that translate the chat path into their own streams (messages.py, responses_api.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class TextDelta:
    text: str


@dataclass
class CallDelta:
    index: int  # the call's index in the choice
    id: str | None  # given on the call's first delta
    name: str | None  # given on the call's first delta
    arguments: str  # the next piece of its arguments' text


@dataclass
class Finish:
    choice: dict  # finish_reason and stop_reason, as the chat chunk has them


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class StreamError:
    message: str


ChatEvent = TextDelta | CallDelta | Finish | Usage | StreamError


async def chat_events(chunks: AsyncIterator[str]) -> AsyncIterator[ChatEvent]:
    """One choice's stream (n = 1) as events, until [DONE] or an error."""
    async for text in chunks:
        data = text.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            yield StreamError(chunk["error"]["message"])
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
            yield Usage(usage["prompt_tokens"], usage["completion_tokens"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content"):
                yield TextDelta(delta["content"])
            for call in delta.get("tool_calls") or []:
                function = call.get("function", {})
                yield CallDelta(
                    call["index"], call.get("id"), function.get("name"),
                    function.get("arguments") or "",
                )  # fmt: skip
            if choice.get("finish_reason"):
                yield Finish(choice)
