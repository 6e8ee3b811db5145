"""Split-K partial sums handed to the next kernel instead of being added by the product that made them.

A split-K product (``kernels/w4a16.py``) cuts K into S ranges; each program writes the fp32 sum of its range to
``part[s]``. Someone must then add the S partial sums (and the bias) and round the result to the activation dtype.
The GEMV can do it itself (the last program of a column block to arrive), which cost it about 1.5 us of its 7-13 at
batch 1 on an H200 (a store, an atomic, then the loads of every split, four at a time then: at least three L2 round
trips after its last tile); the GEMM leaves it to :data:`_reduce_kernel`, a launch of its own. Asked to
(``defer_sum``), the product returns a :class:`SplitK` instead, and the kernel that reads the product next adds the
splits as it loads them: RoPE with the KV write after the q/k/v projection (``kernels/rotary.py``), SiLU-and-mul
after the gate/up projection (``kernels/activation.py``). Both have enough programs to read S partial sums in
parallel; RMSNorm (one program per token) does not, so the o and down projections add their own. The consumer knows
S at compile time (``SPLITS``) and issues every split's load at once (:func:`load_pair`). On an H200, 7B-shaped
engine: 1.8% per batch-1 decode step, 3.6% at 8 sequences, 1-1.6% at 64 (bench/RESULTS.md, fifteenth session; the
spread between two builds of one variant is 10-75 us per step, so the batch-1 and 64-sequence figures are near it).

Every path adds in the same order, from 0.0 in split order, then the bias in fp32, then rounds to the dtype once
(:func:`sum_splits`, :func:`add_splits`): a consumer that reads a :class:`SplitK` computes the same bits as one
that reads ``SplitK.sum()``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import cdiv, device_fn, early_trigger, jit, pdl, pdl_trigger, pdl_wait, tl


#: The most splits a product leaves to the next kernel (each split of each value is a register there while its
#: loads are in flight); a product in more splits adds them itself.
MAX_SPLITS = 16


@dataclass(frozen=True)
class SplitK:
    """y = sum over s of ``part[s]`` (+ ``bias``), rounded to ``dtype``: a product whose split-K sums are not
    added yet. Shaped like a tensor for the few views a layer takes (``split`` along the last dim, ``reshape``).

    part: float32 [S, *shape] (S >= 2; a view whose last dim is contiguous); bias: the values of one row, over the
    trailing dims of ``shape`` ([N] for [M, N] or [B, T, N]; [H, D] after ``reshape(-1, H, D)``), any dtype, or None;
    dtype: the activation dtype y is rounded to.
    """

    part: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    @property
    def splits(self) -> int:
        return self.part.shape[0]

    @property
    def device(self) -> torch.device:
        return self.part.device

    @property
    def is_cuda(self) -> bool:
        return self.part.is_cuda

    def split(self, sizes: list[int], dim: int = -1) -> tuple[SplitK, ...]:
        """Views of consecutive column ranges of ``sizes`` along the last dim (like ``Tensor.split``)."""
        if dim not in (-1, len(self.shape) - 1):
            raise ValueError("SplitK.split: the last dim only")
        parts = self.part.split(sizes, dim=-1)
        biases = self.bias.split(sizes, dim=-1) if self.bias is not None else [None] * len(parts)
        return tuple(SplitK(p, b, self.dtype) for p, b in zip(parts, biases))

    def reshape(self, *shape: int) -> SplitK:
        """The same sums seen as ``shape`` (like ``Tensor.reshape``, -1 allowed). The bias takes the trailing dims,
        never the first (the rows: consumers read the bias once per row), that hold as many values as it has
        (ValueError if none do: a reshape that moves values between rows and columns)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        part = self.part.reshape(self.splits, *shape)
        if self.bias is None:
            return SplitK(part, None, self.dtype)
        dims, want, have, i = part.shape[1:], self.bias.numel(), 1, part.dim() - 1
        while have < want and i > 1:  # trailing dims of the view, never the rows (part dim 1)
            have, i = have * part.shape[i], i - 1
        if have != want:
            raise ValueError(f"SplitK.reshape: no trailing dims of {tuple(dims)} hold the bias's {want}")
        return SplitK(part, self.bias.reshape(part.shape[i + 1:]), self.dtype)

    def sum(self) -> torch.Tensor:
        """The product itself: [*shape] in ``dtype`` (one launch of :data:`_reduce_kernel`)."""
        part = self.part.contiguous()
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        n = self.bias.numel() if self.bias is not None else max(out.numel(), 1)  # the bias's period in out
        bias = self.bias.reshape(n) if self.bias is not None else part
        if out.numel():
            block = 1024
            _reduce_kernel[(cdiv(out.numel(), block),)](part, bias, out, out.numel(), n, self.splits,
                                                        HAS_BIAS=self.bias is not None, BLOCK=block, PDL=pdl(part),
                                                        TRIG=early_trigger(part), num_warps=4)
        return out


