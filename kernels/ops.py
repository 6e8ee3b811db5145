"""The kernels the engine calls: Triton on CUDA tensors, the torch reference on CPU (same signatures, same results
up to rounding). Set ``APPLIANCE_KERNELS=torch`` to force the references on CUDA too (debugging). ``k_scales`` /
``v_scales``: an int8 KV cache's per-token, per-head scales (``kv_cache.py``), None for a float cache; ``window``:
a sliding attention window in tokens (0 = none).

| op | Triton | reference |
|---|---|---|
| ``linear(x, weight, bias)`` | (cuBLAS, ``F.linear``) | ``linear.linear_ref`` |
| ``w4a16_linear(x, qw, bias, silu_gated, defer_sum)`` | ``w4a16.w4a16_linear`` | ``reference_linear`` (of ``silu_and_mul_ref(x)`` when gated) |
| ``write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)`` | ``kv_cache.write_kv_cache`` | ``write_kv_cache_ref`` |
| ``paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales, window)`` | ``paged_attention`` | ``_ref`` |
| ``paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scales, v_scales, window)`` | idem | idem |
| ``rms_norm(x, weight, eps, residual=None)`` | ``norm.rms_norm`` | ``norm.rms_norm_ref`` |
| ``rotary(positions, q, k, cos_sin)`` | ``rotary.rotary`` | ``rotary.rotary_ref`` |
| ``rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, k_scales, v_scales)`` | ``rotary.rotary_write_kv`` | ``rotary_write_kv_ref`` |
| ``silu_and_mul(x)`` | ``activation.silu_and_mul`` | ``activation.silu_and_mul_ref`` |
| ``apply_penalties(logits, rows, offsets, token_ids, params, pending)`` | ``penalties.apply_penalties`` | ``penalties.apply_penalties_ref`` |

A product run with ``defer_sum`` may come back as a ``split_k.SplitK`` (its split-K partial sums, not yet added:
Triton only); ``rotary``, ``rotary_write_kv`` and ``silu_and_mul`` add them as they load, the other ops take
tensors. Given one, the references take its sum (``SplitK.sum``, a Triton launch).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import activation, kv_cache, linear as linear_mod, norm, paged_attention, penalties, quant_formats
from . import rotary as rotary_mod, w4a16
from ._triton import HAS_TRITON
from .split_k import SplitK, as_tensor


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device, Triton is installed and APPLIANCE_KERNELS is not "torch"."""
    return t.is_cuda and HAS_TRITON and os.environ.get("APPLIANCE_KERNELS", "triton") != "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense x [M, K] @ weight [N, K].T (+ bias): cuBLAS on CUDA, the batch-invariant reference on CPU."""
    return F.linear(x, weight, bias) if x.is_cuda else linear_mod.linear_ref(x, weight, bias)


def w4a16_linear(x: torch.Tensor | SplitK, qw: quant_formats.QuantizedWeight, bias: torch.Tensor | None = None,
                 silu_gated: bool = False, defer_sum: bool = False) -> torch.Tensor | SplitK:
    """x [..., K] (or cat(gate, up) [..., 2K] with ``silu_gated``, the input then being silu(gate) * up).
    ``defer_sum``: a product that splits K may return its partial sums (a ``SplitK``; Triton only)."""
    if use_triton(x):
        return w4a16.w4a16_linear(x, qw, bias, silu_gated, defer_sum)
    x = as_tensor(x)
    return quant_formats.reference_linear(activation.silu_and_mul_ref(x) if silu_gated else x, qw, bias)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None) -> None:
    fn = kv_cache.write_kv_cache if use_triton(k) else kv_cache.write_kv_cache_ref
    fn(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, k_scales=None,
                           v_scales=None, window: int = 0) -> torch.Tensor:
    fn = paged_attention.paged_attention_decode if use_triton(q) else paged_attention.paged_attention_decode_ref
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales, v_scales, window)


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                            k_scales=None, v_scales=None, window: int = 0) -> torch.Tensor:
    fn = paged_attention.paged_attention_prefill if use_triton(q) else paged_attention.paged_attention_prefill_ref
    return fn(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scales, v_scales, window)


def rms_norm(x, weight, eps: float, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    fn = norm.rms_norm if use_triton(x) else norm.rms_norm_ref
    return fn(x, weight, eps, residual)


def rotary(positions, q, k, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return rotary_mod.rotary(positions, q, k, cos_sin)
    return rotary_mod.rotary_ref(positions, as_tensor(q), as_tensor(k), cos_sin)


def rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, k_scales=None,
                    v_scales=None) -> torch.Tensor:
    """Rotate q and k, write the rotated k and v to the caches through the slot mapping; returns the rotated q."""
    if use_triton(q):
        return rotary_mod.rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, k_scales,
                                          v_scales)
    return rotary_mod.rotary_write_kv_ref(positions, as_tensor(q), as_tensor(k), as_tensor(v), cos_sin, k_cache,
                                          v_cache, slot_mapping, k_scales, v_scales)


def silu_and_mul(x) -> torch.Tensor:
    return activation.silu_and_mul(x) if use_triton(x) else activation.silu_and_mul_ref(as_tensor(x))


def apply_penalties(logits, rows, offsets, token_ids, params, pending=None) -> torch.Tensor:
    """Repetition / frequency / presence penalties on the rows ``rows`` of ``logits`` [S, V] float32, in place
    (``penalties.py`` has the inputs' layout)."""
    fn = penalties.apply_penalties if use_triton(logits) else penalties.apply_penalties_ref
    return fn(logits, rows, offsets, token_ids, params, pending)
