"""Errors the engine raises for bad requests; the server maps them to OpenAI-style 400 responses."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """Prompt plus requested completion exceed ``max_model_len``; nothing was scheduled or truncated.

    Attributes: ``max_model_len``, ``prompt_tokens``, ``completion_tokens`` (all int, in tokens).
    """

    def __init__(self, max_model_len: int, prompt_tokens: int, completion_tokens: int):
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        total = prompt_tokens + completion_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} "
            f"tokens ({prompt_tokens} in the messages, {completion_tokens} in the completion). Please reduce the "
            f"length of the messages or completion.")
