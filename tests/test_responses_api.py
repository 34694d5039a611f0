"""OpenAI's Responses API, driven by the official `openai` SDK against a real server: create,
stream (the event types in order), parse, a forced function call continued through
previous_response_id, stored responses fetched and deleted, store false, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import ServerProcess
from pydantic import BaseModel

MODEL = "default"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--served-model-name", MODEL, "--max-stored-responses", "4") as process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def test_create_and_stream_give_the_same_greedy_text(client):
    created = client.responses.create(
        model=MODEL, input="What is the capital of France?", instructions="Answer briefly.",
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    assert created.object == "response" and created.id.startswith("resp_")
    assert created.status in ("completed", "incomplete")
    assert created.output_text
    assert created.usage.output_tokens > 0 and created.usage.input_tokens > 0
    kinds, deltas = [], []
    with client.responses.stream(
        model=MODEL, input="What is the capital of France?", instructions="Answer briefly.",
        temperature=0, max_output_tokens=24,
    ) as stream:  # fmt: skip
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
    # A response cut by max_output_tokens ends with response.incomplete, as OpenAI's do (the
    # SDK's get_final_response then has none to give); its response is the whole one.
    assert "".join(deltas) == created.output_text == last.response.output_text
    assert last.response.status == created.status
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    ending = "response.completed" if created.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        ending,
    ]  # fmt: skip
    cut = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


class City(BaseModel):
    name: str
    country: str


def test_parse_gives_an_object_of_the_schema(client):
    parsed = client.responses.parse(
        model=MODEL, input="Name a city in Italy.", text_format=City, temperature=0,
        max_output_tokens=64,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_forced_call_continued_through_previous_response_id(client, server):
    called = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=48,
    )  # fmt: skip
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        temperature=0, max_output_tokens=24,
    )  # fmt: skip
    assert answer.output_text and answer.previous_response_id == called.id
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    with client.responses.stream(
        model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=48,
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    [item] = streamed.output
    assert item.type == "function_call" and json.loads(item.arguments)["city"]


def test_store_false_keeps_nothing_and_the_store_is_bounded(client):
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(
            model=MODEL, input="Again", max_output_tokens=2, previous_response_id=unkept.id
        )
    assert missing.value.body["param"] == "previous_response_id"
    kept = [client.responses.create(model=MODEL, input="Hi", max_output_tokens=2) for _ in range(5)]
    with pytest.raises(openai.NotFoundError):  # --max-stored-responses 4: the oldest went
        client.responses.retrieve(kept[0].id)
    assert client.responses.retrieve(kept[-1].id).id == kept[-1].id
    client.responses.delete(kept[-1].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept[-1].id)


def test_bad_requests_are_400s_naming_the_field(server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, **body})

    hosted = post({"input": "Hi", "tools": [{"type": "web_search"}]})
    assert hosted.status_code == 400 and "web_search" in hosted.json()["error"]["message"]
    assert hosted.json()["error"]["param"] == "tools.0.type"
    assert post({}).status_code == 400
    assert post({"input": "Hi", "max_output_tokens": 0}).status_code == 400
    image = post({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert image.status_code == 400 and "text only" in image.json()["error"]["message"]


def test_an_agents_sdk_agent_runs_its_function_tool_to_a_final_output(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no traces sent to OpenAI's servers

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the get_weather tool.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        # The default model has no tool-call parser, so the call is forced; its result is the
        # answer.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert result.final_output.startswith("Sunny in ")
