"""Triton RMSNorm, rotary, SiLU-and-mul and KV-cache write against their torch references, on CPU through Triton's
interpreter (the same kernel code that runs compiled on CUDA), on fresh random inputs.

The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), so results that copy the reference's
rounding steps are checked bit for bit in fp16 and fp32 here, and within one bf16 step in bf16 (bench/gpu_suite.py
checks them bit for bit on the GPU)."""
import pytest
import torch
from kernels_testenv import DEVICE, FP8, fp8_safe, on_device  # noqa: F401 (autouse fixture)

from kernels import activation, kv_cache, norm, rotary

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def exact(dtype):
    """assert_close tolerances: bit-exact, except a few bf16 steps where the interpreter truncates."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        return dict(rtol=2**-6, atol=2**-4)
    return dict(rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 576), (3, 100)])
def test_rms_norm(dtype, tokens, hidden):
    x = torch.randn(tokens, hidden, dtype=dtype)
    res = torch.randn(tokens, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    out, summed = norm.rms_norm(x, w, 1e-6, res)
    ref_out, ref_sum = norm.rms_norm_ref(x, w, 1e-6, res)
    torch.testing.assert_close(summed, ref_sum, **exact(dtype))
    loose = dict(rtol=2**-6, atol=2**-4) if dtype == torch.bfloat16 else {}  # 1/sqrt vs rsqrt: a last-bit flip
    torch.testing.assert_close(out, ref_out, **loose)
    out, same = norm.rms_norm(x, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out, norm.rms_norm_ref(x, w, 1e-5)[0], **loose)


def test_rms_norm_strided_rows():
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16)[:, 0]  # row stride 128
    w = torch.randn(64, dtype=torch.bfloat16)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6)[0], norm.rms_norm_ref(x, w, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,dim", [(1, 4, 2, 64), (9, 9, 3, 64), (4, 3, 1, 80)])
def test_rotary(dtype, tokens, q_heads, kv_heads, dim):
    cos_sin = rotary.rope_cos_sin(dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype)  # the engine passes views of one qkv
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim: (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    qo, ko = rotary.rotary(positions, q, k, cos_sin)
    qr, kr = rotary.rotary_ref(positions, q, k, cos_sin)
    torch.testing.assert_close(qo, qr, **exact(dtype))  # same rounding steps as the reference
    torch.testing.assert_close(ko, kr, **exact(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,dim,block_size", [(1, 4, 2, 64, 16), (9, 9, 3, 64, 8),
                                                                    (4, 3, 1, 80, 16),
                                                                    (2, 64, 8, 128, 16)])  # 8 warps (70B heads)
def test_rotary_write_kv(dtype, tokens, q_heads, kv_heads, dim, block_size):
    """Rotary with the KV write fused: the same q, and the same caches, as rotary then write_kv_cache (slot -1
    skipped, every other slot written)."""
    cos_sin = rotary.rope_cos_sin(dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    blocks = 4
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[tokens // 2] = -1
    caches = torch.randn(2, blocks, block_size, kv_heads, dim).to(dtype)  # one allocation, as the engine's
    refs = caches.clone()
    qo = rotary.rotary_write_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    qr = rotary.rotary_write_kv_ref(positions, q, k, v, cos_sin, refs[0], refs[1], slots)
    torch.testing.assert_close(qo, qr, **exact(dtype))
    torch.testing.assert_close(caches, refs, **exact(dtype))


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter rounds to fp8 wrongly; on the GPU only")
def test_rotary_write_kv_fp8_cache():
    """The rotated k, rounded to x's dtype, then to fp8 e4m3: the bits the reference writes."""
    tokens, q_heads, kv_heads, dim, block_size = 9, 8, 2, 128, 16
    cos_sin = rotary.rope_cos_sin(dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=torch.bfloat16) * 30
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1))
    slots = torch.randperm(4 * block_size)[:tokens]
    caches = torch.zeros(2, 4, block_size, kv_heads, dim, dtype=FP8)
    refs = caches.clone()
    rotary.rotary_write_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots)
    rotary.rotary_write_kv_ref(positions, q, k, v, cos_sin, refs[0], refs[1], slots)
    assert torch.equal(caches.view(torch.uint8), refs.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 1536), (3, 1100)])
