"""Request ids: a client's ``X-Request-Id`` names its request, and every answer carries one back.

vLLM's rule for the chat and completion endpoints (``OpenAIServing._base_request_id``): the id of the answer is
``chatcmpl-<base>`` / ``cmpl-<base>``, where ``<base>`` is the ``X-Request-Id`` header when the client sends one,
else the body's ``request_id`` field, else a fresh random id (the engine request's id too, but below). Every HTTP
answer carries an ``X-Request-Id`` header, as OpenAI's (the SDK's ``with_raw_response...request_id`` reads it) and
vLLM's with ``--enable-request-id-headers``: the client's own, else the fresh id that a chat or completion answer
without a ``request_id`` field is named after (all but CORS preflights, which the CORS layer outside answers; a
browser page may read the header). A client may send an id again while a request under it runs: the engine's own id
for a client's id has a random suffix (``serving.submit``), as current vLLM makes its internal ids unique.
"""
from __future__ import annotations

import uuid

from fastapi import Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"


class RequestIdMiddleware:
    """Puts the request's id in ``request.state.request_id`` (the client's ``X-Request-Id``, else a fresh hex id)
    and the same id in the ``X-Request-Id`` header of the answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


def base_request_id(raw: Request, given: str | None) -> tuple[str, bool]:
    """``<base>`` of the module doc: the ``X-Request-Id`` header, else ``given`` (the body's ``request_id``), else
    the fresh id the middleware drew (a fresh one here where no middleware ran); and whether it is the client's."""
    header = raw.headers.get(HEADER)
    if header:
        return header, True
    if given:
        return given, True
    return getattr(raw.state, "request_id", None) or uuid.uuid4().hex, False
