"""KV-cache write through the slot mapping (PagedAttention, Kwon et al. 2023): the torch reference and
the Triton kernel.

Cache layout (one layer): ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim].
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot -1 marks padding and is skipped. The cache
may be of another float type than k and v (fp8 e4m3: round to nearest even, saturating at +-448: see
:func:`to_cache_ref`), or int8 with one fp32 scale per token and KV head in ``k_scales``/``v_scales``
[num_blocks, num_kv_heads, block_size] (:func:`quantize_int8_ref`; head-major, so that the decode
kernel, one program per KV head, reads a block's scales as one contiguous run).
"""
from __future__ import annotations

import torch

from ._triton import device_fn, early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl

#: Largest int8 code: symmetric quantization uses -127 .. 127, so that x and -x get codes of the same size.
INT8_MAX = 127.0


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row: x [..., D] (any float dtype) → (codes int8 [..., D], scales fp32
    [...]) with scale s = max|x| / 127 and code round(x / s) (fp32, IEEE division, round half to even; a row of
    zeros gets s = 0 and codes 0). Dequantized: code * s, within s / 2 of x.

    One scale per token and KV head, computed as the token is written, so no calibration is needed: the online KV
    quantization of LMDeploy (per head and token; theirs is asymmetric, with a zero point) and of KVQuant's
    per-token value scheme (Hooper et al., 2024). vLLM's fp8 cache instead uses one scale per tensor.

    A row holding NaN or +-inf gets scale NaN and codes 0: it reads back as NaN, as such a value would make a float
    cache's attention NaN.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scales = amax / torch.full_like(amax, INT8_MAX)  # a tensor: torch divides by a scalar as times its reciprocal
    # on CUDA, which can be one ulp off the IEEE quotient the kernels compute
    scales = torch.where(torch.isfinite(xf).all(dim=-1), scales, float("nan"))
    live = scales > 0
    codes = torch.round(xf / torch.where(live, scales, 1.0)[..., None]).clamp(-INT8_MAX, INT8_MAX)
    return torch.where(live[..., None], codes, 0.0).to(torch.int8), scales


def dequantize_int8_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes int8 [..., D] times scales [...] (fp32): the values an int8 cache holds, fp32 [..., D]."""
    return codes.float() * scales[..., None]


def check_int8_scales(cache: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Raises ValueError unless an int8 cache [num_blocks, block_size, H, D] comes with its fp32 scales
    [num_blocks, H, block_size] (last dim contiguous)."""
    if cache.dtype != torch.int8:
        return
    want = (cache.shape[0], cache.shape[2], cache.shape[1])
    if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != want or scales.stride(-1) != 1:
        got = None if scales is None else (tuple(scales.shape), scales.dtype)
        raise ValueError(f"an int8 KV cache {tuple(cache.shape)} needs fp32 scales of shape {want} with the last "
                         f"dim contiguous; got {got}")


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                       v_scales: torch.Tensor | None = None) -> None:
    """Store ``k[i]``, ``v[i]`` (each [num_kv_heads, head_dim]) at slot ``slot_mapping[i]``, in place.

    k, v: [T, num_kv_heads, head_dim]; slot_mapping: int64 [T], -1 = skip. Values are cast to the cache dtype
    (:func:`to_cache_ref`); into an int8 cache they are quantized (:func:`quantize_int8_ref`), their scales
    going to ``k_scales``/``v_scales`` (required then: ValueError without). The caches may be strided views.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        check_int8_scales(cache, scales)
        if cache.dtype == torch.int8:
            cache[blocks, offsets], scales[blocks, :, offsets] = quantize_int8_ref(x[keep])
        else:
            cache[blocks, offsets] = to_cache_ref(x[keep], cache.dtype)


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


@device_fn
def int8_row_stats(x):
    """Per row of x fp32 [R, D]: (largest magnitude [R], number of NaN or +-inf values [R]). Compiled, ``tl.max``
    skips NaN, so the count is taken apart."""
    a = tl.abs(x)
    return tl.max(a, axis=1), tl.sum(((a != a) | (a == float("inf"))).to(tl.int32), axis=1)


@device_fn
def int8_scale(amax, bad):
    """The int8 scale of rows of largest magnitude ``amax`` holding ``bad`` non-finite values (:func:`int8_row_stats`):
    :func:`quantize_int8_ref`'s, NaN where ``bad`` > 0."""
    return tl.where(bad > 0, float("nan"), tl.math.div_rn(amax, 127.0))


