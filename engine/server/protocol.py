"""OpenAI-compatible request and response models (pydantic v2), with vLLM's extra sampling fields.

Range checks live in ``SamplingParams.validate`` (one source of truth); the models here only check types.
Unknown request fields are ignored, as OpenAI's and vLLM's servers do, and named in a warning in the log, as
vLLM's. A ``null`` in a field whose type excludes it (at the top level, or in ``stream_options``) means the field's
default (OpenAI's spec makes ``n``, ``stream``, ``logprobs``, ``echo``... nullable; clients that send every field
send them as ``null``); fields that take None keep it (``max_tokens: null`` on completions: up to the context, as
in vLLM). A string holding a lone UTF-16 surrogate (JSON's ``"\ud800"`` escape unpaired: no text, and no
tokenizer encodes it) is refused with a 400 naming its field.
"""
from __future__ import annotations

import logging
import re
import time
import types
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.generation_config import with_defaults
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.server.tools import check_choice, check_tools, schema as tool_schema
from engine.structured_output import check

logger = logging.getLogger(__name__)


#: OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) values, and vLLM's "max" (DeepSeek V4's
#: templates); the chat template reads them
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

#: UTF-16 surrogate code points: JSON decodes a well-formed pair to one character, so any left stand alone
_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value (str, list, dict; keys too) holds a lone surrogate anywhere. Walked with a stack
    of its own, not by recursion: JSON nested a few hundred levels deep is valid input, not a RecursionError."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation))


def format_kind(response_format: dict[str, Any] | None) -> str:
    """``response_format``'s type: "text" (also when absent), "json_object" or "json_schema"."""
    return "text" if response_format is None else response_format.get("type", "text")


def _checked_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    check_tools(tools)
    return tools


def _no_request_template(template: str | None) -> str | None:
    if template is not None:
        raise ValueError("a request cannot replace the chat template: the model's own is used")
    return template


#: vLLM's ``chat_template`` field: a 400 here (a template is code the server would run: vLLM runs one only with
#: ``--trust-request-chat-template``), never ignored (that would render another prompt than asked)
RequestTemplate = Annotated[str | None, AfterValidator(_no_request_template)]

#: OpenAI's ``tools`` (function definitions); a 400 naming them for one that is not a function (``tools.check_tools``)
Tools = Annotated[list[dict[str, Any]] | None, AfterValidator(_checked_tools)]


