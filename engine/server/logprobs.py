"""OpenAI ``logprobs`` objects built from the engine's per-token ``{token_id: logprob}`` dicts (natural log).

Each engine dict holds the sampled token and the top-k of the raw distribution. ``-inf`` is clamped to -9999.0
(as vLLM does) so the JSON stays valid.
"""
from __future__ import annotations

from typing import Any

from engine.outputs import logprob_dict, top_k


def _lp(value: float) -> float:
    return max(float(value), -9999.0)


def _item(tokenizer: Any, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [k x {token, logprob, bytes}]}]}``, one per token."""
    content = []
    for tid, entry in zip(token_ids, entries):
        content.append({**_item(tokenizer, tid, entry.get(tid, float("-inf"))),
                        "top_logprobs": [_item(tokenizer, t, lp) for t, lp in top_k(entry, tid, k)]})
    return {"content": content}


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                        text_offset: int) -> dict:
    """Legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (character
    offset of each token, starting at ``text_offset``). Each ``top_logprobs`` dict holds the k most likely tokens
    and the sampled one, so up to k + 1 (OpenAI's and vLLM's rule), keyed by their text. An entry None (the
    first prompt token's, with ``echo``) gives null logprobs (vLLM)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        text = tokenizer.decode([tid])
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry.get(tid, float("-inf"))))
        top = top_k(entry, tid, k)
        if tid not in (t for t, _ in top):
            top.append((tid, entry.get(tid, float("-inf"))))
        out["top_logprobs"].append({tokenizer.decode([t]): _lp(lp) for t, lp in top})
    return out


def prompt_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float] | None],
                    ranks: list[int | None], k: int) -> list[dict[int, dict] | None]:
    """vLLM's ``prompt_logprobs`` response field: per prompt token ``{token_id: {"logprob", "rank",
    "decoded_token"}}``, the prompt token first (its own rank), then the k most likely (ranks 1 .. k; the prompt
    token among them keeps its place first and takes its top-k rank, as vLLM's dict does); None for the first
    token. ``entries`` / ``ranks``: the engine's (``RequestOutput.prompt_logprobs`` / ``prompt_logprob_ranks``)."""
    out: list[dict[int, dict] | None] = []
    for tid, entry, rank in zip(token_ids, entries, ranks):
        if entry is None:
            out.append(None)
            continue
        field = logprob_dict(entry, tid, rank, k, lambda t: tokenizer.decode([t]))
        out.append({t: {"logprob": _lp(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
                    for t, v in field.items()})
    return out


def response_prompt_logprobs(tokenizer: Any, out: Any, k: int) -> list[dict[int, dict] | None] | None:
    """:func:`prompt_logprobs` of a ``RequestOutput`` (its prompt's entries and ranks) with the top ``k``; None
    when the engine computed none."""
    if out.prompt_logprobs is None:
        return None
    return prompt_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, out.prompt_logprob_ranks, k)
