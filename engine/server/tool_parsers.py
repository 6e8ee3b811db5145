"""Tool calls read out of free text, for ``tool_choice`` "auto" (OpenAI's default when a request gives tools): what
vLLM does with ``--enable-auto-tool-choice --tool-call-parser``, and Ollama by the model's template.

Three formats, each what some chat templates ask the model to write:

* "hermes" (Hermes 2 Pro / Hermes 3, Qwen2.5): ``<tool_call>`` blocks around a JSON object with the function's
  ``name`` and ``arguments``; the text before the first block is the message's content::

      I will look it up.
      <tool_call>
      {"name": "weather", "arguments": {"city": "Paris"}}
      </tool_call>

* "llama3_json" (Llama 3.1 / 3.2 Instruct): the whole output is the call, ``{"name": ..., "parameters": {...}}``,
  maybe after ``<|python_tag|>``, several joined by ``; ``; no content.

* "mistral" (Mistral 7B Instruct v0.3, Mistral Nemo / Small): ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}`` (or, with Mistral's newer tokenizers, ``[TOOL_CALLS]name[ARGS]{...}``, one
  such per call); the text before it is the content. Mistral's templates want each call's id to be nine letters
  and digits when it comes back in the history, so these calls get such ids (as vLLM's mistral parser gives).

The server's ``tool_call_parser`` setting (:func:`resolve`): "auto" (the default) takes hermes when the model's chat
template writes ``<tool_call>``, mistral when it writes ``[TOOL_CALLS]`` or ``[AVAILABLE_TOOLS]``, llama3_json when it
writes ``<|python_tag|>`` or asks for a "parameters" dictionary, else none; "hermes", "mistral" or "llama3_json"
always; "none" never ("auto" tool choice is then a 400, as in vLLM
without its flags).

Source: vLLM's ``hermes_tool_parser``, ``llama_tool_parser`` and ``mistral_tool_parser``: when a call does not parse, the whole output stays
content and no call is made; arguments are re-serialized; a response that made calls has finish_reason
"tool_calls". Streamed (:class:`StreamState`), text goes out as content until a call may start (a possible start
of one is held back), and the calls go out whole when the output is complete, so that a streamed answer is the
same as the response would be (vLLM streams the arguments piece by piece; OpenAI's clients add the pieces up either
way). Unlike vLLM, a call without arguments is a call with none (``{}``), and arguments written as a JSON string of
an object are taken as that object.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from engine.server.tools import new_call

START, END = "<tool_call>", "</tool_call>"  # hermes
PYTHON_TAG = "<|python_tag|>"  # llama3_json
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"  # mistral
SETTINGS = ("auto", "hermes", "mistral", "llama3_json", "none")
_ALNUM = string.ascii_letters + string.digits
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def template_text(chat_template: str | dict | None) -> str:
    """A tokenizer's chat template as one text to search: a string, or a dict of named templates joined."""
    return " ".join(chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""])


def resolve(setting: str, chat_template: str | dict | None) -> str | None:
    """The parser to use ("hermes", "mistral", "llama3_json" or None) for ``setting`` (:data:`SETTINGS`) and the
    tokenizer's chat template (a string, or a dict of named templates). Raises ValueError for another setting."""
    if setting not in SETTINGS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    text = template_text(chat_template)
    if START in text:
        return "hermes"
    if TOOL_CALLS in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if PYTHON_TAG in text or '"parameters": dictionary' in text:
        return "llama3_json"
    return None


def _call(obj: Any, key: str, call_id: str | None = None) -> dict | None:
    """The ``tool_calls`` entry of one parsed call ``{"name": str, key: object}``, or None if it is not one (the
    arguments may come as a JSON string of an object; missing, they are {}); ``call_id``: its id (default a fresh
    ``chatcmpl-tool-`` one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return new_call(obj["name"], json.dumps(args, ensure_ascii=False), call_id)


def _mistral_id() -> str:
    """Nine letters and digits: the call ids Mistral's chat templates accept back."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text, start):  # the last block may be left unclosed, as when a stop token ends it
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:start] or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    try:
        while at < len(body):
            obj, end = decoder.raw_decode(body, at)
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = end + len(body[end:]) - len(body[end:].lstrip().removeprefix(";").lstrip())
    except ValueError:
        return text, []
    return None, calls


def _mistral(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    calls = []
    for part in text[start:].split(TOOL_CALLS)[1:]:
        part = part.strip()
        try:
            if ARGS in part:  # name[ARGS]{...}
                name, _, args = part.partition(ARGS)
                objs = [{"name": name.strip(), "arguments": json.loads(args)}]
            else:  # [{"name": ..., "arguments": ...}, ...] (or one object)
                obj, end = json.JSONDecoder().raw_decode(part)
                if part[end:].strip():
                    return text, []
                objs = obj if isinstance(obj, list) else [obj]
        except ValueError:
            return text, []
        for obj in objs:
            call = _call(obj, "arguments", _mistral_id())
            if call is None:
                return text, []
            calls.append(call)
    return (text[:start] or None) if calls else text, calls


_PARSERS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3_json}


def parse(text: str, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output by ``parser`` (module doc); ``(text, [])`` when it holds no call or
    one does not parse."""
    return _PARSERS[parser](text)


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _hold_from(text: str, parser: str) -> int:
    """Where the text that may belong to a call starts (``len(text)``: none of it may)."""
    if parser in ("hermes", "mistral"):
        marker = START if parser == "hermes" else TOOL_CALLS
        start = text.find(marker)
        return start if start >= 0 else len(text) - held(text, marker)
    body = text.lstrip()
    if body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body):  # "" and "<|pyth" too
        return 0
    return len(text)


@dataclass
class StreamState:
    """What one streamed choice has sent: ``sent`` characters of its text as content, and ``calls``. Text goes out
    while no call may have started; from there on nothing goes out until the output is complete, and then
    :func:`parse` decides, as for a response that is not streamed: the calls, or the rest as content."""

    parser: str = "hermes"
    sent: int = 0
    calls: int = 0

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[dict]]:
        """(new content, new calls) now that the choice's text is ``text`` (cumulative); ``finished``: the last
        update."""
        if not finished:
            return self._content(text, _hold_from(text, self.parser)), []
        content, calls = parse(text, self.parser)
        if not calls:
            return self._content(text, len(text)), []
        self.calls = len(calls)
        return self._content(content or "", len(content or "")), calls

    def _content(self, text: str, end: int) -> str | None:
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece or None