def as_tensor(x: torch.Tensor | SplitK) -> torch.Tensor:
    """x itself, or a :class:`SplitK`'s sum (for the code paths that take a plain tensor)."""
    return x.sum() if isinstance(x, SplitK) else x


@device_fn
def sum_splits(ptrs, stride, mask, splits, AHEAD: tl.constexpr):
    """The fp32 split-K partial sums at ``ptrs + s * stride`` for s < splits (where ``mask``), added in split
    order from 0: fp32, shaped like ``ptrs`` (0 where not ``mask``). The loads of AHEAD splits are issued together
    (one at a time, each would wait a full L2 round trip), through L2 (``.cg``: other programs of the same launch
    may have written them)."""
    acc = tl.zeros(ptrs.shape, tl.float32)
    zero = tl.zeros(ptrs.shape, tl.int32)  # the split index as a tensor: a scalar mask term is refused
    for s0 in range(0, splits, AHEAD):
        got = ()
        for u in tl.static_range(AHEAD):
            live = mask & (zero + s0 + u < splits)
            got = got + (tl.load(ptrs + (s0 + u) * stride, mask=live, other=0.0, cache_modifier=".cg"),)
        for u in tl.static_range(AHEAD):
            acc += got[u]
    return acc


@device_fn
def load_splits(ptrs, stride, mask, SPLITS: tl.constexpr):
    """A consumer's loads of a :class:`SplitK` (``ptrs``: split 0's elements): the SPLITS fp32 partial sums at
    ``ptrs + s * stride`` (0 where not ``mask``) as a tuple, all issued before any is used (a loop over a
    run-time count would wait an L2 round trip per four splits: 3% slower per 7B batch-1 step on an H200,
    bench/RESULTS.md, fifteenth session)."""
    got = ()
    for s in tl.static_range(SPLITS):
        got = got + (tl.load(ptrs + s * stride, mask=mask, other=0.0),)
    return got


@device_fn
def add_splits(got, b_ptrs, mask, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
    """The value the product would have stored from :func:`load_splits`' partial sums ``got``: added from 0 in
    split order, + the bias at ``b_ptrs`` (fp32), rounded to ``dt``; returned as fp32."""
    y = tl.zeros(got[0].shape, tl.float32)
    for s in tl.static_range(len(got)):
        y += got[s]
    if HAS_BIAS:
        y += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    return y.to(dt).to(tl.float32)


@device_fn
def load_pair(ptrs, offset, mask, stride_split, SPLITS: tl.constexpr, SPLITK: tl.constexpr):
    """Two values a kernel reads together (RoPE's two halves of a head, SiLU's gate and up) at ``ptrs`` and
    ``ptrs + offset``: loaded as fp32 (0 where not ``mask``), or with SPLITK their partial sums (two tuples,
    :func:`load_splits`). :func:`add_pair` finishes them."""
    if SPLITK:  # (one return: the compiler checks the types of every return, in either branch)
        x = load_splits(ptrs, stride_split, mask, SPLITS), load_splits(ptrs + offset, stride_split, mask, SPLITS)
    else:
        x = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32),
             tl.load(ptrs + offset, mask=mask, other=0.0).to(tl.float32))
    return x


@device_fn
def add_pair(x, b_ptrs, offset, mask, SPLITK: tl.constexpr, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
    """:func:`load_pair`'s result as two fp32 values: with SPLITK the splits added, + the bias at ``b_ptrs`` and
    ``b_ptrs + offset``, in ``dt`` (:func:`add_splits`); else as loaded."""
    if SPLITK:
        x = add_splits(x[0], b_ptrs, mask, HAS_BIAS, dt), add_splits(x[1], b_ptrs + offset, mask, HAS_BIAS, dt)
    return x


@jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (cdiv(M*N, BLOCK),): out [M, N] = sum over splits of part[split] (+ bias [N]), added in split order
    (:func:`sum_splits`), in out's dtype."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = sum_splits(part_ptr + offs, MN, mask, splits, 4)
    pdl_trigger(TRIG)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
