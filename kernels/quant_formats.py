"""Quantized checkpoint formats (design.md §5) repacked into ONE internal layout, and the torch reference math.

Notation: a linear layer's weight is W [N = out_features, K = in_features]; G is the group size (G = K for
per-channel); ``pf = 32 // bits`` codes share one int32 word; code i of a word sits in bits [bits*i, bits*(i+1)).

Formats read (each a set of tensors under one module prefix, plus the model's ``quantization_config``):

* AWQ ``version: gemm`` (AutoAWQ; gptqmodel ``FORMAT.GEMM``): ``qweight`` int32 [K, N/8] packed along N with the
  columns of each word interleaved 0,2,4,6,1,3,5,7 (word slot j holds column ``AWQ_ORDER[j]``); ``qzeros`` int32
  [K/G, N/8] packed the same way, plain zeros; ``scales`` [K/G, N] fp16 (gptqmodel keeps bf16 for a bf16 model).
  w = (q - z) * s.  4-bit only.
* GPTQ (AutoGPTQ / gptqmodel): ``qweight`` int32 [K/pf, N] packed along K in order; ``qzeros`` int32 [K/G, N/pf]
  packed along N in order; ``scales`` [K/G, N]; ``g_idx`` int32 [K] (not monotonic with ``desc_act``).
  ``checkpoint_format`` "gptq" (v1, the default) stores zero - 1, written by subtracting 0x11111111 (4-bit) from
  the packed word, so an asymmetric zero of 0 borrows from its neighbour; adding the constant back to the word
  inverts that exactly.  "gptq_v2" stores the true zero.  w = (q - z) * s[g_idx].
* compressed-tensors ``pack-quantized`` (neuralmagic/compressed-tensors ``pack_to_int32``): ``weight_packed`` int32
  [N, K/pf] packed along K, every code stored as q + 2**(bits-1) (signed to unsigned; for symmetric weights that is
  the whole story); ``weight_scale`` [N, K/G]; ``weight_zero_point`` int32 [N/pf, K/G] packed along N (dim 0), same
  offset, only when asymmetric; ``weight_g_idx`` int32 [K] with act-order.

All of them become a :class:`QuantizedWeight` (the gptq_v2 layout with contiguous groups, see there).
Unsupported bit widths, formats and shapes raise ``ValueError`` naming what is wrong.  Imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_config import SUPPORTED_BITS, QuantSpec, parse_quant_config  # noqa: F401 - this module's API

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ word slot j holds column AWQ_ORDER[j] of its group of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in slot AWQ_REVERSE_ORDER[c]


@dataclass
class QuantizedWeight:
    """One quantized linear weight in the internal layout (that of gptq_v2, with contiguous groups).

    Tensors (all on one device):
      qweight  int32 [K/pf, N]: codes q in [0, 2**bits) packed along K in order (row k -> word k // pf, bits
               (k % pf)*bits), rows in *kernel order*: kernel row k holds input channel ``perm[k]``.
      qzeros   int32 [ceil(K/G), N/pf]: true zero points packed along N in order (symmetric = 2**(bits-1)).
      scales   float16 or bfloat16 [ceil(K/G), N]: as stored in the checkpoint, never converted.
      perm     int64 [K] or None: act-order permutation (argsort of g_idx) that makes groups contiguous;
               a kernel computes ``x[:, perm] @ W_kernel``; None means identity.
    Kernel row k belongs to group k // G; the last group may be shorter when G does not divide K.
    w[n, perm[k]] = (q[k, n] - z[k // G, n]) * s[k // G, n].
    """

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int
    source: str = ""  # "awq", "gptq", "gptq_v2" or "compressed-tensors": where it came from, for messages

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    def to(self, device) -> "QuantizedWeight":
        """A copy with every tensor on ``device``."""
        perm = None if self.perm is None else self.perm.to(device)
        return QuantizedWeight(self.qweight.to(device), self.qzeros.to(device), self.scales.to(device), perm,
                               self.bits, self.group_size, self.in_features, self.out_features, self.source)


def _check_bits(bits: int, what: str) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: {bits}-bit weights are not supported (supported: {SUPPORTED_BITS})")
    return bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack int32 words along ``dim`` (code i of a word at bits [bits*i, bits*(i+1))) -> int32 codes.

    The result has ``packed.shape[dim] * (32 // bits)`` entries along ``dim``, each in [0, 2**bits).
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    pf = 32 // _check_bits(bits, "unpack_int32")
    x = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*x.shape[:-1], x.shape[-1] * pf).movedim(-1, dim).contiguous()


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: codes in [0, 2**bits) -> int32 words along ``dim`` (length / pf)."""
    pf = 32 // _check_bits(bits, "pack_int32")
    x = codes.movedim(dim, -1).to(torch.int64)
    if x.shape[-1] % pf:
        raise ValueError(f"cannot pack {x.shape[-1]} codes into words of {pf}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = ((x & ((1 << bits) - 1)).reshape(*x.shape[:-1], -1, pf) << shifts).sum(-1)
    return _wrap_int32(words).movedim(-1, dim).contiguous()


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the int32 with the same bits."""
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def unpack_awq(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ-gemm ``qweight`` [K, N/8] or ``qzeros`` [K/G, N/8] -> int32 codes [rows, N] in column order."""
    if bits != 4:
        raise ValueError(f"AWQ gemm: {bits}-bit weights are not supported (the interleaved layout is 4-bit only)")
    slots = unpack_int32(packed, 4, dim=1)
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    cols = (torch.arange(slots.shape[1], device=packed.device) // 8) * 8
    return slots[:, cols + order.repeat(slots.shape[1] // 8)]


def gptq_v1_zeros_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ v1 packed ``qzeros`` (zero - 1) -> packed true zeros, by adding 1 to every code of each word.

    The add is done on the whole word, modulo 2**32, so it exactly inverts gptqmodel's v2->v1 export (a word-wide
    subtraction whose borrow crosses codes when an asymmetric zero is 0); codes never carry otherwise.
    """
    pf = 32 // _check_bits(bits, "GPTQ v1 qzeros")
    one_each = sum(1 << (bits * i) for i in range(pf))
    return _wrap_int32((qzeros.to(torch.int64) & 0xFFFFFFFF) + one_each)


def _group_perm(g_idx: torch.Tensor | None, k: int, group_size: int) -> torch.Tensor | None:
    """The permutation (argsort of g_idx) that makes groups contiguous, or None when they already are."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    expected = torch.arange(k, device=g.device) // group_size
    if g.shape != (k,):
        raise ValueError(f"g_idx has shape {tuple(g.shape)}, expected ({k},)")
    if torch.equal(g, expected):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], expected):
        raise ValueError(f"g_idx does not split the {k} input channels into groups of {group_size}")
    return perm


def from_codes(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               g_idx: torch.Tensor | None = None, source: str = "") -> QuantizedWeight:
    """Build a QuantizedWeight from unpacked codes q [K, N] (input-channel order), true zeros [K/G, N],
    scales [K/G, N] and an optional g_idx [K]; every format reader ends here."""
    _check_bits(bits, source or "from_codes")
    k, n = q.shape
    pf = 32 // bits
    group_size = k if group_size in (-1, 0, None) else int(group_size)
    groups = -(-k // group_size)
    if k % pf or n % pf:
        raise ValueError(f"{source}: in_features {k} and out_features {n} must be multiples of {pf}")
    if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
        raise ValueError(f"{source}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not match "
                         f"{groups} groups of {group_size} x {n} outputs")
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{source}: scales must be a float tensor, got {scales.dtype}")
    perm = _group_perm(g_idx, k, group_size)
    rows = q if perm is None else q[perm]
    return QuantizedWeight(pack_int32(rows, bits, dim=0), pack_int32(zeros, bits, dim=1), scales.contiguous(),
                           perm, bits, group_size, k, n, source)


def from_awq(qweight, qzeros, scales, bits: int = 4, group_size: int = 128) -> QuantizedWeight:
    """AWQ gemm tensors (see module doc) -> QuantizedWeight. ``qzeros=None`` means symmetric (zero 2**(bits-1))."""
    q = unpack_awq(qweight, bits)
    z = unpack_awq(qzeros, bits) if qzeros is not None else torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    return from_codes(q, z, scales, bits, group_size, None, "awq")


def from_gptq(qweight, qzeros, scales, g_idx=None, bits: int = 4, group_size: int = 128,
              v2: bool = False) -> QuantizedWeight:
    """GPTQ tensors (see module doc) -> QuantizedWeight; ``v2=False`` reads v1's zero - 1 storage."""
    _check_bits(bits, "GPTQ")
    q = unpack_int32(qweight, bits, dim=0)
    z = unpack_int32(qzeros if v2 else gptq_v1_zeros_to_v2(qzeros, bits), bits, dim=1)
    return from_codes(q, z[:, : scales.shape[1]], scales, bits, group_size, g_idx, "gptq_v2" if v2 else "gptq")


def from_compressed_tensors(weight_packed, weight_scale, weight_zero_point=None, weight_g_idx=None,
                            bits: int = 4, group_size: int = 128) -> QuantizedWeight:
    """compressed-tensors pack-quantized tensors (see module doc) -> QuantizedWeight.

    Codes and zero points are stored with the +2**(bits-1) offset; (u - 8) - (uz - 8) = u - uz, so the unsigned
    values are used as they are, and a missing zero point (symmetric) is the offset itself.
    """
    _check_bits(bits, "compressed-tensors")
    q = unpack_int32(weight_packed, bits, dim=1).t()
    scales = weight_scale.t()
    if weight_zero_point is None:
        z = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32, device=scales.device)
    else:
        z = unpack_int32(weight_zero_point, bits, dim=0)[: scales.shape[1]].t()
    return from_codes(q, z, scales, bits, group_size, weight_g_idx, "compressed-tensors")


def unpack_codes(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [K, N] in kernel order, z int32 [K/G, N]) of a QuantizedWeight."""
    return unpack_int32(qw.qweight, qw.bits, dim=0), unpack_int32(qw.qzeros, qw.bits, dim=1)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """W float32 [N, K] in the checkpoint's input-channel order: (q - z) * s, exact in fp32 (|q - z| < 2**8 and
    an fp16/bf16 scale have at most 19 significant bits), so it rounds to fp16 exactly as an fp16 dequant does."""
    q, z = unpack_codes(qw)
    group = torch.arange(qw.in_features, device=q.device) // qw.group_size
    w = (q - z[group]).to(torch.float32) * qw.scales[group].to(torch.float32)
    if qw.perm is not None:
        w = torch.empty_like(w).index_copy_(0, qw.perm, w)
    return w.t().contiguous()


def reference_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(qw).T (+ bias), computed in x's dtype (the torch reference path)."""
    w = dequantize(qw).to(device=x.device, dtype=x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def is_quantized(tensors: dict, prefix: str) -> bool:
    """Whether ``prefix`` (e.g. "model.layers.0.mlp.up_proj") names a quantized linear in ``tensors``."""
    p = prefix.rstrip(".")
    return f"{p}.qweight" in tensors or f"{p}.weight_packed" in tensors


def from_checkpoint(tensors: dict, prefix: str, quant_config: dict) -> QuantizedWeight:
    """Read the quantized linear at ``prefix`` from a checkpoint's tensors, dispatching on its
    ``quantization_config`` (see :func:`parse_quant_config`). Raises ValueError for an unsupported format or
    KeyError naming a missing tensor."""
    spec = parse_quant_config(quant_config)
    p = prefix.rstrip(".") + "."

    def get(name: str, required: bool = True):
        if p + name not in tensors and not required:
            return None
        if p + name not in tensors:
            raise KeyError(f"{spec.method} checkpoint has no tensor {p + name!r}")
        return tensors[p + name]

    if spec.method == "awq":
        return from_awq(get("qweight"), get("qzeros", False), get("scales"), spec.bits, spec.group_size)
    if spec.method == "gptq":
        return from_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx", False), spec.bits,
                         spec.group_size, v2=spec.fmt == "gptq_v2")
    qw = from_compressed_tensors(get("weight_packed"), get("weight_scale"), get("weight_zero_point", False),
                                 get("weight_g_idx", False), spec.bits, spec.group_size)
    shape = get("weight_shape", False)
    if shape is not None and tuple(int(s) for s in shape) != (qw.out_features, qw.in_features):
        raise ValueError(f"compressed-tensors {p}weight_shape {tuple(shape.tolist())} does not match the packed "
                         f"tensors ({qw.out_features}, {qw.in_features})")
    return qw


def concat_out_features(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack linears that read the same input (q/k/v, gate/up) along N into one QuantizedWeight.

    Returns None when they cannot share one kernel call: different bits, group size or act-order permutation,
    or an N that is not a multiple of the codes per word.
    """
    first = parts[0]
    pf = 32 // first.bits
    for p in parts:
        same_perm = (p.perm is None and first.perm is None) or (
            p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
        if (p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features) \
                or not same_perm or p.out_features % pf:
            return None
    return QuantizedWeight(
        qweight=torch.cat([p.qweight for p in parts], dim=1), qzeros=torch.cat([p.qzeros for p in parts], dim=1),
        scales=torch.cat([p.scales for p in parts], dim=1), perm=first.perm, bits=first.bits,
        group_size=first.group_size, in_features=first.in_features,
        out_features=sum(p.out_features for p in parts), source=first.source)
