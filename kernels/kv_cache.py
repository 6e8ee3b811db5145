"""KV-cache write through the slot mapping (PagedAttention, Kwon et al. 2023): the torch reference.

Cache layout (one layer): ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim].
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot -1 marks padding and is skipped.
"""
from __future__ import annotations

import torch


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store ``k[i]``, ``v[i]`` (each [num_kv_heads, head_dim]) at slot ``slot_mapping[i]``, in place.

    k, v: [T, num_kv_heads, head_dim]; slot_mapping: int64 [T], -1 = skip. Values are cast to the cache dtype.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, heads, dim)[slots] = v[keep].to(v_cache.dtype)
