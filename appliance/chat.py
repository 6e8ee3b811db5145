"""``appliance chat``: talk to the running server from a terminal, as ``ollama run`` does.

A :class:`ChatSession` keeps the conversation (OpenAI chat messages) and streams each answer from
``POST /v1/chat/completions`` (SSE, ``data: {...}`` chunks then ``data: [DONE]``; design.md §3), writing the text as
it comes: a thinking model's reasoning (the chunks' ``reasoning`` field, engine/server/reasoning.py) dimmed, then
the answer. :func:`repl` reads the user's turns: ``/bye`` (or end of input) ends it, ``/clear`` forgets the
conversation, ``\"\"\"`` opens and closes a message of several lines; Ctrl-C stops the answer being written (its
request is aborted on the server when the connection closes) and leaves it out of the conversation.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from appliance.errors import ApplianceError

HELP = ('/bye ends the chat (so does Ctrl-D), /clear forgets the conversation, """ starts and ends a message of '
        "several lines; Ctrl-C stops an answer")


class ChatError(ApplianceError):
    """The server refused the request or failed while answering (its OpenAI error message, with a fix hint)."""


def _error_message(body: object, status: int) -> str:
    """The message of an OpenAI-style error body ``{"error": {"message": ...}}``, else the status."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or body["error"])
    return f"HTTP {status}"


def _hint(status: int) -> str:
    if status == 401:
        return "pass --api-key (or set APPLIANCE_API_KEY)"
    if status == 400:
        return "shorten the conversation (/clear) or lower --max-tokens"
    return "see `appliance status` and `appliance logs`"


@dataclass
class ChatSession:
    """One conversation with ``model`` at ``url`` (the server's base URL, no ``/v1``).

    ``messages``: the OpenAI chat messages so far (the system prompt first when given); an answer joins them only
    when it was written to the end. ``max_tokens`` / ``temperature``: None leaves the server's default (the rest
    of the context; the model's generation_config, else 1.0).
    """

    url: str
    model: str
    api_key: str | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    messages: list[dict] = field(default_factory=list)
    timeout: float = 600.0

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def body(self) -> dict:
        """The request for the next answer: ``messages`` streamed, with the options that were set."""
        options = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        return {"model": self.model, "messages": self.messages, "stream": True,
                **{k: v for k, v in options.items() if v is not None}}

    def stream(self) -> Iterator[tuple[str, str]]:
        """The next answer's text as it streams: ``("reasoning" | "content", text)`` pairs.

        Raises :class:`ChatError` for an error answer (401, 400, 503, ...) or an error event in the stream, and
        ``httpx.HTTPError`` when the server cannot be reached or the connection breaks."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body(), headers=headers,
                          timeout=self.timeout) as resp:
            if resp.status_code != 200:
                resp.read()
                try:
                    body = resp.json()
                except ValueError:
                    body = None
                raise ChatError(f"the server refused the chat: {_error_message(body, resp.status_code)}",
                                _hint(resp.status_code))
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatError(f"the answer failed: {_error_message(chunk, 500)}", _hint(500))
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    for kind in ("reasoning", "content"):
                        if delta.get(kind):
                            yield kind, delta[kind]

    def ask(self, text: str, write: Callable[[str, str], None]) -> str:
        """Send ``text`` as the user's turn and ``write(kind, piece)`` the answer as it streams; returns the
        answer's content. The turn and the answer join ``messages`` once the answer is complete; an error or an
        interruption (``KeyboardInterrupt``, re-raised) leaves ``messages`` as it was."""
        self.messages.append({"role": "user", "content": text})
        answer = []
        try:
            for kind, piece in self.stream():
                write(kind, piece)
                if kind == "content":
                    answer.append(piece)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(answer)})
        return "".join(answer)


def read_turn(read: Callable[[str], str]) -> str | None:
    """The user's next message from ``read(prompt)`` (``input``): one line, or with a line starting with
    ``\"\"\"`` every line up to one ending with ``\"\"\"``, joined by newlines. None at end of input (EOFError)."""
    try:
        line = read(">>> ")
        if not line.lstrip().startswith('"""'):
            return line
        lines, line = [], line.lstrip()[3:]
        while not line.rstrip().endswith('"""'):
            lines.append(line)
            line = read("... ")
        lines.append(line.rstrip()[:-3])
        return "\n".join(lines).strip("\n")
    except EOFError:
        return None


def repl(session: ChatSession, read: Callable[[str], str], write: Callable[[str, str], None],
         say: Callable[[str], None]) -> None:
    """Chat until ``/bye`` or end of input: each turn is answered through ``session.ask``; ``say`` prints the
    REPL's own lines (help, "stopped", errors that leave the chat usable: a refused request, a lost server)."""
    say(f"Chatting with {session.model} at {session.url}. {HELP}.")
    while True:
        try:
            text = read_turn(read)
        except KeyboardInterrupt:  # at the prompt: as Ollama, a hint instead of leaving
            say("\nUse Ctrl-D or /bye to leave.")
            continue
        if text is None or text.strip() == "/bye":
            return
        command = text.strip()
        if command in ("/?", "/help"):
            say(HELP)
            continue
        if command == "/clear":
            session.clear()
            say("Cleared the conversation.")
            continue
        if not command:
            continue
        try:
            session.ask(text, write)
            write("content", "\n")
        except KeyboardInterrupt:
            say("\n(stopped; that answer is left out of the conversation)")
        except ChatError as exc:
            say(f"\n{exc.message} ({exc.hint})")
        except httpx.HTTPError as exc:
            say(f"\nno answer from {session.url} ({type(exc).__name__}: {exc}); `appliance status` says why")