def test_silu_and_mul(dtype, tokens, inter):
    x = torch.randn(tokens, 2 * inter, dtype=dtype) * 4
    torch.testing.assert_close(activation.silu_and_mul(x), activation.silu_and_mul_ref(x))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, FP8])
@pytest.mark.parametrize("block_size", [16, 8])
def test_write_kv_cache(cache_dtype, block_size):
    """Bit-exact against the reference, an fp8 cache included (rounded, saturated at +-448: on the GPU the raw
    values go past it; the interpreter gets values fp8 holds exactly, see ``fp8_safe``)."""
    tokens, heads, dim, blocks = 11, 3, 64, 6
    kv = torch.randn(tokens, 2, heads, dim, dtype=torch.bfloat16) * (200 if cache_dtype == FP8 else 1)
    if cache_dtype == FP8:
        kv = fp8_safe(kv)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[[2, 7]] = -1  # padding
    caches = [torch.randn(blocks, block_size, heads, dim).to(cache_dtype) for _ in range(2)]
    refs = [c.clone() for c in caches]
    kv_cache.write_kv_cache(k, v, caches[0], caches[1], slots)
    kv_cache.write_kv_cache_ref(k, v, refs[0], refs[1], slots)
    assert all(torch.equal(c.view(torch.uint8) if c.dtype == FP8 else c, r.view(torch.uint8) if r.dtype == FP8
                           else r) for c, r in zip(caches, refs))
    if cache_dtype == FP8:
        assert caches[0].float().abs().max() == 448  # some values saturated


def test_quantize_int8_ref_by_hand():
    """Symmetric int8 per row: scale max|x| / 127, codes round half to even, a row of zeros at scale 0, a row with
    NaN or inf at scale NaN (codes 0: it reads back as NaN)."""
    nan, inf = float("nan"), float("inf")
    codes, scales = kv_cache.quantize_int8_ref(torch.tensor([[127.0, 0.5, 1.5, -2.5], [0.0, 0.0, 0.0, 0.0],
                                                             [0.5, -1.27, 0.0, 1.27], [1.0, nan, 2.0, 3.0],
                                                             [1.0, -inf, 2.0, 3.0]]))
    assert codes.tolist() == [[127, 0, 2, -2], [0, 0, 0, 0], [50, -127, 0, 127], [0] * 4, [0] * 4]
    assert scales[:3].tolist() == [1.0, 0.0, torch.tensor(1.27 / 127, dtype=torch.float32).item()]
    assert scales[3:].isnan().all() and kv_cache.dequantize_int8_ref(codes, scales)[3:].isnan().all()
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32


def int8_layout(blocks, block_size, heads, dim):
    """Garbage bytes in the engine's int8 layout (codes, then fp32 scales, inside each block: strided views), and
    the (codes, scales) views of K and V."""
    from engine.model_runner import int8_views

    store = torch.randint(0, 256, (2, blocks, block_size * heads * (dim + 4)), dtype=torch.uint8)
    return store, [int8_views(store[i], block_size, heads, dim) for i in (0, 1)]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 8])
