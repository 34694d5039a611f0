"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation of
the chat path: a Messages request becomes a ChatCompletionRequest (system and text blocks as
messages, tool_use and tool_result blocks as OpenAI tool calls and tool messages, tools and
tool_choice as functions, output_config.format as a JSON-schema response_format), runs through
start_chat like any chat, and its answer (or stream of chunks) is turned back into a message (or
Anthropic's event sequence). One tokenizer path, one sampler, one scheduler entry. The routes
are in app.py; errors on these paths take Anthropic's shape (errors.error_response_for).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from pagedserve.server.chat_stream import (
    CallDelta,
    StreamError,
    TextDelta,
    Usage,
    chat_events,
)
from pagedserve.server.protocol import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest, Lenient
from pagedserve.validation import FieldError

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(Lenient):
    type: Literal["image", "document"]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=1024)]


class ToolDefinition(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted; a model without a reasoning mode has nothing to set


class MessagesRequest(Lenient):
    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[TextBlock] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # accepted (user_id), unused
    thinking: dict[str, Any] | None = None  # accepted; this model has no reasoning mode
    stream: bool = False

    def to_chat(self) -> ChatCompletionRequest:
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self._chat_messages(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
        }
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}}
                for t in self.tools
            ]  # fmt: skip
            chat["tool_choice"] = self._tool_choice()
            if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in chat.items() if value is not None}
        )

    def _tool_choice(self) -> str | dict:
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto"
        if choice.type == "any":
            return "required"
        if choice.type == "none":
            return "none"
        if not choice.name:
            raise FieldError("tool_choice.name", 'tool_choice of type "tool" names the tool')
        return {"type": "function", "function": {"name": choice.name}}

    def _chat_messages(self) -> list[dict]:
        chat: list[dict] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _texts(self.system)
            chat.append({"role": "system", "content": system})
        for index, message in enumerate(self.messages):
            blocks = (
                [TextBlock(type="text", text=message.content)]
                if isinstance(message.content, str)
                else message.content
            )
            texts, calls = [], []
            for block in blocks:
                if isinstance(block, ImageBlock):
                    raise FieldError(
                        f"messages.{index}.content",
                        f"this model reads text only; {block.type} blocks are not supported",
                    )
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    function = {"name": block.name, "arguments": json.dumps(block.input)}
                    calls.append({"id": block.id, "type": "function", "function": function})
                else:
                    chat.append(_tool_message(block, index))
            if message.role == "assistant":
                turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
                if calls:
                    turn["tool_calls"] = calls
                if turn["content"] is not None or calls:
                    chat.append(turn)
            elif texts:
                chat.append({"role": "user", "content": "".join(texts)})
        return chat


def _texts(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _tool_message(block: ToolResultBlock, index: int) -> dict:
    if isinstance(block.content, str):
        text = block.content
    else:
        if any(isinstance(part, ImageBlock) for part in block.content):
            raise FieldError(f"messages.{index}.content", "this model reads text only")
        text = _texts(block.content)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes no max_tokens


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def to_message(chat: dict, model: str, message_id: str) -> dict:
    """A whole chat completion as Anthropic's message."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        content.append(
            {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
             "input": json.loads(call["function"]["arguments"] or "{}")}
        )  # fmt: skip
    stop_reason, stop_sequence = _stop(choice, any(b["type"] == "tool_use" for b in content))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": chat["usage"]["prompt_tokens"],
            "output_tokens": chat["usage"]["completion_tokens"],
        },
    }


def _stop(choice: dict, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish; a turn that ends in
    tool calls stops for "tool_use", however it was forced (OpenAI says "stop" for a named one)."""
    reason = choice.get("finish_reason")
    matched = choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if called and reason in ("stop", "tool_calls"):
        return "tool_use", None
    return STOP_REASONS.get(reason, "end_turn" if reason else None), None


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def events(
    chunks: AsyncIterator[str], model: str, message_id: str, input_tokens: int
) -> AsyncIterator[str]:
    """A chat completion's chunks as Anthropic's stream: message_start, ping, per content block
    its start, deltas (text_delta or input_json_delta) and stop, message_delta, message_stop."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    yield _event("message_start", {"message": start})
    yield _event("ping", {})
    blocks = _Blocks()
    stop: tuple[str | None, str | None] = (None, None)
    output_tokens = 0
    async for event in chat_events(chunks):
        if isinstance(event, StreamError):
            yield _event("error", {"error": {"type": "api_error", "message": event.message}})
            return
        if isinstance(event, Usage):
            output_tokens = event.completion_tokens
        elif isinstance(event, TextDelta):
            for started in blocks.open("text", {"type": "text", "text": ""}):
                yield started
            delta = {"type": "text_delta", "text": event.text}
            yield _event("content_block_delta", {"index": blocks.index, "delta": delta})
        elif isinstance(event, CallDelta):
            if event.index not in blocks.calls:
                block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
                for started in blocks.open("tool_use", block):
                    yield started
                blocks.calls[event.index] = blocks.index
            if event.arguments:
                delta = {"type": "input_json_delta", "partial_json": event.arguments}
                index = blocks.calls[event.index]
                yield _event("content_block_delta", {"index": index, "delta": delta})
        else:
            stop = _stop(event.choice, bool(blocks.calls))
    for event in blocks.close():
        yield event
    final = {"stop_reason": stop[0], "stop_sequence": stop[1]}
    yield _event("message_delta", {"delta": final, "usage": {"output_tokens": output_tokens}})
    yield _event("message_stop", {})


class _Blocks:
    """The content blocks of a streamed message: one open at a time, numbered from 0."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.calls: dict[int, int] = {}  # a tool call's index in the chunks -> its block

    def open(self, kind: str, block: dict) -> list[str]:
        """The events that start a block of this kind, unless one is open already (text)."""
        if kind == "text" and self.kind == "text":
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return [
            *events,
            _event("content_block_start", {"index": self.index, "content_block": block}),
        ]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]
