"""``POST /v1/completions``: one engine request per prompt (string or token ids) -> response or SSE chunks."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import RequestStream
from engine.outputs import CompletionOutput
from engine.server.errors import APIError
from engine.server.logprobs import completion_logprobs
from engine.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, random_id
from engine.server.serving import (DeltaTracker, ServingContext, build_params, collect, merge, sse_response,
                                   submit, usage)


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def prompt_texts(tokenizer: Any, prompts: list[str | list[int]]) -> list[str]:
    """Each prompt as text (for ``echo``)."""
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Answer one completion request (JSON, or SSE when ``stream``). Errors: ``APIError`` (404/400/503)."""
    ctx.check_model(req.model)
    llm = ctx.ready_engine()
    given = split_prompts(req.prompt)
    prompts = given if req.add_special_tokens else [  # the engine encodes strings with them: hand it ids without
        llm.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in given]
    params = build_params(req.sampling_params, req.max_tokens, req.logprobs, llm.default_sampling)
    request_id = random_id("cmpl")
    streams = await submit(ctx, prompts, params, request_id, "prompt")  # checks the token ids before echo decodes
    echo = prompt_texts(llm.tokenizer, given) if req.echo else [""] * len(given)
    created = int(time.time())
    if req.stream:
        return sse_response(_chunks(ctx, llm.tokenizer, req, streams, request_id, created, echo))
    finals = await collect(streams, raw)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    choices = [CompletionChoice(index=i * req.n + c.index, text=echo[i] + c.text, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                logprobs=_logprobs(llm.tokenizer, req, c, 0, len(echo[i])))
               for i, out in enumerate(finals) for c in out.outputs]
    body = CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                              choices=sorted(choices, key=lambda c: c.index), usage=usage(finals))
    return JSONResponse(body.model_dump())


def _logprobs(tokenizer: Any, req: CompletionRequest, choice: CompletionOutput, start: int,
              text_offset: int) -> dict | None:
    """The completions ``logprobs`` of ``choice``'s tokens from ``start`` on, when the request asked for them."""
    if req.logprobs is None or choice.logprobs is None:
        return None
    end = len(choice.token_ids)
    return completion_logprobs(tokenizer, choice.token_ids[start:end], choice.logprobs[start:end], req.logprobs,
                               text_offset)


async def _chunks(ctx: ServingContext, tokenizer: Any, req: CompletionRequest, streams: list[RequestStream],
                  request_id: str, created: int, echo: list[str]) -> AsyncIterator[dict]:
    """``text_completion`` chunk dicts, one choice each: text deltas (the first prefixed by the echoed prompt),
    the last one with its ``finish_reason``; usage as in chat."""
    tracker = DeltaTracker(req.n)
    finals: list[Any] = [None] * len(streams)

    def chunk(choices: list[CompletionChoice]) -> dict:
        body = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices)
        return body.model_dump(exclude=None if req.include_usage else {"usage"})

    async for i, out in merge(streams):
        finals[i] = out
        for d in tracker.update(i, out):
            text = echo[i] + d.text if d.first else d.text
            logprobs = _logprobs(tokenizer, req, d.choice, d.token_start, len(echo[i]) + d.text_start)
            if text or d.finish_reason or (logprobs and logprobs["tokens"]):
                yield chunk([CompletionChoice(index=d.index, text=text, finish_reason=d.finish_reason,
                                              stop_reason=d.choice.stop_reason if d.finish_reason else None,
                                              logprobs=logprobs)])
    if req.include_usage:
        yield {**chunk([]), "usage": usage(finals).model_dump()}
