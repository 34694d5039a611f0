"""What the server refuses at the door, and how it fails when its engine stops: a real server
process on 127.0.0.1 for each."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from faulty_engine import TRIGGER

API_KEY = "door-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"prompt": "Numbers: 1, 2, 3,", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    process = ServerProcess(
        "--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--api-key", API_KEY,
        "--max-waiting", "4", "--max-request-bytes", str(2**20),
    )  # fmt: skip
    yield process
    process.close()


def _post(base_url: str, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{base_url}{path}", content=body, headers=headers, timeout=60)


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


async def _beside_good(base_url: str, path: str, body: bytes) -> tuple[httpx.Response, str]:
    """Sends body while a good greedy request runs; returns the bad one's response and the good
    one's text."""
    headers = {**AUTH, "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as http:
        good = asyncio.create_task(http.post("/v1/completions", json=GOOD))
        bad = await http.post(path, content=body)
        good_response = await good
    assert good_response.status_code == 200
    return bad, good_response.json()["choices"][0]["text"]


# The fuzz that found each of these is described in issue 27; JSON is written with \u escapes.
DOOR_EXAMPLES = [
    ("/v1/completions", {"temperature": 1, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"temperature": 0, "top_k": 2**63}, "top_k"),  # greedy: a latent bomb
    ("/v1/completions", {"temperature": 1, "top_k": 49153}, "vocabulary"),
    ("/v1/completions", {"prompt": "Hello \ud800"}, "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    ("/v1/completions", {"temperature": 1, "top_p": 5e-324}, "top_p"),
    ("/v1/completions", {"temperature": 1e39}, "temperature"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"n": 2**70}, "n"),
    ("/v1/completions", {"logprobs": 2**64}, "logprobs"),
    ("/v1/completions", {"max_tokens": 2**63}, "max_tokens"),
    ("/v1/completions", {"min_tokens": 2**63}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": [2**63]}, "stop_token_ids"),
    ("/v1/completions", {"stop": [1] * 200_000}, "stop"),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [5] * 200_000}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 20_000}, "characters"),  # refused untokenized
    ("/v1/completions", {"prompt": ["one"] * 8}, "--max-waiting"),  # never admissible: 400
    ("/v1/chat/completions", {"messages": CHAT * 5000}, "messages"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    # The engine's "prompt" is a chat request's messages.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]},
     "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "change", "named"), DOOR_EXAMPLES)
def test_bad_values_are_refused_at_the_door_while_others_run(server, path, change, named):
    base = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT}
    body = json.dumps({**base, "max_tokens": 4, **change}).encode()
    response, text = asyncio.run(_beside_good(server.base_url, path, body))
    error = _assert_openai_error(response, 400)
    assert named in error["message"] or named == error["param"], error
    assert error["param"] is not None
    assert len(response.content) < 2000  # a few errors, however many items were bad
    alone = _post(server.base_url, "/v1/completions", json.dumps(GOOD).encode(), AUTH)
    assert text == alone.json()["choices"][0]["text"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_the_body_limit_answers_413_before_reading_on(server):
    big = json.dumps({"prompt": "x" * (2 * 2**20), "max_tokens": 1}).encode()
    error = _assert_openai_error(_post(server.base_url, "/v1/completions", big, AUTH), 413)
    assert "--max-request-bytes" in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 2**16

    response = httpx.post(
        f"{server.base_url}/v1/completions", content=chunks(), headers=AUTH, timeout=60
    )
    _assert_openai_error(response, 413)


def test_the_key_is_checked_on_the_headers_before_the_body(server):
    url = server.base_url
    for body in (b"{not json", json.dumps({"prompt": "x" * (2 * 2**20)}).encode()):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _assert_openai_error(_post(url, "/v1/completions", body, headers), 401)
            assert error["type"] == "authentication_error"
    _assert_openai_error(_post(url, "/v1/completions", b"{not json", AUTH), 400)
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


def test_a_wrong_key_of_any_length_or_bytes_gets_401(server):
    """The key is compared in constant time (guard.py): every wrong length, from empty to past
    the key's, a key differing in its last byte only, and non-ASCII and non-UTF-8 bytes get
    401, never 500."""
    expected = AUTH["Authorization"].encode()
    wrong = [b"x" * length for length in range(len(expected) + 3)]
    wrong += [expected[:-1] + b"!", expected + b"x", "Bearer clé".encode(), b"Bearer \xff\xfe"]
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for key in wrong:
            response = http.get("/v1/models", headers=[(b"Authorization", key)])
            _assert_openai_error(response, 401)
        assert http.get("/v1/models", headers=[(b"Authorization", expected)]).status_code == 200


@pytest.fixture
def faulty_server(tiny_checkpoint):
    """A server whose engine fails on a step holding faulty_engine.TRIGGER's request."""
    process = ServerProcess(
        "--model", str(tiny_checkpoint("llama")), "--dtype", "float32",
        program=[sys.executable, str(Path(__file__).parent / "faulty_engine.py")],
    )  # fmt: skip
    yield process
    process.close()


def test_when_the_engine_fails_in_flight_requests_get_errors_and_the_server_exits(
    faulty_server,
):
    process = faulty_server.process
    results = asyncio.run(_two_streams_and_the_trigger(faulty_server.base_url))
    streamed, triggered = results[:2], results[2]
    for lines in streamed:
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "choices" in events[0]  # it had begun with 200 ...
        assert events[-1]["error"]["type"] == "server_error"  # ... and ends with an error
        assert "data: [DONE]" not in lines
    error = _assert_openai_error(triggered, 500)
    assert "engine stopped" in error["message"]
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server kept running after its engine stopped")
    assert code == 1
    log = faulty_server.log_tail(20_000)
    assert "requests in the failed step" in log and "cmpl-" in log
    assert "a fault planted by the test" in log


async def _two_streams_and_the_trigger(base_url: str) -> list:
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        started = [asyncio.Event(), asyncio.Event()]

        async def stream(index: int) -> list[str]:
            lines = []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        started[index].set()
            return lines

        streams = [asyncio.create_task(stream(i)) for i in range(2)]
        for event in started:
            await asyncio.wait_for(event.wait(), 60)
        trigger = {"prompt": [*TRIGGER, 5, 6], "max_tokens": 50, "ignore_eos": True}
        triggered = await http.post("/v1/completions", json=trigger)
        return [*(await asyncio.gather(*streams)), triggered]


def test_a_stopped_engine_is_reported_by_health_until_the_exit(faulty_server):
    url = faulty_server.base_url
    trigger = {"prompt": [*TRIGGER, 5], "max_tokens": 20, "ignore_eos": True}
    _assert_openai_error(httpx.post(f"{url}/v1/completions", json=trigger, timeout=60), 500)
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    deadline = time.monotonic() + 30
    while faulty_server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert faulty_server.process.returncode == 1


def test_a_shutdown_during_a_stream_is_no_engine_failure(tiny_checkpoint):
    """SIGTERM while a request streams is an ordinary shutdown: uvicorn stops, then raises the
    signal again (exit by SIGTERM, as a supervisor expects), not the engine failure's status 1."""
    process = ServerProcess("--model", str(tiny_checkpoint("llama")), "--dtype", "float32")
    try:
        body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{process.base_url}/v1/completions", json=body,
                          timeout=60) as response:  # fmt: skip
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            process.process.terminate()
            assert process.process.wait(timeout=60) == -signal.SIGTERM
        assert "engine loop stopped" not in process.log_tail(20_000)
    finally:
        process.close()
