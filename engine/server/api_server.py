"""The FastAPI app (design.md §3): routes, API-key check, lifespan; ``run_server`` runs it under uvicorn."""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import DEFAULT_MAX_WAITING, AsyncLLMEngine
from engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from engine.errors import ENGINE_DIED_LOG
from engine.metrics import EngineMetrics
from engine.server.cors import LOCAL_ORIGINS, origin_regex
from engine.server.errors import APIError, install_error_handlers
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    DetokenizeResponse, ModelCard, ModelList, ResponsesRequest, TokenizeRequest,
                                    TokenizeResponse)
from engine.server.request_ids import RequestIdMiddleware
from engine.server.serving import ServingContext, tokenizing
from engine.server.serving_chat import create_chat_completion, render_chat
from engine.server.serving_completion import create_completion
from engine.server.serving_responses import create_response

logger = logging.getLogger(__name__)
router = APIRouter()


def _ctx(raw: Request) -> ServingContext:
    return raw.app.state.ctx


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
    return await create_chat_completion(_ctx(raw), req, raw)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request) -> Response:
    return await create_completion(_ctx(raw), req, raw)


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, raw: Request) -> Response:
    return await create_response(_ctx(raw), req, raw)


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    return ModelList(data=[_card(_ctx(raw))])


@router.get("/v1/models/{model:path}")
async def model(model: str, raw: Request) -> ModelCard:
    """One model's card (OpenAI's ``models.retrieve``, as Ollama serves it; vLLM has only the list); 404
    ``model_not_found`` for a name this server does not serve."""
    ctx = _ctx(raw)
    ctx.check_model(model)
    return _card(ctx)


def _card(ctx: ServingContext) -> ModelCard:
    """The served model's card (503 while the engine loads, or once it died)."""
    llm = ctx.ready_engine()
    config = ctx.engine.config
    return ModelCard(id=ctx.model_name, root=config.model if config else None, max_model_len=llm.max_model_len)


@router.get("/health")
async def health(raw: Request) -> JSONResponse:
    """200 when the engine is ready (``"asleep": true`` while it sleeps: ``sleep_after_idle_s``); 503 while loading
    or once dead (with the error)."""
    engine = _ctx(raw).engine
    body = {"status": engine.state, "model": engine.model_name, **({"asleep": True} if engine.asleep else {})}
    if engine.error is not None:
        body["error"] = repr(engine.error)
    return JSONResponse(body, status_code=200 if engine.is_ready else 503)


@router.get("/version")
async def server_version() -> dict:
    try:
        return {"version": version("edge-appliance")}
    except PackageNotFoundError:
        return {"version": "0+unknown"}


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    data, content_type = _ctx(raw).metrics.render()
    return Response(data, media_type=content_type)


@router.get("/v1/kv")
async def kv(raw: Request) -> dict:
    """The KV block map (design.md §4): counts, one character per block (``.`` free, ``#`` used, ``c`` cached),
    per running request its id and number of blocks, and ``asleep``: the engine gave its memory back
    (``sleep_after_idle_s``; the counts are then those of an empty cache), ``waking``: a request loads it again."""
    ctx = _ctx(raw)
    ctx.ready_engine()
    s = ctx.engine.get_stats()
    if s.block_states:
        free, used, cached = (s.block_states.count(ch) for ch in ".#c")
    else:
        free, cached = s.num_free_blocks, s.num_cached_blocks
        used = max(0, s.num_blocks - free - cached)
    return {"block_size": s.block_size, "num_blocks": s.num_blocks, "free": free, "used": used, "cached": cached,
            "usage": s.kv_cache_usage, "blocks": s.block_states,
            "running": [{"request_id": rid, "num_blocks": nb} for rid, nb in s.running], "asleep": ctx.engine.asleep,
            "waking": ctx.engine.waking}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> TokenizeResponse:
    """Token ids of ``prompt``, or of ``messages`` rendered through the chat template."""
    ctx = _ctx(raw)
    ctx.check_model(req.model)
    llm = ctx.ready_engine()
    if req.messages is not None:  # off the event loop, as every tokenization of the server: megabytes take seconds
        tokens = await tokenizing(render_chat, llm.tokenizer, req, bool(req.add_special_tokens))
    elif req.prompt is not None:
        special = req.add_special_tokens is not False
        tokens = await tokenizing(llm.tokenizer.encode, req.prompt, add_special_tokens=special)
    else:
        raise APIError(400, "prompt: either prompt or messages is required", param="prompt", code="invalid_value")
    strs = await tokenizing(llm.tokenizer.convert_ids_to_tokens, list(tokens)) if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=llm.max_model_len, tokens=list(tokens), token_strs=strs)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    ctx = _ctx(raw)
    ctx.check_model(req.model)
    llm = ctx.ready_engine()
    vocab = len(llm.tokenizer)
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
    return DetokenizeResponse(prompt=await tokenizing(llm.tokenizer.decode, req.tokens))


