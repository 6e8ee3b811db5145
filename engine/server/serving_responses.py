"""``POST /v1/responses`` (OpenAI's Responses API): input messages -> chat template -> one engine request -> a
``response`` object, or its stream of typed events.

The answer becomes the response's ``output``: a thinking model's reasoning as a "reasoning" item (its text in one
``reasoning_text`` part), then the answer as a "message" item with one ``output_text`` part. An answer cut at
``max_output_tokens`` is ``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"`` (and so is
the item it was cut in); a ``max_output_tokens`` past the context is cut to what it holds (vLLM's rule here).
Streamed (``stream: true``), the events are OpenAI's, each an SSE ``event:`` line naming its ``type`` and a
``data:`` line with a ``sequence_number`` from 0: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, ``response.content_part.added`` (a ``reasoning_text`` or ``output_text`` part), its
text's deltas (``response.reasoning_text.delta`` or ``response.output_text.delta``), their ``.done`` events,
``response.content_part.done`` and ``response.output_item.done``; last ``response.completed`` with the whole
response, whatever its status (as vLLM; the OpenAI SDK's stream helper needs that event). An error after the stream
started is an ``error`` event. Nothing is stored (``store`` has no effect). Where ``include`` asks for them, the
message's text part carries each output token's logprobs (:class:`_Logprobs`), and so does each text delta.
"""
from __future__ import annotations

import itertools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import RequestStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server import reasoning
from engine.server.errors import APIError
from engine.server.logprobs import chat_logprobs
from engine.server.protocol import ChatCompletionRequest, ChatMessage, ResponsesRequest
from engine.server.serving import (DeltaTracker, ServingContext, build_params, check_constraint, collect,
                                   event_stream, kept_prompt_len, merge, stream_error, submit, tokenizing)
from engine.server.serving_chat import reasoning_start, render_chat

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    """Answer one Responses request (JSON, or SSE events when ``stream``). Errors: ``APIError`` (404/400/503)."""
    ctx.check_model(req.model)
    if req.previous_response_id:  # nothing is stored, so no response can be found (vLLM without a store)
        raise APIError(404, f"Response with id '{req.previous_response_id}' not found.",
                       param="previous_response_id", code="response_not_found")
    await check_constraint(req)  # a 400 the request would get at any time, before the engine's 503 while it loads
    llm = ctx.ready_engine()
    prompt = await tokenizing(_prompt, llm.tokenizer, req, llm.max_model_len)  # not on the event loop
    open_ = reasoning_start(ctx, llm.tokenizer, req, prompt)
    room = llm.max_model_len - kept_prompt_len(len(prompt), req.truncate_prompt_tokens, llm.max_model_len)
    max_tokens = req.max_output_tokens
    if max_tokens is not None and room >= 1:  # vLLM's rule here (unlike chat's 400): what the context has room for
        max_tokens = min(max_tokens, room)
    try:
        params = build_params(req.sampling_params, max_tokens, req.output_logprobs(), llm.default_sampling, None)
    except APIError as e:  # name the request's own field for the answer's length
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", "max_output_tokens" + e.message.removeprefix("max_tokens")
        raise
    head = _Head(req.request_id, int(time.time()), ctx.model_name, req, params, room)
    streams = await submit(ctx, [prompt], params, head.id, "input", "request_id" in req.model_fields_set)
    logprobs = _Logprobs(llm.tokenizer, req.output_logprobs())
    if req.stream:
        return event_stream(_framed(_events(head, streams, open_, logprobs)))
    finals = await collect(streams, raw)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    final = finals[0]
    choice = final.outputs[0]
    thought, text = reasoning.split(choice.text, open_) if open_ is not None else (None, choice.text)
    items = []
    if thought is not None:
        items.append(_reasoning_item(_id("rs"), thought, "completed"))
    if text is not None:  # every output token's logprobs, as vLLM's (a thinking model's reasoning tokens too)
        items.append(_message_item(_id("msg"), text, "completed", logprobs.of(choice, 0)))
    items[-1]["status"] = _item_status(choice.finish_reason)  # the item an answer cut short was cut in
    return JSONResponse(head.response(items, final))


