"""PagedAttention over a block table (Kwon et al., SOSP 2023): torch references for prefill and decode.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer (see ``kv_cache.py``). Grouped-query
attention: query head h reads KV head ``h // (num_q_heads // num_kv_heads)``. Sequences are computed one at a
time with exact lengths (no padding), so a sequence's result does not depend on the rest of the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's K or V: [length, num_kv_heads, head_dim].

    cache: [num_blocks, block_size, H, D]; block_table: int [>= ceil(length / block_size)].
    """
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions of a ``kv_len`` context.

    q: [q_len, Hq, D]; k, v: [kv_len, Hkv, D]. Query i sits at position kv_len - q_len + i. Returns [q_len, Hq, D].
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = None
    if q_len > 1:
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos_q
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new query token per sequence attends to its whole context (its own K/V already written).

    q: [B, Hq, D]; block_tables: int32 [B, max_blocks]; context_lens: int32 [B] (tokens in cache, >= 1).
    Returns [B, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = gather_kv(k_cache, block_tables[b], n).to(q.dtype)
        v = gather_kv(v_cache, block_tables[b], n).to(q.dtype)
        out[b] = _attend(q[b:b + 1], k, v, scale)[0]
    return out


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves (K/V already written).

    q: [T, Hq, D], the new tokens of S sequences packed back to back; cu_seqlens_q: int32 [S + 1] offsets into q;
    context_lens: int32 [S] = cached prefix + new tokens; block_tables: int32 [S, max_blocks].
    Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for s in range(cu_seqlens_q.shape[0] - 1):
        lo, hi = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n = int(context_lens[s])
        k = gather_kv(k_cache, block_tables[s], n).to(q.dtype)
        v = gather_kv(v_cache, block_tables[s], n).to(q.dtype)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale)
    return out
