"""Tool calls: what the model is held to for each tool_choice, and the calls read from its text.

- `"none"` (or no tools): plain text; the template still shows the tools.
- a named function: the output is held, by the structured-output grammar, to a JSON object of
  the function's parameters, which becomes that function's one call (finish_reason "stop", as
  OpenAI answers a forced call).
- `"required"`: held to a JSON list of one or more `{"name": ..., "parameters": ...}` objects,
  each a declared tool with its own parameters (one at most without parallel_tool_calls).
- `"auto"`: unconstrained; the server's --tool-call-parser reads the calls the model wrote in its
  own format (hermes: `<tool_call>{...}</tool_call>`; llama3_json: `{"name": ..., "parameters":
  ...}` objects, optionally after `<|python_tag|>`, separated by `;`; mistral: `[TOOL_CALLS]`
  then a JSON list), with the text before them as the message's content. Text that does not
  parse stays content.

A call's arguments are the text the model wrote for them, as OpenAI returns them, so a stream
can send them as they come: `CallScanner` reads call objects out of the JSON as it grows, and
`CallStream` turns each new piece into deltas (a call's id, type and name once its name is
whole, then its arguments' text). Streamed, content before the calls is sent until the text may
be starting a call (the parser's marker). A call cut short by max_tokens is returned as far as
it went, with finish_reason "length", streamed or not; text that turns out not to be a call
after its first deltas were streamed ends the stream as content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as a JSON schema (an object of anything when it declares none)."""
    return function.get("parameters") or {"type": "object"}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a list of calls, each one declared function with its
    parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": parameters_schema(function),
            },
            "required": ["name", "parameters"],
        }
        for function in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class _Value:
    start: int
    end: int | None = None  # None while the model is still writing it


@dataclass
class CallObject:
    """A call object as far as the text goes: where each of its own keys' values stands."""

    values: dict[str, _Value] = field(default_factory=dict)
    closed: bool = False

    def name(self, text: str) -> str | None:
        value = self.values.get("name")
        if value is None or value.end is None:
            return None
        name = _loads(text[value.start : value.end])
        return name if isinstance(name, str) else None

    def arguments(self, text: str, keys: tuple[str, ...], final: bool) -> str | None:
        """The arguments' text so far; None while there is nothing to show yet. Arguments
        written as a JSON string (some models quote them) show once whole, unquoted."""
        value = next((self.values[key] for key in keys if key in self.values), None)
        if value is None:
            return "{}" if self.closed else "" if final else None
        raw = text[value.start : value.end]
        if not raw.startswith('"'):
            return raw
        if value.end is None:
            return "" if final else None
        unquoted = _loads(raw)
        return unquoted if isinstance(unquoted, str) else raw


