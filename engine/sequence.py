"""One sequence: the prompt and the tokens generated so far for one completion (choice) of a request."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids and KV-cache bookkeeping of one completion.

    Length: ``len(seq)`` = ``len(token_ids) + num_pending_tokens``. A *pending* token was sampled on the device
    by a launched step whose result the engine has not read back yet (async scheduling, llm_engine.py): the
    scheduler and the block manager count it (the next step computes its K/V, its id reaching the model from the
    device), while ``token_ids``, the outputs and the detokenizer hold only tokens read back. At most one is
    pending when a step is scheduled, and it came from the step launched just before.

    Invariants: ``token_ids`` = prompt + generated tokens; ``num_computed_tokens`` <= ``len(seq)`` counts
    the tokens whose K/V are in the cache (when a sequence is scheduled for prefill it starts at the prefix-cache
    hit, a multiple of the block size, always below ``len(token_ids)``; with chunked prefill it stays below
    ``len(token_ids) - 1`` until the prompt's last chunk is computed, and no token is sampled before);
    ``block_table`` holds exactly the blocks covering those tokens plus those allocated for the tokens of the step
    being run (empty when waiting, swapped or finished); blocks may be shared with other sequences (reference
    counts in the block manager). While SWAPPED, ``swap_table`` holds the CPU swap blocks (swap_pool.py) with the
    K/V of its ``num_computed_tokens`` tokens, one per block it held; otherwise it is empty.
    ``num_cached_tokens``: prefix-cache hit (tokens) of its first scheduling; -1 before it.

    Logprobs (``params.logprobs``): ``logprobs`` holds one entry per generated token read back ({sampled token:
    logprob, then the top k}), ``logprob_ranks`` the sampled token's rank alike (1 = the most likely) and
    ``cumulative_logprob`` the sum of the sampled tokens' logprobs; all three None when not asked.

    Prompt logprobs (``params.prompt_logprobs``, computed for choice 0 only: the choices share the prompt):
    ``prompt_logprobs`` holds one entry per prompt token, None for the first (nothing predicts it) and until read
    back, and ``prompt_logprob_ranks`` each one's rank alike (1 = the most likely token); ``num_prompt_logprobs``
    counts the prompt tokens whose entry is launched (from 1), so a prefill run again after a recompute preemption
    does not launch them twice, and ``num_prompt_logprobs_read`` those read back. Until the first reaches
    ``num_prompt_tokens`` the sequence takes no prefix-cache hit (every position must be computed; vLLM does the
    same).
    """

    request_id: str
    index: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    logprob_ranks: list[int] | None = None
    cumulative_logprob: float | None = None
    num_pending_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    matcher: Any = None  # structured outputs: the grammar matcher of this choice (engine/structured_output.py)
    #: params.allowed_token_ids as a bool [V] row on the logits' device (the sampler's; not in repr: printing a
    #: CUDA tensor waits for the device)
    allowed_mask: Any = field(default=None, repr=False)
    num_prompt_logprobs: int = 1
    num_prompt_logprobs_read: int = 1
    _prompt_array: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.logprobs is not None:
            self.logprobs, self.logprob_ranks, self.cumulative_logprob = [], [], 0.0
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
            self.prompt_logprob_ranks = [None] * self.num_prompt_tokens

    def add_logprobs(self, entry: dict[int, float], rank: int | None) -> None:
        """The logprobs entry of the token just appended: {it: its logprob, then the top k}, and its rank."""
        self.logprobs.append(entry)
        self.logprob_ranks.append(rank)
        self.cumulative_logprob += next(iter(entry.values()))

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt's token ids, int32 numpy [num_prompt_tokens], made once (the prompt never changes): what the
        repetition penalty reads every step (``sampler.apply_penalties``)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int32)
        return self._prompt_array

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt token's logprob is still to be launched."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens

    @property
    def prompt_logprobs_ready(self) -> bool:
        """Whether every prompt entry asked for is read back (True when none was asked)."""
        return self.prompt_logprobs is None or self.num_prompt_logprobs_read >= self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included (what min_tokens and the scheduler count)."""
        return len(self) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        """The last token read back (the model's next input unless a token is pending)."""
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled: 1 for a decode, more for a prefill."""
        return len(self) - self.num_computed_tokens
