"""Shared helpers for engine tests: the demo model folder, prompts, and an engine per module."""
from __future__ import annotations

from appliance.demo_model import demo_model_dir

#: Eight varied prompts: chat-templated questions, plain prose, code, digits, one token, and prompts that end
#: on and around a 16-token block boundary.
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
    "Hello",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;",
    "Paris is the capital of France. Berlin is the capital of",
]
CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def demo_dir() -> str:
    return str(demo_model_dir())


def prompts(tokenizer) -> list[str]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in CHAT_QUESTIONS]
    return RAW_PROMPTS + chats


def as_floats(entries: list | None) -> list | None:
    """An offline ``LLM``'s logprobs entries ({token_id: Logprob}, None kept) as the engine's step outputs carry
    them ({token_id: logprob})."""
    if entries is None:
        return None
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]
