"""``appliance chat``: talk to the running server from a terminal, as ``ollama run`` does.

A :class:`ChatSession` keeps the conversation (OpenAI chat messages) and streams each answer from ``POST
/v1/chat/completions`` (SSE, ``data: {...}`` chunks then ``data: [DONE]``; design.md §3), writing the text as it
comes: a thinking model's reasoning (the chunks' ``reasoning`` field, engine/server/reasoning.py) between
"Thinking..." and "...done thinking." as ``ollama run`` writes it (:class:`AnswerWriter`), then the answer.
:func:`repl` reads the user's turns: ``/bye`` (or end of input) ends it, ``/clear`` forgets the conversation,
``\"\"\"`` opens and closes a message of several lines; Ctrl-C stops the answer being written (its request is
aborted on the server when the connection closes) and leaves it out of the conversation. As in ``ollama run``,
``/set parameter NAME VALUE`` sets a sampling option for the turns after it (Ollama's names, mapped to the OpenAI /
vLLM request fields by :data:`PARAMETERS`), ``/set system``, ``/set format json``, ``/set verbose`` (timings after
each answer), and ``/show info | parameters | system`` print what is set.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.errors import ApplianceError

HELP = ('/bye ends the chat (so does Ctrl-D), /clear forgets the conversation, """ starts and ends a message of '
        "several lines, /set and /show change and show the options (/? set, /? show); Ctrl-C stops an answer")
SET_HELP = ("/set parameter NAME VALUE (seed, num_predict, temperature, top_k, top_p, min_p, repeat_penalty, "
            "presence_penalty, frequency_penalty, stop WORD ...; no VALUE: the server's default), /set system TEXT "
            '(or a """ block), /set nosystem, /set format json, /set noformat, /set think, /set nothink (a thinking '
            "model's reasoning first, or not), /set verbose (timings after each answer), /set quiet")
SYSTEM_BLOCK = "/set system "  # followed by \"\"\": a system prompt of several lines
SHOW_HELP = "/show info (the model and its context), /show parameters, /show system"

#: ``/set parameter`` names (Ollama's, and the OpenAI / vLLM field itself) -> (request field, value type)
PARAMETERS: dict[str, tuple[str, type]] = {
    "seed": ("seed", int), "num_predict": ("max_tokens", int), "max_tokens": ("max_tokens", int),
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "min_p": ("min_p", float), "repeat_penalty": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float), "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "stop": ("stop", list),
}
#: the request fields shown under Ollama's names (``/show parameters``)
OLLAMA_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
#: Ollama parameters that are the server's, not a request's: the reason they cannot be set from the chat
SERVER_PARAMETERS = {
    "num_ctx": "the context length is the server's max_model_len (appliance install --max-model-len N)",
    "num_gpu": "the whole model runs on one device here",
    "num_thread": "the server picks its CPU threads (OMP_NUM_THREADS in its environment)",
    "repeat_last_n": "repetition_penalty looks at the whole prompt and answer, as vLLM's does",
}


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
        return "check the options given (appliance chat -h; /show parameters in the chat)"
    return "see `appliance status` and `appliance logs`"


@dataclass
class AnswerStats:
    """Timings of one answer as the client saw them (``/set verbose``): seconds from the request to the stream's
    end and to its first piece of text; token counts from the stream's usage chunk (None if the server sent
    none)."""

    total_s: float
    first_s: float | None
    prompt_tokens: int | None
    output_tokens: int | None

    def lines(self) -> list[str]:
        """As ``ollama run --verbose`` prints them: durations, counts, and the output rate after the first
        token (the decode rate: (output tokens - 1) / (total - first))."""
        out = [f"total duration:       {self.total_s:.3f}s"]
        if self.first_s is not None:
            out.append(f"time to first token:  {self.first_s:.3f}s")
        if self.prompt_tokens is not None:
            out.append(f"prompt eval count:    {self.prompt_tokens} token(s)")
        if self.output_tokens is not None:
            out.append(f"eval count:           {self.output_tokens} token(s)")
            if self.first_s is not None and self.output_tokens > 1 and self.total_s > self.first_s:
                rate = (self.output_tokens - 1) / (self.total_s - self.first_s)
                out.append(f"eval rate:            {rate:.2f} tokens/s")
        return out


