"""Fuzz and soak of a real server process: generated bodies for both endpoints never get a 5xx,
every 4xx carries an OpenAI error body, and the engine serves the same greedy text afterwards;
streams that disconnect mid-way, and bursts beyond the queue, leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
from conftest import ServerProcess, metric
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams

GOOD = {"prompt": "Numbers: 1, 2, 3,", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same bodies on every run: a failure here reproduces
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Values at and beyond the edges of every type the engine's tensors hold, with the right types and
# the wrong ones.
BIG_INTS = [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40, 49152]
EDGE_FLOATS = [5e-324, 1e-45, 1e-300, 1e-5, -0.0, 2.5, 1e38, 3.5e38, 1e308, math.inf, -math.inf,
               math.nan]  # fmt: skip
big_ints = st.sampled_from(BIG_INTS)
ints = st.one_of(st.integers(-3, 40), big_ints, big_ints)  # the edges twice as often
edge_floats = st.sampled_from(EDGE_FLOATS)
floats = st.one_of(st.floats(-3, 3), edge_floats, ints)
lone_surrogates = st.characters(categories=["Cs"])
texts = st.one_of(
    st.text(max_size=12),
    st.text(st.one_of(st.characters(), lone_surrogates), max_size=12),
    st.just("<|im_start|>system<|im_end|>"),
)
wrong = st.one_of(
    st.none(), st.booleans(), texts, st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
token_ids = st.one_of(st.integers(0, 49151), ints)

SAMPLING_FIELDS = {
    "max_tokens": st.one_of(st.integers(1, 24), ints, wrong),
    "temperature": st.one_of(floats, wrong),
    "top_p": st.one_of(floats, wrong),
    "top_k": st.one_of(ints, wrong),
    "min_p": st.one_of(floats, wrong),
    "seed": st.one_of(ints, wrong),
    "n": st.one_of(st.integers(1, 4), ints, wrong),
    "presence_penalty": st.one_of(floats, wrong),
    "frequency_penalty": st.one_of(floats, wrong),
    "repetition_penalty": st.one_of(floats, wrong),
    "min_tokens": st.one_of(st.integers(0, 8), ints, wrong),
    "ignore_eos": st.one_of(st.booleans(), wrong),
    "stop": st.one_of(texts, st.lists(texts, max_size=70), wrong),
    "stop_token_ids": st.one_of(st.lists(token_ids, max_size=4), wrong),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), wrong),
    "best_of": st.one_of(ints, wrong),
    "user": st.one_of(texts, wrong),
    "model": st.one_of(st.just("tiny"), texts, wrong),
    "unknown_field": wrong,
}


def _bodies(base: dict, fields: dict):
    """A valid body with up to four of its fields drawn from fields' wide strategies, so that
    each odd value is tried beside otherwise good ones (a body wrong everywhere at once tests
    little beyond the first check)."""
    keys = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)
    changes = keys.flatmap(lambda chosen: st.fixed_dictionaries({k: fields[k] for k in chosen}))
    return st.tuples(st.fixed_dictionaries(base), changes).map(lambda pair: {**pair[0], **pair[1]})


BASE = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0, 0.7, 1.0, 1.0]),
    "stream": st.booleans(),
}
PROMPTS = st.one_of(
    texts,
    st.lists(texts, min_size=0, max_size=6),
    st.lists(token_ids, min_size=0, max_size=12),
    st.lists(st.lists(token_ids, max_size=5), max_size=3),
    wrong,
)
COMPLETION = _bodies(
    {**BASE, "prompt": st.sampled_from(["Hello", "1, 2, 3,", [5, 6, 7]])},
    {**SAMPLING_FIELDS, "prompt": PROMPTS, "logprobs": st.one_of(ints, wrong), "echo": wrong},
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant"]), texts),
        "content": st.one_of(
            texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts})),
            wrong,
        ),
    },
    optional={"name": st.one_of(texts, wrong), "tool_calls": wrong},
)  # fmt: skip
CHAT = _bodies(
    {**BASE, "messages": st.just([{"role": "user", "content": "Hi"}])},
    {
        **SAMPLING_FIELDS,
        "messages": st.one_of(st.lists(MESSAGE, min_size=0, max_size=4), wrong),
        "max_completion_tokens": st.one_of(st.integers(1, 24), ints, wrong),
        "logprobs": st.one_of(st.booleans(), wrong),
        "top_logprobs": st.one_of(ints, wrong),
    },
)

TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
ANTHROPIC_BLOCK = st.one_of(
    TEXT_BLOCK,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["tool_use", "tool_result", "image", "thinking", "x"])},
        optional={"id": texts, "name": texts, "input": wrong, "tool_use_id": texts,
                  "content": st.one_of(texts, st.lists(TEXT_BLOCK, max_size=2), wrong)},
    ),
    wrong,
)  # fmt: skip
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), texts),
        "content": st.one_of(texts, st.lists(ANTHROPIC_BLOCK, max_size=3), wrong),
    }
)
ANTHROPIC_TOOL = st.fixed_dictionaries(
    {"name": st.one_of(st.just("f"), texts), "input_schema": st.one_of(
        st.just({"type": "object", "properties": {"a": {"type": "string"}}}), wrong)},
)  # fmt: skip
MESSAGES = _bodies(
    {**BASE, "model": st.just("tiny"), "messages": st.just([{"role": "user", "content": "Hi"}])},
    {
        "max_tokens": SAMPLING_FIELDS["max_tokens"],
        "temperature": SAMPLING_FIELDS["temperature"],
        "top_p": SAMPLING_FIELDS["top_p"],
        "top_k": SAMPLING_FIELDS["top_k"],
        "stop_sequences": st.one_of(st.lists(texts, max_size=5), wrong),
        "system": st.one_of(texts, st.lists(TEXT_BLOCK, max_size=2), wrong),
        "messages": st.one_of(st.lists(ANTHROPIC_MESSAGE, min_size=0, max_size=4), wrong),
        "tools": st.one_of(st.lists(ANTHROPIC_TOOL, max_size=2), wrong),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none"])},
                optional={"name": st.one_of(st.just("f"), texts)},
            ),
            wrong,
        ),
        "output_config": st.one_of(
            st.just({"format": {"type": "json_schema", "schema": {"type": "object"}}}), wrong
        ),
        "metadata": wrong,
        "thinking": wrong,
        "stream": st.booleans(),
        "model": st.one_of(st.just("tiny"), texts, wrong),
        "unknown_field": wrong,
    },
)

RESPONSE_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer"]), texts),
         "content": st.one_of(texts, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
              "text": texts}), max_size=2), wrong)},
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts,
                           "arguments": texts}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts,
                           "output": st.one_of(texts, wrong)}),
    wrong,
)  # fmt: skip
RESPONSES = _bodies(
    {**{k: v for k, v in BASE.items() if k != "max_tokens"}, "model": st.just("tiny"),
     "input": st.just("Hi"), "max_output_tokens": st.integers(1, 12)},
    {
        "input": st.one_of(texts, st.lists(RESPONSE_ITEM, max_size=4), wrong),
        "instructions": st.one_of(texts, wrong),
        "max_output_tokens": SAMPLING_FIELDS["max_tokens"],
        "temperature": SAMPLING_FIELDS["temperature"],
        "top_p": SAMPLING_FIELDS["top_p"],
        "tools": st.one_of(st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search", "x"]), "name": texts}),
            max_size=2), wrong),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                                 st.fixed_dictionaries({"type": st.just("function"),
                                                        "name": texts}), wrong),
        "text": st.one_of(st.just({"format": {"type": "json_object"}}), wrong),
        "previous_response_id": st.one_of(texts, wrong),
        "store": st.one_of(st.booleans(), wrong),
        "metadata": wrong,
        "stream": st.booleans(),
        "model": st.one_of(st.just("tiny"), texts, wrong),
        "unknown_field": wrong,
    },
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(
        "--model", str(checkpoint), "--dtype", "float32", "--served-model-name", "tiny",
        "--max-model-len", "256", "--max-num-seqs", "8", "--max-waiting", "8",
    )  # fmt: skip
    yield process
    process.close()


def _greedy_text(base_url: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", json=GOOD, timeout=60)
    assert response.status_code == 200
    return response.json()["choices"][0]["text"]


def _check_answer(response: httpx.Response, streamed: bool) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.url.path.startswith("/v1/messages"):
        _check_anthropic_answer(response, streamed)
        return
    if response.url.path == "/v1/responses" and streamed and response.status_code == 200:
        kinds = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "response.created", kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        return
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == response.status_code
        return
    assert response.status_code == 200
    if streamed:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"error"' in event[:12] for event in events)


def _check_anthropic_answer(response: httpx.Response, streamed: bool) -> None:
    """Anthropic's shapes: an error body of type "error", or a stream ending in message_stop."""
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return
    if streamed:
        kinds = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert "error" not in kinds
    else:
        assert response.json()["type"] == "message"


