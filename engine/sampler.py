"""Turning logits into next tokens with vLLM's semantics.

Order (vLLM ``Sampler``): min_tokens mask on stop tokens, repetition / presence / frequency penalties,
temperature, top-k, top-p, min-p, then sample. Temperature 0 is greedy (arg-max of the penalised logits).
A request with ``seed`` draws from its own ``torch.Generator`` so its output does not depend on its batch.
"""
from __future__ import annotations

import torch

from engine.sequence import Sequence


def mask_min_tokens(logits: torch.Tensor, seq: Sequence, eos_token_ids: set[int]) -> torch.Tensor:
    """Until ``seq`` has ``min_tokens`` output tokens, its stop tokens (``stop_token_ids``, and the EOS ids unless
    ``ignore_eos``) get -inf so they cannot be sampled (vLLM's ``_apply_min_tokens_penalty``). logits: [V]."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return logits
    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    logits = logits.clone()
    logits[stop_ids] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties on one row [V]: the repetition penalty divides positive and multiplies
    negative logits of every token seen in the prompt or the output; then the frequency penalty times each token's
    count in the output, and the presence penalty for each token present in the output, are subtracted."""
    p = seq.params
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return logits
    out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
    counts = torch.bincount(out_ids, minlength=logits.shape[-1]).to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(seq.token_ids, dtype=torch.long, device=logits.device)] = True
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, seq: Sequence, eos_token_ids: set[int]) -> torch.Tensor:
    """One row [V] in vLLM's order: min_tokens mask, penalties; then, unless greedy, temperature, top-k, top-p
    and min-p. The next token is the arg-max (greedy) or a draw from the softmax of the result."""
    logits = apply_penalties(mask_min_tokens(logits, seq, eos_token_ids), seq)
    return logits if seq.params.greedy else _filter(logits, seq)


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits: float32 [V]."""
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


#: the token ``sample`` returns for a sequence whose processed distribution is empty or not finite (its own
#: parameters did it: all tokens masked by min_tokens + stop_token_ids, or an overflowing penalty); the engine
#: fails that request alone.
INVALID = -1


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> list[int]:
    """One next token per sequence (``INVALID`` for a sequence with no valid distribution).

    logits: float32 [S, V] on any device, row i belonging to ``seqs[i]``. Also appends each sequence's logprobs entry when it
    asked for logprobs (natural-log probabilities of the raw model distribution: the sampled token and the
    ``logprobs`` most likely ones).
    """
    if all(_plain_greedy(s) for s in seqs):
        return torch.argmax(logits, dim=-1).tolist()  # one device-to-host copy for the whole batch
    logits = logits.cpu()
    tokens = []
    for row, seq in zip(logits, seqs):
        processed = process_logits(row, seq, eos_token_ids)
        probs = processed.softmax(-1)
        if not bool(torch.isfinite(probs).all()):  # every token masked, or penalties that overflow: no choice
            tokens.append(INVALID)
            continue
        if seq.params.greedy:
            token = int(torch.argmax(processed))
        else:
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        tokens.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(_logprobs_entry(row, token, seq.params.logprobs or 0))
    return tokens


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and seq.logprobs is None and seq.num_output_tokens >= p.min_tokens
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


def _logprobs_entry(raw: torch.Tensor, token: int, top: int) -> dict[int, float]:
    logp = torch.log_softmax(raw.float(), -1)
    entry = {token: float(logp[token])}
    if top:
        values, ids = torch.topk(logp, top)
        entry.update({int(i): float(v) for i, v in zip(ids, values)})
    return entry
