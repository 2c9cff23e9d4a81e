"""`v1 serve [MODEL]` (or `python -m v1 serve`): an OpenAI-compatible HTTP server over AsyncLLM
(FastAPI + uvicorn); its options are the server's own, then EngineArgs'. Endpoints and limits:
docs/serving.md.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
requests (malformed JSON and wrong types too, not FastAPI's 422), 404 for an unknown model,
401 without the `--api-key`, 500 for a dead engine (/health: 503). A client that disconnects
aborts its request.
"""

import argparse
import asyncio
import dataclasses
import gc
import importlib.metadata
import json
import logging
import os
import re
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from v1 import envs, memory_trim
from v1.compat.utils import FlexibleArgumentParser
from v1.config import EngineArgs
from v1.engine.async_llm import AsyncLLM
from v1.engine.dp_headless import run_headless
from v1.engine.exceptions import EngineDeadError
from v1.engine.launch import interrupted_by_signals
from v1.entrypoints.openai import serving_chat_batch
from v1.entrypoints.openai.http_protocol import JsonErrorH11Protocol
from v1.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from v1.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from v1.entrypoints.openai.responses_protocol import ResponsesRequest
from v1.entrypoints.openai.serving import (
    ModelNotFoundError,
    OpenAIServing,
    ServerLimits,
    error_for,
)
from v1.entrypoints.openai.serving_models import (
    LoadLoRAAdapterRequest,
    LoRAModulePath,
    UnloadLoRAAdapterRequest,
)
from v1.entrypoints.openai.serving_pooling import OpenAIServingPooling
from v1.entrypoints.openai.serving_responses import OpenAIServingResponses
from v1.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from v1.metrics.prometheus import PrometheusMetrics
from v1.models.model_files import resolve_model

T = TypeVar("T")

# On SIGINT/SIGTERM, requests still running get this long to finish; then they are cancelled
# (which aborts them in the engine) and the engine shuts down.
_GRACEFUL_SHUTDOWN_S = 5

# The name the default model (no --model) is served as: its model card's, without the GGUF
# file's quantization suffix, so that clients written for vLLM serving it work unchanged.
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"

router = APIRouter()


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.serving


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw: Request) -> Response:
    return await _respond(raw, _serving(raw).create_completion(request))


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
    return await _respond(raw, _serving(raw).create_chat_completion(request))


@router.post("/v1/chat/completions/batch")
async def create_batch_chat_completion(
    request: BatchChatCompletionRequest, raw: Request
) -> Response:
    return await _respond(raw, serving_chat_batch.create_batch_chat_completion(
        _serving(raw), request
    ))


@router.post("/v1/responses")
async def create_responses(request: ResponsesRequest, raw: Request) -> Response:
    responses: OpenAIServingResponses = raw.app.state.responses
    return await _respond(raw, responses.create_responses(request))


def _pooling(raw: Request) -> OpenAIServingPooling:
    return raw.app.state.serving_pooling


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
    return await _respond(raw, _pooling(raw).create_embedding(request))


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw: Request) -> Response:
    return await _respond(raw, _pooling(raw).create_pooling(request))


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw: Request) -> Response:
    return await _respond(raw, _pooling(raw).create_classify(request))


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw: Request) -> Response:
    return await _respond(raw, _pooling(raw).create_score(request))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def do_rerank(request: RerankRequest, raw: Request) -> Response:
    return await _respond(raw, _pooling(raw).do_rerank(request))


@router.get("/v1/models")
async def show_models(raw: Request) -> ModelList:
    return _serving(raw).models()


# Served only when the operator opts in (VLLM_ALLOW_RUNTIME_LORA_UPDATING), as vLLM's: else
# 404, like any route the server does not have.
lora_router = APIRouter()


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw: Request) -> Response:
    """vLLM's: load a PEFT adapter folder under a name `model` can then give (needs
    --enable-lora); 400 if it cannot be served, is outside the server's LoRA folders, or
    the name is taken."""
    return Response(await _serving(raw).serving_models.load_lora_adapter(request))


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw: Request) -> Response:
    """vLLM's: forget an adapter; 404 for an unknown name, 400 while a request uses it."""
    return Response(await _serving(raw).serving_models.unload_lora_adapter(request))


