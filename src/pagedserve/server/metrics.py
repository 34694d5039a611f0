"""Prometheus metrics and the periodic log line, fed by the engine thread after every step.

Latencies are the server's own view, on the engine's monotonic clock: TTFT runs from the
request's arrival at the server to its first token, so queueing is included.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput, StepOutput

logger = logging.getLogger("pagedserve.stats")

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_PREFIX = "pagedserve:"


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, log_interval: float = 5.0):
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                _PREFIX + name, doc, labels, registry=registry, buckets=_LATENCY_BUCKETS
            ).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(_PREFIX + name, doc, labels, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.")
        self.tpot = histogram(
            "time_per_output_token_seconds", "Decode time over output tokens after the first."
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to release of the result.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.")
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token."
        )
        self.decode_time = histogram("request_decode_time_seconds", "First to last token.")
        self.running = gauge("num_requests_running", "Requests holding a seat in the batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a seat.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.shared_blocks = gauge(
            "kv_cache_shared_blocks", "KV cache blocks held by more than one sequence."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Of those, tokens found in the cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted for recompute.")
        self.finished = Counter(
            _PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.model_name = model_name
        self._last_token_time: dict[tuple[str, int], float] = {}  # by (request id, sample)
        self.step_phases = Counter(
            _PREFIX + "step_phase_seconds",
            "Engine step time by phase (schedule, prepare, forward, sample, output), synchronized.",
            ["model_name", "phase"],
            registry=registry,
        )
        self._seen_phases: dict[str, float] = {}
        self._seen = dict.fromkeys(
            ("prompt", "generation", "preemptions", "prefix_queries", "prefix_hits"), 0
        )
        self._log = _ThroughputLog(log_interval)

    def observe(self, engine: LLMEngine, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        self._observe_tokens(outputs, now)
        if not outputs:  # commands were applied: forget requests that were aborted
            self._last_token_time = {
                key: seen
                for key, seen in self._last_token_time.items()
                if engine.has_request(key[0])
            }
        for output in outputs:
            if output.final is not None:
                self._observe_finished(output.final)
        self._observe_engine(engine)
        self._observe_phases(engine)
        self._log.maybe_log(engine, now)

    def _observe_tokens(self, outputs: list[StepOutput], now: float) -> None:
        for output in outputs:
            key = (output.request_id, output.index)
            previous = self._last_token_time.get(key)
            if output.new_token_ids and previous is not None:
                self.itl.observe((now - previous) / len(output.new_token_ids))
            if output.new_token_ids:
                self._last_token_time[key] = now
            if output.finish_reason is not None:
                self._last_token_time.pop(key, None)

    def _observe_finished(self, result: RequestOutput) -> None:
        m = result.metrics
        completion = result.outputs[0]
        self.finished.labels(self.model_name, completion.finish_reason or "abort").inc()
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        self.e2e.observe(m.finished_time - m.arrival_time)
        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.decode_time.observe(m.last_token_time - m.first_token_time)
        if len(completion.token_ids) > 1:
            decode = m.last_token_time - m.first_token_time
            self.tpot.observe(decode / (len(completion.token_ids) - 1))

    def _observe_engine(self, engine: LLMEngine) -> None:
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(engine.block_manager.usage)
        self.shared_blocks.set(engine.block_manager.num_shared_blocks)
        stats = engine.stats
        self._add(self.prompt_tokens, "prompt", stats.num_prompt_tokens)
        self._add(self.generation_tokens, "generation", stats.num_generation_tokens)
        self._add(self.preemptions, "preemptions", scheduler.num_preemptions)
        self._add(self.prefix_queries, "prefix_queries", stats.prefix_cache_queries)
        self._add(self.prefix_hits, "prefix_hits", stats.prefix_cache_hits)

    def _observe_phases(self, engine: LLMEngine) -> None:
        for phase, total in engine.phase_timer.seconds.items():
            self.step_phases.labels(self.model_name, phase).inc(
                total - self._seen_phases.get(phase, 0.0)
            )
            self._seen_phases[phase] = total

    def _add(self, counter: Counter, key: str, total: int) -> None:
        # Counters only go up, so each observation adds what the engine counted since the last.
        counter.inc(total - self._seen[key])
        self._seen[key] = total


class _ThroughputLog:
    """A line like vLLM's every few seconds while the engine is busy."""

    def __init__(self, interval: float):
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0

    def maybe_log(self, engine: LLMEngine, now: float) -> None:
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        stats, scheduler = engine.stats, engine.scheduler
        prompt_rate = (stats.num_prompt_tokens - self._last_prompt) / elapsed
        generation_rate = (stats.num_generation_tokens - self._last_generation) / elapsed
        if scheduler.running or scheduler.waiting or generation_rate > 0:
            hit_rate = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
            logger.info(
                "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
                "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, preemptions: %d, "
                "prefix cache hit rate: %.1f%%",
                prompt_rate,
                generation_rate,
                len(scheduler.running),
                len(scheduler.waiting),
                100 * engine.block_manager.usage,
                scheduler.num_preemptions,
                100 * hit_rate,
            )
        self._last_time = now
        self._last_prompt = stats.num_prompt_tokens
        self._last_generation = stats.num_generation_tokens
