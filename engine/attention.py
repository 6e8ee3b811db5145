"""Attention over the paged KV cache: what one forward pass needs to know about the batch, and the layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import ops


@dataclass
class AttentionMetadata:
    """Built by the model runner from block tables; the only view of the scheduler the model ever gets.

    is_prefill: every sequence brings its new tokens (a prompt, a chunk of one, a prompt plus generated tokens
        after a preemption, or a single decode token in a mixed step); otherwise every sequence brings exactly
        its last token (decode).
    slot_mapping: int64 [T]: the KV-cache slot (block_id * block_size + offset) of each new token; -1 = padding.
    block_tables: int32 [S, max_blocks]: each sequence's block ids, padded with -1.
    context_lens: int32 [S]: tokens in the cache after this step's tokens are written (a prefill chunk's
        context ends at its last token, before the sequence's end).
    cu_seqlens_q: int32 [S + 1]: offsets of each sequence's new tokens in the packed batch (prefill only).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Rotates q and k (RoPE), writes this step's K/V into the layer's cache through the slot mapping, then
    attends over the cache. The rotation and the write are one kernel (``ops.rotary_write_kv``).

    ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim] are assigned by the model runner, and
    for an int8 cache ``k_scales``/``v_scales`` [num_blocks, num_kv_heads, block_size] fp32 (else None).
    ``window`` > 0: sliding-window attention, each query over the last ``window`` positions up to its own (the
    cache keeps every token; only the attention looks back no further).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.window = window
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scales = self.v_scales = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] before rotation (tensors, or views of one ``kernels.split_k.SplitK``: the
        q/k/v projection's split-K sums, added by the rotary kernel), positions int64 [T], cos_sin the rotary table
        (``kernels.rotary.rope_cos_sin``) → [T, Hq, D]."""
        scales = (self.k_scales, self.v_scales)
        q = ops.rotary_write_kv(positions, q, k, v, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping, *scales)
        if meta.is_prefill:
            return ops.paged_attention_prefill(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                               meta.context_lens, self.scale, *scales, self.window)
        return ops.paged_attention_decode(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens,
                                          self.scale, *scales, self.window)