# vLLM's development routes: reset the prefix cache, pause and resume generation (as for an RL
# trainer's weight updates). They act on every client's requests: served only when the
# operator opts in (VLLM_SERVER_DEV_MODE), as vLLM's; else 404.
dev_router = APIRouter()


@dev_router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    raw: Request, reset_running_requests: bool = False, reset_external: bool = False
) -> Response:
    """vLLM's: `AsyncLLM.reset_prefix_cache` (`reset_external`: the disk tier too); 200
    whether or not the engine could reset (refused while requests hold blocks), as vLLM's."""
    await _serving(raw).engine.reset_prefix_cache(reset_running_requests, reset_external)
    return Response(status_code=200)


@dev_router.post("/pause")
async def pause_generation(
    raw: Request,
    mode: Literal["abort", "wait", "keep"] = "abort",
    wait_for_inflight_requests: bool = False,
    clear_cache: bool = True,
) -> Response:
    """vLLM's: `AsyncLLM.pause_generation`; answers once paused (mode "wait": once the
    requests in flight have finished)."""
    await _serving(raw).engine.pause_generation(
        mode=mode, wait_for_inflight_requests=wait_for_inflight_requests,
        clear_cache=clear_cache,
    )
    return Response(json.dumps({"status": "paused"}), media_type="application/json")


@dev_router.post("/resume")
async def resume_generation(raw: Request) -> Response:
    """A 409 while a pause is still draining (mode "wait"): resume once it has answered."""
    try:
        await _serving(raw).engine.resume_generation()
    except RuntimeError as e:
        if isinstance(e, EngineDeadError):
            raise
        return _error(409, str(e))
    return Response(json.dumps({"status": "resumed"}), media_type="application/json")


@dev_router.get("/is_paused")
async def is_paused(raw: Request) -> Response:
    paused = await _serving(raw).engine.is_paused()
    return Response(json.dumps({"is_paused": paused}), media_type="application/json")


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(request: TokenizeRequest, raw: Request) -> Response:
    return await _json_response(raw, await _serving(raw).tokenize(request))


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(request: DetokenizeRequest, raw: Request) -> Response:
    return await _json_response(raw, await _serving(raw).detokenize(request))


@router.get("/version")
async def show_version() -> VersionResponse:
    return VersionResponse(version=importlib.metadata.version("v1"))


@router.get("/health")
async def health(raw: Request) -> Response:
    engine = _serving(raw).engine
    try:
        await engine.check_health()
    except EngineDeadError as e:
        dead = engine.dead_engines
        if not dead:
            return Response(status_code=503)
        # Data parallel: which cores are down, and whether the others still serve.
        body = {
            "status": "dead" if engine.dead_error is not None else "degraded",
            "dead_engines": sorted(dead),
            "message": str(e),
        }
        return Response(json.dumps(body), 503, media_type="application/json")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    prometheus: PrometheusMetrics = raw.app.state.metrics
    accept = raw.headers.get("accept", "")
    prometheus.set_scheduler_stats(await _serving(raw).engine.get_stats())
    body, content_type = prometheus.expose(accept)
    return Response(body, media_type=content_type)


class _SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Not Starlette's own disconnect watch: its anyio cancel scope cancels every await in
        # the generators' cleanup too, the engine's abort included. Closing the stream at the
        # end aborts a request that is still running (its generator is parked at a yield).
        async with aclosing(self.body_iterator):  # type: ignore[type-var]
            await _unless_disconnected(receive, self.stream_response(send))


async def _respond(
    raw: Request, work: Awaitable[BaseModel | AsyncIterator[str] | Response]
) -> Response:
    result = await _unless_disconnected(raw.receive, work)
    if result is None:  # nobody is left to read it
        return Response(status_code=499)
    if isinstance(result, Response):  # made whole by the route (raw bytes)
        return result
    if isinstance(result, BaseModel):
        return await _json_response(raw, result)
    return _SSEResponse(result)


