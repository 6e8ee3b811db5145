"""kernels.quant_formats: every checkpoint format of design.md §5, built by its producer (gptqmodel's AWQ and GPTQ
packers; compressed-tensors by hand from its spec), dequantizes bit-exactly: against the known weights, against a
plain loop-and-shift unpack of the stored tensors, and against gptqmodel's own dequantization."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import quant_formats as qf
from quant.quantize import import_gptqmodel

gptqmodel = import_gptqmodel()  # the first import in the test process: without tokenicer's change of HF_HOME
from gptqmodel.nn_modules.qlinear import PackableQuantLinear  # noqa: E402
from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # noqa: E402
from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear  # noqa: E402
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm  # noqa: E402
from gptqmodel.quantization.config import QuantizeConfig  # noqa: E402
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module  # noqa: E402

GROUPS = [32, 64, 128, -1]


def make_weight(n, k, group_size, sym, bits=4, g_idx=None, seed=0):
    """Known codes q [N, K], zeros [N, groups], fp16-valued scales [N, groups] and W = (q - z) * s in fp32."""
    gen = torch.Generator().manual_seed(seed)
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    if sym:
        z = torch.full((n, groups), 1 << (bits - 1))
    else:
        z = torch.randint(0, 1 << bits, (n, groups), generator=gen)
        z[:, 0] = 0  # a zero of 0 is what makes GPTQ v1's packed subtraction borrow
        z[0, :] = (1 << bits) - 1
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
    gi = torch.arange(k) // g if g_idx is None else g_idx.long()
    w = (q - z[:, gi]).float() * s[:, gi]
    return q, z, s, w


def act_order_g_idx(k, group_size, seed=1):
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group_size).int()
    return g_idx


def linear_with(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    return lin


def plain_unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Loop-and-shift unpack of uint32 words along ``axis``: code j of word i is entry i*pf + j."""
    pf = 32 // bits
    words = np.moveaxis(words.astype(np.uint32), axis, -1)
    out = np.zeros(words.shape[:-1] + (words.shape[-1] * pf,), dtype=np.int64)
    for j in range(pf):
        out[..., j::pf] = (words >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1)
    return np.moveaxis(out, -1, axis)


def plain_dequant(q_kn, z_gn, s_gn, g_idx):
    """W [N, K] from unpacked codes q [K, N], zeros and scales [groups, N] and g_idx [K]."""
    gi = torch.as_tensor(g_idx).long()
    return ((torch.as_tensor(q_kn) - torch.as_tensor(z_gn)[gi]).float() * s_gn.float()[gi]).t()


