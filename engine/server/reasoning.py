"""Reasoning read out of a chat answer: the text a thinking model writes between ``<think>`` and ``</think>``
goes to the message's ``reasoning`` (and ``reasoning_content``), the rest to its ``content``; what vLLM does with
``--reasoning-parser deepseek_r1`` / ``qwen3`` (docs: "Reasoning Outputs"), and Ollama with a thinking model.

Where the reasoning starts (:func:`starts_open`): DeepSeek-R1's template, and Qwen3's thinking-only releases, open
the ``<think>`` block at the end of the prompt, so the answer starts inside it; Qwen3's hybrid models write the
``<think>`` themselves, and with ``enable_thinking: false`` (``chat_template_kwargs``) their template closes an empty
block in the prompt, so the answer is all content. The split (:func:`split`):

* inside the block, every character up to ``</think>`` is reasoning; after it, the content, without the newlines
  that follow the tag (null if nothing follows). An answer that stops inside the block (``max_tokens``) is all
  reasoning, content null. A ``<think>`` the answer starts with is skipped, also where the prompt opened one.
* otherwise the whole answer is content, reasoning null (unlike vLLM's deepseek_r1 parser, which makes such an
  answer reasoning: here the prompt says whether a block is open).

Streamed, the same split of the text so far, holding back a possible partial tag at its end, so that the deltas
add up to the response that was not streamed. The server's ``reasoning_parser`` setting (:func:`resolve`): "auto"
(the default) reads reasoning when the model's chat template writes ``<think>``; "deepseek_r1" and "qwen3" (vLLM's
names; the same split) always; "none" never. Requests whose output is constrained (``response_format``,
structured outputs, a named or "required" ``tool_choice``) are not split: their grammar holds from the first
token, so the model writes no reasoning there (vLLM lets it reason first). Tool calls under "auto" are read from
the content.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.server.tool_parsers import held, template_text

START, END = "<think>", "</think>"
SETTINGS = ("auto", "deepseek_r1", "qwen3", "none")


def resolve(setting: str, chat_template: str | dict | None) -> bool:
    """Whether answers are split, for ``setting`` (:data:`SETTINGS`) and the tokenizer's chat template (a string,
    or a dict of named templates). Raises ValueError for another setting."""
    if setting not in SETTINGS:
        raise ValueError(f"reasoning_parser: must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return setting != "none"
    return START in template_text(chat_template)


def starts_open(prompt_text: str) -> bool:
    """Whether an answer to this prompt (its rendered text, or its last tokens decoded) starts inside a
    ``<think>`` block: the prompt ends with ``<think>`` (and white space), as the templates that open one end (a
    ``<think>`` in the user's own words opens nothing)."""
    return prompt_text.rstrip().endswith(START)


def split(text: str, open_: bool, finished: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of an answer's text (module doc); ``open_``: :func:`starts_open` of its prompt. Not
    ``finished``: the text so far, less a possible partial tag at its end (and at the start, a possible
    ``<think>``), which the next call decides. None: that part has not started."""
    at = 0
    if text.startswith(START):  # the model opens the block (again, where the prompt did: vLLM skips it too)
        at = len(START)
    elif not finished and START.startswith(text):  # "" or "<thi": a block may be opening
        return None, None
    elif not open_:
        return None, text
    end = text.find(END, at)
    if end < 0:
        reasoning = text[at:] if finished else text[at:len(text) - held(text[at:], END)]
        return reasoning, None
    return text[at:end], text[end + len(END):].lstrip("\n") or None


@dataclass
class StreamSplit:
    """One streamed choice's split: how much of its reasoning and of its content went out; :meth:`delta` gives
    what is new. ``content``: the content so far, which a tool-call stream reads (None before it starts)."""

    open_: bool
    reasoning_sent: int = 0
    content_sent: int = 0
    content: str | None = None

    def delta(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(new reasoning, new content) now that the choice's text is ``text`` (cumulative); ``finished``: the
        last update."""
        reasoning, self.content = split(text, self.open_, finished)
        thought, said = (reasoning or "")[self.reasoning_sent:], (self.content or "")[self.content_sent:]
        self.reasoning_sent += len(thought)
        self.content_sent += len(said)
        return thought or None, said or None
