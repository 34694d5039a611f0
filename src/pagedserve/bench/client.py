"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Plain HTTP, no engine import: the same client measures our server and any other one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from pagedserve.bench.metrics import RequestResult


@dataclass
class Target:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, prompt: list[int] | str, max_tokens: int) -> dict:
    """Greedy, end-of-sequence ignored so that max_tokens is the output length, usage streamed."""
    body = {
        "model": target.model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send(client: httpx.AsyncClient, target: Target, body: dict) -> RequestResult:
    """Sends one request and records when each chunk with output arrived; never raises."""
    result = RequestResult(start=time.perf_counter())
    try:
        url = target.base_url.rstrip("/") + target.endpoint
        async with client.stream("POST", url, json=body, headers=target.headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if _read_event(line, result, target.chat):
                    break
        result.end = time.perf_counter()
        _check_complete(result)
    except Exception as error:  # a failed request is counted and listed, never fatal
        result.error = f"{type(error).__name__}: {error}"
    return result


def _read_event(line: str, result: RequestResult, chat: bool) -> bool:
    """Applies one server-sent-event line to result; True at the end of the stream."""
    if not line.startswith("data:"):
        return False
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        raise RuntimeError(f"error event: {event['error']}")
    now = time.perf_counter()
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        # A last token may decode to no text and still arrive, with its finish_reason.
        if text or choice.get("finish_reason") is not None:
            result.token_times.append(now)
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = usage["prompt_tokens"]
        result.output_tokens = usage["completion_tokens"]
    return False


def _check_complete(result: RequestResult) -> None:
    if not result.token_times:
        raise RuntimeError("the stream carried no output")
    if result.output_tokens == 0:
        raise RuntimeError("the stream had no usage chunk (stream_options.include_usage)")
