"""`pagedserve serve`: load the engine, start its loop, and serve the HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.source import DEFAULT_GGUF_FILE
from pagedserve.server.app import ServerState, build_app
from pagedserve.server.metrics import ServerMetrics

logger = logging.getLogger("pagedserve.serve")


def served_model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_GGUF_FILE.split(".")[0]
    return Path(model).name.removesuffix(".gguf")


def serve(args: argparse.Namespace, engine: LLMEngine) -> None:
    model_name = args.served_model_name or served_model_name(args.model)
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, model_name, args.log_interval)
    async_engine = AsyncLLMEngine(engine, args.max_waiting, observers=[metrics.observe])
    app = build_app(ServerState(async_engine, model_name, args.api_key, registry))
    async_engine.start()
    logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        async_engine.shutdown()
