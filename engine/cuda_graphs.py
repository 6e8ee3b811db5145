"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over persistent input buffers.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch gaps
(vLLM's ``CUDAGraphRunner``). Invariants: the captured kernels never sync with the host and never autotune
(they are warmed up once per bucket before capture); the buffers below are the only inputs and ``hidden`` the
only output, so a step copies its inputs in, replays, and reads ``hidden[:n]``. Padding rows of a bucket
write to slot -1 (skipped) and attend over one token of block 0, so they touch no live KV.
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (rounded up)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else [max_num_seqs]
    return sorted(set(buckets))


class DecodeGraphs:
    """Captured decode graphs of ``model`` for every bucket, sharing one memory pool and one set of buffers.

    Buffers (on the model's device): input_ids int64 [B], positions int64 [B], slot_mapping int64 [B],
    block_tables int32 [B, max_blocks], context_lens int32 [B], hidden [B, hidden_size] in the model dtype,
    where B is the largest bucket.
    """

    def __init__(self, model, max_num_seqs: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:n],
                                 block_tables=self.block_tables[:n], context_lens=self.context_lens[:n])

    def _run(self, n: int) -> None:
        self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n], self._meta(n))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for n in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            self._run(n)  # warm up: compiles and autotunes every kernel for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(n)
            pool = pool or graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None when n exceeds every bucket."""
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Run one decode step of n sequences through the bucket's graph; returns hidden [n, hidden_size]."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bucket] = -1
        self.block_tables[:n, :width] = meta.block_tables
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bucket] = 1
        self.graphs[bucket].replay()
        return self.hidden[:n]