class ApiKeyMiddleware:
    """401 for any ``/v1/*`` request without ``Authorization: Bearer <key>`` (checked before the body is read; a
    browser's CORS preflight, which never carries the key, is answered before this by the CORS layer)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_engine: AsyncLLMEngine, *, served_model_name: str | None = None,
              api_key: str | None = None, tool_call_parser: str = "auto",
              reasoning_parser: str = "auto", allowed_origins: str = LOCAL_ORIGINS,
              stop_engine: bool = False) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine``; its lifespan starts the engine (idempotent) and feeds
    a fresh per-app metrics registry from the engine's outputs. ``tool_call_parser``: for tool_choice "auto"
    (``tool_parsers.SETTINGS``); ``reasoning_parser``: whether chat answers' ``<think>`` blocks become their
    ``reasoning`` (``reasoning.SETTINGS``); ValueError for another setting. ``allowed_origins``: the web pages
    that may call it from a browser (``engine.server.cors``; ValueError for a malformed list): the CORS layer
    is outermost, so it answers preflights and labels every answer, a 401 included. ``stop_engine``: the
    lifespan's end shuts the engine down too (``run_server``: after a SIGTERM uvicorn raises it again once the
    lifespan ends, so no code after its run would)."""
    cors = origin_regex(allowed_origins)
    name = served_model_name or async_engine.model_name
    config = async_engine.config
    cache_config = {} if config is None else {"gpu_memory_utilization": config.gpu_memory_utilization,
                                              "cache_dtype": config.kv_cache_dtype}
    # the token-count histograms' buckets end at max_model_len (unset: the engine takes at most the default)
    metrics = EngineMetrics(name, async_engine.get_stats, cache_config,
                            max_model_len=(config.max_model_len if config else None) or DEFAULT_MAX_MODEL_LEN)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        async_engine.add_output_listener(metrics.observe)
        async_engine.add_failure_listener(metrics.forget)
        try:
            yield
        finally:
            async_engine.remove_output_listener(metrics.observe)
            async_engine.remove_failure_listener(metrics.forget)
            if stop_engine:
                await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="edge-appliance", lifespan=lifespan)
    app.state.ctx = ServingContext(async_engine, name, metrics, api_key, tool_call_parser, reasoning_parser)
    install_error_handlers(app)
    app.include_router(router)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # outside the key check: a 401 carries the id too
    if cors:  # added last: the outermost layer (vLLM's defaults but the origins: any method and header, no cookies)
        app.add_middleware(CORSMiddleware, allow_origin_regex=cors, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])
    return app


#: GET requests that monitoring repeats (Prometheus scrapes, ``appliance top`` once a second, health checks): their
#: successful answers are left out of the access log, which would otherwise fill with them.
POLLED_PATHS = ("/metrics", "/v1/kv", "/health")


