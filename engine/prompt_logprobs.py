"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``; what OpenAI completions return for the prompt with
``echo`` and ``logprobs``): the log-probability of each prompt token given the tokens before it, its rank, and the
top-k at its position, from the hidden states a prefill step computes anyway.

Prompt token t (t >= 1) is predicted by the hidden row of position t - 1. A prefill chunk of positions
[start, end) therefore holds the rows of tokens [start + 1, end + 1), cut to the prompt and to those not launched
before (``Sequence.num_prompt_logprobs``). The LM head runs on at most :data:`ROWS_PER_PASS` rows at a time, so a
long prompt's [rows, V] logits stay small (256 x 152k x 4 bytes: 156 MB). Natural-log probabilities of the raw
model distribution (no penalties or temperature), like the sampled tokens' logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.memory import PROMPT_LOGPROBS_ROWS
from engine.sampler import StepLogprobs, logprobs_of, to_device
from engine.sequence import Sequence

#: LM-head rows per pass (the memory plan counts its buffers: engine/memory.py)
ROWS_PER_PASS = PROMPT_LOGPROBS_ROWS


@dataclass
class PromptChunk:
    """The entries of prompt tokens [first, first + n) of ``seq``: ``logprobs`` row i for token first + i (each
    prompt token's logprob and the top k at its position), on the device until :meth:`to` copies them."""

    seq: Sequence
    first: int
    logprobs: StepLogprobs

    def to(self, host) -> PromptChunk:
        """The same with each tensor copied by ``host`` (a function of one tensor)."""
        return PromptChunk(self.seq, self.first, self.logprobs.to(host))

    def fill(self) -> None:
        """Write the entries ({prompt token: its logprob, then the top k}) into ``seq.prompt_logprobs`` and the
        tokens' ranks into ``seq.prompt_logprob_ranks`` (read back first: the tensors are on the host)."""
        end = self.first + len(self.logprobs.rows)
        entries = self.logprobs.entries(self.seq.token_ids[self.first:end])
        self.seq.prompt_logprobs[self.first:end] = [entry for entry, _ in entries]
        self.seq.prompt_logprob_ranks[self.first:end] = [rank for _, rank in entries]
        self.seq.num_prompt_logprobs_read += end - self.first


def rows_to_launch(seqs: list[Sequence], num_new_tokens: list[int]) -> list[tuple[Sequence, int, int, int]]:
    """For a prefill batch (``seqs`` in batch order, their chunks of ``num_new_tokens`` positions one after the
    other in the step's hidden rows): (seq, first prompt token, count, its hidden row) per sequence with prompt
    logprobs to launch here; advances ``num_prompt_logprobs`` past them."""
    plan, row = [], 0
    for seq, n in zip(seqs, num_new_tokens):
        start = seq.num_computed_tokens
        if seq.wants_prompt_logprobs:
            first = max(start + 1, seq.num_prompt_logprobs)
            end = min(start + n + 1, seq.num_prompt_tokens)
            if first < end:
                plan.append((seq, first, end - first, row + first - 1 - start))
                seq.num_prompt_logprobs = end
        row += n
    return plan


def launch(model, hidden: torch.Tensor, plan: list[tuple[Sequence, int, int, int]]) -> list[PromptChunk]:
    """The chunks of ``plan`` (:func:`rows_to_launch`) from the step's hidden states [T, H], on their device,
    without a host sync: the LM head, log-softmax, the prompt tokens' logprobs and the top-k, a pass per
    :data:`ROWS_PER_PASS` rows."""
    chunks = []
    for seq, first, count, row in plan:
        k = seq.params.prompt_logprobs
        for lo in range(0, count, ROWS_PER_PASS):
            n = min(ROWS_PER_PASS, count - lo)
            target = to_device(seq.token_ids[first + lo:first + lo + n], torch.int64, hidden.device)
            logits = model.compute_logits(hidden[row + lo:row + lo + n])
            chunks.append(PromptChunk(seq, first + lo, logprobs_of(logits, target, list(range(n)), [k] * n,
                                                                    ranks=True)))
    return chunks
