"""The swap pool: integer ids of the CPU blocks that hold the K/V of sequences preempted by swapping (vLLM's
swap space, ``--swap-space`` GiB).

Like the block manager it is pure bookkeeping: the model runner owns the CPU tensors, [num_blocks, block_size,
num_kv_heads, head_dim] per layer for K and V (pinned on CUDA), and copies whole blocks between the two pools
through the (src, dst) block-id pairs the scheduler hands it. A swapped sequence holds one CPU block per KV
block it held, shared prefix blocks included (swap_pool blocks are never shared), in ``seq.swap_table``.
"""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class SwapPool:
    """``num_blocks`` CPU blocks (0 = no swap space: every preemption recomputes).

    Invariant (checked by :meth:`check`): every block id is either in ``free_block_ids`` or in the
    ``swap_table`` of exactly one swapped sequence, once; so once nothing is swapped, every block is free.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"swap pool: need a non-negative number of blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether the pool has a block for every block ``seq`` holds (a sequence without blocks has nothing to
        swap: it is recomputed)."""
        return 0 < len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Give ``seq`` (holding no swap blocks) ``num_blocks`` CPU blocks; returns ``seq.swap_table``.
        Raises RuntimeError when the pool is short; nothing changes then."""
        if seq.swap_table or num_blocks > self.num_free_blocks:
            raise RuntimeError(f"swap pool: cannot give {num_blocks} blocks, {self.num_free_blocks} free")
        seq.swap_table = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        return seq.swap_table

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s swap blocks to the pool (after swap-in, or when a swapped sequence is aborted)."""
        self.free_block_ids.extend(seq.swap_table)
        seq.swap_table = []

    def check(self, seqs=()) -> None:
        """Assert the invariant of the class docstring; ``seqs``: every swapped sequence."""
        held = [b for seq in seqs for b in seq.swap_table]
        assert len(set(held)) == len(held), f"a swap block is held twice: {sorted(held)}"
        assert not set(held) & set(self.free_block_ids), "a swap block is both free and held"
        assert sorted(held + list(self.free_block_ids)) == list(range(self.num_blocks)), "a swap block leaked"