class QuietPolls(logging.Filter):
    """Drops uvicorn access-log records of GETs of :data:`POLLED_PATHS` that succeeded or got 503 (the model is
    loading, or the engine died: the engine logs both itself); other failures stay (uvicorn's record args: client,
    method, path with query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 5:
            _, method, path, _, status = args
            quiet = int(status) < 400 or int(status) == 503
            return not (method == "GET" and str(path).split("?")[0] in POLLED_PATHS and quiet)
        return True


#: Seconds uvicorn waits for running requests when the server stops (streams get ``serving.STREAM_GRACE_S`` of them)
GRACEFUL_S = 5

#: The exit status of a server whose engine died while serving (a service manager restarts it: systemd's
#: ``Restart=on-failure``); uvicorn's own for a server that could not start (its port taken, say) is 3.
ENGINE_DIED_EXIT = 1


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "info",
               max_waiting: int = DEFAULT_MAX_WAITING, tool_call_parser: str = "auto",
               reasoning_parser: str = "auto", engine_process: bool | None = None,
               allowed_origins: str = LOCAL_ORIGINS, keep_alive_on_engine_death: bool = False,
               sleep_after_idle_s: float | None = None) -> None:
    """Load the engine (in the background; /health is 503 until ready) and serve until SIGINT/SIGTERM.

    ``max_waiting``: requests queued beyond ``max_num_seqs`` before new ones get 503 (``AsyncLLMEngine``).
    ``engine_process``: the engine in a process of its own (``AsyncLLMEngine.from_config``; None: on CUDA).
    ``tool_call_parser``, ``reasoning_parser``, ``allowed_origins``: see :func:`build_app`.
    ``sleep_after_idle_s``: an engine in a process of its own frees the GPU after that many seconds without
    requests, until the next one (``AsyncLLMEngine``; None: never).
    An engine that dies while serving (a CUDA error, its process killed by the OOM killer, steps failing in a row)
    fails its requests, then the server shuts down gracefully and exits with ``SystemExit(ENGINE_DIED_EXIT)``, as
    vLLM's does, so that systemd starts it again; ``keep_alive_on_engine_death`` keeps it up instead (vLLM's
    ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``), answering 503. A model that fails to load keeps it up either way:
    /health answers 503 with the error (loading again would fail again). ``SystemExit(3)``: uvicorn could not
    start (the port is taken). A stop (SIGTERM, SIGINT) lets running requests finish (streams for
    ``serving.STREAM_GRACE_S``, the rest for ``GRACEFUL_S``), then the lifespan's end shuts the engine down (an
    engine process stuck in a step is killed). The engine's own log lines (loading, ready, failed steps, CPU thread
    counts) go to stderr at ``log_level`` unless the caller set up logging first.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncLLMEngine.from_config(engine_config, max_waiting=max_waiting, engine_process=engine_process,
                                        sleep_after_idle_s=sleep_after_idle_s)
    app = build_app(engine, api_key=api_key, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                    allowed_origins=allowed_origins, stop_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=GRACEFUL_S))
    died: list[BaseException] = []

    def exit_on_death(error: BaseException) -> None:  # on the engine thread: uvicorn polls should_exit
        if server.should_exit:  # stopping already (a signal): the engine's end is part of it, not a failure
            logger.info("the engine stopped while the server shut down (%r)", error)
            return
        died.append(error)
        logger.error("%s (%r): the server exits with status %d so that its service manager starts it again "
                     "(keep_alive_on_engine_death keeps it up)", ENGINE_DIED_LOG, error, ENGINE_DIED_EXIT)
        server.should_exit = True

    if not keep_alive_on_engine_death:
        engine.add_death_listener(exit_on_death)
    engine.start()
    logging.getLogger("uvicorn.access").addFilter(QuietPolls())  # uvicorn's logging set-up keeps filters
    try:
        server.run()
    except KeyboardInterrupt:  # as uvicorn.run
        pass
    finally:
        engine.shutdown()  # done already where the lifespan ended (idempotent); not where uvicorn failed to start
    if died:  # said again, last: `appliance status` reads the end of the background server's log
        logger.error("%s: exiting with status %d", ENGINE_DIED_LOG, ENGINE_DIED_EXIT)
        raise SystemExit(ENGINE_DIED_EXIT)
    if not server.started:
        raise SystemExit(3)
