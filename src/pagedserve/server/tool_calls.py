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

Streamed, content is sent as it comes until the text may be starting a call (the parser's
marker); what follows is held and read once the choice ends, its calls sent as whole deltas.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{secrets.token_hex(12)}"

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index, **call}


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


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a "required" output; None when it is not the list the grammar holds it to
    (cut short by max_tokens, say)."""
    try:
        return [ToolCall(item["name"], json.dumps(item["parameters"])) for item in json.loads(text)]
    except (ValueError, KeyError, TypeError):
        return None


class ToolCallParser:
    """Reads the calls a model wrote in its own format (tool_choice "auto")."""

    marker = ""  # text that begins a call; content before it is streamed

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls and the whole text as content when none parse."""
        raise NotImplementedError

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


def _call(item: Any, arguments_key: str) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError("not a call")
    arguments = item.get(arguments_key, item.get("arguments", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("arguments are not an object")
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    """The text before the calls, as it streams (whitespace kept), or None when there is none."""
    return text or None


class HermesParser(ToolCallParser):
    """Hermes, Qwen 2.5/3 and most fine-tunes: `<tool_call>{"name", "arguments"}</tool_call>`."""

    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        try:
            calls = [_call(json.loads(body), "arguments") for body in self._CALL.findall(text)]
        except ValueError:  # json.JSONDecodeError is one
            return text, []
        return _content(text[:start]), calls


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}`, several separated by
    `;`, optionally after `<|python_tag|>`; the whole output is the calls."""

    marker = "{"

    def held_from(self, text: str, at_start: bool = True) -> int:
        if not at_start:
            return len(text)  # a call is the whole output or none of it
        stripped = text.lstrip()
        if stripped.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(stripped):
            return 0
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                item, at = decoder.raw_decode(body, at)
                calls.append(_call(item, "parameters"))
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return text, []
        return None, calls


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`, with ids of nine
    letters and digits, as its templates expect them back."""

    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len(self.marker) :].strip())
            items = items if isinstance(items, list) else [items]
            calls = [_call(item, "arguments") for item in items]
        except ValueError:
            return text, []
        for call in calls:
            call.id = "".join(
                secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in "123456789"
            )
        return _content(text[:start]), calls


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