class RequestModel(BaseModel):
    """A request body: unknown fields are ignored, with a warning in the log that names them (vLLM's: a field of
    another server's, or of an older vLLM, such as ``guided_json``, then explains an answer it did not shape);
    ``null`` in a field whose type excludes it means its default; a field holding a lone UTF-16 surrogate is
    refused (ValueError: a 400 naming it)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = sorted(str(k) for k in data if k not in cls.model_fields)
            if ignored:
                logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required() and not _accepts_none(field.annotation):
            return field.get_default(call_default_factory=True)
        if _holds_lone_surrogate(value):
            raise ValueError("holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "text: send valid UTF-16 pairs or the characters themselves")
        return value


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(RequestModel):
    include_usage: bool = False
    #: vLLM's: with ``include_usage``, every chunk carries the usage so far (its choice's tokens) instead of null
    continuous_usage_stats: bool = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingRequest(RequestModel):
    """Fields shared by both endpoints; ``sampling_params`` maps them onto ``SamplingParams``."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)  # OpenAI's bound: one request cannot hold the engine
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    user: str | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI: token id (a JSON key, so a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM: only these may be sampled
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last k tokens (-1: max_model_len)
    #: vLLM fields this server does not follow: a 400 naming them where they ask for something (vLLM would act;
    #: ignoring them would answer something else than asked)
    best_of: int | None = None
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    #: vLLM's extra parameter: each prompt token's logprob and rank, and the k most likely tokens at its position
    #: (the response's ``prompt_logprobs``: per choice in completions, once for the request in chat)
    prompt_logprobs: int | None = None
    request_id: str | None = None  # vLLM: names the answer, chatcmpl-<id> / cmpl-<id> (server/request_ids.py)

    @field_validator("best_of", "use_beam_search", "bad_words")
    @classmethod
    def _not_followed(cls, value: Any, info: ValidationInfo) -> Any:
        """best_of but None or 1 with n = 1 (vLLM V1 refuses best_of above 1, and any best_of below n), beam
        search, bad words: 400s naming them."""
        name = info.field_name
        if name == "best_of" and value is not None and not value == info.data.get("n", 1) == 1:
            raise ValueError(f"best_of is not supported (got {value}; use n for several completions)")
        if name == "use_beam_search" and value:
            raise ValueError("beam search is not supported: sample with n, temperature and seed instead")
        if name == "bad_words" and value:
            raise ValueError("bad_words is not supported: use logit_bias (-100) on their tokens instead")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_in_range(cls, value: int | None, info: ValidationInfo) -> int | None:
        """vLLM's rules: in [0, 20] (its default ``--max-logprobs``), and above 0 not with ``stream: true`` (0
        with it is accepted, and no prompt logprobs are sent)."""
        if value is not None and not 0 <= value <= 20:
            raise ValueError("must be in [0, 20]")
        if value and info.data.get("stream"):
            raise ValueError("`prompt_logprobs` are not available when `stream=True`")
        return value

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The request's ``prompt_logprobs`` for the engine: None when streaming (nothing would carry them)."""
        return None if self.stream else self.prompt_logprobs

    #: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema":
    #: {...}}} (OpenAI's; vLLM takes it on both endpoints): the output is any JSON object, or follows the schema
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A 400 naming it for another type or a json_schema without a schema object; never ignored (a schema that
        cannot be turned into a grammar: :meth:`check_constraint`)."""
        kind = format_kind(value)
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be text, json_object or json_schema, got {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("json_schema needs {\"name\": ..., \"schema\": {...}}")
        return value

    #: vLLM's extra parameter: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": EBNF} |
    #: {"json_object": true}, optionally "disable_any_whitespace"; a request gives it or a JSON response_format
    structured_outputs: dict[str, Any] | None = None

    @field_validator("structured_outputs")
    @classmethod
    def _known_structured_outputs(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """A 400 naming it for a key this server does not follow, none or several of the five, or a JSON
        response_format beside it (a schema, regex or grammar it cannot compile: :meth:`check_constraint`)."""
        if value is None:
            return None
        given = {k: v for k, v in value.items() if v is not None and v is not False}  # vLLM's defaults: unset
        given.pop("disable_fallback", None)  # one backend here: there is nothing to fall back to
        unknown = sorted(set(given) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"{', '.join(unknown)} not supported (json, regex, choice, grammar, json_object, "
                             "disable_any_whitespace)")
        if format_kind(info.data.get("response_format")) != "text":
            raise ValueError("give it or a JSON response_format, not both")
        try:
            spec = StructuredOutputsParams(**given)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("structured_outputs: ")) from None
        return given

    def constraint(self) -> StructuredOutputsParams | None:
        """The engine's ``structured_outputs``: from the field of that name, or from ``response_format`` (None for
        text)."""
        if self.structured_outputs is not None:
            return StructuredOutputsParams(**self.structured_outputs)
        kind = format_kind(self.response_format)
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            return StructuredOutputsParams(json=self.response_format["json_schema"]["schema"])
        return None

    def constraint_field(self) -> str:
        """The request's field that :meth:`constraint` comes from (the one a 400 about it names)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def check_constraint(self) -> None:
        """Raise ValueError ("<field>: not a ... this server can follow (...)", the field of
        :meth:`constraint_field`) when xgrammar (if installed) cannot make a grammar of :meth:`constraint`. It can
        take seconds (a schema ``pattern`` with a repeat count in the thousands), and xgrammar releases the GIL
        meanwhile: the server calls it on a worker thread, never in a validator, which runs on the event loop
        (a robustness audit saw every stream and /health stall for 29 s behind one such request)."""
        spec = self.constraint()
        if spec is not None:
            try:
                check(spec)
            except ValueError as e:
                raise ValueError(f"{self.constraint_field()}: {e}") from e

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """vLLM's rule: non-empty ``stream_options`` only with ``stream: true`` (else a 400 naming it)."""
        if value is not None and value.model_fields_set and not info.data.get("stream"):
            raise ValueError("stream options can only be defined when `stream=True`")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: only together with ``include_usage`` (alone it changes nothing)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Build ``SamplingParams``: the request's fields over ``defaults`` (the model's generation config, see
        engine/generation_config.py); raises ``ValueError("<field>: ...")`` for an out-of-range field."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty")
                 if getattr(self, k) is not None}
        return SamplingParams(
            n=self.n, seed=self.seed, stop=[] if self.stop is None else self.stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            structured_outputs=self.constraint(), allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **with_defaults({**given, "max_tokens": max_tokens}, defaults or {}))


