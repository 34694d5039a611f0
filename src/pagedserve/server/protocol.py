"""OpenAI request bodies, validated by pydantic.

Fields no declaration names are ignored (the server logs their names), as vLLM does, so that a
client sending a field of a newer API version still gets its answer. Fields of features the engine
does not implement (suffix, the legacy functions) are declared: accepted where their value asks
for nothing (`functions: []`), refused by name otherwise.

An output constraint comes in one of three spellings (OpenAI's `response_format`, vLLM's
`structured_outputs`, vLLM's older `guided_*` fields); each becomes a StructuredOutputsParams, and
errors name the field the request used.

Every list is bounded, or checked item by item until the first bad one, so that a body's errors
are few however large it is; the sampling fields are checked by SamplingParams and what depends on
the model (vocabulary, context) by the engine."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pagedserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.server import tool_calls
from pagedserve.server.errors import validation_message
from pagedserve.validation import FieldError

MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's limit on tools, and here on one message's calls too
MAX_CONTENT_PARTS = 4096
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


class Lenient(BaseModel):
    """Unknown fields kept aside (model_extra) to be named in the log, not refused."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self, prefix: str = "") -> list[str]:
        return [f"{prefix}{name}" for name in self.model_extra or ()]


def _refused(field: str, what: str):
    return ValueError(f"{field}: {what} is not supported by this server yet")


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Lenient):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self

    def constraint(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class _GenerationRequest(Lenient):
    """The sampling fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None  # accepted and unused, as OpenAI's abuse-monitoring tag
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Literal[1] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's legacy function calling, declared, not implemented: accepted only where it asks
    # for nothing (tools and tool_choice replace it).
    functions: list[Any] | None = None
    function_call: str | dict | None = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list | None, info: ValidationInfo) -> list | None:
        if value:
            raise _refused(info.field_name, "legacy function calling (send tools)")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: str | dict | None, info: ValidationInfo):
        if value not in (None, "none", "auto"):  # with no functions, auto calls none
            raise _refused(info.field_name, f"function call {value!r} (send tool_choice)")
        return value

    @cached_property
    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The output constraint and the field it came in (built once); a FieldError naming the
        fields when more than one asks for one."""
        given: dict[str, dict[str, Any]] = self._tool_constraint()
        if self.response_format is not None and (asked := self.response_format.constraint()):
            given["response_format"] = asked
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for field, key in _GUIDED_FIELDS.items():
            if getattr(self, field) is not None:
                given[field] = {key: getattr(self, field)}
        if not given:
            return None
        if len(given) > 1:
            raise FieldError(
                next(iter(given)), f"one output constraint at a time: {', '.join(given)} given"
            )
        [(field, fields)] = given.items()
        try:
            return field, StructuredOutputsParams(**fields)
        except ValidationError as error:
            raise FieldError(field, validation_message(error, within=field)[0]) from None

    def _tool_constraint(self) -> dict[str, dict[str, Any]]:
        return {}  # chat requests hold a required or named tool call to its schema

    def unknown_fields(self, prefix: str = "") -> list[str]:
        names = super().unknown_fields(prefix)
        if self.stream_options is not None:
            names += self.stream_options.unknown_fields("stream_options.")
        return names

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        constraint = self.constraint
        fields: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": self.logit_bias or None,
            "structured_outputs": constraint[1] if constraint else None,
        }
        # max_tokens None stays: up to the model's context, as OpenAI's chat API and vLLM do.
        set_fields = {k: v for k, v in fields.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, **set_fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens) before the output's
    suffix: str | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _refused("suffix", "text after the insertion point")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One error for the first bad item, where the union would list every item's errors for
        each of its four shapes."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"prompt must be {_PROMPT_SHAPES}")
        if not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value[0], list):
            for index, item in enumerate(value):
                if not isinstance(item, list):
                    raise ValueError(f"prompt[{index}] is not a list of token ids like prompt[0]")
                _check_token_list(f"prompt[{index}]", item)
        elif type(value[0]) is str:
            bad = _first_not_of_type(value, str)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] is not a string like prompt[0]")
        else:
            _check_token_list("prompt", value)
        return value

    def requested_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or logprobs when the prompt is echoed with them: the wider."""
        asked = [self.prompt_logprobs, self.logprobs if self.echo else None]
        given = [count for count in asked if count is not None]
        return max(given) if given else None

    def prompts(self) -> list[str | dict]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}  # fmt: skip


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (OpenAI's shape), or None when none are given."""
    if not tools:
        return None
    return [{"type": "function", "function": _function(tool)} for tool in tools]