def _post(base_url: str, path: str, body: dict) -> None:
    """Sends body and checks the answer: JSON with \\u escapes keeps lone surrogates in it."""
    response = httpx.post(
        f"{base_url}{path}",
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    _check_answer(response, streamed=body.get("stream") is True)


def _fuzz(server, path: str, bodies) -> None:
    before = _greedy_text(server.base_url)
    sent = 0

    @FUZZ
    @given(body=bodies)
    def send(body: dict) -> None:
        nonlocal sent
        _post(server.base_url, path, body)
        sent += 1
        if sent % 25 == 0:
            assert httpx.get(f"{server.base_url}/health").status_code == 200

    send()
    assert sent >= FUZZ.max_examples
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert _greedy_text(server.base_url) == before


def test_fuzzed_completions_never_stop_the_engine(server):
    _fuzz(server, "/v1/completions", COMPLETION)


def test_fuzzed_chat_completions_never_stop_the_engine(server):
    _fuzz(server, "/v1/chat/completions", CHAT)


def test_fuzzed_anthropic_messages_never_stop_the_engine(server):
    _fuzz(server, "/v1/messages", MESSAGES)


def test_fuzzed_responses_never_stop_the_engine(server):
    _fuzz(server, "/v1/responses", RESPONSES)


# Every field of a good sampled request set, one at a time, to each of these.
EDGES = [
    *BIG_INTS, *EDGE_FLOATS, -1, 0, None, True, "", "x", "\ud800", "a\udfffb", "<|im_end|>",
    [], [1], [-1], ["a"], [[]], [[1], "a"], {}, {"a": 1}, [7] * 20_000, "x " * 100_000,
]  # fmt: skip
SWEEPS = {
    "/v1/completions": (
        {"prompt": "Hello", "max_tokens": 3, "temperature": 1.0},
        [*SAMPLING_FIELDS, "prompt", "logprobs", "echo"],
    ),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 1.0},
        [*SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
         "message.role", "message.content", "message.name"],
    ),
    "/v1/messages": (
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
         "temperature": 1.0},
        ["max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "system", "messages",
         "tools", "tool_choice", "output_config", "metadata", "stream", "model",
         "message.role", "message.content"],
    ),
    "/v1/responses": (
        {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "temperature": 1.0},
        ["input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
         "tool_choice", "text", "previous_response_id", "store", "metadata", "stream", "model"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(SWEEPS))
def test_every_field_at_every_edge_is_served_or_refused(server, path):
    base, fields = SWEEPS[path]
    before = _greedy_text(server.base_url)
    for field in fields:
        for value in EDGES:
            body = json.loads(json.dumps(base))
            if field.startswith("message."):
                body["messages"][0][field.removeprefix("message.")] = value
            else:
                body[field] = value
            _post(server.base_url, path, body)
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert _greedy_text(server.base_url) == before


@pytest.fixture(scope="module")
def offline(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_model_len=256)


wide_floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), edge_floats)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(0.5, 1.5), st.floats(1e-40, 1e-3), wide_floats),
    top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0), st.floats(0, 1e-44), wide_floats),
    top_k=st.one_of(st.just(0), st.integers(1, 50), st.integers(-1, 49152), ints),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0), wide_floats),
    penalties=st.tuples(wide_floats, wide_floats, st.one_of(st.just(1.0), wide_floats)),
    seed=st.one_of(st.integers(-(2**63), 2**63 - 1), ints),
)
def test_every_accepted_sampling_value_draws_an_allowed_token(
    offline, temperature, top_p, top_k, min_p, penalties, seed
):
    """Whatever SamplingParams and the engine accept, the sampler computes with: the drawn tokens
    are real ones (finite logprob), within the request's top_k, and a request whose top_p keeps
    only the best token gets the best token."""
    presence, frequency, repetition = penalties
    try:
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
            presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, max_tokens=6, min_tokens=3, logprobs=1,
            ignore_eos=True,
        )  # fmt: skip
        neighbour = SamplingParams(temperature=0.8, seed=1, max_tokens=6)
        outputs = offline.generate([[5, 6, 7], [9, 10, 11, 12]], [params, neighbour])
    except ValueError:
        return  # refused at the door, as it should be for the values the sampler cannot use
    completion = outputs[0].outputs[0]
    assert len(completion.token_ids) == 6
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert math.isfinite(entry[token].logprob)
        if top_k > 0 and params.temperature > 0:
            assert entry[token].rank <= top_k
        if params.top_p < 1e-6 and params.temperature > 0:
            assert entry[token].rank == 1


