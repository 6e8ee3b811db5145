"""Errors the engine raises: for bad requests (the server maps them to OpenAI-style 400 responses), and for a
forward pass that failed (a 500 for the requests in it: a bug)."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """Prompt plus requested completion exceed ``max_model_len``; nothing was scheduled or truncated.

    Attributes: ``max_model_len``, ``prompt_tokens``, ``completion_tokens`` (all int, in tokens).
    ``completion_tokens`` is below 1 when no ``max_tokens`` was given (it defaults to what is left of the context)
    and the prompt alone fills the context.
    """

    def __init__(self, max_model_len: int, prompt_tokens: int, completion_tokens: int):
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        super().__init__(self.message("prompt"))

    def message(self, where: str) -> str:
        """vLLM's wording, naming the prompt as ``where`` ("messages" for chat, "prompt" for completions)."""
        head = f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
        if self.completion_tokens < 1:
            return f"{head}{self.prompt_tokens} tokens in the {where}. Please reduce the length of the {where}."
        return (f"{head}{self.prompt_tokens + self.completion_tokens} tokens ({self.prompt_tokens} in the {where}, "
                f"{self.completion_tokens} in the completion). Please reduce the length of the {where} or "
                f"completion.")


class StepFailed(RuntimeError):
    """A forward pass raised (``__cause__``). Its requests (``request_ids``) were dropped and their blocks freed
    and unregistered from the prefix cache; every other request and the engine itself carry on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
