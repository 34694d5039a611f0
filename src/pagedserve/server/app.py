"""The OpenAI-compatible HTTP API: handlers validate, submit, stream and abort; nothing more."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    sub_request_ids,
)
from pagedserve.outputs import StepOutput
from pagedserve.server import responses
from pagedserve.server.errors import ApiError, error_response, validation_message
from pagedserve.server.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.responses import Choice, sse
from pagedserve.validation import FieldError

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    api_key: str | None
    registry: CollectorRegistry
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION)
    app.state.server = state
    app.add_middleware(RequestGuard, api_key=state.api_key, max_body_bytes=state.max_request_bytes)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.dead_error is not None:
            return error_response(503, "the engine has stopped", "server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": responses.now_seconds(),
            "owned_by": "pagedserve",
            "max_model_len": state.engine.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        _log_unknown_fields(body)
        params = body.sampling_params(body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            streams = await state.engine.add_requests(body.prompts(), params, request_id)
        except FieldError as error:
            raise _as_request_field(error, body) from None
        run = _Completion(state.model_name, request_id, body, len(streams))
        return await _respond(state, request, run, streams)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        _log_unknown_fields(body)
        try:
            params = body.sampling_params(body.requested_max_tokens(), body.requested_logprobs())
        except ValidationError as error:
            message, param = validation_message(error)
            if param == "max_tokens" and body.max_completion_tokens is not None:
                message = message.replace("max_tokens", "max_completion_tokens")
                raise FieldError("max_completion_tokens", message) from None
            raise
        prompt = {"prompt_token_ids": await asyncio.to_thread(_chat_tokens, state, body)}
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            streams = await state.engine.add_requests([prompt], params, request_id)
        except FieldError as error:
            raise _as_request_field(error, body) from None
        run = _ChatCompletion(state.model_name, request_id, body, len(streams))
        return await _respond(state, request, run, streams)

    return app


def _log_unknown_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    """One warning naming the fields the request sent that the server ignored."""
    names = body.unknown_fields()
    if names:
        shown = ", ".join(repr(name) for name in names[:_MAX_NAMED_FIELDS])
        more = (
            f" and {len(names) - _MAX_NAMED_FIELDS} more" if len(names) > _MAX_NAMED_FIELDS else ""
        )
        logger.warning("ignored unknown request fields: %s%s", shown, more)


# A body may send thousands of unknown fields: the log names the first few.
_MAX_NAMED_FIELDS = 16


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError):
        return error_response(error.status, error.message, error.kind, error.param)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(_: Request, error: RequestValidationError):
        message, param = validation_message(error, skip=("body",))
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, error: ValueError):
        if isinstance(error, ValidationError):
            message, param = validation_message(error)
            return error_response(400, message, "invalid_request_error", param)
        param = getattr(error, "field", None)  # FieldError's
        return error_response(400, str(error), "invalid_request_error", param)

    @app.exception_handler(QueueFullError)
    async def queue_full(_: Request, error: QueueFullError):
        return error_response(503, f"server busy: {error}", "server_busy")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        return error_response(500, str(error), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail), "invalid_request_error")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "not_found_error", "model",
        )  # fmt: skip


def _chat_tokens(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [message.as_template_input() for message in body.messages]
    return state.engine.engine.chat_token_ids(messages)


async def _merge(
    streams: list[AsyncIterator[StepOutput]],
) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleaves several requests' outputs as they come, each with its request's position;
    closing it aborts the unfinished."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except Exception as error:
            await merged.put((index, error))
        await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | Response:
    """Awaits a whole (non-streamed) response, but cancels it, which aborts its requests and
    frees their blocks, as soon as the client goes away."""
    job = asyncio.ensure_future(work)

    async def client_gone() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    done, _ = await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if job in done:
        return job.result()
    job.cancel()
    return Response(status_code=499)  # nobody is listening; nginx's "client closed request"


async def _respond(state: ServerState, request: Request, run: _Completion, streams: list):
    """The response, streamed or whole; whatever it leaves unread (a client gone before or
    while it is sent) is aborted, so that no request runs on, holding blocks, for nobody."""
    ids = sub_request_ids(run.request_id, len(streams))
    if run.body.stream:
        return _AbortingStream(run.chunks(streams), state.engine, ids)
    try:
        return await _unless_disconnected(request, run.response(streams))
    finally:
        for sub_id in ids:
            state.engine.abort(sub_id)


class _AbortingStream(StreamingResponse):
    def __init__(self, chunks: AsyncIterator[str], engine: AsyncLLMEngine, ids: list[str]):
        super().__init__(chunks, media_type="text/event-stream")
        self.engine, self.ids = engine, ids

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for sub_id in self.ids:
                self.engine.abort(sub_id)


def _as_request_field(error: FieldError, body: CompletionRequest | ChatCompletionRequest):
    """The engine names SamplingParams' fields and a completions request's prompt; the request
    may have sent them by other names: a chat's prompt is its messages, its max_tokens may be
    max_completion_tokens, and a constraint may have come as response_format or guided_*."""
    chat = isinstance(body, ChatCompletionRequest)
    if error.field == "prompt" and chat:
        error.field = "messages"
    elif error.field == "max_tokens" and chat and body.max_completion_tokens is not None:
        error.field = "max_completion_tokens"
    elif error.field == "structured_outputs" and (constraint := body.constraint()) is not None:
        field = constraint[0]
        error = FieldError(field, str(error).replace("structured_outputs", field, 1))
    return error


class _Completion:
    kind = "text_completion"

    def __init__(self, model: str, request_id: str, body, num_prompts: int):
        self.model, self.request_id, self.body = model, request_id, body
        self.created = responses.now_seconds()
        # Choice prompt_index * n + sample, as OpenAI numbers them.
        self.choices = [Choice(i) for i in range(num_prompts * body.n)]
        self.prompt_lengths = [0] * num_prompts

    def _envelope(self) -> dict:
        return responses.envelope(self.request_id, self.kind, self.model, self.created)

    def prompt_tokens(self) -> int:
        # Each prompt counts once, however many samples were drawn from it.
        return sum(self.prompt_lengths)

    def _add(self, prompt_index: int, output: StepOutput) -> int:
        """Records a piece; returns the index of the choice it belongs to."""
        index = prompt_index * self.body.n + output.index
        self.choices[index].add(output)
        if output.final is not None:
            self.prompt_lengths[prompt_index] = len(output.final.prompt_token_ids)
        return index

    async def response(self, streams) -> dict:
        async for prompt_index, output in _merge(streams):
            self._add(prompt_index, output)
        return {
            **self._envelope(),
            "choices": [self._choice(c) for c in self.choices],
            "usage": responses.usage(self.choices, self.prompt_tokens()),
        }

    async def chunks(self, streams) -> AsyncIterator[str]:
        try:
            async for prompt_index, output in _merge(streams):
                choice = self.choices[prompt_index * self.body.n + output.index]
                text_offset = sum(len(t) for t in choice.text)
                index = self._add(prompt_index, output)
                if output.new_text or output.finish_reason or output.new_logprobs:
                    yield sse(
                        {**self._envelope(), "choices": [self._delta(output, index, text_offset)]}
                    )
            if self.body.include_usage:
                usage = responses.usage(self.choices, self.prompt_tokens())
                yield sse({**self._envelope(), "choices": [], "usage": usage})
            yield sse("[DONE]")
        except EngineDeadError as error:
            yield sse(responses.error_body_for_stream(str(error)))

    def _choice(self, choice: Choice) -> dict:
        logprobs = responses.completion_logprobs(choice.logprobs, 0)
        return {
            "index": choice.index,
            "text": "".join(choice.text),
            "logprobs": logprobs,
            **responses.finish_fields(choice),
        }

    def _delta(self, output: StepOutput, index: int, text_offset: int) -> dict:
        return {
            "index": index,
            "text": output.new_text,
            "logprobs": responses.completion_logprobs(output.new_logprobs or [], text_offset),
            **responses.finish_fields(output),
        }


class _ChatCompletion(_Completion):
    kind = "chat.completion"

    async def chunks(self, streams) -> AsyncIterator[str]:
        envelope = {**self._envelope(), "object": "chat.completion.chunk"}
        try:
            for choice in self.choices:
                delta = {"role": "assistant", "content": ""}
                first = {"index": choice.index, "delta": delta, "logprobs": None}
                yield sse({**envelope, "choices": [first | responses.finish_fields(choice)]})
            async for prompt_index, output in _merge(streams):
                index = self._add(prompt_index, output)
                if output.new_text or output.finish_reason or output.new_logprobs:
                    yield sse({**envelope, "choices": [self._delta(output, index, 0)]})
            if self.body.include_usage:
                usage = responses.usage(self.choices, self.prompt_tokens())
                yield sse({**envelope, "choices": [], "usage": usage})
            yield sse("[DONE]")
        except EngineDeadError as error:
            yield sse(responses.error_body_for_stream(str(error)))

    def _top_logprobs(self) -> int:
        return self.body.top_logprobs or 0

    def _choice(self, choice: Choice) -> dict:
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": responses.chat_logprobs(choice.logprobs, self._top_logprobs()),
            **responses.finish_fields(choice),
        }

    def _delta(self, output: StepOutput, index: int, text_offset: int) -> dict:
        return {
            "index": index,
            "delta": {"content": output.new_text},
            "logprobs": responses.chat_logprobs(output.new_logprobs or [], self._top_logprobs()),
            **responses.finish_fields(output),
        }
