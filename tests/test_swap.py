"""Swap-space preemption over integer block ids, without a model: the swap pool, the (src, dst) block pairs the
scheduler hands the model runner, and a simulated KV cache that checks those pairs move every token's K/V to
where the block tables say it is. The engine on the demo model is in tests/test_preemption.py."""
from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.swap_pool import SwapPool


def seq(tokens, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(tokens), SamplingParams())


class FakeKV:
    """Both pools as lists of block_size slots; a slot holds the token id whose K/V it would hold. ``step`` does
    what the model runner does with a batch: the swap copies (out, then in), then each row's K/V writes."""

    def __init__(self, num_blocks: int, num_swap_blocks: int, block_size: int):
        self.bs = block_size
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.swap = [[None] * block_size for _ in range(num_swap_blocks)]

    def step(self, batch: ScheduledBatch) -> None:
        for src, dst in batch.blocks_to_swap_out:
            self.swap[dst] = list(self.kv[src])
        for src, dst in batch.blocks_to_swap_in:
            self.kv[dst] = list(self.swap[src])
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                self.kv[s.block_table[p // self.bs]][p % self.bs] = s.token_ids[p]

    def assert_holds(self, s: Sequence) -> None:
        """The pool ``s`` lives in holds the tokens of its computed prefix, in block-table order."""
        pool, table = (self.swap, s.swap_table) if s.status is SequenceStatus.SWAPPED else (self.kv, s.block_table)
        held = [pool[table[p // self.bs]][p % self.bs] for p in range(s.num_computed_tokens)]
        assert held == s.token_ids[:s.num_computed_tokens], f"seq {s.request_id}: K/V not where its table says"


def advance(batch: ScheduledBatch, next_token) -> None:
    for s, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
        s.num_computed_tokens += n
        if samples:
            s.token_ids.append(next_token(s))


def two_decoding(bm: BlockManager, swap_blocks: int) -> tuple[Scheduler, Sequence, Sequence]:
    """``old`` and ``new``, 4 tokens each (two 2-token blocks), prefilled, then one token more each: both need a
    third block and the 4-block pool has none."""
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, swap_pool=SwapPool(swap_blocks))
    old, new = seq([1, 2, 3, 4], "old"), seq([1, 2, 5, 6], "new")
    sched.add(old)
    sched.add(new)
    advance(sched.schedule(), lambda s: 9)
    return sched, old, new


def test_swap_out_then_in_pairs_every_block():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    sched, old, new = two_decoding(bm, swap_blocks=8)
    shared = old.block_table[0]
    assert new.block_table[0] == shared and bm.ref_counts[shared] == 2  # [1, 2] is a prefix-cache hit
    new_blocks = list(new.block_table)
    batch = sched.schedule()
    assert (batch.seqs, batch.num_new_tokens, batch.is_prefill) == ([old], [1], False)
    # the shared block is copied too: the swapped sequence owns a copy of every block it held
    assert batch.blocks_to_swap_out == [(new_blocks[0], 0), (new_blocks[1], 1)] and batch.blocks_to_swap_in == []
    assert new.status is SequenceStatus.SWAPPED and list(sched.swapped) == [new] and not sched.waiting
    assert (new.block_table, new.swap_table, new.num_computed_tokens) == ([], [0, 1], 4)
    assert bm.ref_counts[shared] == 1 and sched.swap_pool.num_free_blocks == 6
    assert (sched.num_preemptions, sched.num_swap_outs, sched.num_swap_ins) == (1, 1, 0)
    bm.check([old])
    sched.swap_pool.check([new])
    advance(batch, lambda s: 9)
    sched.finish(old, "stop")
    batch = sched.schedule()  # blocks are free again: new comes back first, and decodes in the same step
    assert (batch.seqs, batch.num_new_tokens, batch.samples, batch.is_prefill) == ([new], [1], [True], False)
    assert batch.blocks_to_swap_in == [(0, new.block_table[0]), (1, new.block_table[1])]
    assert batch.blocks_to_swap_out == [] and len(new.block_table) == 3 and new.swap_table == []
    assert new.status is SequenceStatus.RUNNING and not sched.swapped
    assert (sched.num_preemptions, sched.num_swap_outs, sched.num_swap_ins) == (1, 1, 1)
    bm.check([new])
    sched.swap_pool.check()
    assert sched.swap_pool.num_free_blocks == 8
    sched.finish(new, "stop")
    bm.check()
    assert bm.num_free_blocks == 4


def test_swap_pool_too_small_falls_back_to_recompute():
    bm = BlockManager(num_blocks=4, block_size=2)
    sched, old, new = two_decoding(bm, swap_blocks=1)  # new holds two blocks, the pool has one
    batch = sched.schedule()
    assert batch.seqs == [old] and batch.blocks_to_swap_out == []
    assert new.status is SequenceStatus.WAITING and list(sched.waiting) == [new] and not sched.swapped
    assert (new.block_table, new.swap_table, new.num_computed_tokens) == ([], [], 0)
    assert (sched.num_preemptions, sched.num_swap_outs) == (1, 0)
    sched.swap_pool.check()
    assert sched.swap_pool.num_free_blocks == 1


def test_aborting_a_swapped_sequence_frees_its_swap_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    sched, old, new = two_decoding(bm, swap_blocks=8)
    sched.schedule()
    assert new.status is SequenceStatus.SWAPPED
    sched.finish(new, "abort")
    assert not sched.swapped and new.swap_table == [] and sched.swap_pool.num_free_blocks == 8
    sched.swap_pool.check()
    bm.check([old])


def test_swap_pool_check_catches_a_leak():
    pool = SwapPool(4)
    s = seq([1])
    pool.allocate(s, 2)
    pool.check([s])
    with pytest.raises(AssertionError, match="leaked"):
        pool.check()  # s's blocks are held by no sequence given
    with pytest.raises(RuntimeError, match="cannot give 3 blocks, 2 free"):
        pool.allocate(seq([2]), 3)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
@pytest.mark.parametrize("swap_blocks", [64, 3], ids=["swap", "small-swap"])
def test_random_traffic_moves_kv_where_the_tables_say(chunked, swap_blocks):
    """Sequences sharing prefixes arrive, prefill (in chunks or whole), decode, get swapped out and in or
    recomputed, and finish; after every step each sequence's K/V (simulated) is where its block table or swap
    table says, both pools keep their invariants, and at the end every block of both is free."""
    rng = random.Random(11)
    bs, num_blocks = 4, 16
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16 if chunked else 64,
                      enable_chunked_prefill=chunked,
                      swap_pool=SwapPool(swap_blocks))
    kv = FakeKV(num_blocks, swap_blocks, bs)
    system = [rng.randrange(50) for _ in range(8)]
    arrivals = [seq(system[:rng.choice([0, 4, 8])] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))], str(i))
                for i in range(40)]
    target = {s.request_id: rng.randrange(1, 24) for s in arrivals}
    finished = 0
    while arrivals or sched.has_unfinished():
        if arrivals and rng.random() < 0.6:
            sched.add(arrivals.pop(0))
        batch = sched.schedule()
        if batch is None:
            continue
        assert not (batch.blocks_to_swap_out and batch.blocks_to_swap_in)
        kv.step(batch)
        advance(batch, lambda s: rng.randrange(50))
        for s in batch.seqs:
            if s.num_output_tokens >= target[s.request_id] and not s.is_finished:
                sched.finish(s, "length")
                finished += 1
        for s in (*sched.running, *sched.swapped):
            kv.assert_holds(s)
        assert all(not s.swap_table for s in (*sched.running, *sched.waiting))
        assert all(not s.block_table and s.swap_table for s in sched.swapped)
        bm.check(list(sched.running))
        sched.swap_pool.check(list(sched.swapped))
    assert finished == 40 and sched.num_swap_ins == sched.num_swap_outs > 0
    if swap_blocks == 3:  # some victims held more blocks than the pool has: recomputed
        assert sched.num_preemptions > sched.num_swap_outs
    else:
        assert sched.num_preemptions == sched.num_swap_outs
    assert bm.num_free_blocks == num_blocks and sorted(bm.free_block_ids) == list(range(num_blocks))
    assert sorted(sched.swap_pool.free_block_ids) == list(range(swap_blocks))
