"""PagedAttention over a block table (Kwon et al., SOSP 2023): torch references for prefill and decode, and
their Triton kernels (online softmax as in FlashAttention-2, Dao 2023; split-KV with a log-sum-exp merge as in
Flash-Decoding, Dao et al. 2023).

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim] per layer (see ``kv_cache.py``; an int8 cache
comes with fp32 scales [num_blocks, num_kv_heads, block_size], applied to the scores and to the softmax weights
in the kernels, so that K and V tiles convert from int8 exactly). Grouped-query
attention: query head h reads KV head ``h // (num_q_heads // num_kv_heads)``. Sliding-window attention (Mistral
7B v0.1; Jiang et al., 2023): with ``window`` W > 0 a query at position p sees keys p - W + 1 .. p only
(transformers' mask, ``kv_idx > q_idx - sliding_window``). The references compute
sequences one at a time (a sequence's result does not depend on the rest of the batch), and within a sequence
``ROW_GROUP`` positions a call, in calls whose shapes and strides depend on the positions alone, so a row's result
does not depend on how many rows of its sequence are computed together (prefill = decode, bit for bit, on CPU).
"""
from __future__ import annotations

import functools

import torch

from .kv_cache import check_int8_scales, dequantize_int8_ref, scale_args
from ._triton import (cdiv, device_fn, dot_f32, early_trigger, hopper, jit, next_pow2, num_sms, pdl, pdl_trigger,
                      pdl_wait, tl)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's K or V: [length, num_kv_heads, head_dim], in the cache's dtype,
    or dequantized to fp32 for an int8 cache (``scales`` [num_blocks, H, block_size] fp32, ValueError without).

    cache: [num_blocks, block_size, H, D]; block_table: int [>= ceil(length / block_size)].
    """
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    blocks = block_table[:nblocks].long()
    if cache.dtype == torch.int8:
        check_int8_scales(cache, scales)
        return dequantize_int8_ref(cache[blocks].flatten(0, 1)[:length],
                                   scales[blocks].transpose(1, 2).flatten(0, 1)[:length])
    return cache[blocks].flatten(0, 1)[:length]


#: Query positions per attention call of the references: positions ``R*g .. R*g + R - 1`` of a sequence go
#: together (absent ones as zero rows), over keys ``0 .. R*g + R - 1`` (absent ones zero, all past a row's own
#: position masked), so the call a position lands in has the same shape whether it is prefilled or decoded. 8 on 2
#: CPU cores (9 query heads of 64, bf16): a decode call 118 us at 100 keys against 157 with 16 and 103 with 4; a
#: 2,048-token prompt's attention 65 ms a layer against 59 and 85 (one SDPA call per row: about 110 us, 425 ms).
ROW_GROUP = 8


def _group_keys(g: int, window: int) -> tuple[int, int]:
    """The keys [lo, hi) of row group ``g``'s call: up to the group's last position, from the first key its first
    row can see (``window`` W > 0), rounded down to a multiple of ``ROW_GROUP``. A function of g alone."""
    hi = (g + 1) * ROW_GROUP
    lo = max(0, (g * ROW_GROUP - window + 1) // ROW_GROUP * ROW_GROUP) if window else 0
    return lo, hi


@functools.lru_cache(maxsize=None)
def _future_keys(rows: int, group: int, device: torch.device) -> torch.Tensor:
    """bool [rows * group, rows]: which of a row group's own keys each of its rows (position r, one of ``group``
    query heads) must not see: those past r. ``rows``: ``ROW_GROUP``."""
    pos = torch.arange(rows, device=device)
    return (pos[None, :] > pos[:, None]).repeat_interleave(group, dim=0)


def _window_hidden(first: int, num_keys: int, group: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [ROW_GROUP * group, num_keys]: the keys before each row's window (keys from ``first``, relative to the
    group's first position)."""
    pos = torch.arange(ROW_GROUP, device=device).repeat_interleave(group)[:, None]
    return torch.arange(first, first + num_keys, device=device)[None, :] <= pos - window


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions of a ``kv_len`` context, ``ROW_GROUP`` positions a call.

    q: [q_len, Hq, D]; k, v: [kv_len, Hkv, D]. Query i sits at position p = kv_len - q_len + i and attends to keys
    0..p (``window`` W > 0: max(0, p - W + 1)..p). Returns [q_len, Hq, D].

    Row-invariant on purpose: position p is computed in the call of its row group g = p // ROW_GROUP, whose shapes
    and strides (ROW_GROUP positions x the query heads of a KV head, against the keys of :func:`_group_keys`)
    depend on g alone, its operands 64-byte aligned whenever Hkv * D is even; rows and keys that are absent (not in
    this chunk, not written yet) are zeros, and the keys past p get weight exactly 0 (so they must be finite: 0 x
    inf is NaN; the engine's K/V are). A GEMM, a masked fill and a softmax over the last dim compute each output
    element from its own row and column in an order fixed by the shapes, so a token recomputed by a prefill (after
    a preemption, or after a prefix-cache hit) matches, bit for bit, the decode that first produced it (checked
    with MKL at 1 and 2 threads, and across them). One SDPA call per row did the same at 5-7x the time of a long
    prefill on the CPU.

    16-bit inputs are computed in float32 (an exact upcast; the result is rounded to q's dtype once).
    """
    q_len, kv_len, heads, dim = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    start = kv_len - q_len
    g0, g1 = start // ROW_GROUP, (kv_len - 1) // ROW_GROUP
    end = (g1 + 1) * ROW_GROUP
    dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    base = _group_keys(g0, window)[0]  # the first key any call reads (0 without a window)
    # K and V of positions base .. end - 1 (zeros from kv_len), each [Hkv, end - base, D] (strides independent of
    # base and end)
    kv = torch.zeros(2, end - base, kv_heads, dim, dtype=dtype, device=q.device)
    kv[0, :kv_len - base], kv[1, :kv_len - base] = k[base:], v[base:]
    keys, values = kv.transpose(1, 2)
    # per row group, a KV head's query heads side by side: [Hkv, ROW_GROUP, group, D], each group's block contiguous
    rows = torch.zeros(g1 - g0 + 1, kv_heads, ROW_GROUP, group, dim, dtype=dtype, device=q.device)
    out = torch.empty(g1 - g0 + 1, ROW_GROUP, kv_heads, group, dim, dtype=dtype, device=q.device)
    for g in range(g0, g1 + 1):
        first, last = max(start, g * ROW_GROUP), min(kv_len, (g + 1) * ROW_GROUP)  # this group's positions in q
        rows[g - g0, :, first - g * ROW_GROUP:last - g * ROW_GROUP] = (
            q[first - start:last - start].reshape(-1, kv_heads, group, dim).transpose(0, 1))
        lo, hi = _group_keys(g, window)
        scaled = rows[g - g0].view(kv_heads, -1, dim).mul_(scale)
        scores = torch.matmul(scaled, keys[:, lo - base:hi - base].transpose(1, 2))
        own = scores[..., -ROW_GROUP:]  # the group's own keys
        own.masked_fill_(_future_keys(ROW_GROUP, group, q.device), -torch.inf)
        if window:
            scores.masked_fill_(_window_hidden(lo - g * ROW_GROUP, hi - lo, group, window, q.device), -torch.inf)
        # [Hkv, ROW_GROUP * group, D]
        attended = torch.matmul(torch.softmax(scores, dim=-1), values[:, lo - base:hi - base])
        out[g - g0] = attended.view(kv_heads, ROW_GROUP, group, dim).transpose(0, 1)
    first = start - g0 * ROW_GROUP
    return out.view(-1, heads, dim)[first:first + q_len].to(q.dtype)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                               window: int = 0) -> torch.Tensor:
    """One new query token per sequence attends to its whole context (its own K/V already written), or to its last
    ``window`` tokens (> 0: sliding-window attention).

    q: [B, Hq, D]; block_tables: int32 [B, max_blocks]; context_lens: int32 [B] (tokens in cache, >= 1); an int8
    cache's scales [num_blocks, Hkv, block_size] fp32 (its values are dequantized, then cast to q's dtype).
    Returns [B, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = gather_kv(k_cache, block_tables[b], n, k_scales).to(q.dtype)
        v = gather_kv(v_cache, block_tables[b], n, v_scales).to(q.dtype)
        out[b] = _attend(q[b:b + 1], k, v, scale, window)[0]
    return out


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, k_scales: torch.Tensor | None = None,
                                v_scales: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves (K/V already written);
    ``window`` > 0: each over its last ``window`` positions.

    q: [T, Hq, D], the new tokens of S sequences packed back to back; cu_seqlens_q: int32 [S + 1] offsets into q;
    context_lens: int32 [S] = cached prefix + new tokens; block_tables: int32 [S, max_blocks]; scales as
    :func:`paged_attention_decode_ref`.
    Returns [T, Hq, D] in q's dtype. Each row equals bit for bit what :func:`paged_attention_decode_ref` returns for
    that position (see :func:`_attend`), so prefill, chunked prefill, prefix-cache hits and recompute after
    preemption all give the tokens plain decoding gives.
    """
    out = torch.empty_like(q)
    for s in range(cu_seqlens_q.shape[0] - 1):
        lo, hi = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n = int(context_lens[s])
        k = gather_kv(k_cache, block_tables[s], n, k_scales).to(q.dtype)
        v = gather_kv(v_cache, block_tables[s], n, v_scales).to(q.dtype)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, window)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. Scores live in the log2 domain: s = q.k * scale * log2(e), so exp2 replaces exp.

LOG2E = 1.4426950408889634
#: An int8 cache's softmax weights times V scales are multiplied by this (a power of two: exact) before they are
#: rounded to fp16 for P.V, and the output divided by it (:func:`_online_softmax_step`).
INT8_V_BOOST = tl.constexpr(1024.0) if tl is not None else 1024.0


@device_fn
def _online_softmax_step(q, k, v, mask, m_i, l_i, acc, scale_log2, ks, vs, KV_INT8: tl.constexpr):
    """One KV tile of FlashAttention-2's online softmax: q [M, D], k/v [N, D], mask [M, N] (False = not seen; None:
    every key seen); running row max m_i and sum l_i [M] (log2 domain), unnormalised output acc [M, D] fp32.
    Returns the new three.
    KV_INT8: k and v hold int8 codes (converted exactly), ``ks`` / ``vs`` [N] fp32 their tokens' scales: the scores
    are q.k times ks, the weights of V times vs (one multiply per token, not per value) and times
    :data:`INT8_V_BOOST` (the kernels take it off at the end): P.V's fp16 operand p vs alone would sink into fp16's
    subnormals for a token whose max|v| is below about 8e-3; boosted it stays normal down to 8e-6 and finite up to
    8,128 (a tile-wise normalisation, exact at any size, measured 6-10% slower on an H200)."""
    s = tl.dot(q, tl.trans(k))
    if KV_INT8:
        s = s * ks[None, :]
    if mask is None:
        s = s * scale_log2
    else:
        s = tl.where(mask, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (padding rows)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    if KV_INT8:
        p = p * (vs * INT8_V_BOOST)[None, :]
    return m_new, l_new, acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)


@device_fn
def _kv_scales(ks_ptr, vs_ptr, page, row, kvh, stride_sb, stride_sh, tmask, KV_INT8: tl.constexpr):
    """The scales [N] (fp32, 0 where ``tmask`` is False) of a tile's tokens (block ``page`` [N], offset ``row`` [N])
    in an int8 cache's ks / vs [num_blocks, Hkv, block_size]; two zeros without KV_INT8 (unused)."""
    if KV_INT8:
        off = page * stride_sb + kvh * stride_sh + row
        ks, vs = tl.load(ks_ptr + off, mask=tmask, other=0.0), tl.load(vs_ptr + off, mask=tmask, other=0.0)
    else:
        ks, vs = 0.0, 0.0
    return ks, vs


@device_fn
def _kv_tile(ptrs, mask, dtype, BYTES: tl.constexpr, INT8: tl.constexpr):
    """A K or V tile [BLOCK_N, BLOCK_D] in the products' ``dtype``, 0 where ``mask`` is False. BYTES: the cache's
    bytes converted to fp16 by inline PTX, four per call, exactly: fp8 e4m3 by ``cvt.rn.f16x2.e4m3x2``; int8 (INT8)
    by putting each byte, its sign bit flipped (c + 128), under fp16's exponent for 1024 (``prmt``), and taking
    1152 off (``sub.f16x2``; the magic-number conversion of Kim et al., 2022). Triton's own ``.to`` moves an fp8
    tile's conversion behind shared memory, read back by scalar loads (about four times the ``LDS`` of a bf16
    tile); this one is opaque to that. H200 probe, same settings (bench/RESULTS.md, seventh session): 216 vs 250 us
    at B = 64, 4k context, 8 KV heads; 428 vs 563 at B = 256, 608, 32 KV heads."""
    if BYTES and INT8:
        x = tl.inline_asm_elementwise(
            "{ .reg .b32 u, m, c, lo, hi; xor.b32 u, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 c, 0x64806480; "
            "prmt.b32 lo, u, m, 0x5140; prmt.b32 hi, u, m, 0x7362; sub.f16x2 $0, lo, c; sub.f16x2 $1, hi, c; }",
            "=r,=r,r", [tl.load(ptrs, mask=mask, other=0)], dtype=tl.float16, is_pure=True, pack=4)
    elif BYTES:
        x = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [tl.load(ptrs, mask=mask, other=0)], dtype=tl.float16, is_pure=True, pack=4)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(dtype)
    return x