def _prompt(tokenizer: Any, req: ResponsesRequest, max_model_len: int) -> list[int]:
    """The input through the chat template, continuing an unfinished assistant message last. With ``truncation``
    "auto", where it leaves no room for one output token, the fewest oldest messages after a leading system (or
    developer) message are dropped that make it fit, the kept ones starting at a message that is not the
    assistant's (or the last one, always kept): OpenAI's rule, items dropped from the conversation's start, found in
    O(log n) renders. A last message too long alone is the usual 400."""
    messages, continues = req.chat_messages(), req.continues_final_message()

    def render(kept: list[ChatMessage]) -> list[int]:
        chat = ChatCompletionRequest.model_construct(  # the chat endpoint's defaults for the rest
            messages=kept, add_generation_prompt=not continues, continue_final_message=continues,
            reasoning_effort=req.effort())
        return render_chat(tokenizer, chat, field="input")

    prompt = render(messages)
    if req.truncation != "auto" or len(prompt) < max_model_len:
        return prompt
    first = 1 if messages[0].role in ("system", "developer") else 0
    head, last = messages[:first], len(messages) - 1
    starts = [i for i in range(first + 1, len(messages)) if messages[i].role != "assistant" or i == last]
    fitting, lo, hi = None, 0, len(starts) - 1  # the kept tokens shrink as the start moves on: binary search
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = render(head + messages[starts[mid]:])
        if len(candidate) < max_model_len:
            fitting, hi = candidate, mid - 1
        else:
            lo = mid + 1
    if fitting is not None:
        return fitting
    return render(head + messages[starts[-1]:]) if starts else prompt


class _Logprobs:
    """The output text's logprobs where ``include`` asked for them (``k`` most likely beside each token; None:
    not asked, every list empty): OpenAI's ``{token, logprob, bytes, top_logprobs}`` per token, a NaN logprob (of
    NaN logits) as null so that the JSON stays valid."""

    def __init__(self, tokenizer: Any, k: int | None) -> None:
        self.tokenizer, self.k = tokenizer, k

    def of(self, choice: Any, start: int) -> list[dict[str, Any]]:
        """Those of ``choice``'s tokens from ``start`` on."""
        if self.k is None or choice.logprobs is None:
            return []
        entries = chat_logprobs(self.tokenizer, choice.token_ids[start:], choice.logprobs[start:], self.k)
        return [_finite(e) | {"top_logprobs": [_finite(t) for t in e["top_logprobs"]]} for e in entries["content"]]


def _finite(entry: dict[str, Any]) -> dict[str, Any]:
    return entry | {"logprob": None} if math.isnan(entry["logprob"]) else entry


class _Head:
    """What every ``response`` object of one request repeats: id, creation time (s), model, the request's
    settings as the engine took them (temperature and top_p after the model's generation config, the output's
    length cut to the context's ``room``), the rest echoed."""

    def __init__(self, response_id: str, created: int, model: str, req: ResponsesRequest,
                 params: SamplingParams, room: int) -> None:
        self.id, self.created, self.model, self.req, self.params = response_id, created, model, req, params
        self.max_output_tokens = params.max_tokens if params.max_tokens is not None else room

    def response(self, output: list[dict], final: RequestOutput | None) -> dict[str, Any]:
        """The ``response`` object: in progress while ``final`` is None, else completed, or incomplete where the
        answer was cut at ``max_output_tokens`` (its ``finish_reason`` "length"), with the usage."""
        status = "in_progress" if final is None else _item_status(final.outputs[0].finish_reason)
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": self.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": req.reasoning, "store": False, "temperature": self.params.temperature,
            "top_p": self.params.top_p, "top_logprobs": req.top_logprobs or 0, "background": False,
            "service_tier": req.service_tier, "text": {"format": req.text_format()},
            "tool_choice": req.tool_choice or "auto", "tools": [], "truncation": req.truncation or "disabled",
            "metadata": req.metadata, "user": req.user, "usage": None if final is None else _usage(final),
        }


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(final: RequestOutput) -> dict[str, Any]:
    """Token counts; ``reasoning_tokens`` is not counted (0): the reasoning is split off the text, not the ids."""
    prompt, output = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as a "message" item with its one text part."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