# ---------------------------------------------------------------------------------------------------- AWQ gemm
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("sym", [True, False])
def test_awq_gemm_from_gptqmodel_packer(group_size, sym):
    n, k = 128, 256
    q, z, s, w = make_weight(n, k, group_size, sym)
    m = AwqTorchLinear(bits=4, group_size=group_size, sym=sym, desc_act=False, in_features=k, out_features=n,
                       bias=False)
    m.pack(linear_with(w), s, z.float())
    g = k if group_size == -1 else group_size
    assert m.qweight.shape == (k, n // 8) and m.qzeros.shape == (k // g, n // 8) and m.scales.shape == (k // g, n)
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not sym, "version": "gemm"}
    qw = qf.from_checkpoint({"l.qweight": m.qweight, "l.qzeros": m.qzeros, "l.scales": m.scales}, "l", cfg)
    ours = qf.dequantize(qw)
    assert torch.equal(ours, w)
    # plain unpack: word slot j holds column AWQ_ORDER[j] of its group of eight columns
    order = np.array(qf.AWQ_ORDER)
    cols = (np.arange(n) // 8) * 8
    slot_of = np.argsort(order)[np.arange(n) % 8]
    q_plain = plain_unpack(m.qweight.numpy(), 4, 1)[:, cols + slot_of]
    z_plain = plain_unpack(m.qzeros.numpy(), 4, 1)[:, cols + slot_of]
    assert torch.equal(ours, plain_dequant(q_plain, z_plain, m.scales, torch.arange(k) // g))
    theirs = dequantize_gemm(m.qweight, m.qzeros, m.scales, 4, g)
    assert theirs.dtype == torch.float16 and torch.equal(ours.half(), theirs.t())


# ---------------------------------------------------------------------------------------------------- GPTQ
def gptq_module(q, z, s, w, group_size, g_idx, bits=4, v1=False):
    n, k = w.shape
    m = TorchLinear(bits=bits, group_size=group_size, sym=False, desc_act=g_idx is not None, in_features=k,
                    out_features=n, bias=False, pack_dtype=torch.int32)
    g = k if group_size == -1 else group_size
    m.pack_original(linear_with(w), s, z.float(), (torch.arange(k) // g).int() if g_idx is None else g_idx)
    if v1:
        convert_gptq_v2_to_v1_format_module(m, QuantizeConfig(bits=bits))
    return m


def gptq_dequant_by_gptqmodel(m, bits, v1):
    if v1:
        convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
    # gptqmodel's reference torch dequantization (TorchLinear.post_init would torch.compile it first)
    return PackableQuantLinear.dequantize_weight(m).t()


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_from_gptqmodel_packer(group_size, sym, act_order, fmt):
    n, k = 64, 256
    g = k if group_size == -1 else group_size
    g_idx = act_order_g_idx(k, g) if act_order else None
    q, z, s, w = make_weight(n, k, group_size, sym, g_idx=g_idx)
    m = gptq_module(q, z, s, w, group_size, g_idx, v1=fmt == "gptq")
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": sym, "desc_act": act_order,
           "checkpoint_format": fmt}
    tensors = {"l.qweight": m.qweight, "l.qzeros": m.qzeros, "l.scales": m.scales, "l.g_idx": m.g_idx}
    qw = qf.from_checkpoint(tensors, "l", cfg)
    ours = qf.dequantize(qw)
    assert torch.equal(ours, w)
    assert (qw.perm is not None) == (act_order and group_size != -1)  # one group needs no permutation
    if qw.perm is not None:  # groups are contiguous in kernel order
        assert torch.equal(m.g_idx.long()[qw.perm], torch.arange(k) // g)
    # plain unpack of the file: v1 zeros are (zero - 1) subtracted word-wide, so add 0x11111111 back per word
    zwords = m.qzeros.numpy().astype(np.uint32)
    if fmt == "gptq":
        zwords = (zwords.astype(np.uint64) + 0x11111111).astype(np.uint32)
    plain = plain_dequant(plain_unpack(m.qweight.numpy(), 4, 0), plain_unpack(zwords, 4, 1), m.scales, m.g_idx)
    assert torch.equal(ours, plain)
    theirs = gptq_dequant_by_gptqmodel(m, 4, v1=fmt == "gptq")
    assert theirs.dtype == torch.float16 and torch.equal(ours.half(), theirs)


def test_gptq_v1_symmetric_is_plain_zero_minus_one():
    """With symmetric zeros (8) no code borrows: the file holds 7 in every nibble, read back as 8."""
    q, z, s, w = make_weight(32, 128, 32, sym=True)
    m = gptq_module(q, z, s, w, 32, None, v1=True)
    assert np.all(plain_unpack(m.qzeros.numpy(), 4, 1) == 7)
    qw = qf.from_gptq(m.qweight, m.qzeros, m.scales, m.g_idx, 4, 32, v2=False)
    assert torch.equal(qf.unpack_codes(qw)[1], torch.full((4, 32), 8, dtype=torch.int32))


def test_gptq_8bit_and_partial_last_group():
    """8-bit codes, and K = 192 with G = 128: two groups, the last one half full."""
    q, z, s, w = make_weight(32, 192, 128, sym=False, bits=8)
    m = gptq_module(q, z, s, w, 128, None, bits=8, v1=False)
    qw = qf.from_gptq(m.qweight, m.qzeros, m.scales, m.g_idx, 8, 128, v2=True)
    assert qw.qweight.shape == (48, 32) and qw.scales.shape == (2, 32)
    assert torch.equal(qf.dequantize(qw), w)
    assert torch.equal(qf.dequantize(qw).half(), gptq_dequant_by_gptqmodel(m, 8, v1=False))


# ------------------------------------------------------------------------------------------ compressed-tensors
def ct_pack(values: torch.Tensor, bits: int, packed_dim: int) -> torch.Tensor:
    """compressed-tensors ``pack_to_int32``, from its spec: signed int8 codes + 2**(bits-1) as uint32, entry i*pf + j
    of ``packed_dim`` at bits [bits*j, bits*(j+1)) of word i, zero-padded, viewed as int32."""
    pf = 32 // bits
    v = (values.to(torch.int64) + (1 << (bits - 1))).numpy().astype(np.uint32)
    v = np.moveaxis(v, packed_dim, -1)
    pad = (-v.shape[-1]) % pf
    v = np.pad(v, [(0, 0), (0, pad)])
    packed = np.zeros(v.shape[:-1] + (v.shape[-1] // pf,), dtype=np.uint32)
    for j in range(pf):
        packed |= v[..., j::pf] << np.uint32(bits * j)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, packed_dim)).view(np.int32))


@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_compressed_tensors_pack_quantized(group_size, sym, act_order):
    n, k = 64, 256
    g = k if group_size == -1 else group_size
    g_idx = act_order_g_idx(k, g, seed=3) if act_order else None
    q, z, s, w = make_weight(n, k, group_size, sym, g_idx=g_idx, seed=2)
    s = s.bfloat16()  # compressed-tensors keeps the model dtype
    w = (q - z[:, (torch.arange(k) // g) if g_idx is None else g_idx.long()]).float() * s.float()[
        :, (torch.arange(k) // g) if g_idx is None else g_idx.long()]
    tensors = {"l.weight_packed": ct_pack(q - 8, 4, 1), "l.weight_scale": s, "l.weight_shape": torch.tensor([n, k])}
    if not sym:
        tensors["l.weight_zero_point"] = ct_pack(z - 8, 4, 0)
    if act_order:
        tensors["l.weight_g_idx"] = g_idx
    scheme = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group_size == -1 else "group",
              "group_size": None if group_size == -1 else group_size, "actorder": "group" if act_order else None}
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}}}
    assert tensors["l.weight_packed"].shape == (n, k // 8)
    qw = qf.from_checkpoint(tensors, "l", cfg)
    assert qw.scales.dtype == torch.bfloat16
    assert torch.equal(qf.dequantize(qw), w)


# ------------------------------------------------------------------------------------------ layout, API, errors
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (16, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    for dim in (0, 1):
        packed = qf.pack_int32(codes, bits, dim)
        assert packed.dtype == torch.int32 and packed.shape[dim] == codes.shape[dim] * bits // 32
        assert torch.equal(qf.unpack_int32(packed, bits, dim), codes)
        assert np.array_equal(plain_unpack(packed.numpy(), bits, dim), codes.numpy())


def test_internal_layout_shapes_and_reference_linear():
    q, z, s, w = make_weight(96, 192, 64, sym=False)
    m = AwqTorchLinear(bits=4, group_size=64, sym=False, desc_act=False, in_features=192, out_features=96, bias=False)
    m.pack(linear_with(w), s, z.float())
    qw = qf.from_awq(m.qweight, m.qzeros, m.scales, 4, 64)
    assert (qw.qweight.shape, qw.qzeros.shape, qw.scales.shape) == ((24, 96), (3, 12), (3, 96))
    assert qw.qweight.dtype == qw.qzeros.dtype == torch.int32 and qw.perm is None and qw.num_groups == 3
    codes, zeros = qf.unpack_codes(qw)
    assert torch.equal(codes, q.t().int()) and torch.equal(zeros, z.t().int())
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(96)
    assert torch.equal(qf.reference_linear(x, qw, bias), torch.nn.functional.linear(x, w, bias))
    assert qf.reference_linear(x.bfloat16(), qw).dtype == torch.bfloat16


def test_errors_name_what_is_wrong():
    z32 = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="3-bit"):
        qf.from_gptq(z32, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8).half(), bits=3)
    with pytest.raises(ValueError, match="AWQ gemm: 8-bit"):
        qf.from_awq(z32, None, torch.ones(1, 32).half(), bits=8)
    with pytest.raises(ValueError, match="gemv"):
        qf.parse_quant_config({"quant_method": "awq", "version": "gemv"})
    with pytest.raises(ValueError, match="marlin"):
        qf.parse_quant_config({"quant_method": "gptq", "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="bitsandbytes"):
        qf.parse_quant_config({"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="float-quantized"):
        qf.parse_quant_config({"quant_method": "compressed-tensors", "format": "float-quantized"})
    with pytest.raises(ValueError, match="g_idx"):  # three channels in group 0: not groups of 2
        qf.from_codes(torch.zeros(8, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32),
                      torch.ones(4, 8).half(), 4, 2, g_idx=torch.tensor([0, 0, 0, 1, 2, 2, 3, 3]))
    with pytest.raises(KeyError, match="l.scales"):
        qf.from_checkpoint({"l.qweight": z32, "l.qzeros": z32}, "l", {"quant_method": "awq", "bits": 4})


def test_concat_out_features_stacks_dequantized_rows():
    parts = []
    for seed, n in ((0, 64), (1, 32), (2, 32)):  # q, k, v shaped
        q, z, s, w = make_weight(n, 128, 32, sym=False, seed=seed)
        parts.append((qf.from_codes(q.t().int(), z.t().int(), s.t().half(), 4, 32, source="gptq_v2"), w))
    fused = qf.concat_out_features([p for p, _ in parts])
    assert fused.out_features == 128 and fused.qweight.shape == (16, 128)
    assert torch.equal(qf.dequantize(fused), torch.cat([w for _, w in parts]))
    q, z, s, _ = make_weight(32, 128, 64, sym=False)
    other = qf.from_codes(q.t().int(), z.t().int(), s.t().half(), 4, 64)
    assert qf.concat_out_features([parts[0][0], other]) is None  # different group size
    moved = fused.to(torch.device("cpu"))
    assert torch.equal(qf.dequantize(moved), qf.dequantize(fused))
