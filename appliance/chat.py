"""``appliance chat``: talk to the running server from a terminal, as ``ollama run`` does.

A :class:`ChatSession` keeps the conversation (OpenAI chat messages) and streams each answer from ``POST
/v1/chat/completions`` (SSE, ``data: {...}`` chunks then ``data: [DONE]``; design.md §3), writing the text as it
comes: a thinking model's reasoning (the chunks' ``reasoning`` field, engine/server/reasoning.py) between
"Thinking..." and "...done thinking." as ``ollama run`` writes it (:class:`AnswerWriter`), then the answer.
:func:`repl` reads the user's turns: ``/bye`` (or end of input) ends it, ``/clear`` forgets the conversation,
``\"\"\"`` opens and closes a message of several lines; Ctrl-C stops the answer being written (its request is
aborted on the server when the connection closes) and leaves it out of the conversation.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from appliance.errors import ApplianceError

HELP = ('/bye ends the chat (so does Ctrl-D), /clear forgets the conversation, """ starts and ends a message of '
        "several lines; Ctrl-C stops an answer")


class ChatError(ApplianceError):
    """The server refused the request or failed while answering (its OpenAI error message, with a fix hint)."""


def _error(body: object) -> dict:
    """The ``error`` object of an OpenAI-style error body ``{"error": {"message", "code", ...}}``, else {}."""
    return body["error"] if isinstance(body, dict) and isinstance(body.get("error"), dict) else {}


def _error_message(body: object, status: int) -> str:
    """The error body's message, else the status."""
    error = _error(body)
    return str(error.get("message") or error) if error else f"HTTP {status}"


def _hint(status: int, body: object) -> str:
    code = _error(body).get("code")
    if status == 401:
        return "pass --api-key (or set APPLIANCE_API_KEY)"
    if code == "context_length_exceeded":
        return "shorten the conversation (/clear) or lower --max-tokens"
    if status == 400:
        return "check the options given (appliance chat -h)"
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

        Raises :class:`ChatError` for an error answer (401, 400, 503, ...), an error event in the stream, a line
        that is no chunk, or a stream that ends before ``data: [DONE]``, and ``httpx.HTTPError`` when the server
        cannot be reached or the connection breaks."""
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
                                _hint(resp.status_code, body))
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                    choices = chunk.get("choices") or []
                    deltas = [choice.get("delta") or {} for choice in choices]
                    pieces = [(kind, d[kind]) for d in deltas for kind in ("reasoning", "content") if d.get(kind)]
                except (ValueError, AttributeError, TypeError):  # not JSON, or not a chunk's shape
                    raise ChatError(f"the server sent a line that is no chat chunk: {data[:200]!r}",
                                    "is --url an OpenAI-compatible server?") from None
                if "error" in chunk:
                    raise ChatError(f"the answer failed: {_error_message(chunk, 500)}", _hint(500, chunk))
                yield from pieces
        raise ChatError("the answer ended before the server said it was done (no data: [DONE])",
                        "see `appliance status` and `appliance logs`")

    def ask(self, text: str, write: Callable[[str, str], None]) -> str:
        """Send ``text`` as the user's turn and ``write(kind, piece)`` the answer as it streams; returns the
        answer's content. The turn and the answer join ``messages`` once the answer is complete; an error or an
        interruption (``KeyboardInterrupt``, re-raised) leaves ``messages`` as it was."""
        self.messages.append({"role": "user", "content": text})
        answer = []
        try:
            with contextlib.closing(self.stream()) as pieces:  # closed at once on Ctrl-C: the request is aborted
                for kind, piece in pieces:
                    write(kind, piece)
                    if kind == "content":
                        answer.append(piece)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(answer)})
        return "".join(answer)


class AnswerWriter:
    """Writes one answer as it streams, through ``out(text, dim)``: a thinking model's reasoning (dim) between a
    "Thinking..." line and a "...done thinking." line, then a blank line and the answer, as ``ollama run``
    writes them; with ``hide_reasoning`` the answer alone. Call it as ``ChatSession.ask``'s ``write``, then
    :meth:`end` (which ends the answer's line). ``started``: whether it wrote anything yet."""

    def __init__(self, out: Callable[[str, bool], None], hide_reasoning: bool = False) -> None:
        self.hide_reasoning, self.thinking, self.started = hide_reasoning, False, False
        self._out = out

    def out(self, text: str, dim: bool) -> None:
        self.started = True
        self._out(text, dim)

    def __call__(self, kind: str, text: str) -> None:
        if kind == "reasoning":
            if self.hide_reasoning:
                return
            if not self.thinking:
                self.out("Thinking...\n", True)
                self.thinking = True
            self.out(text, True)
            return
        self._done_thinking("\n\n")
        self.out(text, False)

    def _done_thinking(self, after: str) -> None:
        if self.thinking:
            self.out("\n...done thinking." + after, True)
            self.thinking = False

    def end(self) -> None:
        self._done_thinking("")
        self.out("\n", False)


class Block(str):
    """A message typed between ``\"\"\"`` lines: never a command, even where it starts with ``/``."""


def read_turn(read: Callable[[str], str]) -> str | None:
    """The user's next message from ``read(prompt)`` (``input``): one line, or with a line starting with
    ``\"\"\"`` every line up to one ending with ``\"\"\"``, joined by newlines (a :class:`Block`). None at end of
    input (EOFError)."""
    try:
        line = read(">>> ")
        if not line.lstrip().startswith('"""'):
            return line
        lines, line = [], line.lstrip()[3:]
        while not line.rstrip().endswith('"""'):
            lines.append(line)
            line = read("... ")
        lines.append(line.rstrip()[:-3])
        return Block("\n".join(lines).strip("\n"))
    except EOFError:
        return None


def repl(session: ChatSession, read: Callable[[str], str], out: Callable[[str, bool], None],
         say: Callable[[str], None], hide_reasoning: bool = False) -> None:
    """Chat until ``/bye`` or end of input: each turn is answered through ``session.ask`` and written by an
    :class:`AnswerWriter` over ``out(text, dim)``; ``say`` prints the REPL's own lines (help, "stopped", errors
    that leave the chat usable: a refused request, a lost server). A line starting with ``/`` is a command (an
    unknown one is named, not sent); a message that starts with ``/`` goes in a ``\"\"\"`` block."""
    say(f"Chatting with {session.model} at {session.url}. {HELP}.")
    while True:
        try:
            text = read_turn(read)
        except KeyboardInterrupt:  # at the prompt: as Ollama, a hint instead of leaving
            say("\nUse Ctrl-D or /bye to leave.")
            continue
        if text is None:
            return
        command = text.strip()
        if not command:
            continue
        if command.startswith("/") and not isinstance(text, Block):
            if command == "/bye":
                return
            if command in ("/?", "/help"):
                say(HELP)
            elif command == "/clear":
                session.clear()
                say("Cleared the conversation.")
            else:
                say(f"Unknown command {command.split()[0]!r}. Type /? for help.")
            continue
        writer = AnswerWriter(out, hide_reasoning)
        try:
            session.ask(text, writer)
            writer.end()
        except KeyboardInterrupt:
            say("\n(stopped; that answer is left out of the conversation)")
        except ChatError as exc:
            say(f"\n{exc.message} ({exc.hint})")
        except httpx.HTTPError as exc:
            say(f"\nno answer from {session.url} ({type(exc).__name__}: {exc}); `appliance status` says why")
