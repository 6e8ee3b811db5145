"""The block manager: hands out integer KV-cache block ids to sequences (PagedAttention, Kwon et al. 2023).

The GPU (or CPU) never sees this bookkeeping: only the block tables and slot mappings the model runner builds
from it.
"""
from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` token slots each.

    Invariant: every block id is either in the free queue or in exactly one running sequence's block table,
    so ``num_free_blocks + sum(len(seq.block_table)) == num_blocks`` at all times (checked by tests after every
    finish and abort).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_missing(self, seq: Sequence) -> int:
        """How many more blocks ``seq`` needs to hold the K/V of all its tokens."""
        return max(0, seq.num_blocks_needed(self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Grow ``seq.block_table`` to cover every token of ``seq``.

        Raises RuntimeError when the pool is short (callers check :meth:`can_allocate` first).
        """
        missing = self.blocks_missing(seq)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            seq.block_table.append(self.free_block_ids.popleft())

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool and forget its cached tokens."""
        self.free_block_ids.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def block_states(self) -> str:
        """One character per block: ``.`` free, ``#`` used."""
        states = ["#"] * self.num_blocks
        for block_id in self.free_block_ids:
            states[block_id] = "."
        return "".join(states)
