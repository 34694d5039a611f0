"""Data-parallel replicas on Ray: N engines as Ray actors behind one front end that routes.

The front end (Replicas, in the server's process) holds no model. It tokenizes and validates each
prompt with its own InputProcessor, so a bad request fails at once as with one engine; picks a
replica with router.Router (prefix-aware by default); and streams that replica's StepOutputs back
through a Ray streaming generator. Each replica (ReplicaActor) is an LLMEngine with its own
AsyncLLMEngine loop, its own cores and its own Prometheus registry.

Plain Ray actors rather than Ray Serve deployments: the front end already is the HTTP server and
the router, and an actor handle gives exactly what they need (a stream per request, cancellation,
restarts) without a second HTTP layer or Serve's controller processes on a 2-core machine.

Faults: Ray restarts a replica whose process dies (max_restarts=-1), constructing it again. A
request that had no token yet when its replica died is sent to another replica; a stream that had
tokens ends with an EngineDeadError (an error event). A health thread pings every replica; one
that does not answer is down (/health "degraded") and gets nothing until it answers again. A
replica whose engine loop stopped on an error exits, so that Ray restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import ray
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from ray.exceptions import GetTimeoutError, RayActorError, TaskCancelledError

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
    StepObserver,
    check_prompt_count,
    sub_request_ids,
)
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.input_processor import InputProcessor, PromptInput
from pagedserve.engine.llm_engine import LLMEngine, ModelFiles
from pagedserve.engine.router import ROUTING_POLICIES, Router, prompt_block_hashes
from pagedserve.engine.tensor_parallel import core_shares
from pagedserve.outputs import StepOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_PING_SECONDS = 0.5  # how often the health thread asks every replica
_PING_TIMEOUT_SECONDS = 3.0  # an answer later than this marks the replica down
_METRICS_TIMEOUT_SECONDS = 2.0
_RAY_ADDRESS_TIMEOUT_SECONDS = 5.0
# How long a request whose replica died waits for any replica to be up before it fails.
_RETRY_WAIT_SECONDS = 120.0
_PREFIX = "pagedserve:"

# Builds a replica's step observer on its registry (server/metrics.ServerMetrics(registry)...).
ObserverFactory = Callable[[CollectorRegistry], object]


class ReplicaActor:
    """One engine and its loop, inside a Ray actor process (wrapped by ray.remote at start)."""

    def __init__(
        self,
        config: EngineConfig,
        max_waiting: int,
        make_observer: ObserverFactory | None,
        cores: list[int] | None,
        threads: int,
    ):
        if cores is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        self.registry = CollectorRegistry()
        observers: list[StepObserver] = []
        if make_observer is not None:
            observers.append(make_observer(self.registry).observe)
        self.loop = AsyncLLMEngine(LLMEngine(config), max_waiting, observers)
        self.loop.start()

    def describe(self) -> dict:
        engine = self.loop.engine
        return {"num_blocks": engine.runner.num_blocks, "max_model_len": engine.max_model_len}

    def ping(self) -> bool:
        if self.loop.dead_error is not None:
            logger.error("this replica's engine stopped; the process exits for Ray to restart it")
            os._exit(1)
        return True

    def metric_families(self) -> list[Metric]:
        return list(self.registry.collect())

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str
    ) -> AsyncIterator[StepOutput]:
        [stream] = await self.loop.add_requests([prompt], params, request_id, [request_id])
        async for output in stream.outputs:  # cancelling this generator aborts the request
            yield output


@dataclass
class _Routed:
    """A request sent to a replica, while it runs there."""

    replica: int
    outputs: ray.ObjectRefGenerator
    has_output: bool = False


class Replicas:
    """The front end: answers the calls AsyncLLMEngine answers (add_requests, abort, inputs,
    dead_error, health_detail, close), over replicas on Ray."""

    def __init__(
        self,
        config: EngineConfig,
        num_replicas: int,
        max_waiting: int,
        registry: CollectorRegistry,
        make_observer: ObserverFactory | None = None,
        ray_address: str | None = None,
        routing_policy: str = "prefix",
        cpu_binding: str = "auto",
    ):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {num_replicas!r}")
        if ray_address is not None:
            check_ray_address(ray_address)
            cores: list[list[int] | None] = [None] * num_replicas
            threads = [max(1, (os.cpu_count() or 1) // num_replicas)] * num_replicas
        else:
            cores = core_shares(num_replicas, cpu_binding, "data_parallel_size")
            every = len(os.sched_getaffinity(0))
            threads = [every if share is None else len(share) for share in cores]
        files = ModelFiles.load(config)  # a bad model or template fails before any replica starts
        if routing_policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing_policy must be one of {ROUTING_POLICIES}, got {routing_policy!r}"
            )
        self.config = config
        self.max_waiting = max_waiting
        self.dead_error: BaseException | None = None  # replicas restart; the front end stays
        if not ray.is_initialized():
            ray.init(
                address=ray_address,
                num_cpus=None if ray_address else sum(threads),
                namespace="pagedserve",
                include_dashboard=False,
            )
        actor = ray.remote(ReplicaActor)
        # The front end is the queue's gate for every replica together (max_waiting each): a
        # replica refuses nothing it is sent.
        self.actors = [
            actor.options(
                max_restarts=-1,  # Ray restarts a replica whose process dies
                max_task_retries=0,  # the front end decides what is sent again
                num_cpus=0 if cores[i] is None else threads[i],
            ).remote(config, max_waiting * num_replicas, make_observer, cores[i], threads[i])
            for i in range(num_replicas)
        ]
        described = ray.get([a.describe.remote() for a in self.actors])
        num_blocks = min(d["num_blocks"] for d in described)
        max_model_len = described[0]["max_model_len"]
        self.inputs: InputProcessor = files.input_processor(
            config, max_model_len, BlockManager(num_blocks, config.block_size, False)
        )
        self.router = Router(num_replicas, num_blocks, routing_policy)
        self._routed: dict[str, _Routed] = {}
        # The router is read by the event loop and written by the health thread too.
        self._lock = threading.Lock()
        self._metrics = _RouterMetrics(registry, self)
        self._stopping = threading.Event()
        self._health = threading.Thread(target=self._watch, name="pagedserve-replicas", daemon=True)
        logger.info(
            "%d replicas on Ray (%s routing), %d KV blocks each",
            num_replicas,
            routing_policy,
            num_blocks,
        )

    def start(self) -> None:
        self._health.start()

    def close(self) -> None:
        self._stopping.set()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()

    def health_detail(self) -> dict:
        replicas = [
            {"replica": index, "state": "up" if up else "down"}
            for index, up in enumerate(self.router.up)
        ]
        status = "ok" if all(self.router.up) else "degraded"
        return {"status": status, "replicas": replicas}

    @property
    def num_waiting(self) -> int:
        return sum(not routed.has_output for routed in self._routed.values())

    async def add_requests(
        self, prompts: list[PromptInput], params: SamplingParams, request_id: str
    ) -> list[RequestStream]:
        """As AsyncLLMEngine.add_requests: validated here, each prompt (with its n samples) sent
        to one replica."""
        check_prompt_count(len(prompts), self.max_waiting)
        ids = sub_request_ids(request_id, len(prompts))
        seqs = await asyncio.to_thread(
            lambda: [
                self.inputs.make_sequence(p, params, i) for p, i in zip(prompts, ids, strict=True)
            ]
        )
        room = self.max_waiting * max(1, sum(self.router.up))
        if self.num_waiting + len(seqs) > room:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting")
        streams = []
        for prompt, seq, sub_id in zip(prompts, seqs, ids, strict=True):
            hashes = prompt_block_hashes(seq.prompt_token_ids, self.config.block_size)
            try:
                self._send(sub_id, prompt, params, hashes, exclude=frozenset())
            except RuntimeError:
                for sent_id in ids[: len(streams)]:
                    self.abort(sent_id)
                raise QueueFullError("no replica is up; retry shortly") from None
            outputs = self._iterate(sub_id, prompt, params, hashes)
            streams.append(RequestStream(seq.prompt_token_ids, outputs))
        return streams

    def abort(self, request_id: str) -> None:
        self._end(request_id, cancel=True)

    def _end(self, request_id: str, cancel: bool) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        if cancel:
            ray.cancel(routed.outputs)
        with self._lock:
            self.router.ended(routed.replica)

    def _send(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        hashes: list[int],
        exclude: frozenset[int],
    ) -> None:
        with self._lock:
            replica, reason = self.router.choose(hashes, exclude)
            self.router.sent(replica, hashes)
        self._metrics.routed.labels(reason).inc()
        outputs = (
            self.actors[replica]
            .generate.options(num_returns="streaming")
            .remote(prompt, params, request_id)
        )
        self._routed[request_id] = _Routed(replica, outputs)

    async def _iterate(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, hashes: list[int]
    ) -> AsyncIterator[StepOutput]:
        failed: set[int] = set()
        finished = False
        try:
            while not finished:
                routed = self._routed.get(request_id)
                if routed is None:
                    return  # aborted
                try:
                    async for ref in routed.outputs:
                        output = await ref
                        routed.has_output = True
                        finished = output.finished
                        yield output
                except TaskCancelledError:
                    return  # aborted while waiting for its next piece
                except (RayActorError, EngineDeadError) as error:
                    self._lost(routed.replica)
                    if routed.has_output:
                        raise EngineDeadError(
                            f"replica {routed.replica} stopped during the request"
                        ) from error
                    failed.add(routed.replica)
                    logger.warning("replica %d lost %s; retrying", routed.replica, request_id)
                    self._metrics.retries.inc()
                    self._end(request_id, cancel=False)
                    await self._resend(request_id, prompt, params, hashes, frozenset(failed))
                    continue
                if not finished:
                    raise EngineDeadError(f"replica {routed.replica} ended the request early")
        finally:
            self._end(request_id, cancel=not finished)

    async def _resend(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        hashes: list[int],
        failed: frozenset[int],
    ) -> None:
        """Sends a request that lost its replica to another that is up, or to any once one is
        back (a restarted replica counts), waiting for one at most _RETRY_WAIT_SECONDS."""
        deadline = time.monotonic() + _RETRY_WAIT_SECONDS
        while True:
            for exclude in (failed, frozenset()):
                try:
                    self._send(request_id, prompt, params, hashes, exclude)
                    return
                except RuntimeError:  # no replica up outside exclude
                    pass
            if time.monotonic() > deadline:
                raise EngineDeadError("no replica came back to take the request")
            await asyncio.sleep(_PING_SECONDS)

    def _lost(self, replica: int) -> None:
        with self._lock:
            if self.router.up[replica]:
                logger.error("replica %d is down; Ray restarts it", replica)
            self.router.set_up(replica, False)

    def _watch(self) -> None:
        """Pings every replica; marks it down when it does not answer in time, up when it does."""
        while not self._stopping.wait(_PING_SECONDS):
            try:
                self._ping_all()
            except Exception:  # shutting down, or a failure worth logging but not dying on
                if self._stopping.is_set():
                    return
                logger.exception("pinging the replicas failed")

    def _ping_all(self) -> None:
        pings = [actor.ping.remote() for actor in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=_PING_TIMEOUT_SECONDS)
        for replica, ping in enumerate(pings):
            try:
                if ping not in ready:
                    raise GetTimeoutError
                ray.get(ping)
            except (RayActorError, GetTimeoutError):
                self._lost(replica)
                continue
            with self._lock:
                if not self.router.up[replica]:
                    logger.info("replica %d is up", replica)
                    self.router.set_up(replica, True)

    def replica_metric_families(self) -> list[tuple[int, list[Metric]]]:
        """Every replica that is up: its registry's families (asked in parallel)."""
        asked = [(r, self.actors[r].metric_families.remote()) for r, up in
                 enumerate(self.router.up) if up]  # fmt: skip
        found = []
        for replica, ref in asked:
            try:
                found.append((replica, ray.get(ref, timeout=_METRICS_TIMEOUT_SECONDS)))
            except (RayActorError, GetTimeoutError):
                continue
        return found


