"""Anthropic's Messages API, driven by the official `anthropic` SDK against a real server with an
API key: create, stream, parse, count_tokens, a forced tool call and its result, and errors in
Anthropic's shape with the SDK's exceptions."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import ServerProcess
from pydantic import BaseModel

KEY = "messages-test-key"
MODEL = "default"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Current SDKs no longer take sampling fields as arguments; older clients send them, and the
# server honours them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", KEY, "--served-model-name", MODEL) as process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_create_and_stream_give_the_same_greedy_text(client):
    created = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=QUESTION,
        system="You answer in one sentence.",
    )  # fmt: skip
    assert created.type == "message" and created.role == "assistant"
    assert created.id.startswith("msg_")
    [block] = created.content
    assert block.type == "text" and block.text
    assert created.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=QUESTION,
        system="You answer in one sentence.",
    ) as stream:  # fmt: skip
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text
    assert final.usage.output_tokens == created.usage.output_tokens
    assert final.usage.input_tokens == created.usage.input_tokens
    assert final.stop_reason == created.stop_reason
    counted = client.messages.count_tokens(
        model=MODEL, messages=QUESTION, system="You answer in one sentence."
    )
    assert counted.input_tokens == created.usage.input_tokens


def test_the_stream_is_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": QUESTION, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        kinds = [line.removeprefix("event: ") for line in response.iter_lines()
                 if line.startswith("event: ")]  # fmt: skip
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}


class City(BaseModel):
    name: str
    country: str


def test_parse_gives_an_object_of_the_schema(client):
    parsed = client.messages.parse(
        model=MODEL, max_tokens=64, extra_body=GREEDY, output_format=City,
        messages=[{"role": "user", "content": "Name a city in Italy."}],
    )  # fmt: skip
    assert isinstance(parsed.parsed_output, City)


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


class WeatherInput(BaseModel):
    city: str


def test_a_forced_tool_call_then_its_result(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(
        model=MODEL, max_tokens=48, extra_body=GREEDY, messages=question, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert called.stop_reason == "tool_use"
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    WeatherInput.model_validate(use.input)
    with client.messages.stream(
        model=MODEL, max_tokens=48, extra_body=GREEDY, messages=question, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()  # its input assembled from input_json_delta
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    answer = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER],
        messages=[
            *question,
            {"role": "assistant", "content": [block.model_dump() for block in called.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
            ]},
        ],
        tool_choice={"type": "none"},
    )  # fmt: skip
    assert answer.content[0].type == "text" and answer.content[0].text


def test_errors_are_anthropics_with_the_sdks_exceptions(client, server):
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", body={"model": MODEL, "messages": QUESTION}, cast_to=object)
    assert missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        client.messages.create(
            model=MODEL, max_tokens=8,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo="}},
            ]}],
        )  # fmt: skip
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=8, messages=QUESTION)
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert refused.value.body["error"]["type"] == "authentication_error"
    # The OpenAI paths keep OpenAI's shape and take the key as a bearer token.
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": -1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 400 and "param" in json.loads(response.text)["error"]
