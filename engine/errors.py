"""Errors the engine raises: for bad requests (the server maps them to OpenAI-style 400 responses), and for a
forward pass that failed (a 500 for the requests in it: a bug)."""
from __future__ import annotations

#: What the server logs before it exits because its engine died while serving (``api_server.run_server``);
#: ``appliance status`` looks for it in the background server's log.
ENGINE_DIED_LOG = "the engine died while serving"


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
    """A step failed for some requests (``request_ids``), which were dropped with their blocks; every other
    request and the engine carry on. ``cause`` is what happened: the forward pass raised (their blocks were also
    unregistered from the prefix cache, their K/V may be half written), or, with ``request_error``, no token
    could be sampled for them (their own parameters; ``cause`` is a ValueError, the step's ``outputs`` for the
    other requests come along)."""

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: list | None = None,
                 request_error: bool = False):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids, self.cause, self.outputs, self.request_error = request_ids, cause, outputs or [], request_error


class EngineWakeFailed(RuntimeError):
    """An engine put to sleep after ``sleep_after_idle_s`` seconds without requests (its process stopped, the GPU's
    memory freed) could not load its model again when a request came (that memory taken by other programs, say).
    That request fails with it (a 503); the engine stays asleep, not dead, and the next request tries again."""


class EngineBroken(RuntimeError):
    """The engine itself cannot go on (its process exited, its pipe broke): never one request's fault, so a server
    that gets it while adding a request declares the engine dead instead of refusing that request."""
