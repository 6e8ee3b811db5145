"""Block manager and scheduler over integer block ids, without a model."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def seq(n_tokens: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(n_tokens)), SamplingParams())


def held(*seqs: Sequence) -> int:
    return sum(len(s.block_table) for s in seqs)


def test_allocate_covers_every_token_and_free_returns_all():
    bm = BlockManager(num_blocks=10, block_size=16)
    a, b = seq(16), seq(17)
    bm.allocate(a)
    bm.allocate(b)
    assert (len(a.block_table), len(b.block_table)) == (1, 2)
    assert bm.num_free_blocks + held(a, b) == 10
    assert len(set(a.block_table) | set(b.block_table)) == 3
    b.token_ids += [0] * 15  # 32 tokens: still 2 blocks
    bm.allocate(b)
    assert len(b.block_table) == 2
    b.token_ids.append(0)  # 33 tokens: a third block
    bm.allocate(b)
    assert len(b.block_table) == 3
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10 and a.block_table == [] and b.num_computed_tokens == 0


def test_allocate_refuses_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(9)
    assert not bm.can_allocate(bm.blocks_missing(s))
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(s)
    assert bm.num_free_blocks == 2


def test_scheduler_prefills_then_decodes_within_max_num_seqs():
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=4096)
    seqs = [seq(5, str(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == seqs[:2]
    for s in batch.seqs:
        s.num_computed_tokens = len(s)
        s.token_ids.append(1)
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == seqs[:2]
    sched.finish(seqs[0], "stop")
    batch = sched.schedule()  # the waiting one joins as soon as a slot frees
    assert batch.is_prefill and batch.seqs == [seqs[2]]
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].block_table == []


def test_token_budget_splits_prefills():
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=20)
    for i in range(3):
        sched.add(seq(10, str(i)))
    assert len(sched.schedule().seqs) == 2


def test_decode_preempts_newest_when_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4096)
    old, new = seq(4, "old"), seq(4, "new")
    sched.add(old)
    sched.add(new)
    assert sched.schedule().seqs == [old, new]
    for s in (old, new):
        s.num_computed_tokens = len(s)
        s.token_ids.append(1)  # both now need a second block; only one can have it
    batch = sched.schedule()
    assert batch.seqs == [old] and not batch.is_prefill
    assert list(sched.waiting) == [new] and new.status is SequenceStatus.WAITING and new.block_table == []
    assert sched.num_preemptions == 1
    assert bm.num_free_blocks + held(old, new) == 2
