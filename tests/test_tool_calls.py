"""Tool calls through a real server and the official openai client (and LangChain): a named
function and "required" held to their schemas by the grammar, "auto" read by the server's
parser, tool messages in the conversation, streamed as the model writes them; and each parser
on its model's format."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from conftest import ServerProcess

from pagedserve.server.tool_calls import (
    CallStream,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    scan_calls,
)

# A Hermes-style template (as Qwen 2.5's): tools in a system turn, calls and results as tags.
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You can call these functions:
{%- for tool in tools %}
{{ tool.function | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments":
{{- " " ~ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    process = ServerProcess(
        "--served-model-name", "smol", "--chat-template", str(template),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield process
    process.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _arguments_hold(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    schema = tool["function"]["parameters"]
    assert set(arguments) == set(schema["required"])
    for name, value in arguments.items():
        assert value in schema["properties"][name]["enum"]
    return arguments


def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    for seed in range(4):
        chat = client.chat.completions.create(
            model="smol", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        choice = chat.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        _arguments_hold(call, WEATHER)


def test_required_calls_declared_tools_one_at_a_time_without_parallel_calls(client):
    for seed in range(4):
        chat = client.chat.completions.create(
            model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        _arguments_hold(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_auto_reads_the_calls_the_model_writes_with_the_servers_parser(client):
    """The model is held (by a regex) to write a hermes call after some text: the server reads
    it as a tool call, the text before it as content."""
    chat = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
        extra_body={"structured_outputs": {"regex": "Let me check. " + HERMES_CALL}},
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "CET"},
    )
    # Without a call in the text, auto answers with content alone.
    plain = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content and plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "options",
    [
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tool_choice": "required"},
        {"extra_body": {"structured_outputs": {"regex": "Let me check. " + HERMES_CALL}}},
        {"tool_choice": "required", "max_tokens": 15},  # cut short inside the call
    ],
)
def test_streamed_calls_equal_the_whole_response(client, options):
    """The openai client's own accumulation of the streamed deltas gives the whole response's
    content, calls and finish reason (greedy, so the same tokens); each call's arguments come
    in several deltas, as the model writes them, not whole at the end."""
    request = dict(model="smol", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                   max_tokens=120) | options  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    content, calls, finish, pieces = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or piece.id
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
            pieces += bool(piece.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason
    assert (content or None) == whole.message.content
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert all(c["id"] for c in calls.values())
    assert pieces > len(calls)
    if request["max_tokens"] == 15:  # the call as far as it went
        assert finish == "length" and expected[0][1] and not _is_json(expected[0][1])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_tool_results_reach_the_template(server, client):
    """An assistant's calls and the tool's answer go through the template (arguments as
    objects); the model then answers from them."""
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]  # fmt: skip
    tokens = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": conversation, "tools": [WEATHER], "return_token_strs": True},
    ).json()["token_strs"]
    text = "".join(tokens).replace("Ġ", " ").replace("Ċ", "\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>18 degrees and sunny</tool_response>" in text
    answer = client.chat.completions.create(
        model="smol", messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=16
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}
                ],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "[1"}}
                        ],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_refused_by_field(server, body, field):
    request = {"model": "smol", "messages": ASK, "max_tokens": 4, **body}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field or field in error["message"], error


def test_auto_needs_the_servers_parser():
    """Without --enable-auto-tool-choice, tools without a tool_choice (auto) are refused by name;
    named and none still work."""
    process = ServerProcess("--served-model-name", "smol")
    try:
        url = f"{process.base_url}/v1/chat/completions"
        refused = httpx.post(url, json={"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in refused.json()["error"]["message"]
        named = {"type": "function", "function": {"name": "get_weather"}}
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": named, "max_tokens": 40}
        assert httpx.post(url, json=body).status_code == 200
    finally:
        process.close()


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            HermesParser(),
            'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            "Sure. ",
            [("f", {"a": 1}), ("g", {})],
        ),
        (
            HermesParser(),
            "<tool_call>{not json}</tool_call>",
            "<tool_call>{not json}</tool_call>",
            [],
        ),
        (HermesParser(), "no call here", "no call here", []),
        (
            Llama3JsonParser(),
            '<|python_tag|>{"name": "f", "parameters": {"a": "x"}}; '
            '{"name": "g", "parameters": {}}',
            None,
            [("f", {"a": "x"}), ("g", {})],
        ),
        (Llama3JsonParser(), 'I think {"name": "f"}', 'I think {"name": "f"}', []),
        (
            MistralParser(),
            'ok[TOOL_CALLS][{"name": "f", "arguments": {"b": [1, 2]}}]',
            "ok",
            [("f", {"b": [1, 2]})],
        ),
        (MistralParser(), "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    ],
)
def test_parsers_read_their_models_formats(parser, text, content, calls):
    found_content, found = parser.parse(text)
    assert found_content == content
    assert [(call.name, json.loads(call.arguments)) for call in found] == calls
    if isinstance(parser, MistralParser):
        assert all(len(call.id) == 9 and call.id.isalnum() for call in found)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            HermesParser(),
            'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "}{\\"]", "b": [1, {}]}}\n'
            '</tool_call>\n<tool_call>{"arguments": {"x": null}, "name": "g"}</tool_call>',
        ),
        (HermesParser(), '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'),
        (HermesParser(), '<tool_call>{"name": "f"}</tool_call>'),
        (
            Llama3JsonParser(),
            '{"name": "f", "parameters": {"a": 1.5e3, "b": true}}; {"name": "g", ',
        ),
        (MistralParser(), '[TOOL_CALLS] [{"name": "f", "arguments": {"b": [1, 2]}}, {"name": "h"'),
    ],
)
def test_calls_streamed_piece_by_piece_add_up_to_the_parsed_calls(parser, text):
    """Fed one character at a time, a choice's call deltas add up to the calls parsed from the
    whole text: the same names, the same arguments' text, the same ids' kind; cut short
    (partial), to the calls as far as they went."""
    start = parser.calls_start(text)[1]
    stream, streamed = CallStream(parser.keys, parser.new_id), {}
    for end in range(start, len(text) + 1):
        for piece in stream.deltas(text[start:end], final=end == len(text)):
            call = streamed.setdefault(piece["index"], {"name": "", "arguments": ""})
            call["name"] += piece["function"].get("name", "")
            call["arguments"] += piece["function"]["arguments"]
    _, parsed = parser.parse(text, partial=True)
    assert parsed, text
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (call.name, call.arguments) for call in parsed
    ]
    assert [len(call_id) for call_id, _ in stream.sent] == [len(call.id) for call in parsed]


def test_required_calls_are_read_by_the_same_scanner():
    keys = ("parameters",)
    whole = scan_calls('[{"name": "f", "parameters": {"z": "C"}}]', keys, partial=False)
    assert [(c.name, c.arguments) for c in whole] == [("f", '{"z": "C"}')]
    assert scan_calls('[{"name": "f", "parameters": {"z": "C', keys, partial=False) is None
    (cut,) = scan_calls('[{"name": "f", "parameters": {"z": "C', keys, partial=True)
    assert (cut.name, cut.arguments) == ("f", '{"z": "C')
    assert scan_calls('[{"name": "f", "parameters": 5}]', keys, partial=False) is None
    assert scan_calls("[]", keys, partial=False) is None


def test_streaming_holds_back_what_may_begin_a_call():
    hermes = HermesParser()
    assert hermes.held_from("Let me <tool") == len("Let me ")
    assert hermes.held_from("Let me <tool_call>{") == len("Let me ")
    assert hermes.held_from("Let me see") == len("Let me see")
    assert Llama3JsonParser().held_from(' {"name"') == 0
    assert Llama3JsonParser().held_from("<|python") == 0
    assert Llama3JsonParser().held_from("Hello") == 5
    assert Llama3JsonParser().held_from('{"name"', at_start=False) == len('{"name"')


def test_langchain_binds_tools_and_parses_structured_output(server):
    """LangChain's ChatOpenAI against the server: bind_tools with a forced tool gives a tool
    call with arguments of the tool's schema; with_structured_output parses into the model."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Forecast(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "Oslo", "Lima"]
        celsius: int

    chat = ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", model="smol", max_tokens=60,
        temperature=0, max_retries=0,
    )  # fmt: skip
    message = chat.bind_tools([Forecast], tool_choice="Forecast").invoke(ASK[0]["content"])
    (call,) = message.tool_calls
    assert call["name"] == "Forecast" and call["args"]["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(call["args"]["celsius"], int)
    parsed = chat.with_structured_output(Forecast).invoke(ASK[0]["content"])
    assert isinstance(parsed, Forecast)