async def _json_response(raw: Request, body: BaseModel) -> Response:
    """`body` serialized on the engine's input pool: a /tokenize answer or an n=1000
    completion is megabytes of JSON. Returned as a Response, FastAPI does not validate it
    again (on the event loop)."""
    text = await _serving(raw).engine.run_in_pool(body.model_dump_json)
    return Response(text, media_type="application/json")


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """Awaits `work`, but cancels it (aborting its request in the engine) and returns None if
    the client disconnects first: a client that gave up should not keep the engine busy."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # its cleanup (the engine's abort) runs first
    return None if task.cancelled() else task.result()


def _error(status: int, message: str, param: str | None = None) -> Response:
    body = ErrorResponse.make(status, message, param)
    return Response(body.model_dump_json(), status, media_type="application/json")


_ERRORS_SHOWN = 8  # validation errors a 400's message names


async def _on_invalid_request(raw: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
        return _error(400, f"invalid JSON: {errors[0].get('ctx', {}).get('error', '')}")
    # A loc starts with where the value was ("body"); the rest is the parameter's path, then
    # for a union the member tried ("prompt.list[int]"): param is the path the errors share.
    # The first few errors are named (a body may hold a million bad values: a message naming
    # each was 52 MB).
    shown = errors[:_ERRORS_SHOWN]
    locs = [tuple(map(str, e["loc"][1:])) for e in shown]
    message = "; ".join(
        f"{'.'.join(loc)}: {_reason(e)}" if loc else _reason(e) for loc, e in zip(locs, shown)
    )
    if len(errors) > len(shown):
        message += f"; and {len(errors) - len(shown)} more errors"
    return _error(400, message, ".".join(os.path.commonprefix(locs)) or None)


def _reason(error: Any) -> str:
    # Our own validators' ValueErrors: their message, without pydantic's "Value error, ".
    return str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]


async def _on_http_error(raw: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail))


async def _on_error(raw: Request, exc: Exception) -> Response:
    body = error_for(exc)
    return Response(body.model_dump_json(), body.error.code, media_type="application/json")


class _APIKeyCheck:
    """vLLM's --api-key: a /v1 request without `Authorization: Bearer KEY` gets 401 (the
    others, /health included, stay open)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and (
            scope["method"] != "OPTIONS"  # CORS preflights carry no credentials
        ):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _error(401, "Unauthorized")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# A JSON string, escapes included; one not closed runs to the end of the body, a last lone
# backslash too. (Required to close, a body of one quote and then 40,000 escaped quotes was
# scanned from each quote to its end: 13 s of the event loop for 1.1 MB.)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)