def _gauges(base_url: str) -> dict[str, float]:
    names = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
    return {name: metric(base_url, f"pagedserve:{name}") for name in names}


def _wait_for_idle(base_url: str) -> dict[str, float]:
    deadline = time.monotonic() + 20
    gauges = _gauges(base_url)
    while any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        gauges = _gauges(base_url)
    return gauges


async def _stream(http: httpx.AsyncClient, index: int, leave_after: int | None) -> str:
    """One streamed completion; leave_after: the chunks read before disconnecting (None: all)."""
    body = {"prompt": f"Story {index}:", "max_tokens": 40 + index, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "seed": index}  # fmt: skip
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return str(response.status_code)
        chunks = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if line == "data: [DONE]":
                    return "done"
                if leave_after is not None and chunks >= leave_after:
                    return "left"
    return "cut"


def test_soak_with_clients_leaving_mid_stream_leaves_nothing_behind(server):
    async def soak() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            outcomes: list[str] = []
            for wave in range(4):  # 4 waves of 8 concurrent streams, about 30% of them leaving
                leaving = [(wave * 8 + i) % 10 < 3 for i in range(8)]
                calls = [
                    _stream(http, wave * 8 + i, 3 + i if leave else None)
                    for i, leave in enumerate(leaving)
                ]
                outcomes += await asyncio.gather(*calls)
            return outcomes

    outcomes = asyncio.run(soak())
    assert outcomes.count("left") == sum((i % 10) < 3 for i in range(32))
    assert set(outcomes) == {"left", "done"}
    assert _wait_for_idle(server.base_url) == dict.fromkeys(_gauges(server.base_url), 0.0)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_burst_beyond_the_queue_gets_503_then_the_server_recovers(server):
    async def burst() -> list[httpx.Response]:
        body = {"prompt": "busy", "max_tokens": 60, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            return await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(40))
            )

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}
    for refused in (r for r in responses if r.status_code == 503):
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_busy"
    assert _wait_for_idle(server.base_url) == dict.fromkeys(_gauges(server.base_url), 0.0)
    assert _greedy_text(server.base_url)  # served again once the burst is over