# ---- chat ----
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message text; list content keeps its ``{"type": "text"}`` parts, one per line as vLLM joins them
        (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages.content: only text parts are supported, got {part.get('type')!r}")
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant turn's header
    continue_final_message: bool = False  # vLLM: leave the last (assistant) message open, the model continues it
    echo: bool = False  # vLLM: the answer starts with the last message's text where it has the answer's role
    chat_template_kwargs: dict[str, Any] | None = None
    #: the chat template sees them; tool_choice "required" or a named function constrains the output to a call
    #: (engine/server/tools.py); "auto" reads calls out of free text where the model has a parser (tool_parsers.py)
    tools: Tools = None
    tool_choice: str | dict[str, Any] | None = Field(default=None, validate_default=True)
    parallel_tool_calls: bool = True  # OpenAI's: false allows at most one tool call in an answer
    #: OpenAI's (one of REASONING_EFFORTS): the chat template's ``reasoning_effort`` variable, and its
    #: ``enable_thinking`` (false for "none"), as current vLLM gives them (serving_chat.render_chat)
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer, its content unchanged
    documents: list[dict[str, Any]] | None = None  # vLLM's: the template's ``documents`` (retrieval templates)
    chat_template: RequestTemplate = None

    def echoed(self) -> str:
        """With ``echo``, the text the answer starts with (vLLM): the last message's, where its role is the
        answer's ("assistant" after the generation prompt, else the last message's own); else ""."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return last.text() if last.role == role else ""

    @field_validator("tool_choice")
    @classmethod
    def _tool_calls_we_can_make(cls, value: str | dict[str, Any] | None, info: ValidationInfo) -> Any:
        """A 400 naming it for a tool_choice ``tools.check_choice`` refuses and a call-making tool_choice beside a
        JSON response_format or structured_outputs (one constraint per request); a call whose schema the grammar
        cannot follow: :meth:`check_constraint`."""
        tools = info.data.get("tools")
        check_choice(tools, value)
        call = tool_schema(tools, value)
        if call is None:
            return value
        if info.data.get("structured_outputs") or format_kind(info.data.get("response_format")) != "text":
            raise ValueError("a tool_choice that makes a call cannot be combined with response_format or "
                             "structured_outputs")
        return value

    @field_validator("reasoning_effort")
    @classmethod
    def _known_effort(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_EFFORTS:
            raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
        return value

    def constraint(self) -> StructuredOutputsParams | None:
        """A call-making tool_choice's JSON schema (``tools.schema``), else the response format's."""
        call = tool_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        return StructuredOutputsParams(json=call) if call is not None else super().constraint()

    def constraint_field(self) -> str:
        call = tool_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        return "tool_choice" if call is not None else super().constraint_field()

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        """vLLM's rule: ``top_logprobs`` in [0, 20], and > 0 only with ``logprobs: true`` (else a 400 naming it)."""
        if value is not None and not 0 <= value <= 20:  # OpenAI's bound, SamplingParams.logprobs's too
            raise ValueError("`top_logprobs` must be in [0, 20]")
        if value and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        return value


class ChatResponseMessage(BaseModel):
    """``reasoning``: a thinking model's reasoning (engine/server/reasoning.py), also as ``reasoning_content``, the
    name DeepSeek's API and vLLM before 0.11 give it; both left out where the server splits no reasoning."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it (None for EOS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    #: vLLM's: with the request's ``prompt_logprobs`` (``logprobs.prompt_logprobs``'s shape), else left out
    prompt_logprobs: list[dict[int, dict] | None] | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(BaseModel):
    """Only what changed: ``role`` appears in a choice's first delta only (sent before any token, content "")."""

    role: str | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = None
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)  # as in ChatResponseMessage
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it (None for EOS)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- completions ----
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt back (and its logprobs), nothing generated (vLLM)
    echo: bool = False  # with logprobs: the prompt tokens' logprobs too, the first one null
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM: string prompts get the tokenizer's BOS (and the like)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        """vLLM refuses ``suffix`` (insertion) for every model: a 400 naming it, never a silent completion."""
        if value is not None:
            raise ValueError("suffix is not currently supported")
        return value


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it (None for EOS)
    #: vLLM's: with ``prompt_logprobs``, or ``echo`` with ``logprobs`` (``logprobs.prompt_logprobs``), else left out
    prompt_logprobs: list[dict[int, dict] | None] | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- responses ----