class _BodySizeLimit:
    """--max-request-body-bytes: a request whose body is larger gets a 400 before more of it
    is read than the limit (at once when its Content-Length says so, else as a chunked body
    streams in). The body read is handed on to the app whole, as it would read it anyway.

    --max-body-bytes-in-flight: the bodies of all requests whose response has not started
    (parsed, validated, tokenized, waiting for the engine) hold at most that many bytes
    together, counted as they arrive; a request whose body would pass it gets a 503 (before
    any of it is read where its Content-Length says so), so that many parallel large bodies
    cannot grow the frontend's memory without bound. A body is not held before it arrives:
    16 clients announcing 16 MB and sending a byte each held the whole budget, and every
    other request got a 503.

    --max-request-body-seconds: a body that has not arrived whole by then gets a 408, and its
    bytes are dropped (a client sending a body slowly, or most of it and then nothing,
    would otherwise hold its bytes and its connection for as long as it likes).

    --max-request-json-values: a body with more commas outside its JSON strings than that gets
    a 400 before it is parsed (a value is at most one comma: the parse and the validation,
    on the event loop, cost per value, not per byte).

    A body of LARGE_BODY_BYTES or more is handed on one per turn of the event loop: its
    parse and validation (tens of ms for 15 MB) run at once when the app reads it, and many
    large bodies read in at once would otherwise run back to back while every stream waits."""

    LARGE_BODY_BYTES = 1 << 20

    def __init__(
        self, app: Any, max_bytes: int, max_bytes_in_flight: int, max_json_values: int,
        max_seconds: float,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_bytes_in_flight = max_bytes_in_flight
        self.max_json_values = max_json_values
        self.max_seconds = max_seconds
        self.bytes_in_flight = 0  # of every request admitted whose response has not started
        self._large_body_turn = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or len(length) > 19 or int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        held = 0  # this request's share of bytes_in_flight

        def fits(size: int) -> bool:  # this request holding `size` bytes instead
            return self.bytes_in_flight - held + size <= self.max_bytes_in_flight

        def hold(size: int) -> bool:
            nonlocal held
            if not fits(size):
                return False
            self.bytes_in_flight += size - held
            held = size
            return True

        def release() -> None:
            nonlocal held
            self.bytes_in_flight -= held
            held = 0

        try:
            if not fits(int(length)):  # checked, not held: only bytes that arrive are
                await self._busy(scope, receive, send)
                return
            chunks, size = [], 0
            deadline = asyncio.get_running_loop().time() + self.max_seconds
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    await self._too_slow(scope, receive, send)
                    return
                if message["type"] != "http.request":  # the client left: nobody to answer
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.max_bytes:
                    await self._refuse(scope, receive, send)
                    return
                if not hold(size):
                    await self._busy(scope, receive, send)
                    return
                if not message.get("more_body", False):
                    break
            body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            del chunks
            if self._too_many_values(body["body"]):
                await _error(400, (
                    "the request body holds more JSON values than max_request_json_values "
                    f"({self.max_json_values}): send its prompts in several requests"
                ))(scope, receive, send)
                return
            replayed = False

            async def replay() -> Any:  # the body, then the connection's own messages
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                if len(body["body"]) >= self.LARGE_BODY_BYTES:
                    await self._large_body_turn.acquire()
                    # Released in the loop's next turn: after what the app does with the
                    # body up to its first wait, and after the loop has polled its sockets.
                    asyncio.get_running_loop().call_soon(self._large_body_turn.release)
                return body

            async def started(message: Any) -> None:  # the response begins: work has started
                if message["type"] == "http.response.start":
                    release()
                await send(message)

            await self.app(scope, replay, started)
        finally:
            release()

    def _too_many_values(self, body: bytes) -> bool:
        # Counting every comma is ~1 ms per MB; only a body over the bound by that count
        # pays for dropping its strings (whose commas are text, not separators).
        return (
            body.count(b",") >= self.max_json_values
            and _JSON_STRING.sub(b"", body).count(b",") >= self.max_json_values
        )

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            "the server holds max_body_bytes_in_flight "
            f"({self.max_bytes_in_flight}) bytes of request bodies not yet answered: retry later"
        )
        await _error(503, message)(scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            "the request body did not arrive within max_request_body_seconds "
            f"({self.max_seconds:g}): send it again"
        )
        await _error(408, message)(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than max_request_body_bytes ({self.max_bytes})"
        await _error(400, message)(scope, receive, send)


class _TrimWhenIdle:
    """Whenever the last request in flight ends, `memory_trim.trim` gives what the requests
    freed back to the OS (a 5 MB /tokenize left ~400 MB in malloc's arenas). On a worker
    thread, as a trim after a large request takes ~0.1 s; one at a time, and once more after
    one that was still running when the server went idle again. Unlike the engine core
    (`memory_trim.IdleTrim`, which waits for growth past a slack), the frontend trims at
    every idle moment: its ordinary requests free little, so a trim costs ~0.1 ms; and a
    trim that ran while the next request was already at work must not make the next idle
    moment skip its own."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._in_flight = 0
        self._trimming: asyncio.Future[bool] | None = None
        self._idle_again = False  # went idle while a trim was running: one more after it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._trim()

    def _trim(self) -> None:
        if self._trimming is not None and not self._trimming.done():
            self._idle_again = True
            return
        self._idle_again = False
        self._trimming = asyncio.get_running_loop().run_in_executor(None, memory_trim.trim)
        self._trimming.add_done_callback(self._trimmed)

    def _trimmed(self, _: "asyncio.Future[bool]") -> None:  # on the event loop
        if self._idle_again and self._in_flight == 0:
            self._trim()


def load_chat_template(chat_template: str) -> str:
    """--chat-template, as vLLM takes it: a file's path, or the template itself."""
    if Path(chat_template).is_file():
        return Path(chat_template).read_text()
    if not any(c in chat_template for c in "{}\n"):  # neither Jinja nor several lines
        raise ValueError(f"--chat-template: no such file {chat_template!r}")
    return chat_template


def build_app(
    engine_args: EngineArgs,
    served_model_names: list[str] | None = None,
    chat_template: str | None = None,
    api_key: str | None = None,
    tool_parser: str | None = None,
    limits: ServerLimits | None = None,
    lora_modules: list[LoRAModulePath] | None = None,
    lora_roots: list[str] | None = None,
) -> FastAPI:
    """`tool_parser` (e.g. "hermes") enables tool_choice "auto"; `limits` bound each HTTP
    request (None: the defaults; `engine_args` holds the engine's `InputLimits`);
    `lora_modules`: LoRA adapters served from the start (with enable_lora), by name;
    `lora_roots`: folders besides theirs that runtime loads may read adapters from (the
    load routes are served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set)."""
    limits = limits or ServerLimits()
    env = envs.read()
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with interrupted_by_signals():  # docker stop, Ctrl-C: not after the load
            engine = AsyncLLM.from_engine_args(engine_args)
        try:  # generation_config.json's sampling defaults (vLLM's --generation-config auto)
            defaults = engine_args.get_diff_sampling_param(engine.model_dir)
        except BaseException:
            engine.shutdown()
            raise
        default_name = engine.model_name if engine_args.model else DEFAULT_SERVED_MODEL_NAME
        app.state.serving = OpenAIServing(
            engine, served_model_names or [default_name], chat_template, tool_parser,
            default_sampling_params=defaults, limits=limits, model_path=str(engine.model_dir),
            reasoning_parser=engine_args.reasoning_parser,
        )
        try:
            await app.state.serving.serving_models.init_static_loras(
                lora_modules or [], lora_roots or []
            )
        except BaseException:
            engine.shutdown()
            raise
        app.state.responses = OpenAIServingResponses(app.state.serving)
        app.state.serving_pooling = OpenAIServingPooling(app.state.serving)
        # Labelled with the name responses report, as vLLM labels its metrics.
        app.state.metrics = PrometheusMetrics(
            app.state.serving.served_model_names[0], engine.max_model_len
        )
        if not engine_args.disable_log_stats:
            engine.stat_loggers.append(app.state.metrics.record)
        # The startup heap (torch, transformers, the tokenizer: ~350k objects) lives as long
        # as the server: out of the collector's sight, a full collection, which runs on
        # whichever thread triggers it and stops the event loop meanwhile, takes microseconds
        # instead of ~0.1-0.5 s.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="v1 OpenAI-compatible server", lifespan=lifespan)
    app.include_router(router)
    if env.allow_runtime_lora_updating:
        app.include_router(lora_router)
    if env.server_dev_mode:
        app.include_router(dev_router)
    app.add_exception_handler(RequestValidationError, _on_invalid_request)
    app.add_exception_handler(HTTPException, _on_http_error)
    # Exception (anything else: a bug) is handled last, by Starlette, which also logs it.
    for exc_class in (ValueError, ModelNotFoundError, EngineDeadError, Exception):
        app.add_exception_handler(exc_class, _on_error)
    app.add_middleware(
        _BodySizeLimit, max_bytes=limits.max_request_body_bytes,
        max_bytes_in_flight=limits.max_body_bytes_in_flight,
        max_json_values=limits.max_request_json_values,
        max_seconds=limits.max_request_body_seconds,
    )
    if api_key is not None:  # added last, so it runs first: no key, no body read
        app.add_middleware(_APIKeyCheck, api_key=api_key)
    app.add_middleware(_TrimWhenIdle)
    return app


def tcp_port(text: str) -> int:
    """A command-line TCP port (`--port`): argparse reports anything but 1..65535 as a
    usage error naming the value."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text!r}")
    return port


def make_parser(prog: str = "v1 serve") -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(  # vLLM's: `--max_model_len` as `--max-model-len`
        prog=prog,
        description="An OpenAI-compatible server over the engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as --model (vLLM's `serve MODEL`)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=tcp_port, default=8000, help="port to listen on")
    parser.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="the model name(s) requests may give (any of them); responses report the first. "
        f"By default the model's file or directory name, or its hub id "
        f"({DEFAULT_SERVED_MODEL_NAME} for the default model)",
    )
    parser.add_argument(
        "--chat-template", default=None,
        help="a chat template (a file, or the Jinja text itself) to use instead of the model's",
    )
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='allow tool_choice "auto" (the default with tools): the model\'s own tool calls '
        "are parsed out of its text (needs --tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), "
        "llama3_json ({json}; {json} as the whole output), mistral ([TOOL_CALLS] and a JSON "
        "array, or name{json}), xlam (a JSON array, bare or in a ```json block)",
    )
    parser.add_argument(
        "--api-key", default=None,
        help="if given, the /v1 routes need the header `Authorization: Bearer API_KEY`",
    )
    parser.add_argument(
        "--headless", action="store_true",
        help="run only this host's data-parallel engine cores (--data-parallel-size-local "
        "of them, ranks from --data-parallel-start-rank), registered with the frontend at "
        "--data-parallel-address:--data-parallel-rpc-port; no HTTP server",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve from the start, each `name=path` or "
        'vLLM\'s JSON {"name": ..., "path": ..., "base_model_name": ...}; a request picks one '
        "by its `model` (needs --enable-lora)",
    )
    parser.add_argument(
        "--lora-root", action="append", default=None, metavar="DIR",
        help="a folder (repeatable) that /v1/load_lora_adapter may load adapters from, "
        "besides the --lora-modules folders; the routes are served only with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", help="uvicorn's log level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    # The server's own request limits; the engine's options (and its request limits) are
    # EngineArgs', spelled as vLLM's flags.
    server_limits = parser.add_argument_group(
        "server request limits", "a request over one gets a 400 naming the field and the limit"
    )
    for field in dataclasses.fields(ServerLimits):
        server_limits.add_argument(
            "--" + field.name.replace("_", "-"), type=int, default=field.default,
            help=field.metadata["help"],
        )
    return EngineArgs.add_cli_args(parser)


def engine_args_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineArgs:
    """The engine options of a parsed command line. A bad option, or a model that is not
    there (a path, or a hub id not in the local Hugging Face cache), ends the command here
    with its message (exit status 2), before anything starts."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    try:
        engine_args = EngineArgs.from_cli_args(args)
        resolve_model(engine_args.model, engine_args.revision)
    except ValueError as e:
        parser.error(str(e))
    return engine_args


def main(argv: list[str], prog: str = "v1 serve") -> None:
    parser = make_parser(prog)
    args = parser.parse_args(argv)
    engine_args = engine_args_from(parser, args)
    if args.headless:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        try:
            run_headless(engine_args)
        except ValueError as e:
            parser.error(str(e))
        return
    try:
        chat_template = None if args.chat_template is None else load_chat_template(
            args.chat_template
        )
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    try:
        limits = ServerLimits(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}
        )
        lora_modules = [LoRAModulePath.parse(m) for m in args.lora_modules or []]
    except ValueError as e:
        parser.error(str(e))
    if (lora_modules or args.lora_root) and not engine_args.enable_lora:
        parser.error("--lora-modules and --lora-root need --enable-lora")
    uvicorn.run(
        build_app(
            engine_args, args.served_model_name, chat_template, args.api_key,
            args.tool_call_parser if args.enable_auto_tool_choice else None, limits,
            lora_modules, args.lora_root,
        ),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        # h11, not httptools (uvicorn's pick where it is installed): with httptools a client
        # closing a connection it had pipelined a second request on never aborted the first
        # (the disconnect reached the queued one only), and a request's headers had no size
        # bound (400 MB of them grew the frontend by 400 MB); h11 bounds them (16 KiB).
        http=JsonErrorH11Protocol,
    )

