"""Rotary position embedding (RoFormer, Su et al. 2021), GPT-NeoX "rotate half" form: the torch reference
and the Triton kernel, alone or with the KV-cache write of the rotated k and of v fused in (any cache dtype of
``kv_cache.py``, int8 with its scales included)."""
from __future__ import annotations

import torch

from ._triton import cdiv, device_fn, early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl
from .kv_cache import int8_codes, int8_row_stats, int8_scale, scale_args, to_cache, write_kv_cache_ref
from .split_k import SplitK, add_pair, load_pair


def rope_cos_sin(head_dim: int, max_positions: int, base: float, device=None, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0) -> torch.Tensor:
    """The cos/sin cache: float32 [max_positions, head_dim] = cat(cos(p·f), sin(p·f)) · attention_factor over the
    head_dim/2 frequencies f.

    f: ``inv_freq`` (float32 [head_dim/2], a scaled RoPE's: ``engine.models.rope``), or by default
    f_i = base^(-2i/head_dim), computed as Hugging Face's default rotary does so the values match bit for bit.
    ``attention_factor`` multiplies cos and sin (YaRN's; 1 otherwise).
    """
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions (int64 [T]); returns new tensors.

    cos_sin: from :func:`rope_cos_sin`, [max_positions, D] float32 (cos half, then sin half).
    """
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :].to(q.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@device_fn
def _rotate_halves(x1, x2, cos, sin, dt: tl.constexpr):
    """The rotated halves of x (fp32 [H, half] each), rounded like the reference in x's dtype ``dt`` (cos and sin,
    each product, then the sum), returned as fp32."""
    o1 = (x1 * cos).to(dt).to(tl.float32) + (-x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    return o1.to(dt).to(tl.float32), o2.to(dt).to(tl.float32)


@device_fn
def _store_halves(out, x1, x2, half, mask, s_ptrs, s_mask, INT8: tl.constexpr):
    """Store the halves x1, x2 (fp32 [H, half], 0 where ``mask`` is False) at out and out + half in out's dtype
    (``kv_cache.store_cache``); into an int8 cache as codes of one scale per head, stored at ``s_ptrs`` [H]."""
    if INT8:
        amax1, bad1 = int8_row_stats(x1)
        amax2, bad2 = int8_row_stats(x2)
        scale = int8_scale(tl.maximum(amax1, amax2), bad1 + bad2)
        tl.store(out, int8_codes(x1, scale), mask=mask)
        tl.store(out + half, int8_codes(x2, scale), mask=mask)
        tl.store(s_ptrs, scale, mask=s_mask)
    else:
        tl.store(out, to_cache(x1, out.dtype.element_ty), mask=mask)
        tl.store(out + half, to_cache(x2, out.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cs_ptr, q_heads, k_heads, half,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                   v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                   ks_ptr, vs_ptr, stride_sb, stride_sh, stride_split, bq_ptr, bk_ptr, bv_ptr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, WRITE_KV: tl.constexpr, INT8: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SPLITK: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (T, cdiv(max(Hq, Hkv), BLOCK_H)): heads h0 .. h0 + BLOCK_H of q and of k (and v) of one token, which
    share one cos/sin row. Outputs are contiguous [T, H, D].

    Rounds like the reference in x's dtype: cos and sin, each product, then the sum. WRITE_KV: the rotated k and
    the token's v go straight to its KV-cache slot (``kv_cache`` layout; slot -1 writes nothing) instead of
    ``ko`` (the caches share strides). INT8: the caches are int8, each head's scale goes to ks / vs
    [num_blocks, Hkv, BLOCK_SIZE] (strides stride_sb, stride_sh, 1). SPLITK: q, k, v are split 0 of a
    ``split_k.SplitK`` (fp32, ``SPLITS`` of them ``stride_split`` apart; with HAS_BIAS its bias [H, D] per
    tensor, contiguous), every split loaded before any is added.
    """
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)  # a step input and a table: read before the previous kernel ends
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    dt = qo_ptr.dtype.element_ty
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + half + d, mask=dmask, other=0.0).to(dt).to(tl.float32)[None, :]
    pdl_wait(PDL)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
        kv_mask = (h < tl.where(slot >= 0, k_heads, 0))[:, None] & dmask[None, :]
    # every load first (q, k and v: one round trip to memory), then the stores (they may alias nothing the loads
    # read, but the compiler cannot know that and would otherwise keep each load behind the stores before it)
    qm = (h < q_heads)[:, None] & dmask[None, :]
    km = (h < k_heads)[:, None] & dmask[None, :]
    qs = load_pair(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], half, qm, stride_split, SPLITS,
                   SPLITK)
    ks = load_pair(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], half, km, stride_split, SPLITS,
                   SPLITK)
    if WRITE_KV:
        vs = load_pair(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], half, kv_mask, stride_split,
                       SPLITS, SPLITK)
    pdl_trigger(TRIG)
    b_heads = h[:, None] * 2 * half + d[None, :]  # a SplitK's bias [H, D]
    q1, q2 = add_pair(qs, bq_ptr + b_heads, half, qm, SPLITK, HAS_BIAS, dt)
    k1, k2 = add_pair(ks, bk_ptr + b_heads, half, km, SPLITK, HAS_BIAS, dt)
    if WRITE_KV:
        v1, v2 = add_pair(vs, bv_ptr + b_heads, half, kv_mask, SPLITK, HAS_BIAS, dt)
    out = qo_ptr + t * q_heads * 2 * half + h[:, None] * 2 * half + d[None, :]
    o1, o2 = _rotate_halves(q1, q2, cos, sin, dt)
    _store_halves(out, o1, o2, half, qm, out, qm, False)
    o1, o2 = _rotate_halves(k1, k2, cos, sin, dt)
    if WRITE_KV:
        s_rows = (slot // BLOCK_SIZE) * stride_sb + h * stride_sh + slot % BLOCK_SIZE
        s_mask = h < tl.where(slot >= 0, k_heads, 0)
        out = kc_ptr + cache_row + h[:, None] * stride_ch + d[None, :]
        _store_halves(out, o1, o2, half, kv_mask, ks_ptr + s_rows, s_mask, INT8)
        out = vc_ptr + cache_row + h[:, None] * stride_ch + d[None, :]
        _store_halves(out, v1, v2, half, kv_mask, vs_ptr + s_rows, s_mask, INT8)
    else:
        out = ko_ptr + t * k_heads * 2 * half + h[:, None] * 2 * half + d[None, :]
        _store_halves(out, o1, o2, half, km, out, km, False)


def _splits_of(q, k, v) -> tuple[int | None, int, tuple, tuple, torch.dtype]:
    """(splits, split stride, (q, k, v) as kernel arguments, their biases, x's dtype) of the inputs: all tensors
    (splits None), or all views of one ``SplitK`` (split 0 of each; ValueError for a mix)."""
    given = [x for x in (q, k, v) if x is not None]
    if not any(isinstance(x, SplitK) for x in given):
        return None, 0, (q, k, v), (None, None, None), q.dtype
    if not all(isinstance(x, SplitK) for x in given) or \
            len({(x.splits, x.part.stride(0), x.dtype) for x in given}) > 1:
        raise ValueError("rotary: q, k (and v) must all be tensors or all views of one SplitK")
    biases = tuple(x.bias.contiguous() if x is not None and x.bias is not None else None for x in (q, k, v))
    if len({b is None for b in biases[:len(given)]}) > 1:
        raise ValueError("rotary: q, k and v views of one SplitK have a bias each or none")
    return (q.splits, q.part.stride(0), tuple(x.part[0] if x is not None else None for x in (q, k, v)), biases,
            q.dtype)


def _launch(positions, q, k, cos_sin, v=None, k_cache=None, v_cache=None, slot_mapping=None, k_scales=None,
            v_scales=None):
    splits, stride_split, (q, k, v), biases, dtype = _splits_of(q, k, v)
    if splits is not None and any(x.stride(-1) != 1 for x in (q, k, v) if x is not None):
        raise ValueError("rotary: a SplitK's last dim must be contiguous")  # a copy would take split 0 alone
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    write_kv = v is not None
    if write_kv and v.stride(-1) != 1:
        v = v.contiguous()
    tokens, q_heads, dim = q.shape
    qo = torch.empty(q.shape, dtype=dtype, device=q.device)
    ko = qo if write_kv else torch.empty(k.shape, dtype=dtype, device=k.device)
    if tokens:
        half = dim // 2
        cache = k_cache if write_kv else qo
        extra = (v, k_cache, v_cache, slot_mapping, v.stride(0), v.stride(1)) if write_kv else (q, qo, qo, positions,
                                                                                            0, 0)
        scales = scale_args(k_cache, k_scales, v_cache, v_scales) if write_kv else (qo, qo, 0, 0)
        heads, block_half = max(q_heads, k.shape[1]), next_pow2(half)
        if splits is None:
            # one program per token: q, k and v are all in registers at once: 4 warps up to 32 heads x 64
            # (measured), more warps beyond (64 heads of 128 spilled with 4: 255 registers, offline ptxas for sm_90)
            block_h = next_pow2(heads)
            warps = min(16, max(4, block_h * block_half // 512))
        else:  # S partial sums per value to read: one head per program (32 programs at one token of 32 heads),
            # up to 2 values of each tensor per thread (S x 6 x 2 registers for the loads). Nothing here depends
            # on the token count: the compiled variant is the same for every batch of one plan's split count
            block_h = 1
            warps = max(1, block_half // 64)
        _rotary_kernel[(tokens, cdiv(heads, block_h))](
            positions, q, k, qo, ko, cos_sin, q_heads, k.shape[1], half, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), cos_sin.stride(0), *extra, cache.stride(0), cache.stride(1),
            cache.stride(2) if write_kv else 0, *scales, stride_split, *[b if b is not None else qo for b in biases],
            BLOCK_H=block_h, BLOCK_HALF=block_half, WRITE_KV=write_kv, INT8=write_kv and k_cache.dtype == torch.int8,
            BLOCK_SIZE=k_cache.shape[1] if write_kv else 1, SPLITK=splits is not None, SPLITS=splits or 1,
            HAS_BIAS=biases[0] is not None, PDL=pdl(q), TRIG=early_trigger(q), num_warps=warps,
            enable_fp_fusion=False)  # no FMA: round each product like torch
    return qo, ko


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rotary_ref`: rotate q [T, Hq, D] and k [T, Hkv, D] (views are fine: last dim contiguous) by
    positions (int64 [T]) in one launch (q and k may be views of one ``split_k.SplitK``, see
    :func:`rotary_write_kv`); returns new contiguous tensors, equal to the reference's. With PDL the
    kernel reads ``positions`` and ``cos_sin`` before the previous kernel has finished: the kernel launched just
    before must not write them (the engine copies positions in before the forward pass)."""
    return _launch(positions, q, k, cos_sin)


def rotary_write_kv_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotary_ref`, then ``kv_cache.write_kv_cache_ref`` of the rotated k and of v [T, Hkv, D]; returns
    the rotated q. Caches [num_blocks, block_size, Hkv, D]; an int8 cache's scales [num_blocks, Hkv, block_size]
    fp32 (ValueError without); slot_mapping int64 [T], -1 = skip."""
    qr, kr = rotary_ref(positions, q, k, cos_sin)
    write_kv_cache_ref(kr, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    return qr


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`rotary_write_kv_ref` in one launch (a decode step's rotary and KV write, fused): the same
    values in q and in the caches (an int8 cache's codes and scales included). The two caches must share dtype
    and strides (as the model runner allocates them), and so must two int8 caches' scales (ValueError).
    ``positions`` and ``cos_sin``: as for :func:`rotary`. q, k and v may be views of one ``split_k.SplitK`` (the
    q/k/v projection with its split-K sums left to this kernel): each value's splits are added as it is loaded,
    giving the bits the summed product would have given; the rotated q comes in the SplitK's dtype. ValueError for
    a mix of tensors and SplitK views, views of which only some have a bias, or a SplitK whose last dim is not
    contiguous."""
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("rotary_write_kv: k_cache and v_cache must have the same dtype and strides")
    return _launch(positions, q, k, cos_sin, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)[0]