def test_write_kv_cache_int8(x_dtype, block_size):
    """int8 codes and per-token, per-head scales bit-equal to the reference's (ties included), in the engine's
    layout; other slots untouched; a head of zeros gets scale 0; every value comes back within half a step."""
    tokens, heads, dim, blocks = 11, 3, 64, 6
    kv = torch.randn(tokens, 2, heads, dim) * torch.logspace(-3, 3, tokens)[:, None, None, None]
    kv[3, 0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1 exactly: three ties
    kv[3, 0, 0, 4:] = 0
    kv[4, :, 1] = 0  # a head of zeros
    kv[5, 0, 2, 7], kv[5, 1, 0, 3] = float("nan"), -float("inf")  # heads that read back as NaN
    kv = kv.to(x_dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[[2, 7]] = -1  # padding
    store, ((kc, ks), (vc, vs)) = int8_layout(blocks, block_size, heads, dim)
    ref = store.clone()
    from engine.model_runner import int8_views
    (rkc, rks), (rvc, rvs) = (int8_views(ref[i], block_size, heads, dim) for i in (0, 1))
    kv_cache.write_kv_cache(k, v, kc, vc, slots, ks, vs)
    kv_cache.write_kv_cache_ref(k, v, rkc, rvc, slots, rks, rvs)
    assert torch.equal(kc, rkc) and torch.equal(vc, rvc)
    for got, want in ((ks, rks), (vs, rvs)):  # NaN where a head held NaN or inf (its bits may differ), else equal
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    b, o = slots[3] // block_size, slots[3] % block_size
    assert ks[b, 0, o] == 1 and kc[b, o, 0, :4].tolist() == [127, 0, 2, -2]
    b, o = slots[4] // block_size, slots[4] % block_size
    assert ks[b, 1, o] == 0 and vs[b, 1, o] == 0 and not kc[b, o, 1].any() and vs[b, 0, o] > 0
    b, o = slots[5] // block_size, slots[5] % block_size
    assert ks[b, 2, o].isnan() and vs[b, 0, o].isnan() and not kc[b, o, 2].any() and ks[b, 0, o] > 0
    keep = (slots >= 0) & (torch.arange(tokens) != 5)
    b, o = slots[keep] // block_size, slots[keep] % block_size
    for codes, scales, x in ((kc, ks, k), (vc, vs, v)):
        err = (kv_cache.dequantize_int8_ref(codes[b, o], scales[b, :, o]) - x[keep].float()).abs()
        assert (err <= scales[b, :, o][..., None] * 0.5001).all()


def test_write_kv_cache_int8_needs_its_scales():
    k = torch.randn(2, 1, 16)
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.int8)
    slots = torch.tensor([0, 1])
    for fn in (kv_cache.write_kv_cache, kv_cache.write_kv_cache_ref):
        with pytest.raises(ValueError, match=r"needs fp32 scales of shape \(2, 1, 16\)"):
            fn(k, k, cache, cache, slots)
        with pytest.raises(ValueError, match="needs fp32 scales"):
            fn(k, k, cache, cache, slots, torch.zeros(2, 1, 16, dtype=torch.float16), torch.zeros(2, 1, 16))
    cos_sin = rotary.rope_cos_sin(16, 8, 10000.0, device=DEVICE)
    for fn in (rotary.rotary_write_kv, rotary.rotary_write_kv_ref):
        with pytest.raises(ValueError, match="needs fp32 scales"):
            fn(slots, k, k, k, cos_sin, cache, cache, slots)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE != "cpu" else []))
@pytest.mark.parametrize("tokens,q_heads,kv_heads,dim,block_size", [(1, 4, 2, 64, 16), (9, 9, 3, 64, 8),
                                                                    (4, 3, 1, 80, 16), (2, 32, 8, 128, 16)])
def test_rotary_write_kv_int8(dtype, tokens, q_heads, kv_heads, dim, block_size):
    """The rotated k (rounded to x's dtype) and v into an int8 cache: the reference's codes and scales, bit for
    bit, and q as :func:`rotary.rotary_ref` (bf16 on the GPU only: the interpreter rounds bf16 differently)."""
    cos_sin = rotary.rope_cos_sin(dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype) * 3
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1))
    slots = torch.randperm(4 * block_size)[:tokens]
    slots[tokens // 2] = -1
    store, ((kc, ks), (vc, vs)) = int8_layout(4, block_size, kv_heads, dim)
    ref = store.clone()
    from engine.model_runner import int8_views
    (rkc, rks), (rvc, rvs) = (int8_views(ref[i], block_size, kv_heads, dim) for i in (0, 1))
    qo = rotary.rotary_write_kv(positions, q, k, v, cos_sin, kc, vc, slots, ks, vs)
    qr = rotary.rotary_write_kv_ref(positions, q, k, v, cos_sin, rkc, rvc, slots, rks, rvs)
    assert torch.equal(qo, qr)
    assert torch.equal(store, ref)