def _function(tool: Tool) -> dict[str, Any]:
    return tool.function.model_dump(exclude_none=True, exclude={"strict"})


def _choice_name(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _check_token_list(field: str, items: list) -> None:
    if not items:
        raise ValueError(f"{field} must not be an empty list")
    bad = _first_not_of_type(items, int)
    if bad is not None:
        raise ValueError(f"{field}[{bad}] is not a token id; prompt must be {_PROMPT_SHAPES}")


def _first_not_of_type(items: list, kind: type) -> int | None:
    """The index of the first item that is not exactly a `kind` (a bool is no int here)."""
    return next((i for i, item in enumerate(items) if type(item) is not kind), None)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionDefinition(Lenient):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the parameters are always enforced exactly when held to them


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Lenient):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallMessage(Lenient):
    """A call in an assistant message of the conversation so far."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only in an assistant message that makes tool calls.
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallMessage], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_unless_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are only for assistant messages")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it; tool calls' arguments as objects, as the
        templates of tool-calling models expect them (a ValueError naming a call whose
        arguments are not a JSON object)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                self._template_call(i, call) for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message

    @staticmethod
    def _template_call(index: int, call: ToolCallMessage) -> dict[str, Any]:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(
                f"tool_calls[{index}].function.arguments is not a JSON object: "
                f"{call.function.arguments[:80]!r}"
            )
        function = {"name": call.function.name, "arguments": arguments}
        return {"id": call.id, "type": "function", "function": function}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: the logprobs of the prompt's tokens (the chat template's), top-level in the answer.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    # Without it: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) or choice == "required":
            if not self.tools:
                raise ValueError(f"tool_choice {_choice_name(choice)} needs tools")
            if isinstance(choice, NamedToolChoice) and self.named_function() is None:
                declared = ", ".join(tool.function.name for tool in self.tools)
                raise ValueError(
                    f"tool_choice names {choice.function.name!r}, not among the tools ({declared})"
                )
        return self

    def tool_mode(self) -> str:
        """none, auto, required or named (see server/tool_calls.py)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def named_function(self) -> dict[str, Any] | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        return next(
            (_function(tool) for tool in self.tools or () if tool.function.name == name),
            None,
        )

    def _tool_constraint(self) -> dict[str, dict[str, Any]]:
        mode = self.tool_mode()
        if mode == "named":
            return {"tool_choice": {"json": tool_calls.parameters_schema(self.named_function())}}
        if mode == "required":
            functions = [_function(tool) for tool in self.tools]
            schema = tool_calls.required_schema(functions, self.parallel_tool_calls)
            return {"tool_choice": {"json": schema}}
        return {}

    def unknown_fields(self, prefix: str = "") -> list[str]:
        names = super().unknown_fields(prefix)
        for index, message in enumerate(self.messages):
            names += message.unknown_fields(f"messages[{index}].")
        return names

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(Lenient):
    """vLLM's /tokenize: a prompt (special tokens added, as for a completion) or messages (through
    the chat template, as for a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # shown by templates
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        return self


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_ids(cls, value):
        bad = _first_not_of_type(value, int) if isinstance(value, list) else None
        if not isinstance(value, list) or bad is not None:
            where = f" (tokens[{bad}] is not)" if bad is not None else ""
            raise ValueError(f"tokens must be a list of token ids{where}")
        return value