@dataclass
class ChatSession:
    """One conversation with ``model`` at ``url`` (the server's base URL, no ``/v1``).

    ``messages``: the OpenAI chat messages so far (the system prompt first when given); an answer joins them only
    when it was written to the end. ``options``: request fields sent with every turn (``max_tokens``,
    ``temperature``, ``response_format``...); one not set leaves the server's default (the rest of the context;
    the model's generation_config, else vLLM's). ``verbose``: ask for the usage chunk and keep
    :class:`AnswerStats` of the last complete answer in ``last_stats``.
    """

    url: str
    model: str
    api_key: str | None = None
    system: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    verbose: bool = False
    messages: list[dict] = field(default_factory=list)
    last_stats: AnswerStats | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def set_system(self, text: str | None) -> None:
        """Make ``text`` the system prompt (None: none), first in the conversation, which goes on."""
        if self.messages and self.messages[0]["role"] == "system":
            self.messages.pop(0)
        self.system = text
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def headers(self) -> dict[str, str]:
        """The API key's ``Authorization`` header, when there is one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def card(self) -> dict:
        """The model's card from ``GET /v1/models`` ({} when the server does not list it); raises
        ``httpx.HTTPError`` when the server cannot be reached or refuses, ``ValueError`` / ``KeyError`` /
        ``TypeError`` for a body that is no model list (``loadgen.model_cards``)."""
        from appliance.loadgen import model_cards
        return next((card for card in model_cards(self.url, self.api_key) if card.get("id") == self.model), {})

    def set_thinking(self, on: bool | None) -> None:
        """Ask a thinking model to think first, or not (None: its template's default), through the chat template's
        ``enable_thinking`` variable (``chat_template_kwargs``, as Qwen3's templates and vLLM's server take it);
        templates without the variable ignore it."""
        kwargs = dict(self.options.get("chat_template_kwargs") or {})
        kwargs.pop("enable_thinking", None)
        if on is not None:
            kwargs["enable_thinking"] = on
        if kwargs:
            self.options["chat_template_kwargs"] = kwargs
        else:
            self.options.pop("chat_template_kwargs", None)

    def body(self) -> dict:
        """The request for the next answer: ``messages`` streamed, with the options that were set."""
        usage = {"stream_options": {"include_usage": True}} if self.verbose else {}
        return {"model": self.model, "messages": self.messages, "stream": True, **usage, **self.options}

    def stream(self) -> Iterator[tuple[str, Any]]:
        """The next answer as it streams: ``("reasoning" | "content", text)`` pairs, and ``("usage", dict)`` for
        the usage chunk when ``verbose`` asked for one.

        Raises :class:`ChatError` for an error answer (401, 400, 503, ...), an error event in the stream, a line
        that is no chunk, or a stream that ends before ``data: [DONE]``, and ``httpx.HTTPError`` when the server
        cannot be reached or the connection breaks."""
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body(), headers=self.headers(),
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
                if not choices and isinstance(chunk.get("usage"), dict):
                    yield "usage", chunk["usage"]
        raise ChatError("the answer ended before the server said it was done (no data: [DONE])",
                        "see `appliance status` and `appliance logs`")

    def ask(self, text: str, write: Callable[[str, str], None]) -> str:
        """Send ``text`` as the user's turn and ``write(kind, piece)`` the answer as it streams; returns the
        answer's content. The turn and the answer join ``messages`` once the answer is complete (and its
        :class:`AnswerStats` become ``last_stats``); an error or an interruption (``KeyboardInterrupt``, re-raised)
        leaves ``messages`` as it was."""
        self.messages.append({"role": "user", "content": text})
        answer, usage, first = [], {}, None
        start = time.perf_counter()
        try:
            with contextlib.closing(self.stream()) as pieces:  # closed at once on Ctrl-C: the request is aborted
                for kind, piece in pieces:
                    if kind == "usage":
                        usage = piece
                        continue
                    first = time.perf_counter() - start if first is None else first
                    write(kind, piece)
                    if kind == "content":
                        answer.append(piece)
        except BaseException:
            self.messages.pop()
            raise
        self.last_stats = AnswerStats(time.perf_counter() - start, first, usage.get("prompt_tokens"),
                                      usage.get("completion_tokens"))
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


@contextlib.contextmanager
def input_history(path: Path, length: int = 1000) -> Iterator[None]:
    """While it lasts, ``input()`` edits lines and recalls earlier ones (readline), the turns of earlier chats
    too: read from ``path`` first, and the last ``length`` lines written back after (as Ollama keeps
    ``~/.ollama/history``). Without readline (Windows) nothing happens; a history file that cannot be read or
    written is left alone."""
    try:
        import readline
    except ImportError:
        yield
        return
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(length)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # to a temporary name, then renamed: a crash never leaves half a file
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                readline.write_history_file(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)


class Block(str):
    """A message typed between ``\"\"\"`` lines: never a command, even where it starts with ``/``."""