class _RouterMetrics(Collector):
    """The router's own series, and every replica's with a replica label added."""

    def __init__(self, registry: CollectorRegistry, replicas: Replicas):
        self.routed = Counter(
            _PREFIX + "router_requests",
            "Requests sent to a replica, by why that one (prefix, least_loaded, round_robin).",
            ["reason"],
            registry=registry,
        )
        self.retries = Counter(
            _PREFIX + "router_retries",
            "Requests sent again after their replica stopped before their first token.",
            registry=registry,
        )
        up = Gauge(_PREFIX + "replicas_up", "Replicas answering the health check.",
                   registry=registry)  # fmt: skip
        up.set_function(lambda: sum(replicas.router.up))
        self._replicas = replicas
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # registering must not ask the replicas; collect() is what asks them

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, families in self._replicas.replica_metric_families():
            for family in families:
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "replica": str(replica)}
                    into.samples.append(sample._replace(labels=labels))
        yield from merged.values()


def check_ray_address(address: str) -> None:
    """An address of host:port (or ray://host:port) must accept a connection before anything
    is loaded; "auto" and other forms are left to ray.init."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=_RAY_ADDRESS_TIMEOUT_SECONDS).close()
    except OSError as error:
        raise ValueError(f"ray_address {address!r} is unreachable: {error}") from None
