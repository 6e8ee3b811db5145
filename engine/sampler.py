"""Turning logits into next tokens with vLLM's semantics, one batch at a time on the logits' device.

Order (vLLM ``Sampler``): logit_bias, allowed_token_ids, min_tokens mask on stop tokens, repetition / presence /
frequency penalties, temperature, top-k, top-p, min-p, then sample (a structured output's grammar mask comes
before, in the model runner: ``structured_output.apply_masks``). Temperature 0 is greedy (arg-max of the
penalised logits). Every step is a tensor operation over the rows that need it, so a batch of 256 sampled
requests costs a few kernels and no host sync, not 256 row loops on the CPU (host lists go over by non-blocking copies,
:func:`to_device`; the tokens, and the logprobs asked for, come back by the engine's copies after the step).
Sampling is the exponential race vLLM V1 uses: token = argmax(probs / q) with q ~ Exp(1) drawn per token, which
picks token i with probability probs[i] (Gumbel-max in another form). A request with ``seed`` draws its q from
its own ``torch.Generator``, so its output does not depend on its batch; the others share the engine's
generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Sequence
from kernels import ops


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or numpy array) on ``device`` without a host sync (a non-blocking copy from pinned memory on
    CUDA; torch's ``torch.tensor(values, device=cuda)`` waits for the stream), so that preparing a step never
    waits for the step before (async scheduling)."""
    cuda = device.type == "cuda"
    if not isinstance(values, np.ndarray):
        host = torch.tensor(values, dtype=dtype, pin_memory=cuda)
    else:
        host = torch.from_numpy(values).to(dtype)  # on the CPU it may share the array's memory
        host = host.pin_memory() if cuda else host
    return host.to(device, non_blocking=True) if cuda else host.to(device)


def _stop_ids(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """The tokens min_tokens masks (vLLM's ``_apply_min_tokens_penalty``): ``stop_token_ids``, and the EOS ids
    unless ``ignore_eos``."""
    return list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else sorted(eos_token_ids))


_NO_IDS = np.zeros(0, dtype=np.int32)