#: the roles a Responses ``input`` message may have, passed on as they are ("developer", OpenAI's newer "system", is
#: rendered as the chat endpoint renders it: ``serving_chat.render_chat``)
RESPONSES_ROLES = ("user", "assistant", "system", "developer")
#: statuses of an input assistant message that the answer continues (vLLM's ``should_continue_final_message``)
UNFINISHED = ("in_progress", "incomplete")
#: what a Responses ``include`` may ask for (OpenAI's ``ResponseIncludable``); only the logprobs change an answer here
INCLUDABLE = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]


def _input_message(item: Any) -> dict[str, str] | None:
    """One Responses ``input`` item as a chat message ``{"role", "content"}``: an item of type "message" (or none)
    whose content is text or a list of text parts ("input_text", "output_text", or chat's "text"; joined by
    newlines, as chat's text parts), with its ``status`` where it is an assistant message left unfinished (the answer
    continues it). None for a "reasoning" item (an earlier answer's, sent back with it: the chat templates drop past
    reasoning too). ValueError for anything else."""
    if not isinstance(item, dict):
        raise ValueError(f"items must be messages (objects with role and content), got {type(item).__name__}")
    kind = item.get("type", "message")
    if kind == "reasoning":  # an earlier answer's reasoning sent back (vLLM's multi-turn example): left out
        return None
    if kind != "message":
        raise ValueError(f"only message items are served, got {kind!r} (this server runs no tools and keeps no "
                         "reasoning between requests on /v1/responses)")
    role = item.get("role")
    if role not in RESPONSES_ROLES:
        raise ValueError(f"role must be user, assistant, system or developer, got {role!r}")
    content = item.get("content")
    unfinished = {"status": item["status"]} if role == "assistant" and item.get("status") in UNFINISHED else {}
    if isinstance(content, str):
        return {"role": role, "content": content, **unfinished}
    if not isinstance(content, list):
        raise ValueError("content must be text or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(f"only text parts (input_text, output_text) are served, got {kind!r}")
        parts.append(part["text"])
    return {"role": role, "content": "\n".join(parts), **unfinished}


class ResponsesStreamOptions(RequestModel):
    """OpenAI's Responses ``stream_options``: ``include_obfuscation`` (random padding of the stream's events, which
    this server does not add)."""

    include_obfuscation: bool = True


class ResponsesRequest(SamplingRequest):
    """``POST /v1/responses``: OpenAI's Responses API, the part a server without a response store or tools serves
    (as vLLM's does without them): ``input`` as text (one user message) or a list of messages (an assistant message
    last with status "in_progress" or "incomplete" is continued, not answered), ``instructions`` as the system
    message before them, ``max_output_tokens``, ``text.format`` (text, json_object, json_schema), ``include`` with
    "message.output_text.logprobs" and ``top_logprobs`` (each output token's logprob and its ``top_logprobs`` most
    likely; as vLLM, ``top_logprobs`` alone asks for nothing), ``truncation`` "auto" (the oldest input messages
    after the system one are dropped until the input leaves room for one output token: OpenAI's rule),
    ``reasoning.effort`` (as the chat endpoint's ``reasoning_effort``, as vLLM), the sampling fields and vLLM's
    extras as on the chat endpoint (``request_id`` names the response), ``stream``. Echoed in the response
    and otherwise without effect: ``metadata``, ``parallel_tool_calls``, ``service_tier``, ``tool_choice`` "auto"
    or "none". Accepted without effect: ``store`` (nothing is stored, so a response cannot be fetched or
    continued; the response says false), ``stream_options`` (streamed or not, as OpenAI's), the other ``include``
    values. A 400 naming them: ``tools``, any other ``tool_choice``, ``conversation``, ``background``, ``n``
    above 1 and chat's ``response_format`` (not Responses fields; ``text.format`` is); ``previous_response_id`` is
    a 404 (no response is ever stored), as vLLM answers it without a store."""

    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    #: {"format": {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict"}}
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool = False
    include: list[INCLUDABLE] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = "disabled"
    store: bool = True
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    service_tier: str = "auto"
    stream_options: ResponsesStreamOptions | None = None
    request_id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}", min_length=1)  # vLLM: the id

    @field_validator("n")
    @classmethod
    def _one_answer(cls, value: int) -> int:
        if value != 1:
            raise ValueError("a response has one answer: n is not a Responses field (use /v1/chat/completions)")
        return value

    @field_validator("input")
    @classmethod
    def _messages(cls, value: str | list[Any]) -> list[dict[str, str]]:
        """The input as chat messages (:func:`_input_message`); text is one user message."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        messages = [m for m in map(_input_message, value) if m is not None]
        if not messages:
            raise ValueError("must hold at least one message")
        return messages

    @field_validator("text")
    @classmethod
    def _known_text_format(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """A 400 naming it for another format type, a json_schema without a schema object, or a JSON format beside
        ``structured_outputs`` (one that cannot be turned into a grammar: :meth:`check_constraint`)."""
        fmt = (value or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"format.type must be text, json_object or json_schema, got {kind!r}")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError('format json_schema needs {"name": ..., "schema": {...}}')
        if kind != "text" and info.data.get("structured_outputs"):
            raise ValueError("give a JSON format or structured_outputs, not both")
        return value

    @field_validator("response_format")
    @classmethod
    def _chat_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError("response_format is the chat endpoint's: here text.format says it")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: ResponsesStreamOptions | None,
                                    info: ValidationInfo) -> ResponsesStreamOptions | None:
        """Overrides chat's rule (same name): the Responses ``stream_options`` are accepted without ``stream``."""
        return value

    @property
    def include_usage(self) -> bool:  # the usage is in response.completed, never in chunks of its own
        return False

    @property
    def continuous_usage(self) -> bool:
        return False

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        """No tools are served here: a choice that asks for a call is a 400 naming it."""
        if value not in (None, "auto", "none"):
            raise ValueError("no tools are served on /v1/responses here (use /v1/chat/completions): only \"auto\" "
                             "or \"none\"")
        return value

    @field_validator("reasoning")
    @classmethod
    def _effort(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        effort = (value or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
        return value

    @field_validator("tools", "conversation", "background")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        """400s naming what this server does not do on this endpoint (a silent answer would be another one)."""
        if not value:
            return value
        name = info.field_name
        if name == "tools":
            raise ValueError("tools are not served on /v1/responses here: /v1/chat/completions serves them")
        if name == "conversation":
            raise ValueError("this server keeps no conversations (store): send the whole conversation in input")
        raise ValueError("background responses are not supported")

    def output_logprobs(self) -> int | None:
        """How many most likely tokens to give beside each output token's logprob: ``top_logprobs`` (0 when
        absent) where ``include`` asks for "message.output_text.logprobs", else None (none asked for)."""
        return (self.top_logprobs or 0) if "message.output_text.logprobs" in (self.include or []) else None

    def continues_final_message(self) -> bool:
        """Whether the input ends with an unfinished assistant message that the answer continues."""
        return self.input[-1].get("status") in UNFINISHED

    def text_format(self) -> dict[str, Any]:
        """``text.format`` as given, ``{"type": "text"}`` when absent (what the response reports)."""
        return (self.text or {}).get("format") or {"type": "text"}

    def constraint(self) -> StructuredOutputsParams | None:
        """The engine's ``structured_outputs``: from ``text.format``, else from ``structured_outputs`` (vLLM's)."""
        fmt = self.text_format()
        if fmt["type"] == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt["type"] == "json_schema":
            return StructuredOutputsParams(json=fmt["schema"])
        return super().constraint()

    def constraint_field(self) -> str:
        return "text" if self.text_format()["type"] != "text" else super().constraint_field()

    def chat_messages(self) -> list[ChatMessage]:
        """``instructions`` (as a system message) then the input's messages, for the chat template."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []  # vLLM
        return system + [ChatMessage(role=m["role"], content=m["content"]) for m in self.input]

    def effort(self) -> str | None:
        """``reasoning.effort``: the chat template's ``reasoning_effort`` (as the chat endpoint's field)."""
        return (self.reasoning or {}).get("effort")


# ---- models, tokenizer ----
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "edge-appliance"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either ``prompt`` (tokenized with special tokens unless ``add_special_tokens`` is false) or ``messages``
    (through the chat template, as the chat endpoint renders them: without extra special tokens unless
    ``add_special_tokens`` is true)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: RequestTemplate = None  # a 400, as on the chat endpoint
    tools: Tools = None  # shown to the template, as the chat endpoint does (vLLM)
    return_token_strs: bool = False  # vLLM: each token's string too (the tokenizer's own pieces)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
