"""``POST /v1/chat/completions``: messages -> chat template -> one engine request -> response or SSE chunks."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.async_engine import RequestStream
from engine.outputs import CompletionOutput
from engine.server.errors import APIError, bad_value
from engine.server.logprobs import chat_logprobs, response_prompt_logprobs
from engine.server.protocol import (ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice, DeltaMessage,
                                    TokenizeRequest, UsageInfo)
from engine.server.request_ids import base_request_id
from engine.server.serving import (DeltaTracker, ServingContext, build_params, check_constraint, collect,
                                   json_response, kept_prompt_len, merge, running_usage, sse_response, submit,
                                   tokenizing, usage)
from engine.server import reasoning, tool_parsers
from engine.server.tools import AUTO_REFUSED, is_auto, new_call, tool_calls


#: prompt tokens decoded to see whether the answer starts inside a <think> block (reasoning.starts_open): a template
#: opens it, or closes an empty one, in its last few
PROMPT_TAIL = 16


#: keyword arguments of ``apply_chat_template`` itself that ``render_chat`` sets or that change what it returns (or
#: do nothing without tokenizing): not template variables, so dropped from ``chat_template_kwargs``, as vLLM's
#: server drops what is not one (once a TypeError's text in a 400 naming the messages: a robustness audit)
TEMPLATE_CALL_ARGS = frozenset({"conversation", "tokenize", "return_dict", "return_tensors",
                                "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                "tokenizer_kwargs", "self"})


def render_chat(tokenizer: Any, req: ChatCompletionRequest | TokenizeRequest,
                add_special_tokens: bool = False, field: str = "messages") -> list[int]:
    """Prompt token ids: the tokenizer's chat template, given the request's ``chat_template_kwargs`` (which may set
    the next two), then its ``tools`` (whatever the tool_choice), ``documents`` and ``reasoning_effort`` over them,
    and ``enable_thinking`` false for the effort "none" (true for another) unless ``chat_template_kwargs`` sets it
    (current vLLM's rules), ending with the assistant turn's header (``add_generation_prompt``) or inside the last
    message (``continue_final_message``), encoded without extra special tokens unless asked (the template has them).
    A template error is a 400 on ``field`` (the request's name for the messages)."""
    # vLLM's order: add_generation_prompt and continue_final_message, then chat_template_kwargs over them (without
    # transformers' own arguments: not template variables), then the request's fields for template variables
    given = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in TEMPLATE_CALL_ARGS}
    fields = {k: getattr(req, k) for k in ("tools", "documents", "reasoning_effort") if getattr(req, k, None)}
    if "reasoning_effort" in fields and "enable_thinking" not in given:  # Qwen3's switch: "none" turns it off
        fields["enable_thinking"] = fields["reasoning_effort"] != "none"
    kwargs = {"add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message, **given, **fields}
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:  # vLLM's rule: one or the other
        raise APIError(400, "continue_final_message: cannot set both `continue_final_message` and "
                       "`add_generation_prompt` to true", param="continue_final_message", code="invalid_value")
    if "chat_template" in kwargs:  # vLLM too needs a server flag for this: a template is code the server runs
        raise APIError(400, "chat_template_kwargs: a request cannot replace the chat template",
                       param="chat_template_kwargs", code="invalid_value")
    try:
        developer = "developer" if "developer" in str(getattr(tokenizer, "chat_template", None) or "") else "system"
        messages = [_for_template(m.model_dump(exclude_none=True), m.text(), developer) for m in req.messages or []]
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except ValueError as e:
        raise bad_value(e, field) from e
    except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages it refuses
        raise APIError(400, f"{field}: the chat template rejected them: {e}", param=field,
                       code="invalid_value") from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def reasoning_start(ctx: ServingContext, tokenizer: Any, req: Any, prompt: list[int]) -> bool | None:
    """Whether the answer to ``prompt`` starts inside a ``<think>`` block (``reasoning.starts_open``), or None where
    it is not split (the server's setting, or a constrained output: reasoning.py). Where the tags are special tokens
    of the tokenizer, ``req.skip_special_tokens`` is turned off, to keep them to split on."""
    if not ctx.splits_reasoning(tokenizer) or req.constraint() is not None:
        return None
    if {reasoning.START, reasoning.END} & set(getattr(tokenizer, "all_special_tokens", [])):
        req.skip_special_tokens = False
    return reasoning.starts_open(tokenizer.decode(prompt[-PROMPT_TAIL:]))


def _for_template(message: dict[str, Any], text: str, developer: str = "developer") -> dict[str, Any]:
    """A message as chat templates take it: its text as ``content``, the ``arguments`` of the tool calls an
    assistant message carries back as objects, not JSON text (as vLLM: templates serialize them with ``tojson``),
    and the role "developer" as ``developer`` (``render_chat``: "system" for a template that never names it: OpenAI's
    newer name for the system message, which such a template would render as a role its model never saw)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass  # not JSON: the template gets the text
        calls.append(call)
    role = {"role": developer} if message.get("role") == "developer" else {}
    return {**message, **role, "content": text, **({"tool_calls": calls} if calls else {})}


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    """Answer one chat request (JSON, or SSE when ``stream``). Errors: ``APIError`` (404/400/503)."""
    ctx.check_model(req.model)
    await check_constraint(req)  # a 400 the request would get at any time, before the engine's 503 while it loads
    llm = ctx.ready_engine()
    auto = is_auto(req.tools, req.tool_choice)
    parser = ctx.tool_parser(llm.tokenizer) if auto else None
    if auto:
        if parser is None:
            why = ("the server's tool_call_parser is none" if ctx.tool_call_parser == "none" else
                   "its chat template asks for no format this server reads; tool_call_parser hermes, "
                   "mistral or llama3_json would force one")
            raise APIError(400, f"tool_choice: {AUTO_REFUSED.format(why=why)}", param="tool_choice",
                           code="invalid_value")
        req.skip_special_tokens = False  # as vLLM's hermes parser: a model's <tool_call> may be a special token
    prompt = await tokenizing(render_chat, llm.tokenizer, req)  # seconds for megabytes: not on the event loop
    open_ = reasoning_start(ctx, llm.tokenizer, req, prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = build_params(req.sampling_params, max_tokens, logprobs, llm.default_sampling,
                              req.engine_prompt_logprobs)
    except APIError as e:  # name the field the request used for the completion's length
        if req.max_completion_tokens is not None and e.param == "max_tokens":
            e.param, e.message = "max_completion_tokens", "max_completion_tokens" + e.message.removeprefix("max_tokens")
        raise
    base, client_id = base_request_id(raw, req.request_id)
    request_id = f"chatcmpl-{base}"
    streams = await submit(ctx, [prompt], params, request_id, "messages", client_id)
    if req.stream:
        kept = kept_prompt_len(len(prompt), params.truncate_prompt_tokens, llm.max_model_len)
        return sse_response(_chunks(ctx, llm.tokenizer, req, streams, request_id, kept, parser, open_))
    finals = await collect(streams, raw)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    choices, echoed = [], req.echoed()
    for c in finals[0].outputs:
        message = _message(req, c.text, parser, open_)
        if echoed:  # also before no content (a model stopped in its reasoning), as vLLM
            message.content = echoed + (message.content or "")
        # vLLM (as OpenAI): "tool_calls" for calls "auto" or "required" made; "stop" for a named function's
        called = message.tool_calls and (auto or req.tool_choice == "required")
        choices.append(ChatCompletionChoice(index=c.index, message=message,
                                            logprobs=_logprobs(llm.tokenizer, req, c, 0),
                                            finish_reason="tool_calls" if called else c.finish_reason,
                                            stop_reason=c.stop_reason))
    body = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage(finals),
                                  prompt_logprobs=response_prompt_logprobs(llm.tokenizer, finals[0],
                                                                           req.prompt_logprobs))
    return json_response(body)


def _message(req: ChatCompletionRequest, text: str, parser: str | None = None,
             open_: bool | None = None) -> ChatResponseMessage:
    """The assistant's message: with ``open_`` (not None: the server splits reasoning, ``reasoning.starts_open``
    of the prompt) the reasoning apart (left out without ``include_reasoning``) and the rest as the text; then the
    tool calls a call-making tool_choice asked for (content "", as vLLM), those the model made under "auto"
    (``parser``'s, ``tool_parsers.parse``: the content what it leaves; the first alone without
    ``parallel_tool_calls``), else the text."""
    thought = None
    if open_ is not None:
        thought, text = reasoning.split(text, open_)
        thought = thought if req.include_reasoning else None
        if text is None:  # it stopped inside its reasoning
            return ChatResponseMessage(content=None, reasoning=thought, reasoning_content=thought)
    if parser is not None:
        content, calls = tool_parsers.parse(text, parser)
        return ChatResponseMessage(content=content, reasoning=thought, reasoning_content=thought,
                                   tool_calls=_allowed(req, calls) or None)
    calls = tool_calls(text, req.tool_choice) if req.tools else None
    if calls:
        return ChatResponseMessage(content="", tool_calls=calls)
    return ChatResponseMessage(content=text, reasoning=thought, reasoning_content=thought)


def _allowed(req: ChatCompletionRequest, calls: list[dict]) -> list[dict]:
    """The calls an answer under "auto" keeps: all of them, or the first without ``parallel_tool_calls`` (a
    "required" answer has one: its schema allows no more, ``tools.schema``)."""
    return calls if req.parallel_tool_calls else calls[:1]


def _delta(req: ChatCompletionRequest, d: Any, state: tool_parsers.StreamState | None,
           split: reasoning.StreamSplit | None = None) -> DeltaMessage:
    """A stream's delta of choice ``d``: with ``split`` (the choice's, where the server splits reasoning) the new
    reasoning apart and the rest as the text; then a named function's arguments as they come (its id, type and
    name in the first), a "required" array's calls once it is complete (nothing before), under "auto" the text
    until a call may start and the calls once the output is complete (``state``, the choice's), else the text."""
    finished, text, thought = d.finish_reason is not None, d.choice.text, None
    if split is not None:
        thought, content = split.delta(text, finished)
        thought = thought if req.include_reasoning else None
        if state is None:
            return DeltaMessage(content=content, reasoning=thought, reasoning_content=thought)
        text = split.content or ""
    if state is not None:  # the calls come all at once, in the last delta
        content, calls = state.delta(text, finished)
        return DeltaMessage(content=content, reasoning=thought, reasoning_content=thought,
                            tool_calls=[{"index": i, **c} for i, c in enumerate(_allowed(req, calls))] or None)
    if not req.tools or req.tool_choice == "none":
        return DeltaMessage(content=d.text)
    if isinstance(req.tool_choice, dict):
        first = new_call(req.tool_choice["function"]["name"], d.text) if d.first else None
        return DeltaMessage(tool_calls=[{"index": 0, **(first or {"function": {"arguments": d.text}})}])
    if not d.finish_reason:
        return DeltaMessage()
    message = _message(req, d.choice.text)
    if not message.tool_calls:
        return DeltaMessage(content=d.choice.text)
    return DeltaMessage(tool_calls=[{"index": i, **call} for i, call in enumerate(message.tool_calls)])


def _logprobs(tokenizer: Any, req: ChatCompletionRequest, choice: CompletionOutput, start: int) -> dict | None:
    """The chat ``logprobs`` of ``choice``'s tokens from ``start`` on, when the request asked for them."""
    if not req.logprobs or choice.logprobs is None:
        return None
    end = len(choice.token_ids)
    return chat_logprobs(tokenizer, choice.token_ids[start:end], choice.logprobs[start:end], req.top_logprobs or 0)


async def _chunks(ctx: ServingContext, tokenizer: Any, req: ChatCompletionRequest, streams: list[RequestStream],
                  request_id: str, prompt_tokens: int, parser: str | None = None,
                  open_: bool | None = None) -> AsyncIterator[str]:
    """``chat.completion.chunk`` JSON texts: per choice first a delta with only the role (content ""), as vLLM sends
    before any token, then text or tool-call deltas (:func:`_delta`), the last one with its ``finish_reason``
    ("tool_calls" where "auto" or "required" made calls); with ``include_usage`` every chunk has ``usage: null``
    (with ``continuous_usage_stats`` the ``prompt_tokens`` and its choice's tokens so far, as vLLM) and one final
    chunk has ``choices: []`` and the usage."""
    created, tracker, final = int(time.time()), DeltaTracker(req.n), None

    def chunk(choices: list[ChatStreamChoice], counts: UsageInfo | None = None, generated: int = 0) -> str:
        if counts is None and req.continuous_usage:
            counts = running_usage(prompt_tokens, generated)
        body = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=counts)
        return body.model_dump_json(exclude=None if req.include_usage else {"usage"})

    states = [tool_parsers.StreamState(parser) if parser else None for _ in range(req.n)]
    splits = [reasoning.StreamSplit(open_) if open_ is not None else None for _ in range(req.n)]
    tokens_sent = [0] * req.n  # per choice: the tokens whose logprobs went out (a held-back delta sends none)
    for index in range(req.n):  # the role on its own: a client sees it whatever the engine's outputs coalesce to
        yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    echoed = req.echoed()
    if echoed:  # vLLM: the echoed text next, before any token
        for index in range(req.n):
            yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=echoed))])
    async for i, out in merge(streams):
        final = out
        for d in tracker.update(i, out):
            state = states[d.index]
            delta = _delta(req, d, state, splits[d.index])
            if delta.content is None and delta.tool_calls is None and delta.reasoning is None and not d.finish_reason:
                continue  # a "required" array or a tool call still being written, a possible tag's start held back
            start, tokens_sent[d.index] = tokens_sent[d.index], len(d.choice.token_ids)
            called = (state is not None and state.calls) or (req.tool_choice == "required" and delta.tool_calls)
            reason = "tool_calls" if d.finish_reason and called else d.finish_reason
            yield chunk([ChatStreamChoice(index=d.index, delta=delta, finish_reason=reason,
                                          stop_reason=d.choice.stop_reason if d.finish_reason else None,
                                          logprobs=_logprobs(tokenizer, req, d.choice, start))],
                        generated=len(d.choice.token_ids))
    if req.include_usage:
        yield chunk([], usage([final]))
