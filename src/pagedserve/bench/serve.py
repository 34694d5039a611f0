"""`pagedserve bench serve`: drives an OpenAI-compatible server with a workload, over HTTP only."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np
from tqdm import tqdm

from pagedserve.bench.arrivals import arrival_offsets
from pagedserve.bench.client import Target, request_body, send
from pagedserve.bench.datasets import (
    BenchRequest,
    chat_template_overhead,
    ordinary_token_ids,
    text_with_length,
)
from pagedserve.bench.metrics import QUANTILES, RequestResult, Slo, summarize
from pagedserve.bench.records import ServerTtft, ServeRun, TtftBucket
from pagedserve.bench.server_metrics import Histogram, scrape_ttft


@dataclass
class ServeConfig:
    target: Target
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is Poisson
    max_concurrency: int | None = None
    slo: Slo | None = None
    seed: int = 0
    progress: bool = True
    request_timeout: float | None = None  # seconds between stream reads; None waits forever


def run_serve_benchmark(
    config: ServeConfig, requests: list[BenchRequest], tokenizer=None
) -> ServeRun:
    """Sends every request as config says; returns the run's summary (see metrics.summarize),
    with the server's own TTFT histogram for the run beside the client's TTFTs."""
    with httpx.Client(timeout=30) as probe:
        if config.target.model is None:
            config = replace(
                config, target=replace(config.target, model=served_model(probe, config.target))
            )
        bodies = request_bodies(config.target, requests, tokenizer)
        before = scrape_ttft(probe, config.target.base_url)
        results, duration = asyncio.run(_send_all(config, bodies))
        after = scrape_ttft(probe, config.target.base_url)
    summary = summarize(results, duration, config.slo)
    summary.requested = {
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }
    server = after.minus(before) if before is not None and after is not None else after
    summary.server_ttft = ttft_comparison(server, [r for r in results if r.ok])
    summary.config = {
        "base_url": config.target.base_url,
        "endpoint": config.target.endpoint,
        "model": config.target.model,
        "request_rate": str(config.request_rate),  # JSON has no infinity
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    return summary


def served_model(client: httpx.Client, target: Target) -> str:
    response = client.get(target.base_url.rstrip("/") + "/v1/models", headers=target.headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def request_bodies(target: Target, requests: list[BenchRequest], tokenizer) -> list[dict]:
    """Completions get the token ids themselves, so the server counts exactly prompt_len tokens.
    Chat needs text: it is made to encode to prompt_len tokens once the template is added."""
    if not target.chat:
        return [request_body(target, r.prompt_token_ids, r.output_len) for r in requests]
    if tokenizer is None:
        raise ValueError("the chat endpoint needs a tokenizer to turn token ids into text")
    overhead = chat_template_overhead(tokenizer)
    vocabulary = ordinary_token_ids(tokenizer)
    return [
        request_body(
            target,
            text_with_length(
                tokenizer, r.prompt_token_ids, max(1, r.prompt_len - overhead), vocabulary
            ),
            r.output_len,
        )
        for r in requests
    ]


async def _send_all(config: ServeConfig, bodies: list[dict]) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(bodies), config.request_rate, config.burstiness, config.seed)
    seats = asyncio.Semaphore(config.max_concurrency or len(bodies))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        with tqdm(total=len(bodies), desc="bench serve", disable=not config.progress) as bar:
            started = time.perf_counter()

            async def one(offset: float, body: dict) -> RequestResult:
                await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
                async with seats:
                    result = await send(client, config.target, body)
                bar.update(1)
                return result

            results = await asyncio.gather(*map(one, offsets, bodies))
            return list(results), time.perf_counter() - started


def ttft_comparison(server: Histogram | None, done: list[RequestResult]) -> ServerTtft | None:
    """The server's TTFT histogram beside the client's TTFTs put in the same buckets."""
    if server is None or server.count == 0:
        return None
    # Bucket i holds values <= bounds[i] and above bounds[i - 1], as Prometheus' `le` does.
    slots = np.searchsorted(server.bounds, [r.ttft for r in done], side="left")
    client_counts = np.bincount(slots, minlength=len(server.bounds))
    quantiles = {}
    for q in QUANTILES:
        value = server.quantile(q / 100)
        quantiles[f"p{q}_ms"] = None if value is None else 1000 * value
    buckets = [
        TtftBucket(le_s=str(bound), server=int(count), client=int(client))
        for bound, count, client in zip(
            server.bounds, server.bucket_counts(), client_counts, strict=True
        )
    ]
    return ServerTtft(
        count=server.count, mean_ms=1000 * server.total / server.count, buckets=buckets, **quantiles
    )
