"""A `pagedserve serve` process on a free local port, for the report's `bench serve` run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_server(
    serve_args: list[str], env: dict[str, str] | None = None, startup_timeout: float = 300.0
) -> Iterator[str]:
    """Yields the base URL of a healthy server started with serve_args (and env on top of ours);
    stops it afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), *serve_args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            _wait_healthy(process, base_url, startup_timeout, log)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(process: subprocess.Popen, base_url: str, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:]
            raise RuntimeError(f"the server exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")
