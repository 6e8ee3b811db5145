"""What the chat and completion handlers share: model check, submission, merging, collection, SSE framing.

A request with P prompts and ``n`` choices each becomes P engine requests; choice ``c`` of prompt ``i`` is
answered as index ``i * n + c`` (OpenAI's order for batched completions).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from sse_starlette import EventSourceResponse

from engine.async_engine import AsyncLLMEngine, RequestStream
from engine.metrics import EngineMetrics
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.server import reasoning, tool_parsers
from engine.server.errors import APIError, bad_value, engine_unavailable, from_engine_exception
from engine.server.protocol import UsageInfo

logger = logging.getLogger(__name__)
_END = object()


class ServingContext:
    """Per-app state the handlers read: the engine, the served model name, metrics and the API key."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: EngineMetrics,
                 api_key: str | None = None, tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        self.engine, self.model_name, self.metrics, self.api_key = engine, model_name, metrics, api_key
        tool_parsers.resolve(tool_call_parser, None)  # a bad setting fails when the app is built, not per request
        reasoning.resolve(reasoning_parser, None)
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self._tool_parser: tuple[str | None] | None = None  # resolved once, from the loaded model's template
        self._splits_reasoning: bool | None = None  # the same

    def tool_parser(self, tokenizer: Any) -> str | None:
        """The tool-call parser for tool_choice "auto" (``tool_parsers.resolve`` on the model's chat template, the
        first time it is asked)."""
        if self._tool_parser is None:
            self._tool_parser = (tool_parsers.resolve(self.tool_call_parser, getattr(tokenizer, "chat_template",
                                                                                      None)),)
        return self._tool_parser[0]

    def splits_reasoning(self, tokenizer: Any) -> bool:
        """Whether chat answers are split into reasoning and content (``reasoning.resolve`` on the model's chat
        template, the first time it is asked)."""
        if self._splits_reasoning is None:
            self._splits_reasoning = reasoning.resolve(self.reasoning_parser, getattr(tokenizer, "chat_template", None))
        return self._splits_reasoning

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served name (None or "" means the served model)."""
        if model and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def ready_engine(self) -> Any:
        """The loaded ``LLMEngine`` (for ``tokenizer`` / ``max_model_len``); 503 while loading or once dead."""
        if not self.engine.is_ready:
            raise engine_unavailable(self.engine.state, self.engine.error)
        return self.engine.engine


def build_params(build: Any, *args: Any) -> SamplingParams:
    """Call ``build(*args)`` (a request's ``sampling_params``); a ``ValueError`` becomes a 400 naming the field."""
    try:
        return build(*args)
    except ValueError as e:
        raise bad_value(e) from e


#: The threads that tokenize (chat templates, prompts, /tokenize and /detokenize): off the event loop, where
#: megabytes of text would stall every stream for seconds (the tokenizers release the GIL), and apart from the
#: default pool, where slow grammar checks and compiles run, so those never hold up a plain request.
TOKENIZER_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenizer")


async def tokenizing(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on one of :data:`TOKENIZER_THREADS`."""
    return await asyncio.get_running_loop().run_in_executor(TOKENIZER_THREADS, functools.partial(fn, *args, **kwargs))


async def check_constraint(req: Any) -> None:
    """``req.check_constraint()`` (a grammar of its structured output can be made) on a worker thread, off the event
    loop (it can take seconds): its ValueError becomes a 400 naming the field. Nothing for a request without one."""
    if req.constraint() is None:
        return
    try:
        await asyncio.to_thread(req.check_constraint)
    except ValueError as e:
        raise bad_value(e) from e


def check_batch(ctx: ServingContext, count: int, prompt_field: str) -> None:
    """A 400 naming the prompt for a batch larger than the engine ever admits at once (a 503 would ask for retries
    that never work)."""
    limit = getattr(ctx.engine, "max_requests", None)
    if isinstance(limit, int) and count > limit:
        raise bad_value(ValueError(f"{prompt_field}: {count} prompts in one request, the server admits at "
                                   f"most {limit} at once (max_num_seqs + max_waiting)"))


async def submit(ctx: ServingContext, prompts: list[str | list[int]], params: SamplingParams,
                 request_id: str, prompt_field: str, client_id: bool = False) -> list[RequestStream]:
    """Submit one engine request per prompt, all or none; engine rejections become ``APIError``s (a batch of
    several prompts passed :func:`check_batch` first). The engine's ids are ``request_id`` (``-i`` after it for
    several prompts), with a random suffix where the id is the client's (``client_id``), so that a client may send
    its id again while a request under it still runs (current vLLM's rule: ids unique inside the engine)."""
    if client_id:
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    arrival = time.monotonic()
    results = await asyncio.gather(*(ctx.engine.add_request(rid, p, params, arrival)
                                     for rid, p in zip(ids, prompts)), return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if not isinstance(r, RequestStream)]
    if errors:
        for s in streams:
            s.abort()
        if not isinstance(errors[0], Exception):
            raise errors[0]  # cancellation
        raise from_engine_exception(errors[0], prompt_field) from errors[0]
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt index, output)`` from all streams as they come; aborts unfinished ones on exit.

    One stream (one prompt, the usual request) is read directly: a consumer that lags then gets the newest
    cumulative output only (``RequestStream``), so a busy event loop sends fewer, larger chunks; with several, a
    task per stream feeds one queue."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
    """The final output of every stream, or None when the client disconnected first (requests aborted)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def run() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    if not await until_disconnect(run(), raw):
        return None
    return finals  # type: ignore[return-value]


async def until_disconnect(work: Awaitable[None], raw: Request) -> bool:
    """Run ``work``; cancel it if the client disconnects first. True when ``work`` completed.

    Engine errors raised by ``work`` are mapped to ``APIError``s.
    """
    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        return False
    if task.exception() is not None:
        raise as_api_error(task.exception())
    return True


def as_api_error(e: BaseException) -> BaseException:
    """An engine exception seen after submission, as an ``APIError`` (unknown exceptions stay as they are)."""
    if isinstance(e, APIError) or not isinstance(e, Exception):
        return e
    try:
        return from_engine_exception(e, "prompt")
    except Exception:  # noqa: BLE001 - not an engine error: a bug, reported as 500
        return e


class Delta(NamedTuple):
    """What one choice gained since the last chunk: ``text`` is new; ``choice.token_ids[token_start:]`` (and
    ``choice.logprobs``) are the new tokens; ``text_start`` is how many characters were sent before."""

    index: int
    text: str
    finish_reason: str | None
    first: bool
    choice: CompletionOutput
    text_start: int
    token_start: int


class DeltaTracker:
    """Per choice, how much of the cumulative text and tokens was sent; turns cumulative outputs into deltas."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        self.done: set[int] = set()

    def update(self, i: int, out: RequestOutput) -> list[Delta]:
        """The deltas of prompt ``i``'s choices that have new text or tokens, just finished, or are new."""
        news = []
        for c in out.outputs:
            index = i * self.n + c.index
            if index in self.done:
                continue
            first = index not in self.sent
            chars, tokens = self.sent.get(index, (0, 0))
            num_tokens = len(c.token_ids)
            if first or c.finish_reason or len(c.text) > chars or num_tokens > tokens:
                news.append(Delta(index, c.text[chars:], c.finish_reason, first, c, chars, tokens))
            self.sent[index] = (max(chars, len(c.text)), num_tokens)
            if c.finish_reason:
                self.done.add(index)
        return news


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """A chunk's usage with ``continuous_usage_stats`` (vLLM): its prompt's tokens and its choice's tokens so far."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def usage(finals: list[RequestOutput | None]) -> UsageInfo:
    """Token counts: the prompts once each, plus every choice's generated tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in finals if o is not None)
    completion = sum(len(c.token_ids) for o in finals if o is not None for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def json_response(body: BaseModel) -> Response:
    """A whole (non-streamed) response as the streamed chunks are written: pydantic's ``model_dump_json``, where a
    NaN float (a logprob of NaN logits) becomes null. Starlette's ``JSONResponse`` (``json.dumps`` with
    ``allow_nan=False``) refuses it, and the request failed with 500 after the generation was done."""
    return Response(body.model_dump_json(), media_type="application/json")


#: Seconds a stream that is running when the server is asked to stop (SIGTERM: `systemctl stop` or `restart`,
#: `appliance stop`) may go on before it is cut (sse-starlette's ``shutdown_grace_period``): a short answer ends
#: with its last chunk and ``[DONE]``. Below uvicorn's ``timeout_graceful_shutdown`` (``api_server.GRACEFUL_S``).
STREAM_GRACE_S = 4.0


def event_stream(events: AsyncIterator[dict]) -> EventSourceResponse:
    """SSE framing of ``events`` (sse-starlette's dicts: ``data``, optionally ``event``), lines ended by "\n";
    at a shutdown a running stream gets :data:`STREAM_GRACE_S` seconds to finish."""
    return EventSourceResponse(events, sep="\n", shutdown_grace_period=STREAM_GRACE_S)


def stream_error(e: Exception) -> APIError:
    """What a stream sends for ``e``, raised after its headers went out: the engine's errors as their
    ``APIError``s; anything else, a chunk that does not serialize among them (pydantic's error is a ValueError,
    not the client's), is a bug: logged, and a 500."""
    err = e if isinstance(e, PydanticSerializationError) else as_api_error(e)
    if not isinstance(err, APIError):
        logger.exception("error while streaming (a bug)", exc_info=e)
        err = APIError(500, f"Internal server error: {e!r}")
    return err


def kept_prompt_len(prompt_len: int, truncate_prompt_tokens: int | None, max_model_len: int) -> int:
    """How many of a prompt's tokens the engine keeps: vLLM's ``truncate_prompt_tokens`` k keeps the last k (-1:
    the last ``max_model_len``)."""
    if truncate_prompt_tokens is None:
        return prompt_len
    return min(prompt_len, max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens)


def sse_response(chunks: AsyncIterator[str]) -> EventSourceResponse:
    """Frame chunks (JSON texts, each a pydantic model's ``model_dump_json``: half the CPU of ``model_dump`` then
    ``json.dumps``, and what vLLM sends) as ``data: {json}`` events and end with ``data: [DONE]``.

    An error after the stream started is sent as one ``data: {"error": ...}`` event before ``[DONE]``.
    """
    async def events() -> AsyncIterator[dict]:
        try:
            async for chunk in chunks:
                yield {"data": chunk}
        except Exception as e:  # noqa: BLE001 - headers are sent; the error goes in the stream
            yield {"data": json.dumps(stream_error(e).body(), ensure_ascii=False)}
        yield {"data": "[DONE]"}

    return event_stream(events())
