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

from pagedserve.engine.input_processor import InputProcessor, PromptInput
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.tensor_parallel import RankLostError
from pagedserve.outputs import StepOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.validation import FieldError

logger = logging.getLogger(__name__)

# Called on the engine thread after each step and after each batch of commands.
StepObserver = Callable[[LLMEngine, list[StepOutput]], None]
_IDLE_POLL_SECONDS = 0.5


def sub_request_ids(request_id: str, count: int) -> list[str]:
    """The engine requests of a caller's request of `count` prompts, as add_requests names them."""
    return [f"{request_id}-{index}" for index in range(count)]


def check_prompt_count(count: int, max_waiting: int) -> None:
    """A request of more prompts than the queue can ever hold is refused outright."""
    if count > max_waiting:
        raise FieldError(
            "prompt",
            f"prompt holds {count} prompts; this server queues at most {max_waiting} requests "
            "(--max-waiting)",
        )


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error and serves no more requests. unavailable: it stopped
    because a process it runs on is gone (a tensor-parallel rank), not on anything a request
    asked for: the server answers 503 instead of 500."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable

    @classmethod
    def caused_by(cls, error: BaseException) -> EngineDeadError:
        if isinstance(error, RankLostError):
            return cls(f"the engine stopped: {error}", unavailable=True)
        return cls("the engine stopped on an error")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class RequestStream:
    """One submitted prompt: its tokens, known at once, and its pieces as they come."""

    prompt_token_ids: list[int]
    outputs: AsyncIterator[StepOutput]


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

    def close(self) -> None:
        """Stops the loop and what the engine started beside itself."""
        self.shutdown()
        self.engine.close()

    @property
    def inputs(self) -> InputProcessor:
        """Tokenization, chat templates and validation, usable from any thread."""
        return self.engine.inputs

    def health_detail(self) -> dict | None:
        """Nothing beyond dead_error to report: one engine is either serving or stopped."""
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    async def add_requests(
        self,
        prompts: list[PromptInput],
        params: SamplingParams,
        request_id: str,
        request_ids: list[str] | None = None,
    ) -> list[RequestStream]:
        """Validates and submits prompts as one unit, each an engine request of params.n samples
        named by sub_request_ids (or request_ids when given), and returns a stream of each
        one's pieces. Raises at once, submitting none: ValueError for a bad prompt or more
        prompts than the queue can ever hold, QueueFullError while the queue has no room for
        all of them. Closing an iterator early aborts its request; one that is never iterated
        must be ended with abort()."""
        check_prompt_count(len(prompts), self.max_waiting)
        self._raise_if_dead()
        ids = request_ids or sub_request_ids(request_id, len(prompts))
        seqs = await asyncio.to_thread(self._make_sequences, prompts, params, ids)
        # Checked after the await, so that the check and the submission are one atomic step.
        if self.num_waiting + len(seqs) > self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting")
        loop = asyncio.get_running_loop()
        streams = {seq.request_id: _Stream(loop, asyncio.Queue()) for seq in seqs}
        self._streams.update(streams)
        # The engine may have stopped during the tokenization, after telling the streams it had.
        if self.dead_error is not None:
            for sub_id in ids:
                self._streams.pop(sub_id)
            self._raise_if_dead()
        for seq in seqs:
            self._commands.put(("add", seq))
        return [
            RequestStream(seq.prompt_token_ids, self._iterate(seq.request_id, stream))
            for seq, stream in zip(seqs, streams.values(), strict=True)
        ]

    def _make_sequences(
        self, prompts: list[PromptInput], params: SamplingParams, ids: list[str]
    ) -> list[Sequence]:
        return [
            self.engine.make_sequence(prompt, params, sub_id)
            for prompt, sub_id in zip(prompts, ids, strict=True)
        ]

    def _raise_if_dead(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError.caused_by(self.dead_error) from self.dead_error

    def abort(self, request_id: str) -> None:
        """Ends a request submitted by add_requests, unless it has finished or ended already."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                output = await stream.queue.get()
                if isinstance(output, BaseException):
                    raise EngineDeadError.caused_by(output) from output
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
            if self._stopping.is_set():
                return  # shutting down: the callers and their event loop are gone
            logger.exception(
                "the engine loop stopped on an error; requests in the failed step: %s",
                ", ".join(self.engine.step_request_ids) or "none",
            )
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
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed: nobody is left to read it
            self.abort(request_id)
