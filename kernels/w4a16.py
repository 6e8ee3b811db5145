"""W4A16 linear: ``y = x @ dequantize(qw).T + bias`` straight from the packed weights (fused dequantization).

Consumes :class:`kernels.quant_formats.QuantizedWeight` (every checkpoint format is repacked to it at load):
``qweight`` int32 [K/pf, N] packed along K, ``qzeros`` int32 [G, N/pf] packed along N, ``scales`` fp16/bf16
[G, N], optional act-order ``perm`` [K] (kernel row k reads input channel ``perm[k]``). 2, 4 and 8 bits.

The paths, picked per shape by :func:`choose_plan` (thresholds measured on an H200, see bench/RESULTS.md):

* ``gemv`` (M = 1): CUDA-core split-K GEMV. The scale and zero factor out of each group,
  y_n = sum_g s_gn * sum_{k in g} x_k (q_kn - z_gn), and codes become floats linear in the code without an
  int-to-float conversion (the "magic number" idea of Kim et al., "Who says elephants can't run", 2022): for
  4-bit codes one ``prmt`` per code places a nibble-masked byte under the exponent byte (f = 0.5 + c/256), so a
  weight costs about a ``prmt`` and an FMA. Split-K partial sums are added by the last program of each column
  block in the same launch (an arrival counter), in a fixed order.
* ``mma`` (4-bit, M <= 16): the tensor-core GEMV of :mod:`kernels.w4a16_mma` (``mma.sync`` fed straight from
  the packed words, about 1.9 instructions per weight against the CUDA-core GEMV's 4.2): the measured winner at
  2 <= M <= 8 on every Llama shape and at M = 1 on three of four (bench/RESULTS.md, fifth session).
* ``gemm`` (1 < M <= 64, 2- and 8-bit): tensor-core tile GEMM; each K tile of the weight is dequantized to x's dtype in
  registers (exactly as ``dequantize(qw).to(x.dtype)`` rounds it) and fed to ``tl.dot``; split-K when the output
  tiles alone cannot fill the GPU.
* ``tc`` (4-bit, 1 < M <= 256): ``_gemm_tc_kernel``, the weight tile as the left (register) operand of the tensor
  cores and x's tile read contiguously, pipelined through shared memory.
* ``dequant`` (above M = 256, and group sizes the kernels cannot tile): dequantize the whole weight with a Triton
  kernel, then cuBLAS (``x @ W``).

Plans measured on the GPU at hand (``w4a16_tune``, at the engine's first start) come first, then those measured on
an H200 for the Llama-2-7B shapes (:data:`TUNED`), then rules that follow the H200 sweeps.

Split-K partial sums (fp32) are added in a fixed order, by a second small kernel for the GEMM (and the GEMV with
``serial=False``), in the same launch for the GEMV, or, asked for with ``defer_sum``, by the kernel that reads the
product next (``split_k.SplitK``): results are deterministic, and the same bits, on every path. The GEMV's in-launch
reduction keeps arrival counters in a buffer per (device, stream), touched only after the kernel's PDL wait,
when the kernel before it on the stream (maybe another GEMV) has finished.
Errors: ``ValueError`` for a QuantizedWeight / x mismatch; shapes the fused kernels cannot tile (a group size
with no power-of-two divisor >= 16 for the GEMM) fall back to the ``dequant`` path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import activation, w4a16_mma
from .split_k import MAX_SPLITS, SplitK, as_tensor, sum_splits
from ._triton import cdiv, device_fn, dot_f32, early_trigger, hopper, jit, num_sms, pdl, pdl_trigger, pdl_wait, tl
from .quant_formats import QuantizedWeight

@device_fn
def _load_tile(qw_ptr, s_ptr, z_ptr, k0, k_end, w, n, nmask, N, BITS: tl.constexpr, GROUP: tl.constexpr):
    """The packed words [WORDS, BLOCK_N] of rows k0 .. k0 + BLOCK_K, and that K tile's fp32 scales and integer
    zeros [BLOCK_N] (a tile lies inside one group); zeros from row ``k_end`` (a multiple of the pack factor) on."""
    PF: tl.constexpr = 32 // BITS
    rows = k0 // PF + w
    q = tl.load(qw_ptr + rows[:, None] * N + n[None, :], mask=(rows < k_end // PF)[:, None] & nmask[None, :], other=0)
    grp = k0 // GROUP
    gmask = nmask & (n * 0 + k0 < k_end)
    scale = tl.load(s_ptr + grp * N + n, mask=gmask, other=0.0).to(tl.float32)
    zero = (tl.load(z_ptr + grp * (N // PF) + n // PF, mask=gmask, other=0) >> ((n % PF) * BITS)) & ((1 << BITS) - 1)
    return q, scale, zero


@device_fn
def _load_x_f32(ptrs, mask, K, GATED: tl.constexpr):
    """x at ``ptrs`` as fp32, 0 where ``mask`` is False (None: no mask). GATED: x is cat(gate, up) [2K] and the
    input is silu(gate) * up, rounded as ``activation.silu_and_mul`` rounds it (silu, then the product, each to
    x's dtype), so the fused GEMV sees the very values the separate kernel would write."""
    if mask is None:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        dtype = ptrs.dtype.element_ty
        if mask is None:
            up = tl.load(ptrs + K).to(tl.float32)
        else:
            up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        act = (x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32)
        x = (act * up).to(dtype).to(tl.float32)
    return x


@device_fn
def _gemv_tile(x_ptr, perm_ptr, q, scale, zero, k0, w, K, exp_byte, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
               EVEN_K: tl.constexpr, ASM: tl.constexpr, GATED: tl.constexpr):
    """sum_k x_k (q_kn - z_n) s_n over one K tile, per packed row: [WORDS, BLOCK_N] fp32.

    Codes become floats linear in the code, and one FMA per weight accumulates x f; the group's zero and the
    offset come out once per tile: sum x (c - z) = UP sum x f - (OFF + z) sum x (the cancellation costs ~4 of
    fp32's 24 bits). 4-bit: the even and the odd codes are masked into the low nibbles of the four bytes once per
    word, then one ``prmt`` per code places a byte under the exponent byte 0x3F: f = 0.5 + c / 256 exactly
    (ASM; plain shifts and masks give the same bits in the interpreter). Other widths: one shift and one mask put
    the code in the top BITS bits of the mantissa: f = 1 + c / 2**BITS. EVEN_K: the tile lies inside K, so x
    needs no bounds mask; then (4-bit, no act-order) each word's eight inputs come in one 16-byte load, split in
    registers (measured 3-8% faster on an H200 than eight 2-byte loads). GATED: see :func:`_load_x_f32`."""
    PF: tl.constexpr = 32 // BITS
    TOP: tl.constexpr = 23 - BITS
    part = tl.zeros(q.shape, tl.float32)
    xsum = tl.zeros([q.shape[0]], tl.float32)
    if BITS == 4:
        UP: tl.constexpr = 256
        OFF: tl.constexpr = 128
        nibbles = (q & 0x0F0F0F0F, (q >> 4) & 0x0F0F0F0F)  # codes 0, 2, 4, 6 and 1, 3, 5, 7 by byte
        exponent = tl.zeros(q.shape, tl.int32) + exp_byte  # 0x3F000000 from a kernel argument: ptxas then keeps
        # it in a register and the byte selector immediate (a literal would take the immediate slot instead)
    else:
        UP: tl.constexpr = 1 << BITS
        OFF: tl.constexpr = 1 << BITS
    x_row = x_ptr + k0 + w * PF  # the words' first inputs: each code's x is a constant offset from it
    if BITS == 4 and EVEN_K and not HAS_PERM:
        x8 = _load_x_f32(x_row[:, None] + tl.arange(0, 8)[None, :], None, K, GATED)
        a, b = tl.split(tl.reshape(x8, [x8.shape[0], 4, 2]))      # a: j even, b: j odd
        a0, a1 = tl.split(tl.reshape(a, [x8.shape[0], 2, 2]))     # a0: j = 0, 4; a1: j = 2, 6
        b0, b1 = tl.split(tl.reshape(b, [x8.shape[0], 2, 2]))
        x0, x4 = tl.split(a0)
        x2, x6 = tl.split(a1)
        x1, x5 = tl.split(b0)
        x3, x7 = tl.split(b1)
    for j in tl.static_range(PF):
        kk = k0 + w * PF + j
        if BITS == 4 and EVEN_K and not HAS_PERM:
            xj = (x0, x1, x2, x3, x4, x5, x6, x7)[j]
        elif EVEN_K and not HAS_PERM:
            xj = _load_x_f32(x_row + j, None, K, GATED)
        elif EVEN_K:
            xj = _load_x_f32(x_ptr + tl.load(perm_ptr + kk), None, K, GATED)
        else:
            if HAS_PERM:
                kk = tl.load(perm_ptr + kk, mask=kk < K, other=0)
            xj = _load_x_f32(x_ptr + kk, k0 + w * PF + j < K, K, GATED)
        xsum += xj
        if BITS == 4 and ASM:
            bits = tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {0x7054 | (j // 2) << 8};", "=r,r,r",
                                             [nibbles[j % 2], exponent], dtype=tl.int32, is_pure=True, pack=1)
        elif BITS == 4:
            bits = (((nibbles[j % 2] >> (8 * (j // 2))) & 0xF) << 16) | exponent
        elif TOP >= j * BITS:
            bits = ((q << (TOP - j * BITS)) & (((1 << BITS) - 1) << TOP)) | 0x3F800000
        else:
            bits = ((q >> (j * BITS - TOP)) & (((1 << BITS) - 1) << TOP)) | 0x3F800000
        part += xj[:, None] * bits.to(tl.float32, bitcast=True)
    return part * (scale * UP)[None, :] - xsum[:, None] * (scale * (zero + OFF))[None, :]


@jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, N, K, k_per_split,
                 splits, exp_byte, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SERIAL: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
                 TRIG: tl.constexpr, AHEAD: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), splits): y[n] for one block of outputs over one K range (a multiple of BLOCK_K;
    BLOCK_K divides GROUP, or GROUP >= K (per channel), so a tile has one scale and one zero per column). The next
    tile is loaded before this one is multiplied (a second tile in flight; a third measured no faster on an H200).
    GATED: x is cat(gate, up) [2K] of an MLP and the input is silu(gate) * up (the activation kernel fused into
    the loads). EVEN_K: K is a multiple of BLOCK_K; ASM: compiled (inline PTX), not interpreted.

    Without SPLIT it writes y + bias in out's dtype. With SPLIT each program writes fp32 partial sums
    ``part[split, n]``; with SERIAL the last program of a column block to finish (an atomic counter in
    ``lock[pid_n]``, which that program resets to 0) adds them in split order and writes y + bias: deterministic,
    one launch (the loads of AHEAD splits in flight at a time). Without SERIAL, ``split_k._reduce_kernel`` or the
    next kernel (``split_k.SplitK``) adds them."""
    PF: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w = tl.arange(0, BLOCK_K // PF)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    k_end = tl.minimum((K + PF - 1) // PF * PF, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_K // PF, BLOCK_N], tl.float32)
    q, scale, zero = _load_tile(qw_ptr, s_ptr, z_ptr, k_lo, k_end, w, n, nmask, N, BITS, GROUP)
    pdl_wait(PDL)  # the first weight tile is on its way while the previous kernel finishes
    for k0 in range(k_lo, k_hi, BLOCK_K):
        q_next, scale_next, zero_next = _load_tile(qw_ptr, s_ptr, z_ptr, k0 + BLOCK_K, k_end, w, n, nmask, N,
                                                   BITS, GROUP)
        acc += _gemv_tile(x_ptr, perm_ptr, q, scale, zero, k0, w, K, exp_byte, BITS, HAS_PERM, EVEN_K, ASM,
                          GATED)
        q, scale, zero = q_next, scale_next, zero_next
    pdl_trigger(TRIG)
    y = tl.sum(acc, axis=0)
    if SPLIT:
        tl.store(part_ptr + tl.program_id(1) * N + n, y, mask=nmask)
        if SERIAL:
            tl.debug_barrier()  # every thread's partial sums are written before the counter moves
            arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                y = sum_splits(part_ptr + n, N, nmask, splits, AHEAD)
                if HAS_BIAS:
                    y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
                tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nmask)
                tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@device_fn
def _codes_minus_zeros(qs, zz, IS_BF16: tl.constexpr, HOPPER: tl.constexpr):
    """Codes c (bits 0-3) and c' (bits 16-19) of the words ``qs`` minus their zeros, exact, as one int32 holding a
    pair of x's 16-bit dtype (c - z in the low half): one ``lop3`` puts the codes under the magic exponent (128 + c
    in bf16, 1024 + c in fp16; Kim et al., "Who says elephants can't run", 2022) and one packed subtraction of
    (magic + z) ``zz`` leaves c - z. PTX before sm_90 (HOPPER false) has no packed bf16 ``sub``: there t * 1 + (-zz)
    in one ``fma.rn.bf16x2``, the same exact value (found compiling for sm_86, fourteenth session: ptxas refused
    the tc GEMM, so every RTX card failed its prefill)."""
    if not IS_BF16:
        t = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 $0, t, $2; }", "=r,r,r",
            [qs, zz], dtype=tl.int32, is_pure=True, pack=1)
    elif HOPPER:
        t = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 $0, t, $2; }", "=r,r,r",
            [qs, zz], dtype=tl.int32, is_pure=True, pack=1)
    else:
        t = tl.inline_asm_elementwise(
            "{ .reg .b32 t, one, nz; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3F803F80; "
            "xor.b32 nz, $2, 0x80008000; fma.rn.bf16x2 $0, t, one, nz; }", "=r,r,r", [qs, zz], dtype=tl.int32,
            is_pure=True, pack=1)
    return t


@device_fn
def _halves(t, dtype: tl.constexpr):
    """The two 16-bit values of the int32 pairs ``t`` (low half first) as ``dtype``."""
    lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [t], dtype=(tl.int16, tl.int16),
                                       is_pure=True, pack=1)
    return lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True)


@device_fn
def _fast_pair(q, zero, zz, j: tl.constexpr, IS_BF16: tl.constexpr, DOT_F32: tl.constexpr, dtype: tl.constexpr,
               HOPPER: tl.constexpr):
    """Codes j and j + 4 of the words q [WORDS, BLOCK_N] minus the zeros, exact in x's 16-bit dtype
    (:func:`_codes_minus_zeros`, ``zz`` = magic + z in both halves); plain Triton with the same values in the
    interpreter (its int -> bf16 cast is broken)."""
    qs = q >> (4 * j)  # code j in bits 0-3, code j + 4 in bits 16-19
    if DOT_F32:
        lo = ((qs & 15) - zero[None, :]).to(tl.float32).to(dtype)
        hi = (((qs >> 16) & 15) - zero[None, :]).to(tl.float32).to(dtype)
    else:
        lo, hi = _halves(_codes_minus_zeros(qs, zz, IS_BF16, HOPPER), dtype)
    return lo, hi


@device_fn
def _dot_acc(a, b, acc, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a @ b (acc [M, N]); SWAP: acc is [N, M] and gets (a @ b).T, the weight being the left operand."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SWAP:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@device_fn
def _load_x(x_ptr, perm_ptr, m, mmask, stride_xm, kk, K, HAS_PERM: tl.constexpr):
    """The activation tile x[m, perm[kk]] (x[m, kk] without act-order): [len(m), len(kk)], 0 outside."""
    col = kk
    if HAS_PERM:
        col = tl.load(perm_ptr + kk, mask=kk < K, other=0)
    return tl.load(x_ptr + m[:, None] * stride_xm + col[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0)


@device_fn
def _store_tile(acc, out_ptr, bias_ptr, m, n, M, N, SWAP: tl.constexpr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """A GEMM program's output tile (acc [len(n), len(m)] with SWAP, else [len(m), len(n)], fp32): its split-K
    partial sums into ``out[split]`` (fp32) with SPLIT, else + bias in out's dtype."""
    if SWAP:
        acc = tl.trans(acc)
    mmask, nmask = m < M, n < N
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(2) * M + m[:, None]) * N + n[None, :], acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@jit
def _gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 SWAP: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, TRIG: tl.constexpr,
                 HOPPER: tl.constexpr = False):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits): one [BLOCK_M, BLOCK_N] output tile over one K range.

    Default: the weight tile [BLOCK_K, BLOCK_N] is dequantized in registers to x's dtype ((q - z) * s, exact in
    fp32, rounded once) for one ``tl.dot``. FAST (4-bit, BLOCK_K >= 128, bf16/fp16 x): q - z is exact in x's dtype,
    so the scale moves after the dot: eight dots with K = BLOCK_K / 8, one per code position j of the words (rows
    8w + j), each code pair (j, j + 4) made by one ``lop3`` with the magic exponent (128 + c in bf16, 1024 + c in
    fp16) and one packed ``sub`` of (magic + z) (Kim et al. 2022; Frantar et al., Marlin, 2024), interpreted in
    plain Triton on CPU. SWAP computes the transposed product (weight as the left operand), which suits small M.
    HOPPER: compute capability >= 9.0 (the packed bf16 ``sub`` of PTX; :func:`_fast_pair`).
    """
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PF
    IS_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    kr = tl.arange(0, BLOCK_K)
    w = tl.arange(0, WORDS)
    shift = ((kr % PF) * BITS)[:, None]
    pdl_wait(PDL)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        q, scale, zero = _load_tile(qw_ptr, s_ptr, z_ptr, k0, K, w, n, nmask, N, BITS, GROUP)
        if FAST:
            part = tl.zeros(acc.shape, tl.float32)
            if IS_BF16:  # (magic + z) in both 16-bit halves
                zz = ((zero + 0x4300) * 0x10001)[None, :]
            else:
                zz = ((zero + 0x6400) * 0x10001)[None, :]
            for j in tl.static_range(4):
                lo, hi = _fast_pair(q, zero, zz, j, IS_BF16, DOT_F32, x_ptr.dtype.element_ty, HOPPER)
                a = _load_x(x_ptr, perm_ptr, m, mmask, stride_xm, k0 + w * PF + j, K, HAS_PERM)
                part = _dot_acc(a, lo, part, SWAP, DOT_F32)
                a = _load_x(x_ptr, perm_ptr, m, mmask, stride_xm, k0 + w * PF + j + 4, K, HAS_PERM)
                part = _dot_acc(a, hi, part, SWAP, DOT_F32)
            if SWAP:
                acc += part * scale[:, None]
            else:
                acc += part * scale[None, :]
        else:
            a = _load_x(x_ptr, perm_ptr, m, mmask, stride_xm, k0 + kr, K, HAS_PERM)
            q = tl.reshape(tl.broadcast_to(q[:, None, :], (WORDS, PF, BLOCK_N)), (BLOCK_K, BLOCK_N))
            code = ((q >> shift) & MASK) | 0x4B000000  # the fp32 2**23 + code
            zf = zero.to(tl.float32) + 8388608.0
            b = ((code.to(tl.float32, bitcast=True) - zf[None, :]) * scale[None, :]).to(x_ptr.dtype.element_ty)
            acc = _dot_acc(a, b, acc, SWAP, DOT_F32)
    pdl_trigger(TRIG)
    _store_tile(acc, out_ptr, bias_ptr, m, n, M, N, SWAP, SPLIT, HAS_BIAS)


@device_fn
def _tc_pair(qs, zz, zero, scale, ss, MODE: tl.constexpr, IS_BF16: tl.constexpr, dtype: tl.constexpr,
             HOPPER: tl.constexpr):
    """Codes j and j + 4 of the shifted words ``qs`` [BLOCK_N, WORDS] (code j in bits 0-3, code j + 4 in bits
    16-19) as two weights in x's dtype; ``zero`` / ``scale`` [BLOCK_N, 1] int / fp32. MODE 0 (any dtype; the
    interpreter): plain Triton, (c - z) * s in fp32 rounded once. MODES 1-3 start from c - z exact in x's dtype
    (:func:`_codes_minus_zeros`). MODE 2: c - z alone (the scale is applied after the dot). fp16 x, MODES 1 and 3:
    c - z times the fp16 scale in packed fp16 ``ss`` (``mul.rn.f16x2``, any GPU): the exact product of a 4-bit
    integer and an 11-bit significand rounded once, MODE 0's bits (``run_plan`` takes these modes for fp16 x only
    with fp16 scales, as AWQ and GPTQ files have). bf16 x: MODE 1: each half widened to fp32 (a shift, a mask),
    multiplied by the fp32 scale and the pair rounded once (``cvt.rn.bf16x2``): the same bits as MODE 0. MODE 3:
    c - z times the scale in packed bf16 ``ss`` (a second rounding for fp16 scales); before sm_90 (HOPPER false),
    which has no packed bf16 ``mul``, as t * s + (-0) in one ``fma.rn.bf16x2`` (adding -0 changes no product, a
    +0 one included): the same bits."""
    if MODE == 0:
        lo = (((qs & 15) - zero).to(tl.float32) * scale).to(dtype)
        hi = ((((qs >> 16) & 15) - zero).to(tl.float32) * scale).to(dtype)
    elif not IS_BF16:
        t = _codes_minus_zeros(qs, zz, False, HOPPER)
        if MODE != 2:
            t = tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [t, ss], dtype=tl.int32,
                                          is_pure=True, pack=1)
        lo, hi = _halves(t, tl.float16)
    else:
        t = _codes_minus_zeros(qs, zz, True, HOPPER)
        if MODE == 1:
            t = tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; shl.b32 a, $1, 16; and.b32 b, $1, 0xFFFF0000; mul.rn.f32 a, a, $2; "
                "mul.rn.f32 b, b, $2; cvt.rn.bf16x2.f32 $0, b, a; }", "=r,r,r", [t, scale.to(tl.int32, bitcast=True)],
                dtype=tl.int32, is_pure=True, pack=1)
        elif MODE == 3 and HOPPER:
            t = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [t, ss], dtype=tl.int32,
                                          is_pure=True, pack=1)
        elif MODE == 3:
            t = tl.inline_asm_elementwise(
                "{ .reg .b32 nz; mov.b32 nz, 0x80008000; fma.rn.bf16x2 $0, $1, $2, nz; }", "=r,r,r", [t, ss],
                dtype=tl.int32, is_pure=True, pack=1)
        lo, hi = _halves(t, tl.bfloat16)
    return lo, hi


@jit
def _gemm_tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
                    SWAP: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr, TRIG: tl.constexpr,
                    HOPPER: tl.constexpr = False):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits), 4-bit weights, no act-order (the caller permutes x):
    one [BLOCK_M, BLOCK_N] output tile over one K range. x's tile [BLOCK_M, BLOCK_K] is read contiguously (16-byte
    loads the compiler pipelines into shared memory). The weight tile is built transposed, [BLOCK_N, BLOCK_K]: the
    words [BLOCK_N, BLOCK_K / 8] unpack by code pairs (:func:`_tc_pair`) and nested ``tl.join`` put each word's
    eight codes next to each other in k order, in one thread's registers. SWAP (the measured winner on an H200):
    the weight tile is the left operand of ``tl.dot`` (wgmma reads it from registers, x's tile from shared memory,
    and with MODE 1 / 3 the next tile is unpacked while the previous product runs); else x's tile is, and the
    weight tile goes through shared memory. MODE 2 scales the product of each tile (BLOCK_K divides GROUP, or
    GROUP >= K: one scale per column per tile); the others multiply the weights. HOPPER: compute capability >= 9.0
    (:func:`_tc_pair`)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    IS_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    kr = tl.arange(0, BLOCK_K)
    w = tl.arange(0, WORDS)
    pdl_wait(PDL)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    # every split holds at least one K tile (run_plan launches cdiv(K, k_per_split) splits). Told this, the
    # compiler drops the loop's zero-trip path, where the zeroed accumulator met the loop's last wgmma wait and made
    # ptxas serialize every wgmma of the kernel (C7515, "non wgmma instructions defining accumulator registers"):
    # 5-8% faster at M = 64 on an H200 (bench/RESULTS.md, eleventh session)
    tl.assume(k_hi > k_lo)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + kr)[None, :], mask=mmask[:, None], other=0.0)
            q = tl.load(qw_ptr + (k0 // 8 + w)[None, :] * N + n[:, None], mask=nmask[:, None], other=0)
        else:
            a = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + kr)[None, :],
                        mask=mmask[:, None] & (k0 + kr < K)[None, :], other=0.0)
            q = tl.load(qw_ptr + (k0 // 8 + w)[None, :] * N + n[:, None],
                        mask=nmask[:, None] & (k0 // 8 + w < (K + 7) // 8)[None, :], other=0)
        grp = k0 // GROUP
        scale = tl.load(s_ptr + grp * N + n, mask=nmask, other=0.0).to(tl.float32)
        zero = (tl.load(z_ptr + grp * (N // 8) + n // 8, mask=nmask, other=0) >> ((n % 8) * 4)) & 15
        if IS_BF16:  # (magic + z) in both 16-bit halves
            zz = ((zero + 0x4300) * 0x10001)[:, None]
        else:
            zz = ((zero + 0x6400) * 0x10001)[:, None]
        if dtype == tl.float16:  # the scale in x's 16-bit dtype in both halves (bf16 for fp32 x: mode 0 skips it)
            sb = scale.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            sb = scale.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        ss = (sb | (sb << 16))[:, None]
        zc, sc = zero[:, None], scale[:, None]
        lo0, hi0 = _tc_pair(q, zz, zc, sc, ss, MODE, IS_BF16, dtype, HOPPER)
        lo1, hi1 = _tc_pair(q >> 4, zz, zc, sc, ss, MODE, IS_BF16, dtype, HOPPER)
        lo2, hi2 = _tc_pair(q >> 8, zz, zc, sc, ss, MODE, IS_BF16, dtype, HOPPER)
        lo3, hi3 = _tc_pair(q >> 12, zz, zc, sc, ss, MODE, IS_BF16, dtype, HOPPER)
        even = tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2))  # codes 0, 2, 4, 6 at [.., t, u]: 4t + 2u
        odd = tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3))
        bt = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))  # [n, 8w + j]
        if DOT_F32:
            a = a.to(tl.float32)
            bt = bt.to(tl.float32)
        if SWAP and MODE == 2:
            acc += tl.dot(bt, tl.trans(a)) * scale[:, None]
        elif SWAP:
            acc = tl.dot(bt, tl.trans(a), acc)
        elif MODE == 2:
            acc += tl.dot(a, tl.trans(bt)) * scale[None, :]
        else:
            acc = tl.dot(a, tl.trans(bt), acc)
    pdl_trigger(TRIG)
    _store_tile(acc, out_ptr, bias_ptr, m, n, M, N, SWAP, SPLIT, HAS_BIAS)


@jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, PDL: tl.constexpr,
                    TRIG: tl.constexpr):
    """Grid (cdiv(K/pf, BLOCK_W), cdiv(N, BLOCK_N)): BLOCK_W packed rows (words) become pf rows each of W [K, N]
    in input-channel order (kernel row k goes to row perm[k]); (q - z) * s exact in fp32, rounded once to out's
    dtype. Each word is read once; any group size."""
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (w < K // PF)[:, None] & (n < N)[None, :]
    q = tl.load(qw_ptr + w[:, None] * N + n[None, :], mask=mask, other=0)
    pdl_wait(PDL)  # out may be memory a previous kernel still reads
    for j in tl.static_range(PF):
        k = w * PF + j
        if j == 0 or GROUP % PF != 0:  # the codes of one word share a group unless PF does not divide GROUP
            grp = (k // GROUP)[:, None]
            z = (tl.load(z_ptr + grp * (N // PF) + (n // PF)[None, :], mask=mask, other=0)
                 >> ((n % PF) * BITS)[None, :]) & MASK
            s = tl.load(s_ptr + grp * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
        val = (((q >> (j * BITS)) & MASK) - z).to(tl.float32) * s
        dst = k
        if HAS_PERM:
            dst = tl.load(perm_ptr + k, mask=k < K, other=0)
        tl.store(out_ptr + dst[:, None] * N + n[None, :], val.to(out_ptr.dtype.element_ty), mask=mask)
    pdl_trigger(TRIG)  # the same as the trigger at exit (and cuBLAS, launched without PDL, follows): kept for the rule


def dequantize_triton(qw: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [K, N] in ``dtype`` (input-channel order; the transpose of ``quant_formats.dequantize``), bit-exact:
    in fp32 it equals ``dequantize(qw).T``, in fp16/bf16 that rounded once."""
    k, n = qw.in_features, qw.out_features
    out = torch.empty(k, n, dtype=dtype, device=qw.qweight.device)
    perm = qw.perm if qw.perm is not None else qw.qweight
    words = k // qw.pack_factor
    _dequant_kernel[(cdiv(words, 8), cdiv(n, 128))](qw.qweight, qw.scales, qw.qzeros, perm, out, n, k, BITS=qw.bits,
                                                    GROUP=qw.group_size, BLOCK_W=8, BLOCK_N=128,
                                                    HAS_PERM=qw.perm is not None, PDL=pdl(out), TRIG=early_trigger(out),
                                                    num_warps=4)
    return out


