"""Continuous batching: which sequences run in the next step (Yu et al., Orca, OSDI 2022; vLLM's scheduler).

A step is either a prefill step (new sequences' prompts, up to the token budget) or a decode step (one token
for every running sequence). New sequences join between steps and finished ones leave at once. When the KV
pool runs out during decode, the newest running sequence is preempted by recompute: its blocks are freed and
it goes back to the front of the waiting queue, to be prefilled again (prompt + tokens generated so far). Its
full blocks stay in the prefix cache until evicted, so the new prefill usually starts after them; on the CPU path
a recomputed token's K/V and logits equal the decoded ones bit for bit (tests/test_preemption.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    """Pure Python over integer block ids; invariant: ``len(running) <= max_num_seqs`` and every running
    sequence holds blocks for all of its tokens once its step is scheduled."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run."""
        prefill = self._schedule_prefill()
        if prefill:
            return ScheduledBatch(prefill, is_prefill=True)
        decode = self._schedule_decode()
        return ScheduledBatch(decode, is_prefill=False) if decode else None

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled, tokens = [], 0
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = len(seq) - seq.num_computed_tokens
            if scheduled and tokens + new_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(self.block_manager.blocks_missing(seq)):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            scheduled.append(seq)
            tokens += new_tokens
        self.running.extend(scheduled)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_allocate(self.block_manager.blocks_missing(seq)):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.allocate(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished ("stop" | "length" | "abort"), take it out of the queues, free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