class CallScanner:
    """Reads call objects out of JSON text as the model writes it: objects one after another
    (with anything between them outside brackets ignored, e.g. hermes' tags or llama3's `;`),
    or the items of a list when the first bracket is `[`. Each feed reads only the new text.
    Inside a call object, values are found by brackets and quotes alone; json.loads judges
    them once whole."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[CallObject] = []
        self._depth = 0  # brackets open outside strings
        self._level: int | None = None  # the depth of a call object's own keys: 1, or 2 in a list
        self._string: int | None = None  # where the string being read began
        self._escaped = False
        self._key: str | None = None  # read, its value not begun
        self._key_start: int | None = None
        self._value: _Value | None = None  # a call object's value being read
        self._bare = False  # that value is a number, true, false or null

    def feed(self, text: str) -> list[CallObject]:
        """The calls in `text`, the whole text so far (what was fed before, and more)."""
        start, self.text = len(self.text), text
        for at in range(start, len(text)):
            self._read(at, text[at])
        return self.calls

    def _read(self, at: int, char: str) -> None:
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._string = None
                if self._depth == self._level:
                    self._string_ended(at + 1)
            return
        if self._level is None:
            if char not in "[{":
                return
            self._level = 2 if char == "[" else 1
        own = self._depth == self._level and bool(self.calls) and not self.calls[-1].closed
        if own and self._bare and (char in ",}" or char.isspace()):
            self._end_value(at)
        if char in '"{[' and own and self._key is not None and self._value is None:
            self._value = self.calls[-1].values[self._key] = _Value(at)
            self._key, self._bare = None, False
        if char == '"':
            if self._depth > 0:
                self._string = at
                if own and self._value is None:
                    self._key_start = at
        elif char in "{[":
            if char == "{" and self._depth == self._level - 1:
                self.calls.append(CallObject())
                self._key = self._value = None
            self._depth += 1
        elif char in "}]":
            self._depth = max(self._depth - 1, 0)
            if self._depth == self._level and self._value is not None:
                self._end_value(at + 1)
            elif self._depth == self._level - 1 and char == "}" and self.calls:
                self.calls[-1].closed = True
        elif own and self._key is not None and self._value is None and char not in ": \t\r\n":
            self._value = self.calls[-1].values[self._key] = _Value(at)
            self._key, self._bare = None, True

    def _string_ended(self, end: int) -> None:
        if self._value is not None:
            self._end_value(end)
        elif self._key_start is not None:
            self._key, self._key_start = _loads(self.text[self._key_start : end]), None

    def _end_value(self, end: int) -> None:
        assert self._value is not None
        self._value.end, self._value, self._bare = end, None, False


def scan_calls(
    text: str, keys: tuple[str, ...], partial: bool, new_id: Callable[[], str] = new_call_id
) -> list[ToolCall] | None:
    """The calls in text (the JSON after a parser's marker, or "required"'s list), or None when
    it holds none or one that is not a call: a name, and arguments that are a JSON object.
    `partial`: the model was cut short (max_tokens), so the calls are taken as far as they go."""
    calls = []
    for call in CallScanner().feed(text):
        name, arguments = call.name(text), call.arguments(text, keys, final=True)
        if name is None or arguments is None:
            if partial:
                break
            return None
        if not partial and not (call.closed and _is_object(arguments)):
            return None
        calls.append(ToolCall(name, arguments, new_id()))
    return calls or None


def _is_object(text: str) -> bool:
    return isinstance(_loads(text), dict)


def _loads(text: str) -> Any:
    """The JSON value of text, or None when it is not one."""
    try:
        return json.loads(text)
    except ValueError:  # json.JSONDecodeError is one
        return None


class CallStream:
    """One choice's calls, streamed as the model writes them: a call's first delta carries its
    id, type and name once the name is whole; the next ones carry its arguments' new text.
    Calls are sent in order, each once its name is known."""

    def __init__(self, keys: tuple[str, ...], new_id: Callable[[], str] = new_call_id):
        self.keys, self.new_id = keys, new_id
        self.scanner = CallScanner()
        self.sent: list[tuple[str, int]] = []  # each call's id, and its arguments' text sent

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The tool_calls deltas that text, the calls' JSON so far, adds to what was sent."""
        pieces = []
        for index, call in enumerate(self.scanner.feed(text)):
            name = call.name(text)
            arguments = call.arguments(text, self.keys, final) if name is not None else None
            if arguments is None:
                break
            if index == len(self.sent):
                self.sent.append((self.new_id(), len(arguments)))
                pieces.append(ToolCall(name, arguments, self.sent[index][0]).as_dict(index))
            elif len(arguments) > self.sent[index][1]:
                call_id, sent = self.sent[index]
                self.sent[index] = (call_id, len(arguments))
                pieces.append({"index": index, "function": {"arguments": arguments[sent:]}})
        return pieces


class ToolCallParser:
    """Reads the calls a model wrote in its own format (tool_choice "auto")."""

    marker = ""  # text that begins a call; content before it is streamed
    keys = ("arguments",)  # the key of a call's arguments, in the order looked for

    def calls_start(self, text: str) -> tuple[int, int] | None:
        """Where the content ends and the calls' JSON begins, once the text shows a call."""
        start = text.find(self.marker)
        return None if start < 0 else (start, start + len(self.marker))

    def new_id(self) -> str:
        return new_call_id()

    def parse(self, text: str, partial: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls and the whole text as content when none parse."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = scan_calls(text[start[1] :], self.keys, partial, self.new_id)
        return (text, []) if calls is None else (text[: start[0]] or None, calls)

    def held_from(self, text: str, at_start: bool = True) -> int:
        """Where text, the output not yet streamed (all of it when at_start), may begin a call:
        content before there can be streamed."""
        start = text.find(self.marker)
        if start >= 0:
            return start
        # A marker cut off at the end of the text so far is held back too.
        for size in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-size:]):
                return len(text) - size
        return len(text)


class HermesParser(ToolCallParser):
    """Hermes, Qwen 2.5/3 and most fine-tunes: `<tool_call>{"name", "arguments"}</tool_call>`."""

    marker = "<tool_call>"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}`, several separated by
    `;`, optionally after `<|python_tag|>`; the whole output is the calls."""

    marker = "{"
    keys = ("parameters", "arguments")
    _TAG = "<|python_tag|>"

    def calls_start(self, text: str) -> tuple[int, int] | None:
        body = text.lstrip().removeprefix(self._TAG).lstrip()
        return (0, 0) if body.startswith("{") else None

    def held_from(self, text: str, at_start: bool = True) -> int:
        if not at_start:
            return len(text)  # a call is the whole output or none of it
        stripped = text.lstrip()
        if stripped.startswith(("{", self._TAG)) or self._TAG.startswith(stripped):
            return 0
        return len(text)


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, with ids of nine
    letters and digits, as its templates expect them back."""

    marker = "[TOOL_CALLS]"

    def new_id(self) -> str:
        return "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(9))


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
