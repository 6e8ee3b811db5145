"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, and the app's exception handlers.

Client mistakes are 4xx naming the field; an engine that is loading, overloaded or dead is 503 (with
``Retry-After`` when retrying helps); a 500 is always a bug.
"""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineDeadError, EngineOverloadedError
from engine.engine_process import WAKE_RETRY_S
from engine.errors import ContextLengthError, EngineWakeFailed
from engine.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

#: Seconds an overloaded server asks a client to wait (``Retry-After``); the OpenAI SDKs honour it when retrying.
OVERLOAD_RETRY_AFTER_S = 1

#: OpenAI's error types: a wrong key and an unknown model are ``invalid_request_error``s too (their ``code`` says
#: which: ``invalid_api_key``, ``model_not_found``).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answer: HTTP ``status`` plus the OpenAI error fields (``type`` follows from the status)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "server_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_unavailable(state: str, error: BaseException | None = None) -> APIError:
    """503 for an engine that is still loading (retry soon) or dead (``code`` "engine_dead")."""
    if state == "dead":
        return APIError(503, f"The engine stopped and cannot serve requests: {error!r}", code="engine_dead")
    return APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                    headers={"Retry-After": "5"})


def from_engine_exception(e: Exception, prompt_field: str) -> APIError:
    """Map what ``AsyncLLMEngine.add_request`` raised to an ``APIError``; unknown exceptions are re-raised.

    ``prompt_field`` ("messages" or "prompt") is named in context-length errors.
    """
    if isinstance(e, ContextLengthError):
        return APIError(400, e.message(prompt_field), param=prompt_field, code="context_length_exceeded")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"The engine stopped and cannot serve requests: {e}", code="engine_dead")
    if isinstance(e, EngineWakeFailed):  # asleep after sleep_after_idle_s and could not load again: a later try may
        return APIError(503, f"The model was unloaded while idle ({e}); retry later, or free the GPU's memory",
                        code="model_load_failed", headers={"Retry-After": str(int(WAKE_RETRY_S))})
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="server_overloaded", headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)})
    if isinstance(e, ValueError):
        return bad_value(e)
    raise e


def bad_value(e: ValueError, default_param: str | None = None) -> APIError:
    """400 for a ``ValueError("<field>: <reason>")`` (the convention of ``SamplingParams.validate``)."""
    text = str(e)
    m = re.match(r"^([A-Za-z_][\w.]*): ", text)
    return APIError(400, text, param=m.group(1) if m else default_param, code="invalid_value")


def _validation_error(exc: RequestValidationError) -> APIError:
    """400 for the first pydantic error, naming its field as a dotted path (``messages.0.role``)."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        return APIError(400, f"Malformed JSON body: {ctx.get('error', err.get('msg'))}", param="body",
                        code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Union types add the tried type to the path (max_tokens.int); keep only the request's own names.
    loc = [p for p in loc if not re.fullmatch(r"int|str|float|bool|list\[.*\]|dict\[.*\]|function-.*", p)]
    param = ".".join(loc) or "body"
    kind = str(err.get("type", ""))
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    msg = re.sub(r"^(Value|Assertion) error, ", "", str(err.get("msg")))  # a validator's own message, as written
    return APIError(400, f"{param}: {msg}", param=param, code=code)


#: FastAPI's 400 for a body its JSON decoder failed on with an error other than a syntax error (a body that is not
#: UTF-8, nesting past the decoder's recursion limit, an integer of over 4,300 digits)
FASTAPI_BODY_ERROR = "There was an error parsing the body"
BODY_ERROR_WHY = "it does not decode (not UTF-8, nested too deeply, or a number with too many digits)"


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the OpenAI shape, FastAPI's 422 included (as 400)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        kind = request.headers.get("content-type", "")
        if error.param == "body" and not kind.split(";")[0].strip().lower().endswith("json"):  # curl -d, no -H
            error.message = (f"body: send a JSON object with the header Content-Type: application/json (got "
                             f"{kind or 'no Content-Type'})")
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:
            return APIError(400, f"Malformed JSON body: {BODY_ERROR_WHY}", param="body", code="invalid_json").response()
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error (a bug)", exc_info=exc)
        rid = getattr(request.state, "request_id", None)  # answered outside the id layer: its header here
        return APIError(500, f"Internal server error: {exc!r}",
                        headers={"x-request-id": rid} if rid else None).response()
