"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) as a
translation of the chat path: a request's input items (and, through previous_response_id, the
stored conversation before them) become chat messages, its function tools and text.format become
the chat's tools and response_format; the chat's answer (or stream) comes back as output items
(message with output_text, function_call) or the Responses event stream, each event numbered.

Stored responses (store, the default) are kept in memory, the least recently used dropped past
--max-stored-responses, each with the chat messages that continue it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field

from pagedserve.server.chat_stream import (
    CallDelta,
    Finish,
    StreamError,
    TextDelta,
    Usage,
    chat_events,
)
from pagedserve.server.errors import ApiError
from pagedserve.server.protocol import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest, Lenient
from pagedserve.validation import FieldError

DEFAULT_MAX_STORED_RESPONSES = 1024


class ContentPart(Lenient):
    type: Literal["input_text", "output_text", "input_image", "input_file"]
    text: str | None = None


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=1024)]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    stream: bool = False

    def to_chat(self, earlier: list[dict]) -> ChatCompletionRequest:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += earlier + self.input_messages()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            chat["tools"] = [_function(tool, index) for index, tool in enumerate(self.tools)]
            choice = self.tool_choice
            if isinstance(choice, NamedFunction):
                choice = {"type": "function", "function": {"name": choice.name}}
            chat["tool_choice"] = choice
        format_ = self.text.format if self.text is not None else None
        if format_ is not None and format_.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif format_ is not None and format_.type == "json_schema":
            if format_.schema_ is None:
                raise FieldError("text.format.schema", "a json_schema format needs its schema")
            schema = {"name": format_.name or "output", "schema": format_.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in chat.items() if value is not None}
        )

    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for index, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _text(item, index)})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages


def _text(item: MessageItem, index: int) -> str:
    if isinstance(item.content, str):
        return item.content
    if any(part.type in ("input_image", "input_file") for part in item.content):
        raise FieldError(f"input.{index}.content", "this model reads text only")
    return "".join(part.text or "" for part in item.content)


def _function(tool: FunctionTool, index: int) -> dict:
    if tool.type != "function":
        raise FieldError(
            f"tools.{index}.type",
            f"the hosted tool {tool.type!r} is not available here; only function tools are",
        )
    if not tool.name:
        raise FieldError(f"tools.{index}.name", "a function tool needs its name")
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


class Stored:
    """A response kept for GET and previous_response_id: the object, and the chat messages that
    continue its conversation (its input and its output)."""

    def __init__(self, response: dict, messages: list[dict]):
        self.response, self.messages = response, messages


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self._kept.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r}", "not_found_error", param)
        self._kept.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        self._kept[response_id] = stored
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._kept[response_id]


def new_ids() -> str:
    return f"resp_{uuid.uuid4().hex}"


def envelope(body: ResponsesRequest, response_id: str, model: str, status: str) -> dict:
    """The response object's fields that do not depend on the answer."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, NamedFunction)
            else body.tool_choice or "auto"
        ),
        "parallel_tool_calls": body.parallel_tool_calls,
        "text": {
            "format": body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else {"type": "text"}
        },
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "metadata": body.metadata or {},
        "usage": None,
    }


def _message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish(response: dict, finish_reason: str | None) -> None:
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def to_response(chat: dict, response: dict) -> dict:
    """A whole chat completion as the response's output, usage and status."""
    choice = chat["choices"][0]
    reply = choice["message"]
    if reply.get("content"):
        response["output"].append(_message_item(reply["content"]))
    for call in reply.get("tool_calls") or []:
        function = call["function"]
        response["output"].append(_call_item(call["id"], function["name"], function["arguments"]))
    usage = chat["usage"]
    response["usage"] = _usage(usage["prompt_tokens"], usage["completion_tokens"])
    _finish(response, choice.get("finish_reason"))
    return response


def continuation(chat: ChatCompletionRequest, response: dict) -> list[dict]:
    """The chat messages a later request continues from: this one's (without its instructions,
    which previous_response_id does not carry) and its output."""
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    if response.get("instructions"):
        messages = messages[1:]
    calls = []
    for item in response["output"]:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": item["content"][0]["text"]})
        else:
            calls.append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    if calls:
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    return messages


class _Events:
    """Numbers the events of one stream."""

    def __init__(self):
        self.number = 0

    def __call__(self, kind: str, data: dict) -> str:
        event = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def events(chunks: AsyncIterator[str], response: dict, done) -> AsyncIterator[str]:
    """A chat completion's chunks as the Responses stream; done(response) runs on the finished
    response before response.completed (to store it)."""
    event = _Events()
    yield event("response.created", {"response": {**response, "status": "in_progress"}})
    yield event("response.in_progress", {"response": {**response, "status": "in_progress"}})
    output = response["output"]
    text_item: dict | None = None
    calls: dict[int, dict] = {}
    finish_reason = None
    usage = (0, 0)

    def close_text():
        if text_item is None or text_item["status"] == "completed":
            return []
        index, text = output.index(text_item), text_item["content"][0]["text"]
        text_item["status"] = "completed"
        where = {"item_id": text_item["id"], "output_index": index, "content_index": 0}
        return [
            event("response.output_text.done", {**where, "text": text}),
            event("response.content_part.done", {**where, "part": text_item["content"][0]}),
            event("response.output_item.done", {"output_index": index, "item": text_item}),
        ]

    def close_call(item: dict):
        index = output.index(item)
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        return [
            event(
                "response.function_call_arguments.done", {**where, "arguments": item["arguments"]}
            ),
            event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def close_open():
        open_calls = [item for item in calls.values() if item["status"] != "completed"]
        return close_text() + [event for item in open_calls for event in close_call(item)]

    async for chat_event in chat_events(chunks):
        if isinstance(chat_event, StreamError):
            failed = {
                **response,
                "status": "failed",
                "error": {"code": "server_error", "message": chat_event.message},
            }
            yield event("response.failed", {"response": failed})
            return
        if isinstance(chat_event, Usage):
            usage = (chat_event.prompt_tokens, chat_event.completion_tokens)
        elif isinstance(chat_event, TextDelta):
            if text_item is None:
                text_item = _message_item("", status="in_progress")
                output.append(text_item)
                index = len(output) - 1
                yield event(
                    "response.output_item.added",
                    {"output_index": index, "item": {**text_item, "content": []}},
                )
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event(
                    "response.content_part.added",
                    {
                        "item_id": text_item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "part": part,
                    },
                )
            text_item["content"][0]["text"] += chat_event.text
            yield event(
                "response.output_text.delta",
                {
                    "item_id": text_item["id"],
                    "output_index": output.index(text_item),
                    "content_index": 0,
                    "delta": chat_event.text,
                },
            )
        elif isinstance(chat_event, CallDelta):
            if chat_event.index not in calls:
                for closing in close_open():
                    yield closing
                item = _call_item(chat_event.id, chat_event.name, "", status="in_progress")
                calls[chat_event.index] = item
                output.append(item)
                yield event(
                    "response.output_item.added",
                    {"output_index": len(output) - 1, "item": dict(item)},
                )
            item = calls[chat_event.index]
            if chat_event.arguments:
                item["arguments"] += chat_event.arguments
                yield event(
                    "response.function_call_arguments.delta",
                    {
                        "item_id": item["id"],
                        "output_index": output.index(item),
                        "delta": chat_event.arguments,
                    },
                )
        elif isinstance(chat_event, Finish):
            finish_reason = chat_event.choice.get("finish_reason")
    for closing in close_open():
        yield closing
    response["usage"] = _usage(*usage)
    _finish(response, finish_reason)
    done(response)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(kind, {"response": response})
