"""KV-cache write through the slot mapping (PagedAttention, Kwon et al. 2023): the torch reference and
the Triton kernel.

Cache layout (one layer): ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim].
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot -1 marks padding and is skipped. The cache
may be of another float type than k and v (fp8 e4m3: round to nearest even, saturating at +-448: see
:func:`to_cache_ref`).
"""
from __future__ import annotations

import torch

from ._triton import device_fn, early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store ``k[i]``, ``v[i]`` (each [num_kv_heads, head_dim]) at slot ``slot_mapping[i]``, in place.

    k, v: [T, num_kv_heads, head_dim]; slot_mapping: int64 [T], -1 = skip. Values are cast to the cache dtype
    (:func:`to_cache_ref`).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim)[slots] = to_cache_ref(k[keep], k_cache.dtype)
    v_cache.view(-1, heads, dim)[slots] = to_cache_ref(v[keep], v_cache.dtype)


def to_cache_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype, rounded once; to fp8 e4m3 saturated at +-448 (as vLLM's ``__NV_SATFINITE``
    conversion: torch's own ``.to`` saturates on the CPU but gives NaN on CUDA)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


@device_fn
def to_cache(x, dtype: tl.constexpr):
    """x in the cache's dtype, rounded once (through fp32); to fp8 e4m3 saturated at +-448 (:func:`to_cache_ref`;
    the explicit clamp keeps Triton's interpreter in step with the GPU's ``satfinite`` conversion)."""
    x = x.to(tl.float32)
    if dtype == tl.float8e4nv:
        x = tl.where(x != x, x, tl.minimum(tl.maximum(x, -448.0), 448.0))  # NaN stays NaN, as in the reference
    return x.to(dtype)


@jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, heads, dim,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                     TRIG: tl.constexpr):
    """Grid (T,): copy token t's K and V heads to its slot (block, offset); nothing for slot -1."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < tl.where(slot >= 0, heads, 0)) & (d < dim)  # no heads at all for slot -1
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    pdl_trigger(TRIG)
    kc = kc_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d
    vc = vc_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d
    tl.store(kc, to_cache(k, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, to_cache(v, vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Triton :func:`write_kv_cache_ref`, in place, one launch (no host sync: graph-safe).

    k, v: [T, Hkv, D] (views are fine: last dim contiguous); caches [num_blocks, block_size, Hkv, D] with the last
    dim contiguous; slot_mapping: int32/int64 [T], -1 = skip. Slots past the cache are the caller's bug (unchecked).
    """
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    tokens, heads, dim = k.shape
    if tokens:
        _write_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, heads, dim, k.stride(0), k.stride(1),
                                    v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                                    BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim),
                                    PDL=pdl(k), TRIG=early_trigger(k), num_warps=4)
