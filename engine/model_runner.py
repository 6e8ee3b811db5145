"""The model runner: owns the model, the KV cache and the swap space, turns a scheduled batch into tensors, runs
one step.

The scheduler hands it a ``ScheduledBatch`` (sequences, tokens per sequence, block pairs to swap); it hands the
model only token ids, positions, slot mappings and block tables. On CUDA a decode step replays a CUDA graph
(``cuda_graphs.py``), and so (unless ``APPLIANCE_PREFILL_GRAPHS=0``) does a step with prefill rows (whole prompts,
chunks, or a mix of decode rows and chunks) of up to 256 tokens of up to 64 sequences; other steps run eagerly.

``launch`` queues a step (swaps, forward pass, sampling) and returns before the device is done; the sampled ids
come back through :class:`LaunchedStep`. They also stay on the device, in ``last_tokens``, where the next step
reads the input of every sequence whose last token is still pending (async scheduling, llm_engine.py), and its
penalties count that token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import kernel_plans
from engine.attention import AttentionMetadata
from engine.config import MIN_CAPABILITY, EngineConfig, checkpoint_dtype, compute_dtype
from engine.memory import gpu_kv_budget
from engine.cuda_graphs import StepGraphs, prefill_graphs_on
from engine.models.llama import load_model
from engine.prompt_logprobs import PromptChunk, launch as launch_prompt_logprobs, rows_to_launch
from engine.sampler import StepLogprobs, penalised_pending, sample_tokens, step_logprobs, to_device
from engine.scheduler import ScheduledBatch
from engine.structured_output import apply_masks
from engine.sequence import Sequence


def resolve_device(name: str) -> torch.device:
    """The engine's device for ``name`` ("auto", "cuda", "cuda:N", "cpu"): "auto" takes the first CUDA device if it
    is an Ampere or newer GPU (:data:`MIN_CAPABILITY`), else the CPU. Raises RuntimeError for a CUDA device that
    torch does not see or that is older than Ampere."""
    if name == "auto":
        ok = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= MIN_CAPABILITY
        return torch.device("cuda" if ok else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no CUDA device: use device='cpu' or 'auto'")
    device = torch.device(name)
    if device.type == "cuda" and (capability := torch.cuda.get_device_capability(device)) < MIN_CAPABILITY:
        major, minor = capability
        raise RuntimeError(f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; the "
                           f"kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (Ampere or newer): use "
                           "device='cpu'")
    return device


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: ``dtype`` for "auto", int8 for "int8", float8 e4m3 for "fp8" (raises ValueError
    on a GPU older than compute capability 8.9, which has no fp8 conversions)."""
    if name == "auto":
        return dtype
    if name == "int8":
        return torch.int8
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype: fp8 needs compute capability 8.9+ (Ada or Hopper); this GPU has "
                         f"{major}.{minor}: use auto")
    return torch.float8_e4m3fn


