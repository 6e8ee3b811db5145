"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed over persistent input buffers.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch gaps
(vLLM's ``CUDAGraphRunner``). Invariants: the captured kernels never sync with the host and never autotune
(they are warmed up once per bucket before capture); the buffers below are the only inputs (besides the W4A16
GEMV's split-K counters, which every replay leaves at 0, and the model runner's ``last_tokens``, the previous
step's sampled ids on the device) and ``hidden`` the only output, so a step copies its inputs in (one
host-to-device copy of the bucket's part), replays, and reads ``hidden[:n]``. A row whose input token is still
pending on the device (async scheduling) reads it from ``last_tokens[prev_rows[row]]`` inside the graph.
Padding rows of a bucket write to slot -1 (skipped) and read one token of a block they held before (or block
0), so they change no live KV and their outputs are dropped.
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

    Buffers (on the model's device, views of one byte buffer ``staging`` with a pinned host mirror): input_ids
    int64 [B], prev_rows int64 [B] (-1, or the row of ``last_tokens`` that holds the row's input token),
    positions int64 [B], slot_mapping int64 [B], context_lens int32 [B], block_tables int32 [B, max_blocks]; and
    hidden [B, hidden_size] in the model dtype, where B is the largest bucket. ``last_tokens``: int64 [>= B],
    owned by the model runner.
    """

    def __init__(self, model, max_num_seqs: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, last_tokens: torch.Tensor):
        self.model = model
        self.last_tokens = last_tokens
        self.buckets = batch_buckets(max_num_seqs)
        b = self.buckets[-1]
        self.max_blocks = max_blocks
        # every input of a step in one byte buffer, mirrored in pinned host memory: a step fills the host copy
        # and moves it with one copy (int64 ids, previous rows, positions, slots; int32 context lens, block tables)
        sizes = [(torch.int64, b)] * 4 + [(torch.int32, b), (torch.int32, b * max_blocks)]
        nbytes = sum(dt.itemsize * n for dt, n in sizes)
        self.head_bytes = 36 * b  # ids, prev rows, positions, slots, context lens; then block-table rows
        self.staging = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        views, host_views, offset = [], [], 0
        for dt, n in sizes:
            views.append(self.staging[offset:offset + dt.itemsize * n].view(dt))
            host_views.append(self.host[offset:offset + dt.itemsize * n].view(dt).numpy())
            offset += dt.itemsize * n
        self.input_ids, self.prev_rows, self.positions, self.slot_mapping, self.context_lens, tables = views
        self.block_tables = tables.view(b, max_blocks)
        self._h_ids, self._h_prev, self._h_pos, self._h_slots, self._h_ctx, h_tables = host_views
        self._h_tables = h_tables.reshape(b, max_blocks)
        self._h_slots[:] = -1
        self._h_prev[:] = -1
        self._h_ctx[:] = 1
        self.staging.copy_(self.host)
        self.copied = torch.cuda.Event()  # the last step's host-to-device copy: wait before refilling the host side
        self.copied.record()
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:n],
                                 block_tables=self.block_tables[:n], context_lens=self.context_lens[:n])

    def _run(self, n: int) -> None:
        prev = self.prev_rows[:n]
        ids = torch.where(prev >= 0, self.last_tokens[prev.clamp(min=0)], self.input_ids[:n])
        self.hidden[:n] = self.model(ids, self.positions[:n], self._meta(n))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket on a stream of the engine's own, warmed up on that same stream first: whatever
        a kernel keeps per stream (the split-K GEMV's arrival counters, ``w4a16._locks``) is then allocated and
        zeroed outside the capture, in ordinary memory. Allocated inside a capture it would come from the graphs'
        shared pool (maybe a block a larger bucket's graph still writes on replay) and be zeroed only when that
        one graph replays (``w4a16._locks`` now refuses)."""
        pool = None
        self.stream = torch.cuda.Stream(self.hidden.device)
        self.stream.wait_stream(torch.cuda.current_stream())
        for n in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            with torch.cuda.stream(self.stream):
                self._run(n)  # warm up: compiles and autotunes every kernel for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                self._run(n)
            pool = pool or graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None when n exceeds every bucket."""
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def replay(self, ids: list[int], prev_rows: list[int], positions: list[int], slots: list[int],
               context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Run one decode step of n = len(ids) sequences through the bucket's graph (n <= the largest bucket;
        each block table at most ``max_blocks`` long); returns hidden [n, hidden_size]. ``prev_rows[i]`` >= 0:
        row i's input is ``last_tokens[prev_rows[i]]`` instead of ``ids[i]``. The inputs reach the GPU in one
        host-to-device copy; padding rows get slot -1 and context length 1."""
        n = len(ids)
        bucket = self.bucket_for(n)
        self.copied.synchronize()  # the previous step's copy: it ran when the step before that one ended
        self._h_ids[:n] = ids
        self._h_prev[:n] = prev_rows
        self._h_prev[n:bucket] = -1
        self._h_pos[:n] = positions
        self._h_slots[:n] = slots
        self._h_slots[n:bucket] = -1
        self._h_ctx[:n] = context_lens
        self._h_ctx[n:bucket] = 1
        for row, table in zip(self._h_tables, block_tables):
            row[:len(table)] = table
        used = self.head_bytes + bucket * self.max_blocks * 4
        self.staging[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        self.graphs[bucket].replay()
        return self.hidden[:n]
