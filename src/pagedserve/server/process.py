"""A `pagedserve serve` process on a free 127.0.0.1 port, for HTTP benchmarks and tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """Starts `pagedserve serve *serve_args` (env on top of ours; program: what runs in place
    of `python -m pagedserve.cli`) and returns once /health answers; close() (or leaving a `with`
    block) stops it. The server's output goes to a temporary file whose tail is raised if the
    server dies while starting."""

    def __init__(
        self,
        serve_args: list[str],
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
        program: list[str] | None = None,
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        program = program or [sys.executable, "-m", "pagedserve.cli"]
        command = [*program, "serve", "--port", str(self.port)]
        # Open for as long as the server runs; close() closes it.
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            [*command, *serve_args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log_tail(self, num_chars: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read()[-num_chars:]

    def peak_rss_bytes(self) -> int | None:
        """The process' peak resident memory so far (Linux' VmHWM); None where /proc lacks it."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return None if match is None else 1024 * int(match.group(1))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")
