"""The live page's feed: a summary of the engine's steps, a few times a second, to each viewer.

The engine thread calls observe() after every step. With nobody watching it returns at once. While
someone watches, each step adds one small record (its tokens, and which seat each scheduled
sequence holds, prefill or decode), and at most every PUBLISH_SECONDS the records gathered since
the last snapshot go out with the engine's state (queues, the KV block map, prefix-cache hit
rate, preemptions) and the latency quantiles of the same histograms /metrics serves. A viewer
whose queue is full misses snapshots rather than slowing the engine.

Seats: a request's samples take the lowest free seat when first scheduled and keep it until they
leave the running set, so the page draws continuous batching as rows refilled step by step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.histogram import histogram_quantile
from pagedserve.outputs import StepOutput
from pagedserve.server.metrics import ServerMetrics

PUBLISH_SECONDS = 0.25
_QUEUE_SNAPSHOTS = 8  # per viewer; older ones are dropped when it falls behind
MAX_VIEWERS = 16
_BLOCK_LETTERS = (("free", "f"), ("used", "u"), ("shared", "s"), ("cached", "c"))


class LiveFeed:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self._viewers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = set()
        self._steps: list[list] = []
        self._seats: dict[tuple[str, int], int] = {}
        self._seen_step = -1
        self._last_publish = 0.0

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    def observe(self, engine: LLMEngine, outputs: list[StepOutput]) -> None:
        if not self._viewers:
            if self._seats:
                self._seats.clear()
                self._steps.clear()
            return
        if engine.step_index != self._seen_step and engine.last_scheduled is not None:
            self._seen_step = engine.step_index
            self._record_step(engine)
        now = time.monotonic()
        # The state the engine rests in is always sent, however soon after the last snapshot.
        idle = not engine.has_unfinished_requests()
        if now - self._last_publish >= PUBLISH_SECONDS or (idle and self._steps):
            self._last_publish = now
            self._publish(self._snapshot(engine))

    def _record_step(self, engine: LLMEngine) -> None:
        running = {(seq.request_id, seq.sample_index) for seq in engine.scheduler.running}
        for key in [key for key in self._seats if key not in running]:
            del self._seats[key]
        taken = set(self._seats.values())
        seats, prefill, decode = [], 0, 0
        for seq, num_new in engine.last_scheduled.entries:
            key = (seq.request_id, seq.sample_index)
            seat = self._seats.get(key)
            if seat is None:
                seat = next(i for i in range(len(taken) + 1) if i not in taken)
                self._seats[key] = seat
                taken.add(seat)
            is_prefill = seq.num_computed_tokens - num_new < seq.num_prompt_tokens
            prefill += num_new if is_prefill else 0
            decode += 0 if is_prefill else num_new
            seats.append([seat, "p" if is_prefill else "d"])
        self._steps.append([engine.step_index - 1, prefill, decode, seats])

    def _snapshot(self, engine: LLMEngine, steps: list | None = None) -> dict:
        stats = engine.stats
        states = engine.block_manager.block_states()
        if steps is None:
            steps, self._steps = self._steps, []
        return {
            "time": time.time(),
            "steps": steps,  # [step, prefill tokens, decode tokens, [[seat, "p"|"d"], ...]]
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "preemptions": engine.scheduler.num_preemptions,
            "kv": {name: states.count(letter) for name, letter in _BLOCK_LETTERS},
            "blocks": states,
            "prefix_cache": {
                "queries": stats.prefix_cache_queries,
                "hits": stats.prefix_cache_hits,
            },
            "latency_ms": self._latencies(),
        }

    def _latencies(self) -> dict:
        found = {}
        for name, histogram in (
            ("ttft", self.metrics.ttft),
            ("itl", self.metrics.itl),
            ("e2e", self.metrics.e2e),
        ):
            found[name] = {
                "p50": _quantile_ms(histogram, 0.5),
                "p99": _quantile_ms(histogram, 0.99),
            }
        return found

    def _publish(self, snapshot: dict) -> None:
        for loop, queue in list(self._viewers):
            try:
                loop.call_soon_threadsafe(_offer, queue, snapshot)
            except RuntimeError:  # its loop has closed
                self._viewers.discard((loop, queue))

    async def watch(self) -> AsyncIterator[dict]:
        """Snapshots for one viewer until it stops listening."""
        if len(self._viewers) >= MAX_VIEWERS:
            raise TooManyViewersError(f"at most {MAX_VIEWERS} viewers at once")
        viewer = (asyncio.get_running_loop(), asyncio.Queue(_QUEUE_SNAPSHOTS))
        self._viewers.add(viewer)
        try:
            # The state now, read from this thread (an idle engine calls no observer): every
            # value is read whole, though they may straddle a step.
            yield self._snapshot(self.engine, steps=[])
            while True:
                yield await viewer[1].get()
        finally:
            self._viewers.discard(viewer)


class TooManyViewersError(RuntimeError):
    pass


def _offer(queue: asyncio.Queue, snapshot: dict) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(snapshot)


def _quantile_ms(histogram, q: float) -> float | None:
    """A prometheus_client histogram's q-quantile in milliseconds."""
    buckets = [(float(s.labels["le"]), s.value) for metric in histogram.collect()
               for s in metric.samples if s.name.endswith("_bucket")]  # fmt: skip
    seconds = histogram_quantile([b for b, _ in buckets], [c for _, c in buckets], q)
    return None if seconds is None else 1000 * seconds
