"""What the engine returns per request: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion (choice) of a request.

    ``text`` and ``token_ids`` are cumulative (everything generated so far, stop string removed unless
    ``include_stop_str_in_output``); a streaming server sends the suffix it has not sent yet.
    ``finish_reason`` is None while running, else "stop" | "length" | "abort".
    ``logprobs``: per generated token a dict {token_id: logprob} (natural log), or None when not asked.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step; ``finished`` once every choice has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    #: with ``SamplingParams.prompt_logprobs``: per prompt token {token_id: logprob, then the top k} (natural log),
    #: None for the first (vLLM's shape); None when not asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: the same prompt tokens' ranks in their distributions (1 = the most likely; vLLM's ``Logprob.rank``), None
    #: for the first; None when not asked
    prompt_logprob_ranks: list[int | None] | None = None
