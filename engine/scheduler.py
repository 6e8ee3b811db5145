"""Continuous batching: which sequences run in the next step, and how many tokens each computes (Yu et al., Orca,
OSDI 2022; vLLM's scheduler).

Two policies, picked by ``enable_chunked_prefill``:

* chunked prefill (vLLM V1, the engine's default): every running decode takes one token of the step's budget
  (``max_num_batched_tokens``) first; what is left goes to the next chunk of each partly prefilled sequence, then
  to swapped-out sequences and new ones. A prompt longer than what is left is split across steps: a chunk
  computes tokens ``[num_computed_tokens, num_computed_tokens + chunk)``, and a sequence samples its next token
  only in the step whose chunk reaches its last token. A step is then *mixed* (decode rows and prefill chunks).
* without it (vLLM V0's default): a step either prefills whole prompts (new sequences first, up to the budget)
  or decodes every running sequence.

Async scheduling (llm_engine.py): a running sequence whose pending token is its last (max_tokens, max_model_len)
is left out of the step and out of preemption; the read-back of the step before finishes it.

Preemption. When the KV pool runs out, the newest running sequence not yet scheduled in this step is preempted
(the sequence itself when none is left). With swap space (``swap_pool``) that has a block for each of its blocks,
it is *swapped out*: its K/V is copied to the CPU pool and it waits in ``swapped``, to be swapped back in (fresh
blocks, copied back) before any new sequence is admitted. Otherwise it is *recomputed*: its blocks are freed and
it goes back to the front of the waiting queue, to be prefilled again (prompt + tokens generated so far). Its
full blocks stay in the prefix cache until evicted, so the new prefill usually starts after them; on the CPU path
a recomputed token's K/V and logits equal the decoded ones bit for bit (tests/test_preemption.py). A step that
preempts swaps nothing in and admits no new sequence, so a step has swap-outs or swap-ins, never both.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.swap_pool import SwapPool


@dataclass
class ScheduledBatch:
    """One step's work, in batch order (chunked prefill: decodes first).

    ``seqs[i]`` computes ``num_new_tokens[i]`` tokens from its ``num_computed_tokens`` on; ``samples[i]`` says
    whether that reaches its last token, so that the step samples a token for it (a prefill chunk that does not
    gets none). ``is_prefill``: some row computes more than its last token (the model runner runs the step
    through the prefill path: eagerly, or from a prefill CUDA graph, up to 256 tokens of 64 sequences; a
    pure decode step may replay a decode graph).
    ``blocks_to_swap_out``: (KV block, swap block) pairs; ``blocks_to_swap_in``: (swap block, KV block) pairs;
    the model runner copies them, swap-outs first, before the forward pass. ``seqs`` may be empty when the step
    only swaps out.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    is_prefill: bool = False
    num_batched_tokens: int = 0
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        samples = num_new_tokens == seq.num_uncomputed_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(samples)
        self.is_prefill |= not (samples and num_new_tokens == 1)
        self.num_batched_tokens += num_new_tokens


