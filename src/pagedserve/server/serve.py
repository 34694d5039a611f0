"""`pagedserve serve`: load the engine, start its loop, and serve the HTTP API with uvicorn.

If the engine loop stops on an error, the requests in flight are answered with errors, /health
turns 503, and the process exits with status 1 within seconds, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from functools import partial
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.source import DEFAULT_GGUF_FILE, hub_name
from pagedserve.server.app import CorsPolicy, ServerState, build_app
from pagedserve.server.live import LiveFeed
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.responses_api import ResponseStore

logger = logging.getLogger("pagedserve.serve")
_ENGINE_CHECK_SECONDS = 0.2
# How long /health reports the stopped engine (503) before the process exits.
_EXIT_DELAY_SECONDS = 1.0
# Time for responses already answered with the engine's error to reach their clients.
_GRACEFUL_SHUTDOWN_SECONDS = 5


def served_model_name(model: str | None) -> str:
    """The name clients send as "model": a hub name's repository (as vLLM serves it), else the
    directory's or GGUF file's name."""
    if model is None:
        return DEFAULT_GGUF_FILE.split(".")[0]
    name = hub_name(model)
    if name is not None:
        return name[0]
    return Path(model).name.removesuffix(".gguf")


def serve(args: argparse.Namespace, config: EngineConfig) -> None:
    if args.data_parallel_size > 1 and args.distributed_executor_backend != "ray":
        raise ValueError("data_parallel_size above 1 needs --distributed-executor-backend ray")
    if args.ray_address is not None and args.distributed_executor_backend != "ray":
        raise ValueError("ray_address needs --distributed-executor-backend ray")
    model_name = args.served_model_name or served_model_name(args.model)
    live = None
    registry = CollectorRegistry()
    make_metrics = partial(ServerMetrics, model_name=model_name, log_interval=args.log_interval)
    if args.distributed_executor_backend == "ray":
        from pagedserve.engine.replicas import Replicas  # Ray is imported only when asked for

        async_engine = Replicas(
            config,
            args.data_parallel_size,
            args.max_waiting,
            registry,
            make_metrics,
            args.ray_address,
            args.routing_policy,
            config.cpu_binding,
        )
    else:
        engine = LLMEngine(config)
        metrics = make_metrics(registry)
        live = LiveFeed(engine, metrics)
        async_engine = AsyncLLMEngine(
            engine, args.max_waiting, observers=[metrics.observe, live.observe]
        )
    cors = None
    if args.allowed_origins is not None:
        cors = CorsPolicy(
            args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials
        )
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    state = ServerState(
        async_engine,
        model_name,
        args.api_key,
        registry,
        args.max_request_bytes,
        cors,
        parser,
        ui=not args.no_ui,
        live=live,
        stored=ResponseStore(args.max_stored_responses),
    )
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning")
    )
    async_engine.start()
    watcher = threading.Thread(
        target=_exit_when_engine_dies, args=(server, async_engine), daemon=True
    )
    watcher.start()
    logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
    try:
        server.run()
    finally:
        async_engine.close()
    if async_engine.dead_error is not None:
        sys.exit(1)


def _exit_when_engine_dies(server: uvicorn.Server, engine: AsyncLLMEngine) -> None:
    """Stops the server once the engine has stopped; requests still open then (answered with
    the engine's error already) get a few seconds to reach their clients. uvicorn's loop reads
    should_exit on every tick."""
    while engine.dead_error is None:
        time.sleep(_ENGINE_CHECK_SECONDS)
    logger.error("the engine has stopped; the server exits with status 1")
    time.sleep(_EXIT_DELAY_SECONDS)
    server.config.timeout_graceful_shutdown = _GRACEFUL_SHUTDOWN_SECONDS
    server.should_exit = True
