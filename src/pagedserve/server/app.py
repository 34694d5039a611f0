"""The OpenAI-compatible HTTP API: handlers validate, submit, stream and abort; nothing more."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
    sub_request_ids,
)
from pagedserve.outputs import StepOutput
from pagedserve.server import messages, responses, responses_api
from pagedserve.server.errors import (
    ApiError,
    error_response,
    error_response_for,
    validation_message,
)
from pagedserve.server.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from pagedserve.server.live import MAX_VIEWERS, LiveFeed
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_tools,
)
from pagedserve.server.responses import Choice, sse
from pagedserve.server.tool_calls import (
    PARSERS,
    CallStream,
    ToolCall,
    new_call_id,
    scan_calls,
)
from pagedserve.validation import FieldError

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
UI_DIR = Path(__file__).parent / "ui"
UI_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
# The page runs only its own files: nothing a model writes can load or run anything.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass
class ServerState:
    # One engine in this process, or engine/replicas.Replicas, which answers the same calls.
    engine: AsyncLLMEngine
    model_name: str
    api_key: str | None
    registry: CollectorRegistry
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    cors: CorsPolicy | None = None  # None: no CORS headers, browsers on other origins refused
    # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto" reads calls with it.
    tool_parser: str | None = None
    # The page at / (off with --no-ui) and its feed of the engine's steps (None with replicas).
    ui: bool = True
    live: LiveFeed | None = None
    # Responses kept for GET /v1/responses/{id} and previous_response_id (--max-stored-responses).
    stored: responses_api.ResponseStore = field(default_factory=responses_api.ResponseStore)


@dataclass
class CorsPolicy:
    """What browsers on other origins may do (--allowed-origins and the flags beside it)."""

    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagedserve", version=VERSION)
    app.state.server = state
    app.add_middleware(RequestGuard, api_key=state.api_key, max_body_bytes=state.max_request_bytes)
    if state.cors is not None:
        # Outermost: a preflight, which carries no API key, is answered before the guard, and
        # every response (a 401 too) carries the CORS headers a browser needs to read it.
        cors = state.cors
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.allowed_origins,
            allow_methods=cors.allowed_methods,
            allow_headers=cors.allowed_headers,
            allow_credentials=cors.allow_credentials,
        )
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.dead_error is not None:
            return error_response(503, "the engine has stopped", "server_error")
        detail = state.engine.health_detail()  # replicas: which are up ("degraded" if not all)
        return Response(status_code=200) if detail is None else JSONResponse(detail)

    if state.ui:
        _add_page(app, state)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        # On a thread: replicas' series are fetched from their processes while collecting.
        text = await asyncio.to_thread(generate_latest, state.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": responses.now_seconds(),
            "owned_by": "pagedserve",
            "max_model_len": state.engine.inputs.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        _log_unknown_fields(body)
        params = body.sampling_params(
            body.max_tokens, body.logprobs, body.requested_prompt_logprobs()
        )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = body.prompts()
        try:
            streams = await state.engine.add_requests(prompts, params, request_id)
        except FieldError as error:
            raise _as_request_field(error, body) from None
        run = _Completion(state.model_name, request_id, body, streams)
        if body.echo:
            run.echoes = await asyncio.to_thread(_echoes, state, prompts, streams)
        return await _respond(state, request, run, streams)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        run, streams = await start_chat(state, body)
        return await _respond(state, request, run, streams)

    @app.post("/v1/messages")
    async def anthropic_messages(body: messages.MessagesRequest, request: Request):
        run, streams = await start_chat(state, body.to_chat())
        ids = sub_request_ids(run.request_id, len(streams))
        outputs = [stream.outputs for stream in streams]
        name = messages.message_id()
        if body.stream:
            events = messages.events(run.chunks(outputs), body.model, name, run.prompt_tokens())
            return _AbortingStream(events, state.engine, ids)
        whole = await _whole(state, request, run, outputs, ids)
        if isinstance(whole, Response):
            return whole
        return messages.to_message(whole, body.model, name)

    @app.post("/v1/responses")
    async def create_response(body: responses_api.ResponsesRequest, request: Request):
        earlier = []
        if body.previous_response_id is not None:
            stored = state.stored.get(body.previous_response_id, "previous_response_id")
            earlier = stored.messages
        chat = body.to_chat(earlier)
        run, streams = await start_chat(state, chat)
        ids = sub_request_ids(run.request_id, len(streams))
        outputs = [stream.outputs for stream in streams]
        response = responses_api.envelope(
            body, responses_api.new_ids(), state.model_name, "in_progress"
        )

        def keep(finished: dict) -> None:
            if body.store:
                messages = responses_api.continuation(chat, finished)
                state.stored.put(finished["id"], responses_api.Stored(finished, messages))

        if body.stream:
            events = responses_api.events(run.chunks(outputs), response, keep)
            return _AbortingStream(events, state.engine, ids)
        whole = await _whole(state, request, run, outputs, ids)
        if isinstance(whole, Response):
            return whole
        finished = responses_api.to_response(whole, response)
        keep(finished)
        return finished

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return state.stored.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        state.stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(body: messages.CountTokensRequest) -> dict:
        chat = body.to_chat()
        _check_model(state, chat.model)
        return {"input_tokens": len(await asyncio.to_thread(_chat_tokens, state, chat))}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        inputs = state.engine.inputs
        if body.messages is not None:
            messages = _template_messages(body.messages)
            tools = template_tools(body.tools)
            work = partial(inputs.chat_token_ids, messages, body.add_generation_prompt, tools)
        else:
            work = partial(inputs.tokenize, body.prompt, body.add_special_tokens)
        tokens = await asyncio.to_thread(work)
        token_strs = (
            inputs.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        )
        return {
            "count": len(tokens),
            "max_model_len": inputs.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        return {"prompt": await asyncio.to_thread(state.engine.inputs.detokenize, body.tokens)}

    return app


@dataclass
class _Echo:
    text: str  # the prompt as sent, or its token ids' text
    first_token: str  # its first token's text, which has no logprob


def _echoes(state: ServerState, prompts: list, streams: list[RequestStream]) -> list[_Echo]:
    tokenizer = state.engine.inputs.tokenizer
    echoes = []
    for prompt, stream in zip(prompts, streams, strict=True):
        ids = stream.prompt_token_ids
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        echoes.append(_Echo(text, tokenizer.decode(ids[:1])))
    return echoes


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


def _add_page(app: FastAPI, state: ServerState) -> None:
    """The live page (static files in server/ui) and its event stream."""

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(UI_DIR / "index.html", headers=PAGE_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def no_icon() -> Response:
        return Response(status_code=204)

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in UI_FILES:
            raise ApiError(404, f"no page file {name!r}", "not_found_error")
        return FileResponse(UI_DIR / name, media_type=UI_FILES[name], headers=PAGE_HEADERS)

    @app.get("/engine/events", include_in_schema=False)
    async def engine_events() -> Response:
        if state.live is None:
            raise ApiError(
                404, "the live feed shows one engine; replicas have none", "not_found_error"
            )
        if state.live.num_viewers >= MAX_VIEWERS:
            raise ApiError(503, f"at most {MAX_VIEWERS} viewers at once", "server_busy")
        snapshots = state.live.watch()

        async def events() -> AsyncIterator[str]:
            try:
                async for snapshot in snapshots:
                    yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
            finally:
                await snapshots.aclose()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response_for(
            request.url.path, error.status, error.message, error.kind, error.param
        )

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request, error: RequestValidationError):
        message, param = validation_message(error, skip=("body",))
        return error_response_for(request.url.path, 400, message, "invalid_request_error", param)

    @app.exception_handler(ValueError)
    async def value_error(request: Request, error: ValueError):
        if isinstance(error, ValidationError):
            message, param = validation_message(error)
            return error_response_for(
                request.url.path, 400, message, "invalid_request_error", param
            )
        param = getattr(error, "field", None)  # FieldError's
        return error_response_for(request.url.path, 400, str(error), "invalid_request_error", param)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, error: QueueFullError):
        return error_response_for(request.url.path, 503, f"server busy: {error}", "server_busy")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError):
        status = 503 if error.unavailable else 500
        return error_response_for(request.url.path, status, str(error), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return error_response_for(
            request.url.path, error.status_code, str(error.detail), "invalid_request_error"
        )


async def start_chat(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[_ChatCompletion, list[RequestStream]]:
    """Validates and submits a chat request; the run that answers it, and its streams. Every
    API that chats (OpenAI's chat completions, Anthropic's Messages) comes through here."""
    _check_model(state, body.model)
    _log_unknown_fields(body)
    try:
        params = body.sampling_params(
            body.requested_max_tokens(), body.requested_logprobs(), body.prompt_logprobs
        )
    except ValidationError as error:
        message, param = validation_message(error)
        if param == "max_tokens" and body.max_completion_tokens is not None:
            message = message.replace("max_tokens", "max_completion_tokens")
            raise FieldError("max_completion_tokens", message) from None
        raise
    if body.tool_mode() == "auto" and state.tool_parser is None:
        raise FieldError(
            "tool_choice",
            'tool_choice "auto" (the default with tools) needs the server started with '
            '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "none", '
            '"required" or a named function otherwise',
        )
    prompt = {"prompt_token_ids": await asyncio.to_thread(_chat_tokens, state, body)}
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        streams = await state.engine.add_requests([prompt], params, request_id)
    except FieldError as error:
        raise _as_request_field(error, body) from None
    run = _ChatCompletion(state.model_name, request_id, body, streams, state.tool_parser)
    return run, streams


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(
            404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "not_found_error", "model",
        )  # fmt: skip


def _chat_tokens(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = _template_messages(body.messages)
    return state.engine.inputs.chat_token_ids(messages, tools=template_tools(body.tools))


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    found = []
    for index, message in enumerate(messages):
        try:
            found.append(message.as_template_input())
        except ValueError as error:
            raise FieldError("messages", f"messages[{index}].{error}") from None
    return found


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


async def _respond(
    state: ServerState, request: Request, run: _Completion, streams: list[RequestStream]
):
    """The response, streamed or whole; whatever it leaves unread (a client gone before or
    while it is sent) is aborted, so that no request runs on, holding blocks, for nobody."""
    ids = sub_request_ids(run.request_id, len(streams))
    outputs = [stream.outputs for stream in streams]
    if run.body.stream:
        return _AbortingStream(run.chunks(outputs), state.engine, ids)
    try:
        return await _unless_disconnected(request, run.response(outputs))
    finally:
        for sub_id in ids:
            state.engine.abort(sub_id)


async def _whole(state: ServerState, request: Request, run: _Completion, outputs, ids):
    """A chat run's whole answer (a dict), or the response for a client gone meanwhile; what is
    left unread is aborted."""
    try:
        return await _unless_disconnected(request, run.response(outputs))
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
    elif error.field == "structured_outputs" and (constraint := body.constraint) is not None:
        field = constraint[0]
        error = FieldError(field, str(error).replace("structured_outputs", field, 1))
    return error


class _Completion:
    kind = "text_completion"

    def __init__(self, model: str, request_id: str, body, streams: list[RequestStream]):
        self.model, self.request_id, self.body = model, request_id, body
        self.created = responses.now_seconds()
        # Choice prompt_index * n + sample, as OpenAI numbers them.
        self.choices = [Choice(i) for i in range(len(streams) * body.n)]
        self.prompt_lengths = [len(stream.prompt_token_ids) for stream in streams]
        self.echoes: list[_Echo] | None = None  # set when the request asks for echo

    def _envelope(self) -> dict:
        return responses.envelope(self.request_id, self.kind, self.model, self.created)

    def prompt_tokens(self) -> int:
        # Each prompt counts once, however many samples were drawn from it.
        return sum(self.prompt_lengths)

    def _add(self, prompt_index: int, output: StepOutput) -> int:
        """Records a piece; returns the index of the choice it belongs to."""
        index = prompt_index * self.body.n + output.index
        self.choices[index].add(output)
        return index

    def _echo(self, prompt_index: int, output: StepOutput) -> dict | None:
        """With echo, on a choice's first piece: records the prompt's text (and logprobs) ahead
        of the output's, and returns the stream delta that carries them; None otherwise."""
        choice = self.choices[prompt_index * self.body.n + output.index]
        if self.echoes is None or choice.echoed:
            return None
        echo = self.echoes[prompt_index]
        choice.echoed, choice.first_token = True, echo.first_token
        choice.text.append(echo.text)
        entries = []
        if self.body.logprobs is not None and output.prompt_logprobs is not None:
            entries = output.prompt_logprobs
            choice.logprobs.extend(entries)
        logprobs = responses.completion_logprobs(entries, 0, echo.first_token)
        return {"index": choice.index, "text": echo.text, "logprobs": logprobs,
                "finish_reason": None, "stop_reason": None}  # fmt: skip

    def _chunk(self, payload: dict) -> str:
        """A stream event; with stream_options.continuous_usage_stats, the usage so far too."""
        if self.body.continuous_usage:
            payload["usage"] = responses.usage(self.choices, self.prompt_tokens())
        return sse(payload)

    async def response(self, streams) -> dict:
        async for prompt_index, output in _merge(streams):
            self._echo(prompt_index, output)
            self._add(prompt_index, output)
        return {
            **self._envelope(),
            "choices": [self._choice(c) for c in self.choices],
            "usage": responses.usage(self.choices, self.prompt_tokens()),
        }

    async def chunks(self, streams) -> AsyncIterator[str]:
        try:
            async for prompt_index, output in _merge(streams):
                echo = self._echo(prompt_index, output)
                if echo is not None:
                    yield self._chunk({**self._envelope(), "choices": [echo]})
                choice = self.choices[prompt_index * self.body.n + output.index]
                text_offset = sum(len(t) for t in choice.text)
                index = self._add(prompt_index, output)
                if output.new_text or output.finish_reason or output.new_logprobs:
                    delta = self._delta(output, index, text_offset)
                    yield self._chunk({**self._envelope(), "choices": [delta]})
            if self.body.include_usage:
                usage = responses.usage(self.choices, self.prompt_tokens())
                yield sse({**self._envelope(), "choices": [], "usage": usage})
            yield sse("[DONE]")
        except EngineDeadError as error:
            yield sse(responses.error_body_for_stream(str(error)))

    def _choice(self, choice: Choice) -> dict:
        logprobs = responses.completion_logprobs(choice.logprobs, 0, choice.first_token)
        body = {
            "index": choice.index,
            "text": "".join(choice.text),
            "logprobs": logprobs,
            **responses.finish_fields(choice),
        }
        if self.body.prompt_logprobs is not None and choice.prompt_logprobs is not None:
            body["prompt_logprobs"] = responses.prompt_logprobs(choice.prompt_logprobs)
        return body

    def _delta(self, output: StepOutput, index: int, text_offset: int) -> dict:
        delta = {
            "index": index,
            "text": output.new_text,
            "logprobs": responses.completion_logprobs(output.new_logprobs or [], text_offset),
            **responses.finish_fields(output),
        }
        if self.body.prompt_logprobs is not None and output.prompt_logprobs is not None:
            delta["prompt_logprobs"] = responses.prompt_logprobs(output.prompt_logprobs)
        return delta


