"""Runs the engine loop on its own thread and streams each request's pieces to asyncio callers.

Only the engine thread touches the scheduler and the model. Callers validate a request (which
raises ValueError at once), then hand it over through a command queue; the engine thread admits
it before its next step and pushes every StepOutput to the caller's asyncio queue. A caller that
stops listening (a client that disconnects) aborts its request, and the engine frees its blocks
before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedserve.engine.llm_engine import LLMEngine, PromptInput
from pagedserve.engine.sequence import Sequence
from pagedserve.outputs import StepOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called on the engine thread after each step and after each batch of commands.
StepObserver = Callable[[LLMEngine, list[StepOutput]], None]
_IDLE_POLL_SECONDS = 0.5


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error and serves no more requests."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int,
        observers: list[StepObserver] | None = None,
    ):
        self.engine = engine
        self.max_waiting = max_waiting
        self.observers = list(observers or [])
        self._commands: queue.SimpleQueue[tuple[str, Sequence | str]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self.dead_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", ""))
        self._thread.join(timeout=10)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    async def add_request(
        self, prompt: PromptInput, params: SamplingParams, request_id: str
    ) -> AsyncIterator[StepOutput]:
        """Validates and submits one request (ValueError, QueueFullError at once), and returns
        an iterator over its pieces. Closing the iterator early aborts the request; one that is
        never iterated must be ended with abort()."""
        if self.dead_error is not None:
            raise EngineDeadError("the engine stopped on an error") from self.dead_error
        seq = await asyncio.to_thread(self.engine.make_sequence, prompt, params, request_id)
        # Checked after the await, so that the check and the submission are one atomic step.
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        # The engine may have stopped during the tokenization, after telling the streams it had.
        if self.dead_error is not None:
            self._streams.pop(request_id)
            raise EngineDeadError("the engine stopped on an error") from self.dead_error
        self._commands.put(("add", seq))
        return self._iterate(request_id, stream)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                output = await stream.queue.get()
                if isinstance(output, BaseException):
                    raise EngineDeadError("the engine stopped on an error") from output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self._notify(outputs)
                for output in outputs:
                    self._deliver(output.request_id, output)
        except Exception as error:  # the loop must tell every caller rather than die silently
            logger.exception("engine loop stopped")
            self.dead_error = error
            for request_id in list(self._streams):
                self._deliver(request_id, error)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_SECONDS) if block else None
        except queue.Empty:
            return
        applied = False
        while True:
            if command is not None:
                self._apply(*command)
                applied = True
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        if applied:
            self._notify([])

    def _apply(self, kind: str, payload: Sequence | str) -> None:
        if kind == "add":
            if payload.request_id in self._streams:
                self.engine.submit(payload)
        elif kind == "abort":
            self.engine.abort_request(payload)

    def _notify(self, outputs: list[StepOutput]) -> None:
        for observer in self.observers:
            observer(self.engine, outputs)

    def _deliver(self, request_id: str, item: StepOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