def int8_views(blocks: torch.Tensor, block_size: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 cache and its scales inside ``blocks``, uint8 [num_blocks, block_size * heads * (head_dim + 4)]
    (last dim contiguous): codes int8 [num_blocks, block_size, heads, head_dim] from each block's first bytes, then
    scales fp32 [num_blocks, heads, block_size] (4-byte aligned: the codes take a multiple of 4 bytes). Views,
    not copies."""
    codes = block_size * heads * head_dim
    num_blocks = blocks.shape[0]
    return (blocks[:, :codes].view(torch.int8).view(num_blocks, block_size, heads, head_dim),
            blocks[:, codes:].view(torch.float32).view(num_blocks, heads, block_size))


def resolve_dtype(name: str, device: torch.device, model_config: dict) -> torch.dtype:
    """The torch dtype of ``config.compute_dtype`` for the checkpoint whose config.json is ``model_config``:
    "auto" = float32 on CPU (exact reference path); on CUDA the dtype it names if float16 or bfloat16, else
    bfloat16."""
    return getattr(torch, compute_dtype(name, device.type, checkpoint_dtype(model_config)))


@dataclass
class LaunchedStep:
    """A step queued on the device. :meth:`read` returns its sampled ids (one per sampling row, in batch order) and
    each row's logprobs entry (``StepLogprobs.entries``; None where not asked), waiting for the device-to-host
    copies. Nothing in a step needs the host before it is read, so the engine may schedule the next step first
    (async scheduling)."""

    host: torch.Tensor | list[int]
    event: torch.cuda.Event | None = None
    logprobs: StepLogprobs | None = None
    prompt: list[PromptChunk] = field(default_factory=list)  # prompt logprobs, filled in by read()

    def read(self) -> tuple[list[int], list[tuple[dict[int, float], int | None] | None]]:
        """Also writes the step's prompt logprobs into their sequences (``PromptChunk.fill``)."""
        if self.event is not None:
            self.event.synchronize()
        for chunk in self.prompt:
            chunk.fill()
        tokens = self.host if isinstance(self.host, list) else self.host.tolist()
        return tokens, self.logprobs.entries(tokens) if self.logprobs else [None] * len(tokens)


class ModelRunner:
    """Runs the model over the paged KV cache.

    KV cache: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer in ``kv_dtype`` (the model
    dtype, or float8 e4m3 with ``kv_cache_dtype="fp8"``), K at [0] and V at [1] (the attention layer's ``k_cache``
    / ``v_cache`` views; the kernels convert on write and on read). With ``kv_cache_dtype="int8"`` one uint8
    [2, num_blocks, block_bytes] tensor per layer: each block holds its int8 codes [block_size, num_kv_heads,
    head_dim], then their fp32 scales [num_kv_heads, block_size] (:func:`int8_views`), so a block's scales move
    with it wherever blocks are copied. Swap space: the same shape with ``num_swap_blocks`` blocks
    (``swap_space`` GiB) on the CPU, pinned when the cache is on CUDA.
    """

    def __init__(self, config: EngineConfig, max_model_len: int, model_config: dict):
        """``model_config``: the checkpoint's config.json, as the engine read it."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        #: free GPU memory before the weights load (the CUDA context made first): the KV budget's starting point
        self._free_at_start = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.model = load_model(config.model, self.dtype, self.device, max_model_len)
        self.kernel_plans = kernel_plans.prepare(self.model, config, self.device, self.dtype)  # before any capture
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)  # unseeded sampling
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(max_model_len)
        self.num_swap_blocks = int(config.swap_space * 2**30 // self._bytes_per_block())
        self._allocate_kv_cache()
        #: the last launched step's sampled ids (row i: its i-th sampling sequence), and each sequence's row
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self._rows: dict[int, int] = {}
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = self.step_graphs(max_model_len)
        if self.device.type == "cuda":
            self.warm_up_prefill(max_model_len)

    def step_graphs(self, max_model_len: int, capture: bool = True, prefill: bool | None = None) -> StepGraphs:
        """This engine's CUDA graphs (``capture=False``: uncaptured, as the CPU tests check their buffers;
        ``prefill`` None: prefill graphs as :func:`cuda_graphs.prefill_graphs_on` says)."""
        return StepGraphs(self.model, self.config.max_num_seqs, self.config.token_budget(max_model_len),
                          -(-max_model_len // self.block_size), self.model.config["hidden_size"], self.dtype,
                          self.device, self.last_tokens, capture, prefill_graphs_on() if prefill is None else prefill)

    #: Prompt lengths of the start-up prefills: in each W4A16 plan bucket (``w4a16.M_BUCKETS``: 1, <= 8, <= 16,
    #: <= 64, <= 128, <= 256, above) a count that is a multiple of 16 and one that is not (Triton specializes
    #: integer arguments on that; rotary and SiLU-and-mul on the split count of the product before them, which
    #: each bucket's plan sets), so that every kernel variant a prompt can need compiles at start-up, not at a
    #: user's first prompt.
    WARM_UP_TOKENS = (1, 7, 8, 15, 16, 63, 64, 127, 128, 255, 256, 257)

    @torch.inference_mode()
    def warm_up_prefill(self, max_model_len: int) -> None:
        """Throw-away prefills of one sequence of each length in :attr:`WARM_UP_TOKENS` (up to ``max_model_len``
        and the step's token budget: a 257-token prefill would dequantize whole weights, which a 256-token budget's
        memory plan does not count),
        then the LM head on its last row: their kernels compile here (vLLM's start-up profile run does the same).
        Nothing is written to the KV cache (every slot is -1, padding) and the attention reads block 0 for every
        position, whatever it holds: the outputs are discarded."""
        budget = self.config.token_budget(max_model_len)  # no step computes more: its kernels are never needed
        for n in (t for t in self.WARM_UP_TOKENS if t <= min(max_model_len, budget)):
            meta = AttentionMetadata(
                is_prefill=True, slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
                block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int32, device=self.device),
                context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device))
            hidden = self.model(torch.zeros(n, dtype=torch.int64, device=self.device),
                                torch.arange(n, device=self.device), meta)
            self.model.compute_logits(hidden[n - 1:])

    def _layer_block_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer; an int8 cache adds an fp32 scale per token and head."""
        layer = self.model.layers[0]
        scale = 4 if self.kv_dtype == torch.int8 else 0
        return self.block_size * layer.num_kv_heads * (layer.head_dim * self.kv_dtype.itemsize + scale)

    def _bytes_per_block(self) -> int:
        return 2 * self._layer_block_bytes() * len(self.model.layers)

    def _blocks_that_fit(self, max_model_len: int) -> int:
        """KV blocks from the memory budget: ``cpu_kv_cache_gib`` on CPU; on CUDA ``memory.gpu_kv_budget``, the
        weights being what the free memory fell by while they loaded."""
        if self.device.type == "cpu":
            budget = self.config.cpu_kv_cache_gib * 2**30
        else:
            torch.cuda.empty_cache()  # blocks freed while loading (fp16 checkpoints read, then cast) count as free
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_budget(total, self._free_at_start, self._free_at_start - free,
                                   self.config.gpu_memory_utilization, self.config.token_budget(max_model_len),
                                   self.model.config["hidden_size"], self.dtype.itemsize, self.config.max_num_seqs,
                                   self.model.config["vocab_size"])
        return max(int(budget // self._bytes_per_block()), 0)

    def _allocate_kv_cache(self) -> None:
        layer = self.model.layers[0]
        shape = (2, self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        dtype = self.kv_dtype
        if dtype == torch.int8:  # codes and scales in one byte tensor per layer (class docstring)
            shape, dtype = (2, self.num_blocks, self._layer_block_bytes()), torch.uint8
        swap_shape = (2, self.num_swap_blocks) + shape[2:]
        pin = self.device.type == "cuda"
        self.kv_caches, self.swap_caches = [], []
        for attn in self.model.attention_layers():
            kv = torch.zeros(shape, dtype=dtype, device=self.device)
            if self.kv_dtype == torch.int8:
                (attn.k_cache, attn.k_scales), (attn.v_cache, attn.v_scales) = (
                    int8_views(kv[i], self.block_size, layer.num_kv_heads, layer.head_dim) for i in (0, 1))
            else:
                attn.k_cache, attn.v_cache = kv[0], kv[1]
            self.kv_caches.append(kv)
            self.swap_caches.append(torch.zeros(swap_shape, dtype=dtype, pin_memory=pin))

    @torch.inference_mode()
    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy whole K/V blocks: (KV block, swap block) pairs out to the swap space, then (swap block, KV block)
        pairs back in; one gather and one scatter per layer and direction, on the bytes (torch has no
        ``index_copy_`` for fp8). A step that swaps syncs with the host here (rare: preemption under pressure)."""
        for pairs, src_caches, dst_caches in ((blocks_to_swap_out, self.kv_caches, self.swap_caches),
                                              (blocks_to_swap_in, self.swap_caches, self.kv_caches)):
            if not pairs:
                continue
            src, dst = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*pairs))
            src = src.to(src_caches[0].device)
            dst = dst.to(dst_caches[0].device)
            for src_cache, dst_cache in zip(src_caches, dst_caches):
                dst_cache.view(torch.uint8).index_copy_(
                    1, dst, src_cache.view(torch.uint8).index_select(1, src).to(dst_cache.device))

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        return to_device(rows, torch.int32, self.device)

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _prev_row(self, seq: Sequence) -> int:
        """-1, or the row of ``last_tokens`` holding ``seq``'s pending last token (sampled by the step launched
        just before; KeyError if it was not)."""
        return self._rows[seq.seq_id] if seq.num_pending_tokens else -1

    def _pending_tokens(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """int64 [S] on the device: each sequence's pending token (``last_tokens``) where its penalties must count
        it, else -1; None when none must (the sampler's ``pending``)."""
        rows = [self._prev_row(s) if penalised_pending(s) else -1 for s in seqs]
        if all(r < 0 for r in rows):
            return None
        rows = to_device(rows, torch.int64, self.device)
        return torch.where(rows >= 0, self.last_tokens[rows.clamp_min(0)], -1)

    def _input_ids(self, ids: list[int], pending: list[tuple[int, int]]) -> torch.Tensor:
        """ids as a device tensor, entry i of each (i, row) in ``pending`` replaced by ``last_tokens[row]``."""
        out = to_device(ids, torch.int64, self.device)
        if pending:
            at, rows = (to_device(list(v), torch.int64, self.device) for v in zip(*pending))
            out[at] = self.last_tokens[rows]
        return out

    def _prefill_lists(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """Host lists of a prefill step: (ids, prev_rows, positions, slots: T entries each; cu_seqlens: S + 1;
        context_lens: S) for tokens ``[num_computed_tokens, num_computed_tokens + n)`` of each of the S sequences,
        T tokens in all; a pending token's id is 0 and its ``prev_rows`` entry the row of ``last_tokens`` that holds
        it (else -1)."""
        ids, prev, positions, slots, cu = [], [], [], [], [0]
        for seq, n in zip(seqs, num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            prev += [-1] * (len(ids) - len(prev))
            if end > len(seq.token_ids):  # the last one is pending
                ids.append(0)
                prev.append(self._prev_row(seq))
            positions += range(start, end)
            slots += [self._slot(seq, p) for p in range(start, end)]
            cu.append(len(ids))
        return ids, prev, positions, slots, cu, [s.num_computed_tokens + n for s, n in zip(seqs, num_new_tokens)]

    def prepare_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]):
        """Inputs for tokens ``[num_computed_tokens, num_computed_tokens + n)`` of each sequence: its prompt, a
        chunk of it, prompt + output after a recompute preemption, or one decode token in a mixed step (whose
        token may be pending: see :meth:`_input_ids`)."""
        ids, prev, positions, slots, cu, context_lens = self._prefill_lists(seqs, num_new_tokens)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=to_device(slots, torch.int64, self.device),
            block_tables=self._block_tables(seqs),
            context_lens=to_device(context_lens, torch.int32, self.device),
            cu_seqlens_q=to_device(cu, torch.int32, self.device))
        pending = [(i, row) for i, row in enumerate(prev) if row >= 0]
        return self._input_ids(ids, pending), positions, meta, [c - 1 for c in cu[1:]]

    def prepare_decode(self, seqs: list[Sequence]):
        """Inputs for the last token of each sequence (maybe pending); its K/V goes to slot ``len(seq) - 1``."""
        ids = self._input_ids([s.last_token_id for s in seqs],
                              [(i, self._prev_row(s)) for i, s in enumerate(seqs) if s.num_pending_tokens])
        positions = [len(s) - 1 for s in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=to_device([self._slot(s, len(s) - 1) for s in seqs], torch.int64, self.device),
            block_tables=self._block_tables(seqs),
            context_lens=to_device([len(s) for s in seqs], torch.int32, self.device))
        return ids, positions, meta, list(range(len(seqs)))

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """The batch's forward pass, queued: from a decode or prefill CUDA graph where one holds the step, else
        eagerly. Returns (hidden [T, hidden_size], valid until the next step; each sequence's last row in it)."""
        seqs, graphs = batch.seqs, self.graphs
        if graphs is not None and not batch.is_prefill and graphs.bucket_for(len(seqs)) is not None:
            hidden = graphs.replay([s.last_token_id for s in seqs], [self._prev_row(s) for s in seqs],
                                   [len(s) - 1 for s in seqs], [self._slot(s, len(s) - 1) for s in seqs],
                                   [len(s) for s in seqs], [s.block_table for s in seqs])
            return hidden, list(range(len(seqs)))
        if graphs is not None and batch.is_prefill and \
                graphs.prefill_bucket_for(sum(batch.num_new_tokens), len(seqs)) is not None:
            ids, prev, positions, slots, cu, context_lens = self._prefill_lists(seqs, batch.num_new_tokens)
            hidden = graphs.replay_prefill(ids, prev, positions, slots, cu, context_lens,
                                           [s.block_table for s in seqs])
            return hidden, [c - 1 for c in cu[1:]]
        if batch.is_prefill:
            ids, positions, meta, last = self.prepare_prefill(seqs, batch.num_new_tokens)
        else:
            ids, positions, meta, last = self.prepare_decode(seqs)
        return self.model(ids, to_device(list(positions), torch.int64, self.device), meta), last

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_token_ids: set[int]) -> LaunchedStep:
        """Swap the batch's blocks, then one forward pass over its sequences and the sampling, queued on the
        device; the step's tokens: one per sequence whose ``batch.samples`` entry is True, in batch order (none
        for an unfinished prefill chunk). A sequence's pending last token is read from ``last_tokens``."""
        self.swap(batch.blocks_to_swap_out, batch.blocks_to_swap_in)
        seqs = batch.seqs
        if not seqs:
            return LaunchedStep([])
        hidden, last = self._forward(batch)
        plan = rows_to_launch(seqs, batch.num_new_tokens) if batch.is_prefill else []
        prompt = launch_prompt_logprobs(self.model, hidden, plan) if plan else []
        sampling = [i for i, samples in enumerate(batch.samples) if samples]
        pending = self._pending_tokens([seqs[i] for i in sampling])
        self._rows = {}
        tokens, logprobs = [], None
        if sampling:
            rows = [last[i] for i in sampling]
            # a slice when the rows are 0..n-1 (every decode step); a list index would be copied over with a sync
            picked = hidden[:len(rows)] if rows == list(range(len(rows))) else hidden[to_device(rows, torch.int64,
                                                                                                 self.device)]
            logits = self.model.compute_logits(picked)
            sampling_seqs = [seqs[i] for i in sampling]
            matchers = [s.matcher for s in sampling_seqs]
            if any(m is not None for m in matchers):  # structured outputs: masked before sampling and logprobs
                apply_masks(logits, matchers, self.model.config["vocab_size"])
            tokens = sample_tokens(logits, sampling_seqs, eos_token_ids, self.generator, pending)
            logprobs = step_logprobs(logits, tokens, sampling_seqs)
            self.last_tokens[:len(tokens)] = tokens.clamp(min=0)  # an INVALID row's request fails on read-back
            self._rows = {s.seq_id: i for i, s in enumerate(sampling_seqs)}
        if self.device.type != "cuda":
            return LaunchedStep(tokens, logprobs=logprobs, prompt=prompt)
        if not (sampling or prompt):
            return LaunchedStep([])

        def to_pinned(t: torch.Tensor) -> torch.Tensor:  # copied once the step's kernels are done; read after the event
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        tokens = to_pinned(tokens) if sampling else []
        logprobs = logprobs.to(to_pinned) if logprobs else None
        prompt = [chunk.to(to_pinned) for chunk in prompt]
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(tokens, event, logprobs, prompt)
