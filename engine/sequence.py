"""One sequence: the prompt and the tokens generated so far for one completion (choice) of a request."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Token ids and KV-cache bookkeeping of one completion.

    Invariants: ``token_ids`` = prompt + generated tokens; ``num_computed_tokens`` <= ``len(token_ids)`` counts
    the tokens whose K/V are in the cache (when a sequence is scheduled for prefill it starts at the prefix-cache
    hit, a multiple of the block size, always below ``len(token_ids)``); ``block_table`` holds exactly the blocks
    covering those tokens plus those allocated for the tokens of the step being run
    (``len(block_table) * block_size >= len(token_ids)`` while running, empty when waiting or finished); blocks
    may be shared with other sequences (reference counts in the block manager).
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
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks needed to hold the K/V of every token in ``token_ids``."""
        return (len(self.token_ids) + block_size - 1) // block_size
