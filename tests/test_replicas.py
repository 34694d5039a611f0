"""Replicas on Ray: a real `pagedserve serve -dp 2 --distributed-executor-backend ray` process on a
local Ray instance answers as one engine does, routes shared prefixes to one replica, and keeps
serving while a replica is killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import ServerProcess, metric

from pagedserve import LLM, SamplingParams
from pagedserve.server.process import free_port

MODEL = "default"
PROMPTS = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(32)]
GREEDY_16 = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    """What one engine in this process writes for each prompt (16 greedy tokens)."""
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        prompts = [*PROMPTS, "The capital of France is"]
        return {
            p: r.outputs[0].text
            for p, r in zip(prompts, llm.generate(prompts, params), strict=True)
        }
    finally:
        llm.close()


@pytest.fixture(scope="module")
def server(expected):
    with ServerProcess(
        "--distributed-executor-backend", "ray", "-dp", "2", "--served-model-name", MODEL
    ) as process:
        yield process


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def _health(server) -> dict:
    return httpx.get(f"{server.base_url}/health").json()


def test_32_concurrent_requests_get_what_one_engine_writes(server, expected):
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)

    async def ask(prompt: str) -> str:
        completion = await client.completions.create(model=MODEL, prompt=prompt, **GREEDY_16)
        return completion.choices[0].text

    async def ask_all() -> list[str]:
        return await asyncio.gather(*(ask(prompt) for prompt in PROMPTS))

    assert asyncio.run(ask_all()) == [expected[prompt] for prompt in PROMPTS]
    assert _health(server) == {
        "status": "ok",
        "replicas": [{"replica": 0, "state": "up"}, {"replica": 1, "state": "up"}],
    }
    # Both replicas served: each one's series carries its replica label.
    for replica in ("0", "1"):
        assert (
            metric(server.base_url, "pagedserve:request_success_total", f'replica="{replica}"') > 0
        )
    assert metric(server.base_url, "pagedserve:router_requests_total") == 32


def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(server):
    shared = "You are a careful assistant who answers in one short sentence. " * 6
    client = _client(server)

    def counters(name: str) -> list[float]:
        return [metric(server.base_url, name, f'replica="{r}"') for r in ("0", "1")]

    prompts_before = counters("pagedserve:prompt_tokens_total")
    hits_before = counters("pagedserve:prefix_cache_hits_total")
    by_prefix = metric(server.base_url, "pagedserve:router_requests_total", 'reason="prefix"')
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"{shared}Question {i}?", max_tokens=1)
    grew = [
        a - b
        for a, b in zip(counters("pagedserve:prompt_tokens_total"), prompts_before, strict=True)
    ]
    hits = [
        a - b
        for a, b in zip(counters("pagedserve:prefix_cache_hits_total"), hits_before, strict=True)
    ]
    assert sorted(grew)[0] == 0, grew  # all six went to one replica
    holder = grew.index(max(grew))
    count = httpx.post(f"{server.base_url}/tokenize", json={"prompt": shared}).json()["count"]
    cached = (count - 1) // 16 * 16  # the shared prefix's full blocks (the default block size)
    assert cached >= 64
    assert hits[holder] >= 5 * cached, hits  # the five after the first found them cached
    routed = metric(server.base_url, "pagedserve:router_requests_total", 'reason="prefix"')
    assert routed - by_prefix >= 5


def _replica_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "ray::ReplicaActor"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_a_killed_replica_ends_its_streams_with_an_error_and_comes_back(server, expected):
    client = _client(server)
    ended: dict[int, str] = {}
    first_tokens = threading.Barrier(9, timeout=120)

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for count, _ in enumerate(chunks):
                if count == 0:
                    first_tokens.wait()
            ended[i] = "finished"
        except openai.APIError as error:
            ended[i] = f"error: {error}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    first_tokens.wait()
    pids = _replica_pids()
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    # Requests sent now go to the replica that is up, or are sent again once one is.
    prompt = "The capital of France is"
    later = [
        client.completions.create(model=MODEL, prompt=prompt, **GREEDY_16).choices[0].text
        for _ in range(3)
    ]
    assert later == [expected[prompt]] * 3
    deadline = time.monotonic() + 30
    while _health(server)["status"] != "degraded" and time.monotonic() < deadline:
        time.sleep(0.1)
    health = _health(server)
    assert health["status"] == "degraded"
    assert sorted(r["state"] for r in health["replicas"]) == ["down", "up"]
    for thread in threads:
        thread.join(timeout=300)
    assert len(ended) == 8  # every stream ended: none hangs
    errors = [text for text in ended.values() if text.startswith("error")]
    assert errors and all("stopped during the request" in text for text in errors), ended
    assert len(errors) < 8  # the other replica's streams finished
    deadline = time.monotonic() + 180
    while _health(server)["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _health(server)["status"] == "ok"
    assert len(_replica_pids()) == 2
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY_16)
    assert answer.choices[0].text == expected[PROMPTS[0]]


def _serve_fails(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "loaded" not in done.stdout + done.stderr  # refused before any model was loaded
    return done.stderr


def test_bad_replica_settings_are_refused_before_loading():
    port = free_port()
    assert f"ray_address '127.0.0.1:{port}' is unreachable" in _serve_fails(
        "--distributed-executor-backend", "ray", "--ray-address", f"127.0.0.1:{port}"
    )
    assert "needs --distributed-executor-backend ray" in _serve_fails("-dp", "2")
    cores = len(os.sched_getaffinity(0))
    assert f"data_parallel_size {cores + 1} is more than this machine's {cores} cores" in (
        _serve_fails("--distributed-executor-backend", "ray", "-dp", str(cores + 1))
    )


def test_serving_without_replicas_does_not_import_ray():
    code = "import sys, pagedserve.cli, pagedserve.server.serve; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