@device_fn
def int8_codes(x, scale):
    """x fp32 [R, D] as int8 codes of the row scales ``scale`` [R] (:func:`int8_scale`): round(x / scale), half to
    even, in -127 .. 127; 0 in a row whose scale is 0 or NaN. Bit-equal to :func:`quantize_int8_ref` (IEEE division; the
    rounding adds and takes off 1.5 * 2^23, exact in fp32 for |y| < 2^22, which the interpreter does alike)."""
    live = (scale > 0)[:, None]
    y = tl.math.div_rn(x, tl.where(live, scale[:, None], 1.0))
    y = (y + 12582912.0) - 12582912.0
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return tl.where(live, y, 0.0).to(tl.int8)


@device_fn
def store_cache(ptrs, x, mask, s_ptrs, s_mask, INT8: tl.constexpr):
    """Store the rows x [R, D] (fp32, 0 where ``mask`` is False) at ``ptrs`` in the cache's dtype; for an int8 cache
    (INT8) as codes, with each row's scale stored at ``s_ptrs`` [R] where ``s_mask``."""
    if INT8:
        amax, bad = int8_row_stats(x)
        scale = int8_scale(amax, bad)
        tl.store(ptrs, int8_codes(x, scale), mask=mask)
        tl.store(s_ptrs, scale, mask=s_mask)
    else:
        tl.store(ptrs, to_cache(x, ptrs.dtype.element_ty), mask=mask)


@jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, heads, dim,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_sh,
                     BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr,
                     PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (T,): copy token t's K and V heads to its slot (block, offset); nothing for slot -1. INT8: the caches
    are int8, each head's scale goes to ks / vs [num_blocks, heads, BLOCK_SIZE] (strides stride_sb, stride_sh, 1)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    hv = tl.arange(0, BLOCK_H)
    h = hv[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    hmask = hv < tl.where(slot >= 0, heads, 0)  # no heads at all for slot -1
    mask = hmask[:, None] & (d < dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
    pdl_trigger(TRIG)
    kc = kc_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d
    vc = vc_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d
    s_row = block * stride_sb + hv * stride_sh + offset
    store_cache(kc, k, mask, ks_ptr + s_row, hmask, INT8)
    store_cache(vc, v, mask, vs_ptr + s_row, hmask, INT8)


def scale_args(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_cache: torch.Tensor,
               v_scales: torch.Tensor | None) -> tuple:
    """The scale arguments a kernel takes for these caches: (ks, vs, stride_sb, stride_sh), the scales themselves
    for an int8 cache (checked: :func:`check_int8_scales`, and K's and V's strides equal), else the caches in their
    place and zero strides (never read)."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache, 0, 0
    check_int8_scales(k_cache, k_scales)
    check_int8_scales(v_cache, v_scales)
    if k_scales.stride() != v_scales.stride():
        raise ValueError("int8 KV cache: k_scales and v_scales must have the same strides")
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                   v_scales: torch.Tensor | None = None) -> None:
    """Triton :func:`write_kv_cache_ref`, in place, one launch (no host sync: graph-safe); int8 codes and scales
    bit-equal to the reference's.

    k, v: [T, Hkv, D] (views are fine: last dim contiguous); caches [num_blocks, block_size, Hkv, D] with the last
    dim contiguous; an int8 cache's scales [num_blocks, Hkv, block_size] fp32; slot_mapping: int32/int64 [T], -1 =
    skip. Slots past the cache are the caller's bug (unchecked).
    """
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"write_kv_cache: K and V caches differ in dtype ({k_cache.dtype}, {v_cache.dtype})")
    ks, vs, stride_sb, stride_sh = scale_args(k_cache, k_scales, v_cache, v_scales)
    tokens, heads, dim = k.shape
    if tokens:
        _write_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, ks, vs, heads, dim, k.stride(0),
                                    k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
                                    *v_cache.stride()[:3], stride_sb, stride_sh,
                                    BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim),
                                    INT8=k_cache.dtype == torch.int8, PDL=pdl(k), TRIG=early_trigger(k),
                                    num_warps=4)