class _Item:
    """One output item being streamed: its id, index in ``output``, text and (message) logprobs so far."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind, self.index, self.id, self.text = kind, index, _id("rs" if kind == "reasoning" else "msg"), ""
        self.logprobs: list[dict[str, Any]] = []

    def part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if self.kind == "reasoning" else _text_part(text, logprobs)

    def whole(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return _reasoning_item(self.id, self.text, status)
        return _message_item(self.id, self.text, status, self.logprobs)


async def _events(head: _Head, streams: list[RequestStream], open_: bool | None,
                  logprobs: _Logprobs) -> AsyncIterator[dict[str, Any]]:
    """The response's stream events (module doc) as dicts with their ``type``; ``sequence_number`` is added when
    they are framed (:func:`_framed`). Each ``response.output_text.delta`` carries the logprobs of the tokens
    since the last one (the first also those of the reasoning before it), the ``.done`` events all of the
    message's, also of tokens that wrote no text: the same list as the answer not streamed."""
    yield {"type": "response.created", "response": head.response([], None)}
    yield {"type": "response.in_progress", "response": head.response([], None)}
    split = reasoning.StreamSplit(open_) if open_ is not None else None
    tracker, done, final, open_item, sent = DeltaTracker(1), [], None, None, 0

    def opening(kind: str) -> list[dict[str, Any]]:
        nonlocal open_item
        open_item = _Item(kind, len(done))
        events = [{"type": "response.output_item.added", "output_index": open_item.index,
                   "item": open_item.whole("in_progress") | {"content": []}},
                  {"type": "response.content_part.added", "item_id": open_item.id, "output_index": open_item.index,
                   "content_index": 0, "part": open_item.part("", [])}]
        return events

    def closing(status: str) -> list[dict[str, Any]]:
        nonlocal open_item
        item, open_item = open_item, None
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "text": item.text}]
        else:
            events = [{"type": "response.output_text.done", **where, "text": item.text, "logprobs": item.logprobs}]
        events.append({"type": "response.content_part.done", **where, "part": item.part(item.text, item.logprobs)})
        done.append(item.whole(status))
        return events + [{"type": "response.output_item.done", "output_index": item.index, "item": done[-1]}]

    def adding(kind: str, delta: str, lps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if open_item is not None and open_item.kind != kind:
            events += closing("completed")
        if open_item is None:
            events += opening(kind)
        open_item.text += delta
        if kind == "reasoning":
            name, extra = "response.reasoning_text.delta", {}
        else:
            name, extra = "response.output_text.delta", {"logprobs": lps}
            open_item.logprobs += lps
        return events + [{"type": name, "item_id": open_item.id, "output_index": open_item.index,
                          "content_index": 0, "delta": delta, **extra}]

    async for _, out in merge(streams):
        final = out
        for d in tracker.update(0, out):
            finished = d.finish_reason is not None
            thought, said = split.delta(d.choice.text, finished) if split else (None, d.text or None)
            for kind, delta in (("reasoning", thought), ("message", said)):
                if not delta:
                    continue
                lps = []
                if kind == "message":  # the tokens since the last text delta (reasoning ones too)
                    lps, sent = logprobs.of(d.choice, sent), len(d.choice.token_ids)
                for event in adding(kind, delta, lps):
                    yield event
            if finished:
                if not said and (split is None or reasoning.split(d.choice.text, open_)[1] is not None):
                    for event in adding("message", "", []):  # an empty answer is an empty message, as not streamed
                        if event["type"] != "response.output_text.delta":
                            yield event
                if open_item is not None:
                    if open_item.kind == "message":  # tokens that wrote no text: the EOS, a stop string cut
                        open_item.logprobs += logprobs.of(d.choice, sent)
                    for event in closing(_item_status(d.finish_reason)):
                        yield event
    # response.completed also where the status is "incomplete", as vLLM: the SDK's stream helper
    # (client.responses.stream) needs it to give a final response
    yield {"type": "response.completed", "response": head.response(done, final)}


async def _framed(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """SSE frames: ``event: <type>`` and ``data: <json>`` with a ``sequence_number`` from 0; an error once the
    stream started is an ``error`` event (its code, message and param), the last."""
    numbers = itertools.count()
    try:
        async for event in events:
            body = {"type": event["type"], "sequence_number": next(numbers), **event}
            yield {"event": event["type"], "data": json.dumps(body, ensure_ascii=False)}
    except Exception as e:  # noqa: BLE001 - headers are sent; the error goes in the stream
        err = stream_error(e)
        body = {"type": "error", "sequence_number": next(numbers), "code": err.code, "message": err.message,
                "param": err.param}
        yield {"event": "error", "data": json.dumps(body, ensure_ascii=False)}