def read_turn(read: Callable[[str], str]) -> str | None:
    """The user's next message from ``read(prompt)`` (``input``): one line, or with a line starting with
    ``\"\"\"`` every line up to one ending with ``\"\"\"``, joined by newlines (a :class:`Block`); ``/set system
    \"\"\"`` opens such a block too (Ollama's), returned as that command with the block's text. None at end of
    input (EOFError)."""
    try:
        line = read(">>> ")
        stripped = line.lstrip()
        command = SYSTEM_BLOCK if stripped.startswith(SYSTEM_BLOCK) else ""
        if not stripped[len(command):].startswith('"""'):
            return line
        lines, line = [], stripped[len(command) + 3:]
        while not line.rstrip().endswith('"""'):
            lines.append(line)
            line = read("... ")
        lines.append(line.rstrip()[:-3])
        text = "\n".join(lines).strip("\n")
        return command + text if command else Block(text)
    except EOFError:
        return None


def _parse(name: str, kind: type, values: list[str]) -> Any:
    """A ``/set parameter`` value as its request field takes it; ValueError with the reason for a bad one (not a
    number, not finite, a ``num_predict`` below 1 but Ollama's -1 and -2)."""
    if kind is list:
        return values
    if len(values) != 1:
        raise ValueError(f"give one value, e.g. /set parameter {name} {kind(1)}")
    try:
        value = kind(values[0])
    except ValueError:
        raise ValueError(f"{values[0]!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise ValueError(f"{values[0]!r} is not a finite number")
    if PARAMETERS[name][0] == "max_tokens" and value < 1 and value not in (-1, -2):
        raise ValueError("give at least 1 (or -1: the rest of the context)")
    return value


def set_option(session: ChatSession, args: list[str]) -> str:
    """Apply ``/set ARGS`` to ``session``; returns the line to say (what was set, or why nothing was).
    ``/set parameter NAME`` without a value unsets it (the server's default again)."""
    what, rest = (args[0], args[1:]) if args else ("", [])
    if what == "parameter" and rest:
        name, values = rest[0], rest[1:]
        if name in SERVER_PARAMETERS:
            return f"{name} is not a per-request setting here: {SERVER_PARAMETERS[name]}."
        if name not in PARAMETERS:
            return f"Unknown parameter {name!r}. {SET_HELP}."
        field_name, kind = PARAMETERS[name]
        if not values:
            session.options.pop(field_name, None)
            return f"Unset parameter {name!r} (the server's default)."
        try:
            value = _parse(name, kind, values)
        except ValueError as exc:
            return f"Couldn't set parameter {name!r}: {exc}."
        if field_name == "max_tokens" and value < 0:  # Ollama's -1 (no limit) and -2 (fill the context)
            session.options.pop(field_name, None)
            return f"Set parameter {name!r} to {values[0]!r} (the rest of the context)."
        session.options[field_name] = value
        return f"Set parameter {name!r} to {' '.join(values)!r}."
    if what == "system" and rest:
        session.set_system(" ".join(rest))
        return "Set system message."
    if args == ["nosystem"]:
        session.set_system(None)
        return "Removed the system message."
    if args == ["format", "json"]:
        session.options["response_format"] = {"type": "json_object"}
        return "Set format to 'json' mode."
    if args == ["noformat"]:
        session.options.pop("response_format", None)
        return "Disabled format."
    if args in (["verbose"], ["quiet"]):
        session.verbose = args == ["verbose"]
        return f"Set {args[0]!r} mode."
    if args in (["think"], ["nothink"]):
        session.set_thinking(args == ["think"])
        return f"Set {args[0]!r} mode."
    return f"Usage: {SET_HELP}."


def show(session: ChatSession, what: str) -> list[str]:
    """The lines ``/show WHAT`` prints. ``info`` asks the server for the model's card (``/v1/models``; raises
    ``httpx.HTTPError`` when it cannot be reached)."""
    if what == "info":
        card = session.card()
        return [f"  model           {session.model}", f"  context length  {card.get('max_model_len', '?')}",
                f"  server          {session.url}"]
    if what == "parameters":
        if not session.options:
            return ["No parameters were set: the server's defaults apply (the model's generation_config)."]
        return ["User defined parameters:"] + [f"{OLLAMA_NAMES.get(k, k):<20} {json.dumps(v)}"
                                               for k, v in session.options.items()]
    if what == "system":
        return [session.system or "No system message was specified."]
    return [f"Usage: {SHOW_HELP}."]


def command(session: ChatSession, line: str) -> list[str] | None:
    """Run one REPL command line (starting with ``/``); returns the lines to say, None for ``/bye``. Raises what
    ``ChatSession.card`` raises where ``/show info`` cannot read the server's model list."""
    name, *args = line.split()
    if name == "/bye":
        return None
    if name in ("/?", "/help"):
        return [{"set": SET_HELP, "show": SHOW_HELP}.get(args[0], HELP) if args else HELP]
    if name == "/clear":
        session.clear()
        return ["Cleared the conversation."]
    if name == "/set":
        if args[:1] == ["system"]:  # the system prompt as typed, spaces and lines and all
            text = line.split(None, 2)[2] if len(args) > 1 else ""
            args = ["system", text] if text else ["system"]
        return [set_option(session, args)]
    if name == "/show":
        return show(session, args[0] if args else "")
    return [f"Unknown command {name!r}. Type /? for help."]


def repl(session: ChatSession, read: Callable[[str], str], out: Callable[[str, bool], None],
         say: Callable[[str], None], hide_reasoning: bool = False) -> None:
    """Chat until ``/bye`` or end of input: each turn is answered through ``session.ask`` and written by an
    :class:`AnswerWriter` over ``out(text, dim)``; ``say`` prints the REPL's own lines (help, "stopped", errors
    that leave the chat usable: a refused request, a lost server; with ``verbose``, the answer's timings). A line
    starting with ``/`` is a command (:func:`command`; an unknown one is named, not sent); a message that starts
    with ``/`` goes in a ``\"\"\"`` block."""
    say(f"Chatting with {session.model} at {session.url}. {HELP}.")
    while True:
        try:
            text = read_turn(read)
        except KeyboardInterrupt:  # at the prompt: as Ollama, a hint instead of leaving
            say("\nUse Ctrl-D or /bye to leave.")
            continue
        if text is None:
            return
        if not text.strip():
            continue
        if text.strip().startswith("/") and not isinstance(text, Block):
            try:
                lines = command(session, text.strip())
            except KeyboardInterrupt:
                lines = ["(stopped)"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:  # /show info: no model list
                lines = [f"no answer from {session.url} ({type(exc).__name__}: {exc}); `appliance status` says why"]
            if lines is None:
                return
            for line in lines:
                say(line)
            continue
        writer = AnswerWriter(out, hide_reasoning)
        try:
            session.ask(text, writer)
            writer.end()
            if session.verbose and session.last_stats:
                for line in ["", *session.last_stats.lines()]:
                    say(line)
        except KeyboardInterrupt:
            say("\n(stopped; that answer is left out of the conversation)")
        except ChatError as exc:
            say(f"\n{exc.message} ({exc.hint})")
        except httpx.HTTPError as exc:
            say(f"\nno answer from {session.url} ({type(exc).__name__}: {exc}); `appliance status` says why")