@device_fn
def _kv_tiles(kc_ptr, vc_ptr, bt_row, ks_ptr, vs_ptr, t0, kv_end, kvh, stride_kb, stride_kt, stride_kh, stride_vb,
              stride_vt, stride_vh, stride_sb, stride_sh, dtype, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_BYTES: tl.constexpr, KV_INT8: tl.constexpr):
    """The KV tile of tokens t0 .. t0 + BLOCK_N of one sequence (block table row ``bt_row``), KV head ``kvh``:
    (tok [BLOCK_N], tmask = tok < kv_end, k and v [BLOCK_N, BLOCK_D] in ``dtype`` (0 past kv_end), an int8 cache's
    scales ks and vs [BLOCK_N]: :func:`_kv_scales`)."""
    tok = t0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    tmask = tok < kv_end
    page = tl.load(bt_row + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    row = (tok % BLOCK_SIZE)[:, None]
    kvmask = tmask[:, None] & (d < DIM)[None, :]
    k = _kv_tile(kc_ptr + page[:, None] * stride_kb + row * stride_kt + kvh * stride_kh + d[None, :], kvmask, dtype,
                 KV_BYTES, KV_INT8)
    v = _kv_tile(vc_ptr + page[:, None] * stride_vb + row * stride_vt + kvh * stride_vh + d[None, :], kvmask, dtype,
                 KV_BYTES, KV_INT8)
    ks, vs = _kv_scales(ks_ptr, vs_ptr, page, tok % BLOCK_SIZE, kvh, stride_sb, stride_sh, tmask, KV_INT8)
    return tok, tmask, k, v, ks, vs


@device_fn
def _to_f16(q):
    """q for an fp8 or int8 cache: the products run in fp16, into which e4m3 values and int8 codes convert exactly
    (fp8: two values per instruction; to bf16 takes a scalar conversion per value: 10-14% slower decode on an H200,
    bench/RESULTS.md).
    q is clamped to fp16's range (+-65504); p is rounded to fp16, finer than bf16."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@device_fn
def _split_tokens(ctx, num_splits, TILE: tl.constexpr):
    """Tokens per split of a sequence with ``ctx`` tokens: its context spread evenly over the ``num_splits`` splits
    in whole tiles of TILE tokens (at least one). The split count is fixed by shapes (a CUDA graph keeps it), the
    spread by the context: a short context in a wide block table (a graph's are ``max_model_len`` wide) runs on
    min(splits, cdiv(ctx, TILE)) splits, not all in the first one. H200, 7B bs1 engine at about 160 tokens in
    1,024-token tables: 1,984-2,004 µs per step against 2,075-2,096 with each split's token range fixed by the table
    (bench/RESULTS.md, ninth session). At least ``cdiv(ctx, num_splits)``, so ``cdiv(ctx, chunk) <= num_splits``."""
    return ((ctx - 1) // (num_splits * TILE) + 1) * TILE  # cdiv(cdiv(ctx, num_splits), TILE) tiles, ctx >= 1


@jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, po_ptr, plse_ptr, scale_log2,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_bt, stride_ob, stride_oh, num_splits, ks_ptr, vs_ptr, stride_sb, stride_sh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                   KV_FP8: tl.constexpr, KV_BYTES: tl.constexpr, KV_INT8: tl.constexpr, WINDOW: tl.constexpr,
                   PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (B, Hkv, splits): the GROUP query heads of one KV head attend to tokens [lo + split*chunk, +chunk) of
    one sequence, chunk = :func:`_split_tokens` of its span: its context (lo = 0) or, with a sliding WINDOW > 0,
    its last WINDOW tokens (lo = ctx - WINDOW, at least 0); every KV tile is loaded once for the whole group.
    Without SPLIT the result goes to ``out``; with it, the normalised partial output to ``po`` [B, Hq, splits, D]
    fp32 and its log2-sum-exp to ``plse`` [B, Hq, splits]. A split past the context (but split 0) exits before the
    PDL wait, writing nothing (the merge skips it): a graph's tables are ``max_model_len`` wide, so at a short
    context most of the grid is such splits (H200, bs1 at ~160 tokens in 32k-token tables, 64 splits: 2,248
    against 2,265 µs per step of a Llama-3.1-8B shape with them waiting, 2,242 in 1k-token tables;
    bench/RESULTS.md, twenty-second session). KV_FP8 / KV_BYTES / KV_INT8: see :func:`_cache_args`."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)  # a step input, not the previous kernel's output: readable before the wait
    lo = tl.maximum(ctx - WINDOW, 0) if WINDOW else 0
    chunk = _split_tokens(ctx - lo, num_splits, BLOCK_N)
    start = lo + split * chunk
    if split > 0 and start >= ctx:  # a split past the context reads and writes nothing: it exits without waiting
        return  # (split 0 always waits: every grid has programs that wait, so none can overtake the kernel before)
    pdl_wait(PDL)
    end = tl.minimum(ctx, start + chunk)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = (g < GROUP)[:, None] & (d < DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    elif KV_FP8 or KV_BYTES:
        q = _to_f16(q)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok, tmask, k, v, ks, vs = _kv_tiles(kc_ptr, vc_ptr, bt_ptr + b * stride_bt, ks_ptr, vs_ptr, t0, end, kvh,
                                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                             stride_sb, stride_sh, q.dtype, DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                             KV_BYTES, KV_INT8)
        m_i, l_i, acc = _online_softmax_step(q, k, v, tmask[None, :], m_i, l_i, acc, scale_log2, ks, vs, KV_INT8)
    pdl_trigger(TRIG)
    if KV_INT8:
        acc = acc * (1.0 / INT8_V_BOOST)
    acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    if SPLIT:
        row_off = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(po_ptr + row_off[:, None] * DIM + d[None, :], acc, mask=gmask)
        tl.store(plse_ptr + row_off, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=g < GROUP)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=gmask)


@jit
def _merge_kernel(po_ptr, plse_ptr, ctx_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                  DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, TILE: tl.constexpr,
                  WINDOW: tl.constexpr, PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (B, Hq): combine the valid splits (those that start inside the span: TILE and WINDOW are the decode
    kernel's BLOCK_N and WINDOW) by their log2-sum-exp."""
    pdl_wait(PDL)
    b, h = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    span = tl.minimum(ctx, WINDOW) if WINDOW else ctx
    chunk = _split_tokens(span, num_splits, TILE)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    # the live splits, at most num_splits (see _split_tokens); split 0 at least (a 0-token span, against the
    # contract, has chunk 0: no division by 0)
    smask = sp < tl.maximum((span + chunk - 1) // tl.maximum(chunk, 1), 1)
    row = (b * tl.num_programs(1) + h) * num_splits + sp
    lse = tl.load(plse_ptr + row, mask=smask, other=float("-inf"))
    o = tl.load(po_ptr + row[:, None] * DIM + d[None, :], mask=smask[:, None] & (d < DIM)[None, :], other=0.0)
    pdl_trigger(TRIG)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)


#: the most splits of one sequence's context: a graph's tables are max_model_len wide, and at a short context the
#: splits past it are programs that start and exit. H200, bs1 decode of a Llama-3.1-8B shape at ~160 tokens:
#: 311 tok/s with 131,072-token tables (512 splits) against 442 capped at 64, 462 with 1,024-token tables
#: (bench/RESULTS.md, twenty-first session); 64 is the sweeps' choice at 16k tokens
MAX_SPLITS = 64


def decode_split_chunk(batch: int, kv_heads: int, max_tokens: int, sms: int) -> int:
    """Tokens per split of the decode kernel for a context as long as the block table (a multiple of 64), or
    ``max_tokens`` rounded up (no split) when ``batch * kv_heads`` programs already fill the GPU. ``max_tokens`` is
    the block table's width in tokens; ``cdiv(max_tokens, chunk)`` is the number of splits, at most
    :data:`MAX_SPLITS`. A shorter context is spread over the same splits (``_split_tokens``, in the kernel), so a
    CUDA graph's tables can be ``max_model_len`` wide. Depends only on shapes, so a graph keeps it."""
    programs = batch * kv_heads
    whole = cdiv(max(max_tokens, 1), 64) * 64
    if programs >= 2 * sms:
        return whole
    if programs <= 16:  # H200 sweeps (bench/RESULTS.md): 64 up to 4k tokens (7.1 vs 7.8 µs for 128 at 1k, 11.4
        # vs 12.7 at 4k), 128 up to 8k, 256 beyond (23.7 µs at 16k)
        chunk = 64 if max_tokens <= 4096 else 128 if max_tokens <= 8192 else 256
    else:  # about four splits, 256 to 2048 tokens each
        chunk = min(2048, max(256, next_pow2(cdiv(max_tokens, 4))))
    return min(max(chunk, next_pow2(cdiv(max(max_tokens, 1), MAX_SPLITS))), whole)


def _cache_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                v_scales: torch.Tensor | None):
    """The caches as the kernels take them, their scale arguments (``kv_cache.scale_args``: ks, vs, stride_sb,
    stride_sh) and their KV_FP8 / KV_BYTES / KV_INT8 constexprs: KV_FP8 for an fp8 e4m3 cache, KV_INT8 for an int8
    one (its scales applied per token: :func:`_online_softmax_step`). Compiled, either goes in as uint8 views with
    KV_BYTES, converted exactly to fp16 by :func:`_kv_tile`, the products in fp16 (:func:`_to_f16`); interpreted,
    as it is, converted by ``.to`` (the interpreter has no inline PTX)."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"paged attention: K and V caches differ in dtype ({k_cache.dtype}, {v_cache.dtype})")
    scales = scale_args(k_cache, k_scales, v_cache, v_scales)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    int8 = k_cache.dtype == torch.int8
    if (fp8 or int8) and not dot_f32(q):
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales, dict(KV_FP8=fp8, KV_BYTES=True,
                                                                                    KV_INT8=int8)
    return k_cache, v_cache, scales, dict(KV_FP8=fp8, KV_BYTES=False, KV_INT8=int8)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                           window: int = 0) -> torch.Tensor:
    """Triton :func:`paged_attention_decode_ref` (same arguments and result), without host syncs (graph-safe).

    q: [B, Hq, D] (last dim contiguous); caches [num_blocks, block_size, Hkv, D], any float dtype (converted to
    q's on load; an fp8 e4m3 cache computes in fp16 on the GPU, see ``_to_f16``; an int8 cache needs its fp32
    scales [num_blocks, Hkv, block_size], K's and V's of equal strides: ValueError otherwise); block_tables int32 [B,
    max_blocks]; context_lens int32 [B], each >= 1 and <= max_blocks * block_size. Splits each context evenly
    (:func:`decode_split_chunk` sets the number of splits from the shapes, ``_split_tokens`` spreads a sequence's
    context over them) when B * Hkv is too small to fill the GPU, then merges them in a second launch.
    """
    config = DECODE_CONFIG
    if k_cache.dtype == torch.float8_e4m3fn:
        config = DECODE_CONFIG_FP8 if q.shape[1] > k_cache.shape[2] else DECODE_CONFIG_FP8_MHA
    elif k_cache.dtype == torch.int8:
        config = DECODE_CONFIG_INT8
    return decode_with(q, k_cache, v_cache, block_tables, context_lens, scale, k_scales=k_scales, v_scales=v_scales,
                       window=window, **config)


#: Tile and launch settings of the decode kernel (measured on an H200: bench/gpu_suite.py --sweep).
DECODE_CONFIG = dict(block_n=64, num_warps=4, num_stages=3)
#: The same for an fp8 cache with grouped KV heads (GQA): 128 fp8 tokens are the bytes of the bf16 tile, and two
#: warps beat four (H200 probes, bench/RESULTS.md, seventh session: 193 us at B = 64, 4k context, 8 KV heads,
#: against 221 with four warps and 284 with the bf16 settings). :func:`decode_with` narrows the tile to the chunk
#: when the context is split finer (B = 1 up to 4k: 64 tokens per split).
DECODE_CONFIG_FP8 = dict(block_n=128, num_warps=2, num_stages=2)
#: fp8 without grouping (one query head per KV head, as Llama-2-7B): 64 tokens (B = 256, 32 KV heads, 608 tokens:
#: 409 us against 460 with 128 and 601 for the bf16 cache; 140 against 199 at 200 tokens).
DECODE_CONFIG_FP8_MHA = dict(block_n=64, num_warps=2, num_stages=2)
#: An int8 cache (H200 sweep of block_n 32/64/128, 2/4/8 warps, 2/3 stages, bench/RESULTS.md, twelfth session):
#: 8 KV heads, B = 64, 4k context 207.5 us (bf16 cache 250.5, fp8 190.0, the bf16 settings 321.5), 16k 800.6
#: (975.8, 741.3); 32 KV heads, B = 256, 608 tokens, 519 (bf16 599, fp8 408; 64 tokens best there too).
DECODE_CONFIG_INT8 = dict(block_n=64, num_warps=2, num_stages=3)


def decode_tile(block_n: int, chunk: int) -> int:
    """The decode kernel's KV tile in tokens: ``block_n``, narrowed to the largest power of two <= ``chunk`` (at
    least 16, ``tl.dot``'s minimum) when the splits are shorter. Splits are whole tiles (``_split_tokens``), so a
    narrower tile lets a short context run on more splits."""
    return min(block_n, max(16, 1 << (chunk.bit_length() - 1)))


def decode_with(q, k_cache, v_cache, block_tables, context_lens, scale: float, chunk: int | None = None,
                block_n: int = 64, num_warps: int = 4, num_stages: int = 3, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """:func:`paged_attention_decode` with explicit settings (the benchmark sweeps them): ``chunk`` tokens per
    split at a full block table (or a full sliding ``window``, when narrower), which sets ``cdiv(width, chunk)``
    splits (None = :func:`decode_split_chunk`; a shorter context is spread over them in whole tiles), KV tile
    ``block_n`` tokens (narrowed to a power of two <= the chunk)."""
    batch, q_heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * block_size
    if window:
        max_tokens = min(max_tokens, window)  # no sequence attends over more
    if chunk is None:
        chunk = decode_split_chunk(batch, kv_heads, max_tokens, num_sms(q.device))
    splits = cdiv(max_tokens, chunk)
    block_n = decode_tile(block_n, chunk)
    if splits > 1:
        po = torch.empty(batch, q_heads, splits, dim, dtype=torch.float32, device=q.device)
        plse = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
    else:
        po = plse = out
    kc, vc, scale_meta, kv_meta = _cache_args(q, k_cache, v_cache, k_scales, v_scales)
    block_d = max(16, next_pow2(dim))
    if kv_meta["KV_BYTES"] and block_n * block_d < 4 * 32 * num_warps:  # the conversion takes 4 bytes per thread
        raise ValueError(f"paged attention: a byte tile of {block_n} x {block_d} is too small for {num_warps} warps; "
                         "use a larger block_n or fewer warps")
    _decode_kernel[(batch, kv_heads, splits)](
        q, kc, vc, block_tables, context_lens, out, po, plse, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), splits, *scale_meta, GROUP=group, BLOCK_G=max(16, next_pow2(group)), DIM=dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=splits > 1,
        DOT_F32=dot_f32(q), WINDOW=window, PDL=pdl(q), TRIG=early_trigger(q), num_warps=num_warps,
        num_stages=num_stages, **kv_meta)
    if splits > 1:
        _merge_kernel[(batch, q_heads)](po, plse, context_lens, out, splits, out.stride(0), out.stride(1),
                                        DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_S=next_pow2(splits), TILE=block_n,
                                        WINDOW=window, PDL=pdl(q), TRIG=early_trigger(q), num_warps=4)
    return out


@jit(do_not_specialize=("num_seqs", "stride_bt"))  # both change from step to step
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, scale_log2, num_seqs,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh, ks_ptr, vs_ptr, stride_sb, stride_sh,
                    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                    DOT_F32: tl.constexpr, KV_FP8: tl.constexpr, KV_BYTES: tl.constexpr, KV_INT8: tl.constexpr,
                    MASK_FREE: tl.constexpr, DIAG_STAGES: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
                    TRIG: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M) + S, Hq): one tile of BLOCK_M new tokens of one sequence, one query head.

    Sequence s owns tiles from ``cu[s] // BLOCK_M + s`` on (an upper bound of the tiles before it), found by binary
    search; tiles past a sequence's new tokens do nothing. Query i of a sequence with context c and n new tokens
    sits at position c - n + i and sees keys 0..c - n + i (a cached prefix, then causal). MASK_FREE: the KV tiles
    that every row of the query tile sees whole run without the causal mask, the rest (up to cdiv(BLOCK_M - 1,
    BLOCK_N) + 1 tiles) with it and DIAG_STAGES pipeline stages: the same values, and on an H200
    (bench/RESULTS.md, twenty-second session) 162 against 187 µs for 2,048 new tokens, 810 against 1,000 after a
    6,144-token prefix (32 heads, D 128). Else every tile takes the mask (the two loops spill registers on sm_86
    and sm_89, where nothing measured them). A sliding WINDOW > 0 (MASK_FREE false): the tiles from the one the
    tile's first row sees first, each key also masked below its row's window. KV_FP8 / KV_BYTES / KV_INT8: see
    :func:`_cache_args`.
    """
    pdl_wait(PDL)
    tile, h = tl.program_id(0), tl.program_id(1)
    lo = 0
    hi = num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        ok = tl.load(cu_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    seq = lo
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    row0 = (tile - q_start // BLOCK_M - seq) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    q_pos = ctx - q_len + rows
    d = tl.arange(0, BLOCK_D)
    dmask = (d < DIM)[None, :]
    kvh = h // GROUP
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    elif KV_FP8 or KV_BYTES:
        q = _to_f16(q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    live = row0 < q_len
    kv_end = tl.where(live, tl.minimum(ctx, ctx - q_len + row0 + BLOCK_M), 0)  # the tile's last row sees these
    bt_row = bt_ptr + seq * stride_bt
    if MASK_FREE:
        kv_all = tl.where(live, (ctx - q_len + row0 + 1) // BLOCK_N * BLOCK_N, 0)  # whole KV tiles every row sees
        for t0 in range(0, kv_all, BLOCK_N):  # below the diagonal: no mask
            tok, tmask, k, v, ks, vs = _kv_tiles(kc_ptr, vc_ptr, bt_row, ks_ptr, vs_ptr, t0, kv_end, kvh, stride_kb,
                                                 stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_sb,
                                                 stride_sh, q.dtype, DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, KV_BYTES,
                                                 KV_INT8)
            m_i, l_i, acc = _online_softmax_step(q, k, v, None, m_i, l_i, acc, scale_log2, ks, vs, KV_INT8)
    else:  # from the first tile the first row sees (with a sliding window, its window's first key)
        kv_all = tl.maximum(ctx - q_len + row0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N if WINDOW else 0
    for t0 in tl.range(kv_all, kv_end, BLOCK_N, num_stages=DIAG_STAGES):  # each row sees keys up to its position
        tok, tmask, k, v, ks, vs = _kv_tiles(kc_ptr, vc_ptr, bt_row, ks_ptr, vs_ptr, t0, kv_end, kvh, stride_kb,
                                             stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_sb,
                                             stride_sh, q.dtype, DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, KV_BYTES, KV_INT8)
        if WINDOW:  # 0 <= q_pos - tok < WINDOW in one unsigned compare (tok <= q_pos implies tok < kv_end for the
            # tile's real rows): two compares spilled registers on sm_86 / sm_89
            causal = (q_pos[:, None] - tok[None, :]).to(tl.uint32) < WINDOW
        else:
            causal = tmask[None, :] & (tok[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, scale_log2, ks, vs, KV_INT8)
    pdl_trigger(TRIG)
    if KV_INT8:
        acc = acc * (1.0 / INT8_V_BOOST)
    acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask)


#: Binary-search steps of the prefill kernel (a program finding its sequence) for up to 511 sequences, whatever
#: their number: one compiled variant for every step (surplus steps keep the answer), where the number of steps
#: as a constexpr compiled a new variant, at serving time, for each new bit length of the batch.
PREFILL_SEARCH_STEPS = 9


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Triton :func:`paged_attention_prefill_ref` (same arguments and result): all sequences in one launch, no host
    sync. q: [T, Hq, D] (last dim contiguous); cu_seqlens_q int32 [S + 1]; context_lens int32 [S] (cached prefix +
    new tokens); block_tables int32 [S, max_blocks]; caches and scales as :func:`paged_attention_decode`."""
    return prefill_with(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scales=k_scales,
                        v_scales=v_scales, window=window)


#: Tile and launch settings of the prefill kernel on Hopper, its KV tiles below the diagonal without the mask. H200
#: sweep (bench/RESULTS.md, twenty-second session), 32 q heads, D 128: 4 stages against 2, 154 against 162 µs for
#: 2,048 new tokens, 756 against 809 after a 6,144-token prefix, 51 against 66 for 8 x 256 (3% slower at most).
#: 128 x 128 tiles on 8 warps, 3 stages, were 7% faster still with a long prefix but need more shared memory than
#: an RTX card has (99 KB); the 7B engine's time to first token did not move with either (2,048 and 8,000 tokens).
PREFILL_CONFIG = dict(block_m=64, block_n=64, num_warps=4, num_stages=4, mask_free=True)
#: Before Hopper: every KV tile masked, 2 stages (the settings before the sweep; the mask-free loops spill
#: registers on sm_86 / sm_89, and no such GPU measured them).
PREFILL_CONFIG_PRE_HOPPER = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, mask_free=False)
#: Interpreted (CPU): small tiles, the Hopper loops (the tests run both through :func:`prefill_with`).
PREFILL_CONFIG_INTERPRETED = dict(block_m=16, block_n=16, num_warps=4, num_stages=2, mask_free=True)


def prefill_config(q: torch.Tensor) -> dict:
    """The prefill settings for ``q``'s device: interpreted, Hopper, or an older GPU."""
    if dot_f32(q):
        return PREFILL_CONFIG_INTERPRETED
    return PREFILL_CONFIG if hopper(q) else PREFILL_CONFIG_PRE_HOPPER


def prefill_with(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale: float,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, window: int = 0,
                 **settings) -> torch.Tensor:
    """:func:`paged_attention_prefill` with some settings of :func:`prefill_config` replaced (probes and tests
    sweep them): ``block_m`` new tokens per query tile, ``block_n`` per KV tile, ``num_warps``, ``num_stages``,
    ``mask_free`` (the tiles below the diagonal without the causal mask; never with a sliding ``window``).
    ValueError for an unknown setting."""
    config = {**prefill_config(q)}
    unknown = set(settings) - set(config)
    if unknown:
        raise ValueError(f"prefill_with: unknown settings {sorted(unknown)}; choose from {sorted(config)}")
    config.update(settings)
    block_m, block_n, mask_free = config["block_m"], config["block_n"], config["mask_free"] and not window
    tokens, q_heads, dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q)
    if tokens == 0 or num_seqs == 0:
        return out
    kc, vc, scale_meta, kv_meta = _cache_args(q, k_cache, v_cache, k_scales, v_scales)
    _prefill_kernel[(cdiv(tokens, block_m) + num_seqs, q_heads)](
        q, kc, vc, block_tables, cu_seqlens_q, context_lens, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), *scale_meta, GROUP=q_heads // k_cache.shape[2], DIM=dim,
        BLOCK_D=max(16, next_pow2(dim)), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        SEARCH_STEPS=max(PREFILL_SEARCH_STEPS, num_seqs.bit_length()), DOT_F32=dot_f32(q), MASK_FREE=mask_free,
        DIAG_STAGES=1 if mask_free else None, WINDOW=window, PDL=pdl(q), TRIG=early_trigger(q),
        num_warps=config["num_warps"], num_stages=config["num_stages"], **kv_meta)
    return out
