"""``POST /v1/completions``: one engine request per prompt (string or token ids) -> response or SSE chunks."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.async_engine import RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from engine.server.errors import APIError
from engine.server.logprobs import completion_logprobs, response_prompt_logprobs
from engine.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from engine.server.request_ids import base_request_id
from engine.server.serving import (DeltaTracker, ServingContext, build_params, check_batch, check_constraint,
                                   collect, json_response, merge, running_usage, sse_response, submit, tokenizing,
                                   usage)


def split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _encoded(tokenizer: Any, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
    """Each prompt as token ids (texts encoded as the engine would, with the special tokens unless told not to)."""
    return [tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p for p in prompts]


def prompt_texts(tokenizer: Any, prompts: list[str | list[int]]) -> list[str]:
    """Each prompt as text (for ``echo``)."""
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    """Answer one completion request (JSON, or SSE when ``stream``). Errors: ``APIError`` (404/400/503)."""
    ctx.check_model(req.model)
    await check_constraint(req)  # a 400 the request would get at any time, before the engine's 503 while it loads
    llm = ctx.ready_engine()
    given = split_prompts(req.prompt)
    echo_only = req.echo and req.max_tokens == 0  # vLLM: the prompt back, one token generated and dropped
    params = build_params(req.sampling_params, 1 if echo_only else req.max_tokens, req.logprobs,
                          llm.default_sampling, _engine_prompt_logprobs(req))
    check_batch(ctx, len(given), "prompt")  # the cheap checks before the tokenizer's work
    if req.add_special_tokens and req.truncate_prompt_tokens is not None:
        prompts = given  # the engine truncates a text keeping the special tokens its encoding adds (a BOS)
    else:  # encoded here, off the event loop (megabytes take seconds): the engine thread then gets ids
        prompts = await tokenizing(_encoded, llm.tokenizer, given, req.add_special_tokens)
    base, client_id = base_request_id(raw, req.request_id)
    request_id = f"cmpl-{base}"
    streams = await submit(ctx, prompts, params, request_id, "prompt", client_id)  # checks ids before echo decodes
    echo = await tokenizing(prompt_texts, llm.tokenizer, given) if req.echo else [""] * len(given)
    created = int(time.time())
    if req.stream:
        return sse_response(_chunks(ctx, llm.tokenizer, req, streams, request_id, created, echo, echo_only))
    finals = await collect(streams, raw)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    prompt_parts = [_prompt_logprobs(llm.tokenizer, req, out) for out in finals]
    prompt_fields = [_prompt_logprobs_field(llm.tokenizer, req, out) for out in finals]
    choices = [CompletionChoice(index=i * req.n + c.index, text=echo[i] + ("" if echo_only else c.text),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                logprobs=_logprobs(llm.tokenizer, req, c, 0, 0, prompt_parts[i], True, echo_only),
                                prompt_logprobs=prompt_fields[i])
               for i, out in enumerate(finals) for c in out.outputs]
    body = CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                              choices=sorted(choices, key=lambda c: c.index), usage=usage(finals))
    return json_response(body)


def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """The top-k the engine computes for the prompt: the request's ``prompt_logprobs``, and ``logprobs`` for
    ``echo`` (the echoed tokens' logprobs), the larger of the two; None when neither asks."""
    asked = [k for k in (req.engine_prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(asked) if asked else None


def _prompt_logprobs_field(tokenizer: Any, req: CompletionRequest, out: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice (:func:`engine.server.logprobs.prompt_logprobs`), with the request's
    top-k, else ``echo``'s ``logprobs`` (vLLM returns them then too); None when the engine computed none."""
    k = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs
    return response_prompt_logprobs(tokenizer, out, k)


def _prompt_logprobs(tokenizer: Any, req: CompletionRequest, out: RequestOutput) -> dict | None:
    """The prompt's part of the logprobs (``echo`` with ``logprobs``; the first token's null, offsets from 0 as
    in vLLM), once per prompt: every choice starts with it; None without echo."""
    if not (req.echo and req.logprobs is not None and out.prompt_logprobs is not None):
        return None
    return completion_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, req.logprobs, 0)


def _logprobs(tokenizer: Any, req: CompletionRequest, choice: CompletionOutput, start: int, text_start: int,
              prompt: dict | None, first: bool, echo_only: bool) -> dict | None:
    """The completions ``logprobs`` of ``choice``'s tokens from ``start`` on (none with ``echo_only``), when the
    request asked for them; their offsets from ``text_start`` in the choice's text, after the ``prompt`` part
    (:func:`_prompt_logprobs`), which leads the choice's ``first`` logprobs."""
    if req.logprobs is None or choice.logprobs is None:
        return None
    end = start if echo_only else len(choice.token_ids)
    base = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if prompt else 0  # vLLM: over all tokens
    got = completion_logprobs(tokenizer, choice.token_ids[start:end], choice.logprobs[start:end], req.logprobs,
                              base + text_start)
    return {key: prompt[key] + got[key] for key in got} if prompt and first else got


async def _chunks(ctx: ServingContext, tokenizer: Any, req: CompletionRequest, streams: list[RequestStream],
                  request_id: str, created: int, echo: list[str], echo_only: bool) -> AsyncIterator[str]:
    """``text_completion`` chunk JSON texts, one choice each: text deltas (the first prefixed by the echoed prompt, and
    its logprobs by the prompt's), the last one with its ``finish_reason``; usage as in chat (with
    ``continuous_usage_stats`` a chunk's is its prompt's tokens and its choice's so far)."""
    tracker = DeltaTracker(req.n)
    finals: list[Any] = [None] * len(streams)

    def chunk(choices: list[CompletionChoice], counts: UsageInfo | None = None, prompt_tokens: int = 0,
              generated: int = 0) -> str:
        if counts is None and req.continuous_usage:
            counts = running_usage(prompt_tokens, generated)
        body = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=counts)
        return body.model_dump_json(exclude=None if req.include_usage else {"usage"})

    prompt_parts: dict[int, dict | None] = {}  # per prompt, made at its first output
    async for i, out in merge(streams):
        finals[i] = out
        for d in tracker.update(i, out):
            text = "" if echo_only else d.text
            text = echo[i] + text if d.first else text
            if i not in prompt_parts:
                prompt_parts[i] = _prompt_logprobs(tokenizer, req, out)
            logprobs = _logprobs(tokenizer, req, d.choice, d.token_start, d.text_start, prompt_parts[i], d.first,
                                 echo_only)
            if text or d.finish_reason or (logprobs and logprobs["tokens"]):
                yield chunk([CompletionChoice(index=d.index, text=text, finish_reason=d.finish_reason,
                                              stop_reason=d.choice.stop_reason if d.finish_reason else None,
                                              logprobs=logprobs)],
                            prompt_tokens=len(out.prompt_token_ids), generated=len(d.choice.token_ids))
    if req.include_usage:
        yield chunk([], usage(finals))
