"""CUDA graphs for decode steps and short prefill steps (:func:`prefill_graphs_on`), replayed over persistent input
buffers.

A step launches hundreds of small kernels; replaying a captured graph removes the launch gaps (vLLM's
``CUDAGraphRunner``; vLLM V1 also captures steps with prefill rows up to a token count). Two kinds of graph:

- decode, one per batch-size bucket (:func:`batch_buckets`): B sequences, one new token each;
- prefill, one per token bucket (:func:`prefill_buckets`: :data:`PREFILL_TOKEN_BUCKETS`, the W4A16 kernels' M
  buckets, so a padded step runs the plans an eager step of its length runs) and sequence class
  (:data:`PREFILL_SEQ_CLASSES`): up to T new tokens of up to S sequences (prompts, chunks, decode rows of a mixed
  step), always launched as S sequences, those past the step's with no new tokens and an empty context.

Invariants: the captured kernels never sync with the host and never autotune (each graph is warmed up before its
capture); the buffers below are the only inputs (besides the W4A16 GEMV's split-K counters, which every replay
leaves at 0, and the model runner's ``last_tokens``, the previous step's sampled ids on the device) and ``hidden``
the only output, so a step copies its inputs in (one host-to-device copy), replays, and reads ``hidden[:T]``. A
token whose id is still pending on the device (async scheduling) is read from ``last_tokens[prev_rows[i]]`` inside
the graph. Padding tokens write to slot -1 (skipped) and belong to no sequence (a prefill's) or to a padding row
that reads one token of a block it held before, or block 0 (a decode's); either way they change no live KV and
their outputs are dropped.

``capture=False`` (the CPU, tests): nothing is captured; a replay runs the same forward pass eagerly over the same
buffers, so the padding above is checked where no graph can be (through the torch reference ops, with a blocking
copy: the Triton prefill kernel's padded launch has a test of its own, and the non-blocking copy, its event and the
replay run only on a GPU).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from engine.attention import AttentionMetadata
from engine.memory import NON_TORCH_BYTES
from kernels.w4a16 import M_BUCKETS

logger = logging.getLogger(__name__)

#: Prefill graphs' token counts: a step of up to 256 new tokens is padded to the first of these >= its count.
#: Above that a step's kernels keep the GPU busier than their launches keep the host (H200, 7B shape, eager steps,
#: bench/RESULTS.md run 95: 2,048 tokens 0.99 busy, 512 tokens 0.78, 128 tokens 0.31). They are the W4A16 M buckets
#: (``w4a16.M_BUCKETS``), so that padding never crosses into another plan. Finer buckets between them (every 16-32
#: tokens) gained nothing (H100, run 99: 143 tokens 10.35 ms padded to 160, 10.41 to 256; 175 tokens 11.72 to
#: 192, 11.63 to 256): within a plan bucket a step's time hardly depends on its padded count.
PREFILL_TOKEN_BUCKETS = M_BUCKETS
#: Sequence counts prefill graphs launch (each capped by ``max_num_seqs``; a step takes the smallest that holds its
#: sequences, and runs eagerly with more than the largest). Each absent sequence costs the prefill attention one
#: query tile per query head, whose programs find no tokens and return, but queue behind the others: H100, 7B
#: shape (bench/RESULTS.md run 97), a 128-token prompt's step 6.5 ms from a 16-sequence graph, 7.2 from a 64; a
#: 128-token prompt beside 47 decoding sequences 23.2 ms eager, 11.2 from a 64-sequence graph.
PREFILL_SEQ_CLASSES = (16, 64)


def prefill_graphs_on() -> bool:
    """Whether the engine captures prefill graphs: yes unless ``APPLIANCE_PREFILL_GRAPHS`` is 0, false, no or off
    (``enforce_eager`` turns every graph off). H200, 7B shape, random AWQ (bench/RESULTS.md run 95): a 128-token
    prefill step 20.3 ms eager, 6.3 ms replayed; 32 tokens 20.0 and 4.1 ms; a 4-sequence engine's 3 decode and 6
    prefill graphs took 11.7 s of warm-ups and captures (compiles included) and 80 MiB."""
    return os.environ.get("APPLIANCE_PREFILL_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")


def prefill_buckets(token_budget: int) -> tuple[int, ...]:
    """Prefill graphs' token counts for steps of at most ``token_budget`` tokens: :data:`PREFILL_TOKEN_BUCKETS`
    up to the first that holds the budget."""
    bigger = [t for t in PREFILL_TOKEN_BUCKETS if t >= token_budget]
    return tuple(t for t in PREFILL_TOKEN_BUCKETS if t < token_budget) + tuple(bigger[:1])


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (rounded up)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else [max_num_seqs]
    return sorted(set(buckets))


def _round4(n: int) -> int:
    """``n`` rounded up to a multiple of 4."""
    return -(-n // 4) * 4


class StepGraphs:
    """Captured decode and prefill graphs of ``model``, sharing one memory pool and one set of buffers.

    Graph keys: ("decode", B), B in ``buckets`` (:func:`batch_buckets` of ``max_num_seqs``), and ("prefill", T, S):
    S in ``prefill_classes`` (:data:`PREFILL_SEQ_CLASSES` capped by ``max_num_seqs``), T in ``prefill_buckets``
    (:func:`prefill_buckets` of ``token_budget``, the most tokens a step computes; none without ``prefill``) and
    above the next smaller class (a step that needs S sequences has more tokens than that class has sequences).

    Buffers (on the model's device, views of one byte buffer ``staging`` with a host mirror, pinned on CUDA), with
    N tokens the largest key and R rows the largest decode bucket or sequence class (each rounded up to 4 entries,
    so that every view starts 16-byte aligned): input_ids, prev_rows (-1, or the row of ``last_tokens``
    holding the token), positions, slot_mapping: int64 [N]; context_lens int32 [R]; cu_seqlens int32 [R + 1];
    block_tables int32 [R, max_blocks]; and the output, hidden [N, hidden_size] in the model dtype.
    ``last_tokens``: int64 [>= largest decode bucket], owned by the model runner.
    """

    def __init__(self, model, max_num_seqs: int, token_budget: int, max_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, last_tokens: torch.Tensor, capture: bool = True,
                 prefill: bool = True):
        self.model = model
        self.last_tokens = last_tokens
        self.buckets = batch_buckets(max_num_seqs)
        self.prefill_buckets = prefill_buckets(token_budget) if prefill else ()
        self.prefill_classes = tuple(sorted({min(c, max_num_seqs) for c in PREFILL_SEQ_CLASSES}))
        tokens = _round4(max(self.buckets[-1], max(self.prefill_buckets, default=0)))
        seqs = _round4(max(self.buckets[-1], self.prefill_classes[-1]))
        self.max_blocks = max_blocks
        # every input of a step in one byte buffer, mirrored on the host: a step fills the host copy and moves it
        # with one copy (the per-token and per-sequence arrays, then the block-table rows the step uses)
        sizes = [(torch.int64, tokens)] * 4 + [(torch.int32, seqs), (torch.int32, seqs + 4),
                                               (torch.int32, seqs * max_blocks)]
        self.head_bytes = sum(dt.itemsize * n for dt, n in sizes[:-1])
        pinned = device.type == "cuda"
        self.staging = torch.zeros(self.head_bytes + 4 * seqs * max_blocks, dtype=torch.uint8, device=device)
        self.host = torch.zeros(self.staging.shape[0], dtype=torch.uint8, pin_memory=pinned)
        views, host_views, offset = [], [], 0
        for dt, n in sizes:
            views.append(self.staging[offset:offset + dt.itemsize * n].view(dt))
            host_views.append(self.host[offset:offset + dt.itemsize * n].view(dt).numpy())
            offset += dt.itemsize * n
        self.input_ids, self.prev_rows, self.positions, self.slot_mapping, self.context_lens, self.cu_seqlens, \
            tables = views
        self.block_tables = tables.view(seqs, max_blocks)
        self._h_ids, self._h_prev, self._h_pos, self._h_slots, self._h_ctx, self._h_cu, h_tables = host_views
        self._h_tables = h_tables.reshape(seqs, max_blocks)
        self._h_slots[:] = -1
        self._h_prev[:] = -1
        self._h_ctx[:] = 1
        self.staging.copy_(self.host)
        # the last step's host-to-device copy: wait for it before refilling the host side
        self.copied = torch.cuda.Event() if pinned else None
        if self.copied is not None:
            self.copied.record()
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0  # seconds the warm-ups and captures took (start-up time)
        self.pool_bytes = 0  # GPU memory the warm-ups and captures reserved (mostly the graphs' pool)
        if capture:
            self._capture_all()

    def _meta(self, key: tuple) -> AttentionMetadata:
        """The attention metadata of ``key``'s graph: views of the buffers, as many rows as the graph launches."""
        kind, n = key[:2]
        if kind == "decode":
            return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:n],
                                     block_tables=self.block_tables[:n], context_lens=self.context_lens[:n])
        s = key[2]
        return AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:n],
                                 block_tables=self.block_tables[:s], context_lens=self.context_lens[:s],
                                 cu_seqlens_q=self.cu_seqlens[:s + 1])

    def _run(self, key: tuple) -> None:
        """``key``'s forward pass over the buffers (what its graph captures): the first ``key[1]`` tokens, each
        token's id from ``last_tokens`` where its ``prev_rows`` entry says so; writes ``hidden[:key[1]]``."""
        n = key[1]
        prev = self.prev_rows[:n]
        ids = torch.where(prev >= 0, self.last_tokens[prev.clamp(min=0)], self.input_ids[:n])
        self.hidden[:n] = self.model(ids, self.positions[:n], self._meta(key))

    def keys(self) -> list[tuple]:
        """Every graph's key, largest first (captured in this order, so smaller graphs reuse its memory)."""
        smaller = (0,) + self.prefill_classes[:-1]
        keys = [("decode", b) for b in self.buckets] + [("prefill", t, s) for s, p in zip(self.prefill_classes, smaller)
                                                        for t in self.prefill_buckets if t > p]
        return sorted(keys, key=lambda k: (-k[1], k[0], -k[-1]))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every graph on a stream of the engine's own, warmed up on that same stream first: whatever
        a kernel keeps per stream (the split-K GEMV's arrival counters, ``w4a16._locks``) is then allocated and
        zeroed outside the capture, in ordinary memory. Allocated inside a capture it would come from the graphs'
        shared pool (maybe a block a larger graph still writes on replay) and be zeroed only when that one graph
        replays (``w4a16._locks`` now refuses). The buffers hold padding while capturing (every slot -1; prefill:
        no sequence has new tokens, so no query reads a key), so the warm-up writes no KV and reads none. Warns when
        the pool takes over half of ``memory.NON_TORCH_BYTES``, the margin the KV budget leaves it."""
        pool, start = None, time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.hidden.device)
        self.stream = torch.cuda.Stream(self.hidden.device)
        self.stream.wait_stream(torch.cuda.current_stream())
        for key in self.keys():
            with torch.cuda.stream(self.stream):
                self._run(key)  # warm up: compiles and autotunes every kernel for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                self._run(key)
            pool = pool or graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved(self.hidden.device) - reserved
        logger.info("captured %d decode and %d prefill CUDA graphs in %.1f s (%.0f MiB)", len(self.buckets),
                    len(self.graphs) - len(self.buckets), self.capture_s, self.pool_bytes / 2**20)
        if self.pool_bytes > NON_TORCH_BYTES // 2:
            logger.warning("the CUDA graphs reserved %.0f MiB, over half the %.0f MiB the KV cache budget leaves "
                           "them; lower gpu_memory_utilization if the GPU runs out of memory",
                           self.pool_bytes / 2**20, NON_TORCH_BYTES / 2**20)

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size >= n, or None when n exceeds every bucket."""
        return next((b for b in self.buckets if b >= n), None)

    def prefill_bucket_for(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """(T, S): the smallest sequence class >= ``seqs`` and the smallest prefill token bucket >= ``tokens``
        (and >= ``seqs``: every sequence of a step has a new token, and a class has graphs only for buckets above
        the next smaller class), or None (no graph: more tokens than the largest bucket, or more sequences than
        the largest class). Every key it gives was captured (:meth:`keys`)."""
        s = next((c for c in self.prefill_classes if c >= seqs), None)
        t = next((t for t in self.prefill_buckets if t >= max(tokens, seqs)), None)
        return None if s is None or t is None else (t, s)

    def _fill_tables(self, block_tables: list[list[int]]) -> None:
        """Write each sequence's block ids into its host row; entries past a table's length keep what earlier
        steps left (no kernel reads a block past a sequence's context length)."""
        for row, table in zip(self._h_tables, block_tables):
            row[:len(table)] = table

    def _launch(self, key: tuple, table_rows: int) -> torch.Tensor:
        """Copy the head and ``table_rows`` block-table rows to the device in one copy, then run ``key``'s graph
        (on the CPU, uncaptured, its forward pass); returns ``hidden``. RuntimeError for a key not captured on
        CUDA."""
        used = self.head_bytes + table_rows * self.max_blocks * 4
        cuda = self.copied is not None
        if cuda and key not in self.graphs:
            raise RuntimeError(f"no CUDA graph was captured for {key}")
        self.staging[:used].copy_(self.host[:used], non_blocking=cuda)
        if cuda:
            self.copied.record()
            self.graphs[key].replay()
        else:
            with torch.inference_mode():
                self._run(key)
        return self.hidden

    def replay(self, ids: list[int], prev_rows: list[int], positions: list[int], slots: list[int],
               context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Run one decode step of n = len(ids) sequences through the bucket's graph (n <= the largest bucket;
        each block table at most ``max_blocks`` long); ids, positions and slots become int64, context lengths and
        block ids int32. Returns hidden [n, hidden_size], a view of the persistent output that the next replay
        overwrites (use it within the step). ``prev_rows[i]`` >= 0:
        row i's input is ``last_tokens[prev_rows[i]]`` instead of ``ids[i]``. Padding rows get slot -1 and
        context length 1."""
        n = len(ids)
        bucket = self.bucket_for(n)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy: it ran when the step before that one ended
        self._h_ids[:n] = ids
        self._h_prev[:n] = prev_rows
        self._h_prev[n:bucket] = -1
        self._h_pos[:n] = positions
        self._h_slots[:n] = slots
        self._h_slots[n:bucket] = -1
        self._h_ctx[:n] = context_lens
        self._h_ctx[n:bucket] = 1
        self._fill_tables(block_tables)
        return self._launch(("decode", bucket), bucket)[:n]

    def replay_prefill(self, ids: list[int], prev_rows: list[int], positions: list[int], slots: list[int],
                       cu_seqlens: list[int], context_lens: list[int],
                       block_tables: list[list[int]]) -> torch.Tensor:
        """Run one prefill step through the graph of :meth:`prefill_bucket_for` T = len(ids) tokens: the new
        tokens of S = len(context_lens) sequences (at most the largest class), packed (``cu_seqlens`` [S + 1], as
        ``AttentionMetadata``; ``prev_rows`` as in :meth:`replay`, per token; dtypes as there, ``cu_seqlens``
        int32); returns hidden [T, hidden_size], a view that the next replay overwrites.
        Raises ValueError when no graph holds the step (:meth:`prefill_bucket_for`)."""
        tokens, seqs = len(ids), len(context_lens)
        key = self.prefill_bucket_for(tokens, seqs)
        if key is None:
            raise ValueError(f"no prefill graph for {tokens} tokens of {seqs} sequences")
        bucket, graph_seqs = key
        if self.copied is not None:
            self.copied.synchronize()
        self._h_ids[:tokens] = ids
        self._h_ids[tokens:bucket] = 0
        self._h_prev[:tokens] = prev_rows
        self._h_prev[tokens:bucket] = -1
        self._h_pos[:tokens] = positions
        self._h_pos[tokens:bucket] = 0
        self._h_slots[:tokens] = slots
        self._h_slots[tokens:bucket] = -1
        self._h_cu[:seqs + 1] = cu_seqlens
        self._h_cu[seqs + 1:graph_seqs + 1] = tokens  # absent sequences: no new tokens ...
        self._h_ctx[:seqs] = context_lens
        self._h_ctx[seqs:graph_seqs] = 0  # ... and no context
        self._fill_tables(block_tables)
        return self._launch(("prefill", bucket, graph_seqs), seqs)[:tokens]