def penalty_inputs(seqs: list[Sequence], rows: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(rows, offsets, token_ids, params)`` on ``device`` for the penalty kernel (``kernels/penalties.py`` has
    the layout) of rows ``rows`` of a batch of ``seqs``: one int32 host array, one non-blocking copy. The output
    ids are read back ones (each step's made into an array); a prompt goes over (``Sequence.prompt_array``, made
    once) only for a row with a repetition penalty, the only one that reads it."""
    parts = []
    for i in rows:
        seq = seqs[i]
        parts.append(seq.prompt_array if seq.params.repetition_penalty != 1.0 else _NO_IDS)
        parts.append(np.fromiter(seq.output_token_ids, dtype=np.int32))
    count = len(rows)
    offsets = np.zeros(2 * count + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=2 * count), out=offsets[1:])
    params = np.array([[seqs[i].params.repetition_penalty for i in rows],
                       [seqs[i].params.frequency_penalty for i in rows],
                       [seqs[i].params.presence_penalty for i in rows]], dtype=np.float32)
    heads = [np.asarray(rows, dtype=np.int32), offsets, params.view(np.int32).ravel()]
    sizes = [-(-len(h) // 4) * 4 for h in heads]  # each part 16-byte aligned: one kernel variant for every R
    flat = np.zeros(sum(sizes) + int(offsets[-1]), dtype=np.int32)
    at = 0
    for h, size in zip(heads, sizes):
        flat[at:at + len(h)] = h
        at += size
    if parts:
        np.concatenate(parts, out=flat[at:])
    flat = to_device(flat, torch.int32, device)
    a, b, c = np.cumsum(sizes)
    return flat[:count], flat[a:a + 2 * count + 1], flat[c:], flat[b:b + 3 * count].view(torch.float32).view(3, count)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], pending: torch.Tensor | None = None,
                    rows: list[int] | None = None) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties on ``logits`` [S, V] float32, row i for ``seqs[i]``, in place (returned):
    the repetition penalty divides positive and multiplies non-positive logits of every token seen in the prompt
    or the output; then the frequency penalty times each token's count in the output, and the presence penalty
    for each token present in the output, are subtracted. ``rows``: the rows to penalise (host list; None: all).

    ``pending``: int64 [S] on logits' device, row i's pending output token (sampled on the device by the step
    launched before and not read back: async scheduling), or -1; None when no row has one. Token ids come from
    the host (:func:`penalty_inputs`, copied without a sync) and the pending ones from the device, so a penalised
    step never waits for the step before it. On CUDA one Triton launch (``kernels/penalties.py``)."""
    rows = list(range(len(seqs))) if rows is None else rows
    return ops.apply_penalties(logits, *penalty_inputs(seqs, rows, logits.device), pending)


def _penalised(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def process_logits(logits: torch.Tensor, seq: Sequence, eos_token_ids: set[int]) -> torch.Tensor:
    """One row [V] through :func:`process_batch` (the reference the tests read): min_tokens mask, penalties; then,
    unless greedy, temperature, top-k, top-p and min-p as -inf masks."""
    return process_batch(logits[None], [seq], eos_token_ids)[0]


def _put(logits: torch.Tensor, rows: list[dict[int, float]], accumulate: bool) -> None:
    """``logits[i, t] = v`` (``+= v`` with ``accumulate``) for each ``{t: v}`` of row i, in one ``index_put_`` with
    a tensor of values (a Python scalar value would be copied over with a host sync)."""
    where = [(i, t, v) for i, given in enumerate(rows) for t, v in given.items()]
    if not where:
        return
    i, t, v = zip(*where)
    index = (to_device(list(i), torch.int64, logits.device), to_device(list(t), torch.int64, logits.device))
    logits.index_put_(index, to_device(list(v), logits.dtype, logits.device), accumulate=accumulate)


def _allow_only(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` with -inf on each row of a sequence with ``allowed_token_ids`` for every other token (the rows
    without them as they are): one stack of each such sequence's mask, made once per sequence on the device
    (``Sequence.allowed_mask``), no host sync."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.allowed_token_ids]
    if not rows:
        return logits
    keep = torch.stack([_allowed_mask(seqs[i], logits) for i in rows])
    return _map_rows(logits, rows, lambda part: part.masked_fill_(~keep, float("-inf")))


def _allowed_mask(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """``seq``'s allowed tokens as a bool [V] row on ``logits``' device, made at its first use."""
    mask = seq.allowed_mask
    if mask is None or mask.device != logits.device or mask.shape[0] != logits.shape[-1]:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        # index_fill_ takes True as a kernel argument: an index assignment would copy it over with a sync
        mask.index_fill_(0, to_device(seq.params.allowed_token_ids, torch.int64, logits.device), True)
        seq.allowed_mask = mask
    return mask


def _map_rows(logits: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
    """``logits`` with rows ``rows`` (a host list of row numbers) replaced by ``fn(part)`` of them, gathered and
    put back without a sync (in place: the caller owns ``logits``); all rows: ``fn(logits)``, a new tensor."""
    if len(rows) == len(logits):
        return fn(logits)
    idx = to_device(rows, torch.int64, logits.device)
    logits[idx] = fn(logits[idx])
    return logits


def process_batch(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
                  pending: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [S, V] (float32, row i for ``seqs[i]``; not changed in place) in vLLM's order: logit_bias, the
    allowed_token_ids mask, min_tokens mask and penalties on every row; temperature and the filters on the rows
    that are not greedy. ``pending``: as :func:`apply_penalties`, for all S rows. Returns a new tensor."""
    logits = logits.clone()
    # logit_bias first (vLLM V1 applies it with min_tokens, before the penalties), and allowed_token_ids' mask
    _put(logits, [seq.params.logit_bias or {} for seq in seqs], accumulate=True)
    logits = _allow_only(logits, seqs)
    _put(logits, [dict.fromkeys(_stop_ids(seq, eos_token_ids), float("-inf"))
                  if seq.num_output_tokens < seq.params.min_tokens else {} for seq in seqs], accumulate=False)
    penalised = [i for i, seq in enumerate(seqs) if _penalised(seq)]
    if penalised:
        apply_penalties(logits, seqs, pending, penalised)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        logits = _map_rows(logits, sampled, lambda part: filter_batch(part, [seqs[i].params for i in sampled]))
    return logits


def filter_batch(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks, on rows [R, V] float32 (row i with ``params[i]``,
    a SamplingParams that is not greedy). Top-k keeps every token at least as likely as the k-th (ties kept);
    top-p keeps the smallest prefix of the tokens sorted by probability whose mass reaches top_p (the first token
    always); min-p drops tokens below min_p x the top probability. Sorts only when a row asks for top-k / top-p."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = to_device([p.temperature for p in params], logits.dtype, dev)
    logits = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        kth = ordered.gather(1, to_device(top_k, torch.int64, dev)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # still in descending order
        probs = ordered.softmax(-1)
        p_lim = to_device(top_p, logits.dtype, dev)[:, None]
        drop = (probs.cumsum(-1) - probs >= p_lim) & (p_lim < 1.0)
        drop[:, 0] = False  # the most likely token stays, also where top_p rounds to 0 in float32 (1e-46)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(-1)
        floor = to_device(min_p, logits.dtype, dev)[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


#: the token ``sample`` returns for a sequence whose processed distribution is empty or not finite (its own
#: parameters did it: all tokens masked by min_tokens + stop_token_ids, or an overflowing penalty); the engine
#: fails that request alone.
INVALID = -1


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
                  generator: torch.Generator | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
    """One next token per sequence, int64 [S] on logits' device, without a host sync (``INVALID`` for a sequence
    with no valid distribution). logits: float32 [S, V], row i belonging to ``seqs[i]``. ``generator``: on
    logits' device, for the rows without a seed (None: torch's default); a seeded sequence's ``generator`` is on
    logits' device too. ``pending``: int64 [S] on logits' device, each row's pending token or -1 (what the
    penalties count beside the token ids read back; None: no row has one)."""
    if all(_plain_greedy(s) for s in seqs):
        return torch.argmax(logits, dim=-1)
    processed = process_batch(logits.float(), seqs, eos_token_ids, pending)
    if all(s.params.greedy for s in seqs):  # penalised, biased or masked greedy rows: no race to draw
        return torch.where(torch.isfinite(processed.amax(-1)), processed.argmax(-1), INVALID)  # amax keeps NaN
    probs = processed.softmax(-1)
    valid = torch.isfinite(probs).all(-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    for i, seq in enumerate(seqs):
        if seq.generator is not None and not seq.params.greedy:  # seeded: its own stream (on q's device)
            q[i].exponential_(generator=seq.generator)
    greedy = to_device([s.params.greedy for s in seqs], torch.bool, logits.device)
    race = torch.where(greedy[:, None], processed, probs / q.clamp_min(torch.finfo(q.dtype).tiny))
    return torch.where(valid, race.argmax(-1), INVALID)


@dataclass
class StepLogprobs:
    """The logprobs a step's rows asked for, computed on the logits' device and read back with the tokens:
    ``rows`` (their positions among the step's sampling rows), ``k`` (each one's ``logprobs``), ``chosen`` float32
    [W] (the sampled token's), ``top_values`` float32 [W, K] and ``top_ids`` int64 [W, K] (the K = max(k) most
    likely tokens', descending); ``ranks`` int64 [W] when asked for: each row's token's rank, the count of tokens
    at least as likely (1 = the most likely; vLLM's ``Logprob.rank``). Natural-log probabilities of the raw model
    distribution (vLLM's raw logprobs)."""

    rows: list[int]
    k: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    ranks: torch.Tensor | None = None

    def to(self, host) -> StepLogprobs:
        """The same on the host: each tensor copied by ``host`` (a function of one tensor)."""
        return StepLogprobs(self.rows, self.k, host(self.chosen), host(self.top_values), host(self.top_ids),
                            None if self.ranks is None else host(self.ranks))

    def entries(self, tokens: list[int]) -> list[tuple[dict[int, float], int | None] | None]:
        """One entry per sampling row of the step (``tokens``: its sampled ids, read back): ({sampled token: its
        logprob, then the top ``k``}, the sampled token's rank or None when not computed), or None for a row that
        did not ask or could not sample (``INVALID``)."""
        out: list[tuple[dict[int, float], int | None] | None] = [None] * len(tokens)
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        ranks = self.ranks.tolist() if self.ranks is not None else [None] * len(self.rows)
        for row, (i, k) in enumerate(zip(self.rows, self.k)):
            if tokens[i] != INVALID:
                out[i] = ({tokens[i]: chosen[row], **dict(zip(ids[row][:k], values[row][:k]))}, ranks[row])
        return out


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> StepLogprobs | None:
    """The logprobs of the rows of ``seqs`` that asked for them (``logits`` [S, V], ``tokens`` int64 [S] from
    :func:`sample_tokens`), with the sampled tokens' ranks (vLLM's ``Logprob.rank``), on the logits' device
    without a host sync; None when no row asked."""
    rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if not rows:
        return None
    idx = to_device(rows, torch.int64, logits.device)
    return logprobs_of(logits[idx], tokens[idx].clamp_min(0), rows, [seqs[i].params.logprobs or 0 for i in rows],
                       ranks=True)


#: rows of [rows, V] a rank count compares at a time (``logprobs_of``): 32 x 152k x 9 bytes = 44 MB of temporaries
RANK_ROWS = 32


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: list[int],
                ranks: bool = False) -> StepLogprobs:
    """:class:`StepLogprobs` of logits [W, V] (row j: ``rows[j]``, asking for ``k[j]``): the log-softmax, each
    row's ``tokens`` (int64 [W]) logprob and the top max(k), and with ``ranks`` each token's rank (ties count
    ahead, as vLLM counts), on the logits' device without a host sync."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top_values, top_ids = torch.topk(logp, max(k)) if max(k) else (logp[:, :0], logp[:, :0].long())
    rank = None
    if ranks:  # by slices of rows: the comparison's bool [rows, V] and the sum's int64 one stay small
        parts = [(lp >= c[:, None]).sum(-1) for lp, c in zip(logp.split(RANK_ROWS), chosen.split(RANK_ROWS))]
        rank = parts[0] if len(parts) == 1 else torch.cat(parts)  # a decode step of <= 32 rows: no copy
    return StepLogprobs(rows, k, chosen, top_values, top_ids, rank)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
           generator: torch.Generator | None = None, pending: torch.Tensor | None = None) -> list[int]:
    """:func:`sample_tokens` read back to the host, and each sequence's logprobs entry appended when it asked for
    logprobs (:class:`StepLogprobs`). The engine reads the two back later instead (``model_runner.LaunchedStep``);
    this is the same at once."""
    tokens = sample_tokens(logits, seqs, eos_token_ids, generator, pending)
    logprobs = step_logprobs(logits, tokens, seqs)
    tokens = tokens.tolist()
    for seq, entry in zip(seqs, logprobs.entries(tokens) if logprobs else []):
        if entry is not None:
            seq.add_logprobs(*entry)
    return tokens


def penalised_pending(seq: Sequence) -> bool:
    """Whether ``seq``'s penalties must count a pending token (its id is still on the device)."""
    return seq.num_pending_tokens > 0 and _penalised(seq)


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and seq.logprobs is None and seq.num_output_tokens >= p.min_tokens and not _penalised(seq)
            and not p.logit_bias and not p.allowed_token_ids)
