"""What the engine returns per request: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes.

The engine's outputs carry logprobs as plain ``{token_id: logprob}`` dicts with the ranks beside them (the server's
form: cheap to build every step and to send between processes); the offline ``LLM`` hands them out as vLLM does,
``{token_id: Logprob}`` (:func:`with_logprob_objects`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class Logprob(float):
    """vLLM's ``Logprob``: a token's log-probability ``logprob`` (natural log, of the raw model distribution), its
    ``rank`` in that distribution (1 = the most likely; ties count ahead) and its text ``decoded_token``.

    It is also the float ``logprob`` itself (a subclass of float), so code that sorts, adds or compares the
    engine's ``{token_id: logprob}`` entries works on these too, and entries compare equal to the engine's."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


@dataclass
class CompletionOutput:
    """One completion (choice) of a request.

    ``text`` and ``token_ids`` are cumulative (everything generated so far, stop string removed unless
    ``include_stop_str_in_output``); a streaming server sends the suffix it has not sent yet.
    ``finish_reason`` is None while running, else "stop" | "length" | "abort".
    ``logprobs``: per generated token a dict {sampled token: logprob, then the top k} (natural log; from the
    offline ``LLM``, vLLM's {token_id: :class:`Logprob`}), or None when not asked; ``logprob_ranks``: the sampled
    tokens' ranks (1 = the most likely) and ``cumulative_logprob`` the sum of their logprobs, None alike.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    logprob_ranks: list[int] | None = None

    def finished(self) -> bool:
        """Whether this choice is done (a method, as vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic()`` seconds) of one request's life, and the most tokens it may
    generate (``max_tokens`` in force: the request's, at most what the context leaves; None where not known)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_tokens: int | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step; ``finished`` once every choice has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    #: prompt tokens whose K/V the prefix cache held at the request's first scheduling (vLLM's)
    num_cached_tokens: int = 0
    #: with ``SamplingParams.prompt_logprobs``: per prompt token {token_id: logprob, then the top k} (natural log),
    #: None for the first (vLLM's shape); None when not asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    #: the same prompt tokens' ranks in their distributions (1 = the most likely; vLLM's ``Logprob.rank``), None
    #: for the first; None when not asked
    prompt_logprob_ranks: list[int | None] | None = None



def top_k(entry: dict[int, float], token_id: int, k: int) -> list[tuple[int, float]]:
    """The k most likely of ``entry`` (an engine dict: ``token_id``, then the device's top-k in its order), as the
    device picked them: a ``token_id`` tied with the k-th goes after the others, since the device's top-k left it
    out unless it is among them."""
    return sorted(entry.items(), key=lambda kv: (-kv[1], kv[0] == token_id))[:k]


def logprob_dict(entry: dict[int, float], token_id: int, rank: int | None, k: int,
                 decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """vLLM's {token_id: Logprob} of one position: ``token_id`` (the sampled or prompt token) first with its
    ``rank``, then the k most likely with ranks 1 .. k (``token_id`` among them keeps its place first and takes
    its top-k rank, as in vLLM's dict); ``decode``: a token id's text (None: no ``decoded_token``)."""
    items = [(token_id, entry.get(token_id, float("-inf")), rank)]
    items += [(t, lp, r) for r, (t, lp) in enumerate(top_k(entry, token_id, k), start=1)]
    return {t: Logprob(lp, r, decode(t) if decode is not None else None) for t, lp, r in items}


def with_logprob_objects(out: RequestOutput, logprobs: int, prompt_logprobs: int,
                         decode: Callable[[int], str] | None) -> RequestOutput:
    """``out`` with its logprobs as vLLM's offline ``LLM`` returns them, {token_id: :class:`Logprob`}, changed in
    place (``logprobs`` / ``prompt_logprobs``: the request's k of each; ``decode``: see :func:`logprob_dict`)."""
    for choice in out.outputs:
        if choice.logprobs is not None:
            ranks = choice.logprob_ranks or [None] * len(choice.logprobs)
            choice.logprobs = [logprob_dict(e, t, r, logprobs, decode)
                               for e, t, r in zip(choice.logprobs, choice.token_ids, ranks)]
    if out.prompt_logprobs is not None:
        ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
        out.prompt_logprobs = [None if e is None else logprob_dict(e, t, r, prompt_logprobs, decode)
                               for e, t, r in zip(out.prompt_logprobs, out.prompt_token_ids, ranks)]
    return out