class _ChatCompletion(_Completion):
    kind = "chat.completion"

    def __init__(self, model: str, request_id: str, body, streams, tool_parser: str | None):
        super().__init__(model, request_id, body, streams)
        self.tool_mode = body.tool_mode()
        named = body.named_function()
        self.named_call = [ToolCall(named["name"], "") for _ in self.choices] if named else None
        self.parser = PARSERS[tool_parser]() if self.tool_mode == "auto" else None
        self.sent = [0] * len(self.choices)  # streamed: each choice's text sent as content
        self.unsent = [""] * len(self.choices)  # streamed with a parser: the text held back
        new_id = self.parser.new_id if self.parser is not None else new_call_id
        self.call_streams = [CallStream(self._arguments_keys(), new_id) for _ in self.choices]

    async def chunks(self, streams) -> AsyncIterator[str]:
        envelope = {**self._envelope(), "object": "chat.completion.chunk"}
        try:
            for choice in self.choices:
                delta = {"role": "assistant", "content": ""}
                first = {"index": choice.index, "delta": delta, "logprobs": None}
                yield self._chunk(
                    {**envelope, "choices": [first | responses.finish_fields(choice)]}
                )
            async for prompt_index, output in _merge(streams):
                index = self._add(prompt_index, output)
                delta = self._delta(output, index, 0)
                prompt = self._prompt_logprobs(output.prompt_logprobs)
                if delta["delta"] or output.finish_reason or output.new_logprobs or prompt:
                    yield self._chunk({**envelope, "choices": [delta], **prompt})
            if self.body.include_usage:
                usage = responses.usage(self.choices, self.prompt_tokens())
                yield sse({**envelope, "choices": [], "usage": usage})
            yield sse("[DONE]")
        except EngineDeadError as error:
            yield sse(responses.error_body_for_stream(str(error)))

    async def response(self, streams) -> dict:
        whole = await super().response(streams)
        return whole | self._prompt_logprobs(self.choices[0].prompt_logprobs)

    def _prompt_logprobs(self, entries) -> dict:
        """vLLM's top-level prompt_logprobs, when asked for and these are the prompt's."""
        if self.body.prompt_logprobs is None or entries is None:
            return {}
        return {"prompt_logprobs": responses.prompt_logprobs(entries)}

    def _top_logprobs(self) -> int:
        return self.body.top_logprobs or 0

    def _arguments_keys(self) -> tuple[str, ...]:
        return self.parser.keys if self.parser is not None else ("parameters",)

    def _calls(self, index: int, text: str, partial: bool) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content and tool calls (server/tool_calls.py); `partial`: cut
        short by max_tokens, so calls are taken as far as they go."""
        if self.named_call is not None:
            call = self.named_call[index]
            call.arguments = text
            return None, [call]
        if self.tool_mode == "required":
            calls = scan_calls(text, self._arguments_keys(), partial)
            return (text, []) if calls is None else (None, calls)
        if self.parser is not None:
            return self.parser.parse(text, partial)
        return text, []

    def _calls_start(self, text: str) -> int | None:
        """Where the calls' JSON begins in a choice's text, once it shows a call."""
        if self.tool_mode == "required":
            return 0
        start = self.parser.calls_start(text) if self.parser is not None else None
        return None if start is None else start[1]

    def _finish_fields(self, source: StepOutput | Choice, calls: list[ToolCall]) -> dict:
        fields = responses.finish_fields(source)
        if calls and self.named_call is None and fields["finish_reason"] == "stop":
            fields["finish_reason"] = "tool_calls"
        return fields

    def _choice(self, choice: Choice) -> dict:
        text = "".join(choice.text)
        content, calls = self._calls(choice.index, text, choice.finish_reason == "length")
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": responses.chat_logprobs(choice.logprobs, self._top_logprobs()),
            **self._finish_fields(choice, calls),
        }

    def _delta(self, output: StepOutput, index: int, text_offset: int) -> dict:
        delta, calls = self._tool_delta(output, index)
        return {
            "index": index,
            "delta": delta,
            "logprobs": responses.chat_logprobs(output.new_logprobs or [], self._top_logprobs()),
            **self._finish_fields(output, calls),
        }

    def _tool_delta(self, output: StepOutput, index: int) -> tuple[dict, list[ToolCall]]:
        """The stream delta of a piece, and the calls of the choice when it ends. A named call
        streams its arguments as they come. Otherwise content is sent up to where a call may
        begin (all of it without tools), and calls are sent as the model writes them: each
        one's id and name, then its arguments piece by piece."""
        if self.tool_mode == "none":
            return ({"content": output.new_text} if output.new_text else {}), []
        if self.named_call is not None:
            call = self.named_call[index]
            if not output.new_text and self.sent[index]:
                return {}, []
            first = self.sent[index] == 0
            self.sent[index] += len(output.new_text) or 1
            piece = {"index": 0, "function": {"arguments": output.new_text}}
            if first:
                piece = {"index": 0, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": output.new_text}}  # fmt: skip
            return {"tool_calls": [piece]}, []
        text = "".join(self.choices[index].text)
        final = output.finish_reason is not None
        calls: list[ToolCall] = []
        delta: dict = {}
        if final:
            _, calls = self._calls(index, text, output.finish_reason == "length")
        if self.parser is not None:  # content is streamed up to where a call may begin
            unsent = self.unsent[index] + output.new_text
            end = len(unsent)
            if calls or not final:
                end = self.parser.held_from(unsent, at_start=self.sent[index] == 0)
            if end:
                delta["content"] = unsent[:end]
                self.sent[index] += end
            self.unsent[index] = unsent[end:]
        elif final and not calls:  # required, and not a list of calls
            delta = {"content": text} if text else {}
        start = self._calls_start(text)
        if start is not None and (calls or not final):
            pieces = self.call_streams[index].deltas(text[start:], final)
            if pieces:
                delta["tool_calls"] = pieces
        return delta, calls