@dataclass(frozen=True)
class Plan:
    """How one W4A16 call runs: ``path`` "gemv" | "mma" | "gemm" | "tc" | "dequant"; tile sizes (``mma``: block_n
    is 64 x num_warps / k_warps, each warp owning 64 columns and ``k_warps`` warps sharing them, each taking every
    k_warps-th K tile of the split, their sums added in shared memory; block_m unused); K per split (a multiple of
    block_k, and of block_k x k_warps for the mma path; >= K means no split); ``swap`` computes the transposed
    product in the GEMM; ``fast`` its scale-after-the-dot dequantization (4-bit, block_k >= 128, fp16/bf16
    activations; see ``_gemm_kernel``); ``serial``: the GEMV adds its split-K partial sums in the same launch (see
    ``_gemv_kernel``; unless the call defers them, ``run_plan``'s ``defer_sum``), else in a second kernel. ``tc``
    (4-bit): ``_gemm_tc_kernel``, ``swap`` as for the GEMM, ``mode`` its dequantization (``_tc_pair``; bf16 x, or
    fp16 x with fp16 scales, on a GPU only, else 0)."""

    path: str
    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    k_per_split: int = 1 << 30
    swap: bool = False
    num_warps: int = 4
    num_stages: int = 3
    fast: bool = False
    serial: bool = True
    mode: int = 1
    k_warps: int = 1


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two dividing n, at most cap."""
    return min(n & -n, cap)


def _split(k: int, block_k: int, tiles: int, target: int) -> int:
    """K per split so that tiles * splits reaches about ``target`` programs (a multiple of block_k)."""
    k_tiles = cdiv(k, block_k)
    splits = max(1, min(k_tiles, cdiv(target, max(tiles, 1))))
    return cdiv(k_tiles, splits) * block_k


#: M above which dequantize-then-cuBLAS is always used. Between 65 and this, 4-bit products run the "tc" kernel (it
#: beat dequantize-then-cuBLAS at M=256 on three of the four Llama-2 shapes, H200, bench/RESULTS.md 2026-11-30 run 9;
#: on the fourth, 4096 -> 4096, from 129 rows once ptxas stopped serializing it, eleventh session; on the four
#: Llama-3-8B shapes at M = 128 and 256 by 1.04-2.5x, thirteenth session), unless a measured plan says otherwise.
DEQUANT_ABOVE_M = 256

#: Multiprocessors of the GPU :data:`TUNED` was measured on (an H200; an H100 SXM has as many, and Hopper's shared
#: memory).
TUNED_SMS = 132

#: The M buckets of :data:`TUNED`: a product of M rows takes the plan of the first bucket >= M (1, 2-8, 9-16, 17-64,
#: 65-128, 129-256).
M_BUCKETS = (1, 8, 16, 64, 128, 256)

#: The fastest plans measured on an H200 for Llama-7B shapes, by (M bucket, N, K) (:data:`M_BUCKETS`), group size
#: 128 (bench/gpu_suite.py --sweep, 2026-11-30; the M = 1 splits retuned in the fourth session's probes so the grid
#: fills whole waves; the "mma" plans from the fifth session's probes, against the best other plan in the same run;
#: ratios in bench/RESULTS.md). Used on GPUs of :data:`TUNED_SMS` multiprocessors only (their splits and tiles were
#: timed there; the 128-deep tc tiles take 115 KB of shared memory on sm_90, 91 KB on sm_86 / sm_89, whose blocks
#: get 99 KB: tests/compile_targets.py); other GPUs and shapes use choose_plan's rules, or measure their own.
#: The "tc" plans use mode 3 (the scale multiplied in packed bf16): 5-10% faster than the exact mode 1 at M = 16
#: and 64 (same sweep); with fp16 scales each weight is rounded twice (scale to bf16, then the product). With fp16
#: x and fp16 scales, mode 3 multiplies in packed fp16: one rounding, mode 0's bits (``_tc_pair``).
TUNED = {
    # 4096 -> 4096 in 16 splits, thirteenth session: 6.9 us in the suite (run 56) against 7.7 for 8 splits (run 48);
    # kernels/w4a16_tune.py in the 7B engine, same process: 7.05-7.08 against 7.67-7.71, the mma GEMV 7.99-8.11
    (1, 4096, 4096): Plan("gemv", 1, 128, 128, 256),
    (1, 12288, 4096): Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1),  # 8 splits (gemv: 13.9 us, 5)
    (1, 22016, 4096): Plan("mma", 8, 64, 128, 768, num_warps=1, num_stages=1),  # 6 splits (gemv: 22.0 us, 3)
    (1, 4096, 11008): Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1),  # 22 splits (gemv: 13.5 us, 8)
    # M = 8: two warps per 64 columns share each split's K (k_warps, sixth session): 9.4 / 20.3 / 14.7 us against
    # 10.1 / 21.2 / 16.2 with one warp (same probe); on 4096 -> 12288 one warp stays faster (13.9 against 15.0).
    # Confirmed by w4a16_tune in the thirteenth session (9.8 / - / 16.2 us against 10.5-10.7 / - / 17.0 for one warp
    # in 16 / 22 splits; one warp in 11 splits 9.7 on 4096 -> 4096)
    (8, 4096, 4096): Plan("mma", 8, 128, 128, 512, num_warps=4, num_stages=1, k_warps=2),  # 8 splits
    (8, 12288, 4096): Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1),  # 8 splits
    (8, 22016, 4096): Plan("mma", 8, 128, 128, 1536, num_warps=4, num_stages=1, k_warps=2),  # 3 splits
    (8, 4096, 11008): Plan("mma", 8, 128, 128, 1536, num_warps=4, num_stages=1, k_warps=2),  # 8 splits
    # M = 16: the mma GEMV, x one tile ahead (eighth session) on 4096 -> 22016, and on 4096 -> 12288 in 8 splits
    # (thirteenth session: 17.7 us in the suite against 20.0 for 6 splits in run 48; w4a16_tune 18.3 against
    # 20.6 for the best tc plan). The tc plans stay on 4096 -> 4096 and 11008 -> 4096 (the mma GEMV 14.3 against
    # 10.6 us, 22.4 against 19.8 in the suite)
    (16, 12288, 4096): Plan("mma", 16, 64, 128, 512, num_warps=1, num_stages=1),  # 8 splits
    (16, 22016, 4096): Plan("mma", 16, 64, 128, 1024, num_warps=1, num_stages=1),  # 4 splits
    (16, 4096, 4096): Plan("tc", 16, 64, 128, 512, swap=True, mode=3),
    (16, 4096, 11008): Plan("tc", 16, 64, 128, 1408, swap=True, mode=3),  # 8 splits
    # the splits of M = 64 4096 -> 4096 and 11008 -> 4096 retuned in the tenth session (probe/reduce_ahead.py, same
    # process, µs against the splits before): 4 splits 13.0-13.1 against 5 splits 13.6; 6 splits 25.8-26.0 against
    # 5 splits 27.7-27.8
    (64, 4096, 4096): Plan("tc", 64, 64, 128, 1024, swap=True, mode=3),  # 4 splits
    (64, 12288, 4096): Plan("tc", 64, 64, 128, 2048, swap=True, mode=3),
    (64, 22016, 4096): Plan("tc", 64, 64, 128, 4096, swap=True, mode=3),
    (64, 4096, 11008): Plan("tc", 64, 64, 128, 1920, swap=True, mode=3),  # 6 splits
    # M = 65-128 and 129-256, eleventh session (probe/mbucket.py, µs at M = 96 / 128 / 192 / 256, same process).
    # 4096 -> 4096: dequantize 28.1 / 28.6 / 36.0 / 29.8 against tc 128x64x128 28.5 / 27.6 / 29.5 / 27.9 (and
    # 28.0-28.1 against 30.2 alternating at 256, probe/m256_sq.py): tc from 129 rows, dequantize up to 128.
    # 4096 -> 22016: 128x64x64 67.2 / 65.9 / 132.7 / 132.6 against 128x64x128 83.5 / 77.4 / 125.0 / 125.3.
    # 11008 -> 4096: 128x64x128 in 3 splits 45.3 / 42.6 / 83.1 / 74.9, 128x64x64 in 3 splits 49.6 / 50.7 / 65.5 /
    # 66.6, 256x128x64 on 8 warps in 4 splits 54.7 / 55.7 / 56.1 / 57.5.
    (128, 12288, 4096): Plan("tc", 128, 64, 128, 4096, swap=True, mode=3),  # 42.7 us, bk 64 50.1 (w4a16_tune)
    (128, 22016, 4096): Plan("tc", 128, 64, 64, 4096, swap=True, mode=3),
    (128, 4096, 11008): Plan("tc", 128, 64, 128, 3712, swap=True, mode=3),  # 3 splits
    (256, 4096, 4096): Plan("tc", 128, 64, 128, 4096, swap=True, mode=3),
    (256, 12288, 4096): Plan("tc", 128, 64, 64, 4096, swap=True, mode=3),
    (256, 22016, 4096): Plan("tc", 128, 64, 128, 4096, swap=True, mode=3),
    (256, 4096, 11008): Plan("tc", 256, 128, 64, 2752, num_warps=8, swap=True, mode=3),  # 4 splits
}


#: Plans measured on this process's GPU, by (M bucket, N, K, group size), 4-bit weights: filled by
#: ``kernels.w4a16_tune.install`` (the engine times the candidates of its model's shapes at start-up, or reads them
#: back from its per-GPU file) and read before :data:`TUNED`. Empty until then.
MEASURED: dict[tuple[int, int, int, int], Plan] = {}


@functools.lru_cache(maxsize=4096)
def choose_plan(m: int, n: int, k: int, bits: int, group: int, sms: int, mma: bool = True,
                measured: bool = True) -> Plan:
    """The path and tiles for an [m, k] x [k, n] W{bits} product with group size ``group`` (= k per-channel) on a
    GPU of ``sms`` multiprocessors: the plan measured on this GPU (:data:`MEASURED`, unless ``measured`` is false),
    else one measured on an H200 (:data:`TUNED`) where one fits, else the rules below, which follow the sweeps.
    ``mma``: the tensor-core GEMV may run (fp16/bf16 x; fp32 x takes the other paths). Pure function of shapes and
    of the tables (no host sync, stable under CUDA graphs; ``w4a16_tune.install`` clears its cache)."""
    pf = 32 // bits
    if group % pf or m > DEQUANT_ABOVE_M:
        return Plan("dequant")
    bucket = next(b for b in M_BUCKETS if m <= b)
    mine = MEASURED.get((bucket, n, k, group)) if measured and bits == 4 else None
    if mine is not None and (mma or mine.path != "mma"):
        return mine
    tuned = TUNED.get((bucket, n, k)) if sms == TUNED_SMS else None
    fits = tuned is not None and bits == 4 and (group % tuned.block_k == 0 or group >= k)
    if fits and (mma or tuned.path != "mma"):
        return tuned
    block_k = _pow2_divisor(group, 128)
    if m > 64:  # 128 x 64 x 64 tensor-core tiles (46-62 KB of shared memory in 3 stages from sm_80 to sm_90, well
        # inside any GPU's block limit; tests/compile_targets.py), K split when the tiles leave SMs idle
        if bits != 4 or block_k < 64:
            return Plan("dequant")
        tiles = cdiv(m, 128) * cdiv(n, 64)
        k_per_split = _split(k, 64, tiles, sms) if tiles < sms else k
        return Plan("tc", block_m=128, block_n=64, block_k=64, k_per_split=k_per_split, swap=True, mode=3)
    gemv = m == 1 and n <= k <= 4096  # the CUDA-core GEMV's measured wins at M = 1: 4096 -> 4096 (TUNED)
    if mma and m <= 16 and not gemv and bits == 4 and (group % 32 == 0 or group >= k):
        # the tensor-core GEMV, one warp per 64 columns, K split to about 12 warps per SM
        block_k = 128 if group >= k else block_k
        return Plan("mma", block_m=8 if m <= 8 else 16, block_n=64, block_k=block_k,
                    k_per_split=_split(k, block_k, cdiv(n, 64), 12 * sms), num_warps=1, num_stages=1)
    if m == 1:
        block_n = 64 if n <= 1024 else 128
        return Plan("gemv", block_m=1, block_n=block_n, block_k=block_k,
                    k_per_split=_split(k, block_k, cdiv(n, block_n), 4 * sms), num_warps=4, num_stages=3)
    if block_k < max(16, pf):
        return Plan("dequant")
    block_m = 16 if m <= 16 else 64
    if bits == 4:  # the sweep's winners: 64 columns, one warpgroup, K split to about 3 programs per SM
        tiles = cdiv(m, block_m) * cdiv(n, 64)
        k_per_split = _split(k, block_k, tiles, 3 * sms) if tiles < 3 * sms else k
        return Plan("tc", block_m=block_m, block_n=64, block_k=block_k, k_per_split=k_per_split, swap=True, mode=3)
    tiles = cdiv(m, block_m) * cdiv(n, 128)
    k_per_split = _split(k, block_k, tiles, 2 * sms) if tiles < sms else k
    return Plan("gemm", block_m=block_m, block_n=128, block_k=block_k, k_per_split=k_per_split, swap=True)


def w4a16_linear(x: torch.Tensor | SplitK, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                 silu_gated: bool = False, defer_sum: bool = False) -> torch.Tensor | SplitK:
    """Triton ``quant_formats.reference_linear``: y [..., N] = x [..., K] @ dequantize(qw).T (+ bias), in x's dtype.

    x: fp16/bf16 on the weight's device, last dim K (or a :class:`~kernels.split_k.SplitK`, the product before;
    added as it is read where SiLU-and-mul comes first, else summed first); bias [N] or None. ``silu_gated``: x is
    cat(gate, up) [..., 2K] and the product takes ``activation.silu_and_mul(x)`` (fused into the GEMV's loads at
    M = 1, where the separate kernel would be a launch of its own). ``defer_sum``: when the plan splits K, return
    the fp32 partial sums as a ``SplitK`` for the next kernel to add (``split_k`` module doc), else y. No host
    sync: graph-safe once the kernels for the shape are compiled (warm up before capture). GEMVs on different
    streams may run concurrently (their split-K counters are per stream, see ``_locks``). The path is
    :func:`choose_plan`'s.
    """
    width = qw.in_features * (2 if silu_gated else 1)
    if x.shape[-1] != width:
        raise ValueError(f"w4a16_linear: x has {x.shape[-1]} features, the weight expects {width}")
    x2 = x.reshape(-1, width)
    plan = choose_plan(x2.shape[0], qw.out_features, qw.in_features, qw.bits, qw.group_size, num_sms(x.device),
                       x.dtype in (torch.float16, torch.bfloat16))
    if silu_gated and (plan.path != "gemv" or isinstance(x2, SplitK)):
        # the mma path measured 28% slower with it fused (8 lanes repeat it); the SiLU kernel adds a SplitK's splits
        x2, silu_gated = activation.silu_and_mul(x2), False
    y = run_plan(as_tensor(x2), qw, bias, plan, silu_gated, defer_sum)
    return y.reshape(*x.shape[:-1], qw.out_features)


#: Splits whose partial sums the GEMVs' in-launch sum loads at once (``_gemv_kernel``: one value per thread and
#: split; ``_gemv_mma_kernel``: 16). 7B engine on an H200, µs per step at batch 1 / 8 sequences (bench/RESULTS.md,
#: fifteenth session): 4 / 4 1,994-2,002 / 2,537-2,539; 16 / 4 1,996 / 2,537-2,541; 16 / 8 1,971-1,973 /
#: 2,532-2,533; 16 / 16 1,981-1,983 / 2,560-2,561 (16 / 8 shipped). The CUDA-core GEMV's count changed nothing
#: measurable; the mma GEMV's 22-split down projection at batch 1 waits for three rounds of loads instead of six.
#: The mma GEMV at 9-16 rows (two sets of 8) loads 4 at once (``MMA_SUM_AHEAD_16``): with 8 its registers went from
#: 168 to 173, a warp fewer per multiprocessor, and its suite rows with PDL from 17.7 to 22.6 µs (4096→12288) and
#: 26.5 to 34.0 (4096→22016) (nineteenth session, `probe/ahead16.py`); M <= 8 keeps 8 (12.6 against 12.9 µs).
#: (The Llama engine's M = 16 products defer their sums or run the tc GEMM: the in-launch sum is not in them.)
GEMV_SUM_AHEAD = 16
MMA_SUM_AHEAD = 8
MMA_SUM_AHEAD_16 = 4

_LOCKS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MAX_LOCKS = 1 << 16  # column blocks of one GEMV: N up to 65536 x BLOCK_N


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """``_MAX_LOCKS`` int32 split-K arrival counters for GEMVs on ``device``'s current stream, all 0 between
    calls (each call's last program resets its counters). One buffer per (device, stream): two streams running
    GEMVs at once would otherwise share counters (wrong sums; measured on an H200), while on one stream a GEMV
    touches them only after its PDL wait, when the kernel before it has finished. Never reallocated (captured
    CUDA graphs keep its address). Allocated, and zeroed, on a stream's first call, which must not be inside a
    graph capture: there the allocation comes from the graph's private pool (a block that graphs sharing the pool
    may still write on replay: the engine's graphs share one, captured largest first), and the zeroing is
    only recorded, run when that one graph replays. Counters that start as garbage break the last-program
    detection: wrong sums, and split-K GEMVs that timed 8.6 against 14.3 us (H200, thirteenth session). Capturers
    warm up on their capture stream first (``engine.cuda_graphs``, ``w4a16_tune.time_graph``). Raises
    ``ValueError`` past ``_MAX_LOCKS`` column blocks, RuntimeError for a first call inside a capture."""
    if count > _MAX_LOCKS:
        raise ValueError(f"w4a16 GEMV: {count} column blocks, at most {_MAX_LOCKS}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buf = _LOCKS.get((device, stream))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("w4a16 GEMV: first split-K call on this stream is inside a CUDA graph capture; run "
                               "the step once on the capture stream before capturing (its counters would live in "
                               "the graph's memory pool, freed with the graph while this cache still held them)")
        buf = _LOCKS[(device, stream)] = torch.zeros(_MAX_LOCKS, dtype=torch.int32, device=device)
    return buf


def run_plan(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, plan: Plan,
             silu_gated: bool = False, defer_sum: bool = False) -> torch.Tensor | SplitK:
    """Run one :class:`Plan` on x [M, K] (the benchmark sweeps plans through this). Returns [M, N] in x's dtype,
    or with ``defer_sum`` and a plan that splits K the :class:`~kernels.split_k.SplitK` of it (no sum taken).
    ``silu_gated`` (the gemv path only): x is [1, 2K], see :func:`w4a16_linear`."""
    if silu_gated and plan.path != "gemv":
        raise ValueError("silu_gated inputs run on the gemv path only")
    m, k = x.shape[0], qw.in_features
    if x.shape[1] != k * (2 if silu_gated else 1):
        raise ValueError(f"run_plan: x has {x.shape[1]} features, the weight expects {k}"
                         f"{' x 2 (gate, up)' if silu_gated else ''}")
    n = qw.out_features
    if plan.path != "dequant" and (plan.block_k % qw.pack_factor or
                                   (qw.group_size % plan.block_k and qw.group_size < k)):
        raise ValueError(f"plan block_k {plan.block_k} must divide the group size {qw.group_size} "
                         f"and be a multiple of {qw.pack_factor}")
    if x.stride(-1) != 1 or (plan.path in ("gemv", "mma") and not x.is_contiguous()):
        x = x.contiguous()
    if plan.path == "dequant":
        y = x @ dequantize_triton(qw, x.dtype)
        return y if bias is None else y + bias.to(y.dtype)
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    splits = cdiv(k, plan.k_per_split)
    defer_sum = defer_sum and splits <= MAX_SPLITS
    # the GEMVs add their own partial sums (plan.serial) unless told to leave them to the next kernel
    serial = splits > 1 and plan.serial and not defer_sum and plan.path in ("mma", "gemv")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if splits == 1 or serial else None
    target = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    out = x if out is None else out  # an argument the launch does not write (x's dtype: the same compiled kernel)
    perm = qw.perm if qw.perm is not None else qw.qweight
    bias_arg = bias if bias is not None else qw.scales
    common = dict(BITS=qw.bits, GROUP=qw.group_size, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                  HAS_PERM=qw.perm is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1,
                  num_warps=plan.num_warps, num_stages=plan.num_stages)
    fast = plan.fast and qw.bits == 4 and plan.block_k >= 128 and x.dtype in (torch.float16, torch.bfloat16)
    if plan.path == "mma":
        problems = [what for what, bad in (
            (f"4-bit weights (got {qw.bits})", qw.bits != 4), (f"at most 16 rows (got {m})", m > 16),
            (f"fp16/bf16 x (got {x.dtype})", x.dtype not in (torch.float16, torch.bfloat16)),
            (f"block_k a multiple of 32 (got {plan.block_k})", plan.block_k % 32),
            (f"k_per_split a multiple of block_k (got {plan.k_per_split})", plan.k_per_split % plan.block_k),
            (f"num_warps a multiple of k_warps (got {plan.num_warps}, {plan.k_warps})",
             plan.k_warps < 1 or plan.num_warps % plan.k_warps),
            (f"block_n = 64 x num_warps / k_warps (got {plan.block_n}, {plan.num_warps}, {plan.k_warps})",
             plan.block_n * max(plan.k_warps, 1) != 64 * plan.num_warps),
            (f"k_per_split a multiple of block_k x k_warps (got {plan.k_per_split})",
             plan.k_per_split % (plan.block_k * max(plan.k_warps, 1)) and plan.k_per_split < k),
        ) if bad]
        if problems:
            raise ValueError(f"the mma path takes {', '.join(problems)}")
        if qw.perm is not None:  # act-order: kernel row k reads x[:, perm[k]]
            x = x[:, qw.perm.long()].contiguous()
        locks = _locks(x.device, cdiv(n, plan.block_n)) if serial else target
        w4a16_mma._gemv_mma_kernel[(cdiv(n, plan.block_n), splits)](
            x.view(torch.int32), qw.qweight, qw.scales, qw.qzeros, bias_arg, out, target, locks, m, n, k,
            x.shape[1] // 2, plan.k_per_split, splits,
            0x43004300 if x.dtype == torch.bfloat16 else 0x64006400, GROUP=qw.group_size, BLOCK_K=plan.block_k,
            HAS_BIAS=bias is not None, SPLIT=splits > 1, SERIAL=serial, IS_BF16=x.dtype == torch.bfloat16,
            ASM=not dot_f32(x), WARPS=plan.num_warps,
            EVEN=k % (plan.block_k * plan.k_warps) == 0 and n % plan.block_n == 0,
            SETS=1 if m <= 8 else 2, PDL=pdl(x), TRIG=early_trigger(x), KW=plan.k_warps,
            AHEAD=MMA_SUM_AHEAD if m <= 8 else MMA_SUM_AHEAD_16,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
        if serial or splits == 1:
            return out
    elif plan.path == "tc":
        if qw.bits != 4:
            raise ValueError(f"the tc path takes 4-bit weights, got {qw.bits}")
        if plan.k_per_split % plan.block_k and plan.k_per_split < k:
            raise ValueError(f"the tc path takes k_per_split a multiple of block_k (got {plan.k_per_split})")
        xk = x if qw.perm is None else x[:, qw.perm.long()]  # act-order: kernel row k reads x[:, perm[k]]
        # fp16 x multiplies by the scale in fp16: exact only from fp16 scales (others run mode 0, exact)
        fast = x.dtype == torch.bfloat16 or (x.dtype == torch.float16 and qw.scales.dtype == torch.float16)
        mode = plan.mode if fast and not dot_f32(x) else 0
        _gemm_tc_kernel[(cdiv(m, plan.block_m), cdiv(n, plan.block_n), splits)](
            xk, qw.qweight, qw.scales, qw.qzeros, bias_arg, target, m, n, k, xk.stride(0), plan.k_per_split,
            GROUP=qw.group_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            HAS_BIAS=bias is not None, SPLIT=splits > 1, EVEN_K=k % plan.block_k == 0, MODE=mode, SWAP=plan.swap,
            DOT_F32=dot_f32(x), PDL=pdl(x), TRIG=early_trigger(x), HOPPER=hopper(x), num_warps=plan.num_warps,
            num_stages=plan.num_stages)
    elif plan.path == "gemv":
        if m != 1:
            raise ValueError(f"the gemv path takes one row, got {m}")
        locks = _locks(x.device, cdiv(n, plan.block_n)) if serial else target
        _gemv_kernel[(cdiv(n, plan.block_n), splits)](x, qw.qweight, qw.scales, qw.qzeros, perm, bias_arg, out,
                                                      target, locks, n, k, plan.k_per_split, splits, 0x3F000000,
                                                      SERIAL=serial,
                                                      EVEN_K=k % plan.block_k == 0, ASM=not dot_f32(x),
                                                      GATED=silu_gated, PDL=pdl(x), TRIG=early_trigger(x),
                                                      AHEAD=GEMV_SUM_AHEAD, **common)
        if serial or splits == 1:
            return out
    else:
        _gemm_kernel[(cdiv(m, plan.block_m), cdiv(n, plan.block_n), splits)](
            x, qw.qweight, qw.scales, qw.qzeros, perm, bias_arg, target, m, n, k, x.stride(0), plan.k_per_split,
            BLOCK_M=plan.block_m, SWAP=plan.swap, FAST=fast, DOT_F32=dot_f32(x), PDL=pdl(x),
            TRIG=early_trigger(x), HOPPER=hopper(x), **common)
    if splits > 1:
        sums = SplitK(target, bias, x.dtype)
        return sums if defer_sum else sums.sum()
    return out