class Scheduler:
    """Pure Python over integer block ids.

    Invariants: ``len(running) <= max_num_seqs``; every running sequence holds blocks for its computed tokens
    and, once scheduled, for the tokens of its step; a step computes at most ``max_num_batched_tokens`` tokens
    (without chunked prefill, a whole prompt that alone exceeds it is never scheduled); waiting sequences hold no
    blocks, swapped ones hold swap blocks only. ``enable_chunked_prefill=False`` and no swap pool are the
    defaults here; the engine passes ``EngineConfig``'s (chunked prefill on by default).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = False, swap_pool: SwapPool | None = None,
                 max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swap_pool = swap_pool or SwapPool(0)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.swapped: deque[Sequence] = deque()
        #: Cumulative counts: preemptions of both kinds, and the swap-outs and swap-ins among them.
        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run."""
        batch = ScheduledBatch()
        if self.enable_chunked_prefill:
            self._schedule_running(batch)
            if not batch.num_preempted:
                self._schedule_swapped(batch)
                if not self.swapped:
                    self._schedule_waiting(batch)
        else:
            if not self.swapped:
                self._schedule_waiting(batch)
            if not batch.seqs:
                self._schedule_running(batch)
                if not batch.num_preempted:
                    self._schedule_swapped(batch)
        return batch if batch.seqs or batch.blocks_to_swap_out else None

    def _chunk(self, seq: Sequence, num_computed_tokens: int, batch: ScheduledBatch) -> int:
        """Tokens ``seq`` computes in this step if it starts at ``num_computed_tokens``: all it lacks, or, with
        chunked prefill, as many as the budget has left; 0 when they do not fit."""
        wanted = len(seq) - num_computed_tokens
        left = self.max_num_batched_tokens - batch.num_batched_tokens
        return min(wanted, left) if self.enable_chunked_prefill or wanted <= left else 0

    def _schedule_running(self, batch: ScheduledBatch) -> None:
        """Decodes first (one token each), then the next chunk of each partial prefill, oldest first, within the
        budget; when the pool is short, preempt the newest sequence not yet scheduled (itself when none is)."""
        bm = self.block_manager
        # a sequence whose pending token is its last (async scheduling) gets no step, no block, and is never a
        # victim: it stays running until its read-back finishes it
        done = [s for s in self.running if self._ends_with_pending(s)]
        pending = deque(sorted((s for s in self.running if not self._ends_with_pending(s)),
                               key=lambda s: s.num_uncomputed_tokens > 1))  # stable: decodes first
        self.running.clear()
        self.running.extend(done)
        while pending:
            seq = pending[0]
            n = self._chunk(seq, seq.num_computed_tokens, batch)
            if n == 0:
                break
            pending.popleft()
            while not bm.can_allocate(bm.blocks_missing(seq, seq.num_computed_tokens + n)):
                victim = pending.pop() if pending else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, seq.num_computed_tokens + n)
                batch.add(seq, n)
                self.running.append(seq)
        self.running.extend(pending)  # not scheduled in this step: the budget ran out

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """Whether ``seq``'s pending token (async scheduling) is its last one: max_tokens or max_model_len."""
        if not seq.num_pending_tokens:
            return False
        limit = seq.params.max_tokens if seq.params.max_tokens is not None else self.max_model_len
        return (limit is not None and seq.num_output_tokens >= limit) or \
            (self.max_model_len is not None and len(seq) >= self.max_model_len)

    def _schedule_swapped(self, batch: ScheduledBatch) -> None:
        """Swap sequences back in, oldest preempted first, while the pool has blocks for their K/V and their
        next tokens; they run in this step."""
        bm = self.block_manager
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = self._chunk(seq, seq.num_computed_tokens, batch)
            needed = max(len(seq.swap_table), bm.blocks_for_tokens(seq.num_computed_tokens + n))
            if n == 0 or not bm.can_allocate(needed):
                break
            self.swapped.popleft()
            blocks = bm.swap_in(seq, len(seq.swap_table))
            batch.blocks_to_swap_in += zip(seq.swap_table, blocks)
            self.swap_pool.free(seq)
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            batch.add(seq, n)
            self.running.append(seq)
            self.num_swap_ins += 1

    def _schedule_waiting(self, batch: ScheduledBatch) -> None:
        """Admit new (or recompute-preempted) sequences, first come first served, from their prefix-cache hit on,
        while the budget, ``max_num_seqs`` and the pool allow."""
        bm = self.block_manager
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            start = bm.num_cached_prefix_tokens(seq)
            n = self._chunk(seq, start, batch)
            if n == 0 or not bm.can_allocate(bm.blocks_missing(seq, start + n)):
                break
            self.waiting.popleft()
            bm.allocate(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            batch.add(seq, n)
            self.running.append(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Swap ``seq`` out when the swap pool has room for all its blocks, else free them for recompute."""
        batch.num_preempted += 1
        self.num_preemptions += 1
        if self.swap_pool.can_swap_out(seq):
            swap_blocks = self.swap_pool.allocate(seq, len(seq.block_table))
            batch.blocks_to_swap_out += zip(self.block_manager.swap_out(seq), swap_blocks)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.num_swap_outs += 1
        else:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished ("stop" | "length" | "abort"), take it out of the queues, free its blocks (KV and
        swap)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        self.swap_pool.free(seq)
