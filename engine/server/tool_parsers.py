"""Tool calls read out of free text, for ``tool_choice`` "auto" (OpenAI's default when a request gives tools): what
vLLM does with ``--enable-auto-tool-choice --tool-call-parser``, and Ollama by the model's template.

One format, "hermes": the ``<tool_call>`` blocks that Hermes 2 Pro's and Qwen2.5's / Qwen3's chat templates ask the
model to write, a JSON object with the function's ``name`` and ``arguments`` in each::

    I will look it up.
    <tool_call>
    {"name": "weather", "arguments": {"city": "Paris"}}
    </tool_call>

The server's ``tool_call_parser`` setting (:func:`resolve`): "auto" (the default) takes hermes when the model's chat
template writes ``<tool_call>``, else none; "hermes" always; "none" never ("auto" tool choice is then a 400, as in
vLLM without its flags).

Source: vLLM's ``hermes_tool_parser``: the text before the first block is the message's content (None when empty);
if a block is not such a JSON object, the whole output stays content and no call is made; arguments are
re-serialized; a response that made calls has finish_reason "tool_calls". Streamed (:class:`StreamState`), text
goes out as content until a block starts (a possible start of one is held back), and the calls go out whole when the
output is complete, so that a streamed answer is the same as the response would be (vLLM streams the arguments
piece by piece; OpenAI's clients add the pieces up either way). Unlike vLLM, a block without ``arguments`` is a call
with none (``{}``), and arguments written as a JSON string of an object are taken as that object.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.server.tools import new_call

START, END = "<tool_call>", "</tool_call>"
SETTINGS = ("auto", "hermes", "none")
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def resolve(setting: str, chat_template: str | dict | None) -> str | None:
    """The parser to use ("hermes" or None) for ``setting`` (:data:`SETTINGS`) and the tokenizer's chat template
    (a string, or a dict of named templates). Raises ValueError for another setting."""
    if setting not in SETTINGS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return None if setting == "none" else setting
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return "hermes" if any(START in t for t in templates) else None


def _calls(blocks: list[str]) -> list[dict] | None:
    """One ``tool_calls`` entry per block, or None if a block is not ``{"name": str, "arguments": object}`` (the
    arguments may come as a JSON string of an object)."""
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
            return None
        calls.append(new_call(obj["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output: the text before the first block and a call per block (the last
    one may be left unclosed, as when a stop token ends it); ``(text, [])`` when there is no block or one does not
    parse."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = _calls(_BLOCK.findall(text, start))
    if not calls:
        return text, []
    return text[:start] or None, calls


def _held(text: str) -> int:
    """How many characters at the end of ``text`` could be the beginning of :data:`START`."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class StreamState:
    """What one streamed choice has sent: ``sent`` characters of its text as content. Text goes out until the first
    block starts (a possible start of one held back); from there on nothing goes out until the output is complete,
    and then :func:`parse` decides, as for a response that is not streamed: the calls, or the rest as content."""

    sent: int = 0
    calls: int = 0

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[dict]]:
        """(new content, new calls) now that the choice's text is ``text`` (cumulative); ``finished``: the last
        update."""
        start = text.find(START)
        if start < 0:
            return self._content(text, len(text) if finished else len(text) - _held(text)), []
        content = self._content(text, start)
        if not finished:
            return content, []
        _, calls = parse(text)
        if not calls:  # not a tool call after all: the rest is content
            return ((content or "") + (self._content(text, len(text)) or "")) or None, []
        self.calls = len(calls)
        return content, calls

    def _content(self, text: str, end: int) -> str | None:
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece or None
