"""Triton paged attention (decode with and without split-KV, prefill over a cached prefix) against the torch
references, on CPU through Triton's interpreter, on fresh random caches and scattered block tables."""
import itertools

import pytest
import torch
from kernels_testenv import FP8, on_device  # noqa: F401 (autouse fixture)

from kernels import kv_cache, paged_attention as pa
from kernels._triton import cdiv


def make_cache(lengths, kv_heads, dim, block_size, dtype, spare_blocks=3):
    """Random K/V caches and block tables whose blocks are scattered (a random permutation of the pool)."""
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    pool = torch.randperm(num_blocks).to(torch.int32)
    width = max(need) + 1  # wider than needed, as the engine pads block tables
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = pool[used:used + n]
        used += n
    return k_cache, v_cache, tables


def check(out, ref_fn, *args):
    """out (bf16/fp16 math) against the reference computed in fp32 on upcast inputs: bf16 tolerances."""
    up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref = ref_fn(*up)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths,q_heads,kv_heads,block_size", [
    ([1], 4, 1, 16),                     # one token
    ([15, 16, 17, 33], 4, 2, 16),        # block boundaries, GQA group 2
    ([300, 129], 8, 2, 16),              # split-KV (few programs) with a log-sum-exp merge
    ([5, 64, 65, 200, 7, 1, 90, 31], 6, 2, 8),  # enough programs for no split; group 3; block size 8
])
def test_decode(dtype, lengths, q_heads, kv_heads, block_size):
    dim = 64
    k_cache, v_cache, tables = make_cache(lengths, kv_heads, dim, block_size, dtype)
    q = torch.randn(len(lengths), q_heads, dim, dtype=dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    scale = dim ** -0.5
    out = pa.paged_attention_decode(q, k_cache, v_cache, tables, ctx, scale)
    check(out, pa.paged_attention_decode_ref, q, k_cache, v_cache, tables, ctx, scale)


@pytest.mark.parametrize("lengths", [[15, 16, 17, 33], [300, 129]], ids=["no-split", "split"])
@pytest.mark.parametrize("q_heads", [4, 2], ids=["gqa", "mha"])
def test_decode_fp8_cache(lengths, q_heads):
    """An fp8 e4m3 cache, converted to q's dtype on load: the reference on the same fp8 values."""
    k_cache, v_cache, tables = make_cache(lengths, 2, 64, 16, torch.float32)
    k_cache, v_cache = k_cache.mul(30).to(FP8), v_cache.to(FP8)  # K over fp8's range, V of order 1
    q = torch.randn(len(lengths), q_heads, 64, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.paged_attention_decode(q, k_cache, v_cache, tables, ctx, 0.125 / 30)
    check(out, pa.paged_attention_decode_ref, q, k_cache, v_cache, tables, ctx, 0.125 / 30)


@pytest.mark.parametrize("config", ["DECODE_CONFIG_FP8", "DECODE_CONFIG_FP8_MHA"])
def test_decode_fp8_shipped_tiles(config):
    """The fp8 settings' own tiles (128 and 64 tokens), unsplit: one chunk spans each whole block table."""
    lengths = [300, 129, 5, 200]
    k_cache, v_cache, tables = make_cache(lengths, 2, 64, 16, torch.float32)
    k_cache, v_cache = k_cache.mul(30).to(FP8), v_cache.to(FP8)
    q = torch.randn(len(lengths), 4, 64, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    settings = getattr(pa, config)
    out = pa.decode_with(q, k_cache, v_cache, tables, ctx, 0.125 / 30, chunk=tables.shape[1] * 16, **settings)
    check(out, pa.paged_attention_decode_ref, q, k_cache, v_cache, tables, ctx, 0.125 / 30)


def test_byte_caches_go_to_compiled_kernels_as_bytes():
    """Compiled (any device but the CPU; ``meta`` here), an fp8 or int8 cache is passed as uint8 views of the same
    memory layout for the inline-PTX conversion (int8 with its scales); interpreted, as it is. K and V of different
    dtypes are refused."""
    k8 = torch.empty(5, 16, 2, 64, dtype=FP8, device="meta")[:, :, :, :32]  # not contiguous
    v8 = torch.empty(5, 16, 2, 32, dtype=FP8, device="meta")
    k, v, _, meta = pa._cache_args(torch.empty(1, 4, 32, device="meta"), k8, v8, None, None)
    assert (k.dtype, v.dtype, meta) == (torch.uint8, torch.uint8, dict(KV_FP8=True, KV_BYTES=True, KV_INT8=False))
    assert (k.stride(), v.stride()) == (k8.stride(), v8.stride())
    k8c = torch.zeros(5, 16, 2, 32, dtype=FP8, device="cpu")
    k, v, _, meta = pa._cache_args(torch.zeros(1, 4, 32, device="cpu"), k8c, k8c, None, None)
    assert k is k8c and meta == dict(KV_FP8=True, KV_BYTES=False, KV_INT8=False)
    i8 = torch.empty(5, 16, 2, 32, dtype=torch.int8, device="meta")
    s8 = torch.empty(5, 2, 16, device="meta")
    k, v, scales, meta = pa._cache_args(torch.empty(1, 4, 32, device="meta"), i8, i8, s8, s8)
    assert (k.dtype, meta) == (torch.uint8, dict(KV_FP8=False, KV_BYTES=True, KV_INT8=True))
    assert scales[0] is s8 and scales[2:] == (32, 16)
    with pytest.raises(ValueError, match="differ in dtype"):
        pa._cache_args(torch.zeros(1, 4, 32), k8c, torch.zeros(5, 16, 2, 32, dtype=torch.bfloat16), None, None)
    # the conversion takes four bytes per thread: 16 tokens x 32 dims cannot feed 8 warps (refused before launch)
    q = torch.empty(1, 4, 32, dtype=torch.bfloat16, device="meta")
    tables, ctx = torch.zeros(1, 2, dtype=torch.int32, device="meta"), torch.ones(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="too small"):
        pa.decode_with(q, v8, v8, tables, ctx, 1.0, block_n=16, num_warps=8)


def test_decode_tile_narrows_to_the_chunk():
    """A KV tile wider than the chunk (the fp8 settings' 128 tokens against 64-token splits) is narrowed to a power
    of two that fits: a 48-token chunk over 128-token tables gives 3 splits of 32-token tiles (100 tokens then run
    64 + 36, 47 run 32 + 15), and the merge of the splits gives the reference."""
    assert [pa.decode_tile(128, c) for c in (64, 48, 128, 640, 8)] == [64, 32, 128, 128, 16]
    assert pa.decode_tile(64, 4096) == 64
    lengths = [100, 47]
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.bfloat16)
    q = torch.randn(len(lengths), 4, 32, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.decode_with(q, k_cache, v_cache, tables, ctx, 32 ** -0.5, chunk=48, block_n=128)
    check(out, pa.paged_attention_decode_ref, q, k_cache, v_cache, tables, ctx, 32 ** -0.5)


@pytest.mark.parametrize("lengths", [[1, 17, 130, 300], [64, 63, 65, 2]])
def test_decode_short_contexts_spread_over_a_wide_table(lengths, monkeypatch):
    """A CUDA graph's block tables are max_model_len wide: here 64 blocks (1,024 tokens) in 256-token chunks, 4
    splits. Each context is spread over the splits in whole 16-token tiles, cdiv(cdiv(ctx, 4), 16) tiles per split
    (130 tokens: 48 + 48 + 34 and an empty fourth; 17: 16 + 1; 300: 80 + 80 + 80 + 60): each live split's partial
    output is attention over exactly its tokens, and the merge of the live splits gives the reference, the same
    bits each call. A split past the context writes nothing (it leaves before the PDL wait on a GPU)."""
    partials = {}
    merge, decode = pa._merge_kernel, pa._decode_kernel

    class Spy:  # keeps the partial outputs the merge kernel is given
        def __getitem__(self, grid):
            def launch(po, *args, **meta):
                partials["po"] = po.clone()
                return merge[grid](po, *args, **meta)
            return launch

    class NanFill:  # the decode kernel's partial outputs start as NaN: what it leaves alone stays NaN
        def __getitem__(self, grid):
            def launch(*args, **meta):
                args[6].fill_(float("nan"))
                args[7].fill_(float("nan"))
                return decode[grid](*args, **meta)
            return launch

    monkeypatch.setattr(pa, "_merge_kernel", Spy())
    monkeypatch.setattr(pa, "_decode_kernel", NanFill())
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.bfloat16)
    wide = torch.full((len(lengths), 64), -1, dtype=torch.int32)
    wide[:, :tables.shape[1]] = tables
    q = torch.randn(len(lengths), 4, 32, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.decode_with(q, k_cache, v_cache, wide, ctx, 32 ** -0.5, chunk=256, block_n=16)
    check(out, pa.paged_attention_decode_ref, q, k_cache, v_cache, tables, ctx, 32 ** -0.5)
    assert torch.equal(out, pa.decode_with(q, k_cache, v_cache, wide, ctx, 32 ** -0.5, chunk=256, block_n=16))
    for b, n in enumerate(lengths):
        chunk = cdiv(cdiv(n, 4), 16) * 16
        k = pa.gather_kv(k_cache, tables[b], n).float().repeat_interleave(2, dim=1).transpose(0, 1)
        v = pa.gather_kv(v_cache, tables[b], n).float().repeat_interleave(2, dim=1).transpose(0, 1)
        assert partials["po"][b, :, cdiv(n, chunk):].isnan().all()
        for split in range(cdiv(n, chunk)):
            lo, hi = split * chunk, min(n, (split + 1) * chunk)
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b].float()[:, None], k[:, lo:hi], v[:, lo:hi], scale=32 ** -0.5)[:, 0]
            torch.testing.assert_close(partials["po"][b, :, split], want, rtol=2e-2, atol=2e-2)


def test_decode_split_chunks_are_shape_only():
    assert pa.decode_split_chunk(64, 8, 4096, 132) == 4096  # 512 programs fill the GPU: one split
    assert pa.decode_split_chunk(1, 8, 16384, 132) == 256
    assert pa.decode_split_chunk(1, 8, 4096, 132) == 64
    assert pa.decode_split_chunk(1, 8, 8192, 132) == 128
    assert pa.decode_split_chunk(16, 8, 4096, 132) == 1024
    assert pa.decode_split_chunk(16, 8, 1024, 132) == 256
    assert pa.decode_split_chunk(1, 8, 48, 132) == 64
    # a long table (Llama 3.1's 131,072-token context) gets at most MAX_SPLITS splits, whatever the branch
    assert pa.MAX_SPLITS == 64 and pa.decode_split_chunk(1, 8, 131072, 132) == 2048
    assert pa.decode_split_chunk(1, 8, 32768, 132) == 512 and pa.decode_split_chunk(1, 8, 110000, 132) == 2048
    assert pa.decode_split_chunk(8, 8, 262144, 132) == 4096  # the many-programs branch too (2048 would be 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefixes,new,q_heads,kv_heads,block_size", [
    ([0], [1], 2, 1, 16),                          # one token
    ([0, 5, 16], [17, 3, 16], 4, 2, 16),           # no prefix, prefix inside a block, prefix on a boundary
    ([40, 0, 0], [21, 33, 2], 3, 1, 8),            # group 3, longer than a tile
])
def test_prefill(dtype, prefixes, new, q_heads, kv_heads, block_size):
    dim = 32
    lengths = [p + n for p, n in zip(prefixes, new)]
    k_cache, v_cache, tables = make_cache(lengths, kv_heads, dim, block_size, dtype)
    q = torch.randn(sum(new), q_heads, dim, dtype=dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    scale = dim ** -0.5
    out = pa.paged_attention_prefill(q, k_cache, v_cache, tables, cu, ctx, scale)
    check(out, pa.paged_attention_prefill_ref, q, k_cache, v_cache, tables, cu, ctx, scale)


def _prefill_batch():
    """Five sequences' new tokens after cached prefixes that end inside a KV tile, on a tile boundary, at 0, and
    one and two keys before a boundary: (q, k_cache, v_cache, tables, cu_seqlens, context lens)."""
    prefixes, new = [0, 37, 64, 31, 30], [70, 45, 33, 2, 20]
    lengths = [p + n for p, n in zip(prefixes, new)]
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.bfloat16)
    q = torch.randn(sum(new), 4, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("mask_free", [True, False])
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (32, 32)])
def test_prefill_tiles_below_and_across_the_diagonal(block_m, block_n, mask_free):
    """The kernel takes the KV tiles every row of a query tile sees without a mask, then the tiles across the
    diagonal with one: query tiles taller and shorter than the KV tiles, prefixes that end inside a KV tile, on a
    tile boundary and at 0, and query tiles whose first row sits one and two keys before a KV tile boundary (30:
    a tile taken whole one key too early would show that row its next key). Without ``mask_free`` (GPUs before
    Hopper) every tile takes the mask."""
    q, k_cache, v_cache, tables, cu, ctx = _prefill_batch()
    out = pa.prefill_with(q, k_cache, v_cache, tables, cu, ctx, 32 ** -0.5, block_m=block_m, block_n=block_n,
                          mask_free=mask_free)
    check(out, pa.paged_attention_prefill_ref, q, k_cache, v_cache, tables, cu, ctx, 32 ** -0.5)


def test_prefill_settings_per_device_and_unknown_ones_refused(monkeypatch):
    q = torch.zeros(1, 2, 32, device="cpu")  # interpreted, also when the kernel tests run on a GPU
    assert pa.prefill_config(q) is pa.PREFILL_CONFIG_INTERPRETED
    on_gpu = torch.zeros(1, device="meta")
    monkeypatch.setattr(pa, "dot_f32", lambda t: False)
    monkeypatch.setattr(pa, "hopper", lambda t: True)
    assert pa.prefill_config(on_gpu) is pa.PREFILL_CONFIG and pa.PREFILL_CONFIG["mask_free"]
    monkeypatch.setattr(pa, "hopper", lambda t: False)
    assert pa.prefill_config(on_gpu) is pa.PREFILL_CONFIG_PRE_HOPPER and not pa.PREFILL_CONFIG_PRE_HOPPER["mask_free"]
    with pytest.raises(ValueError, match="unknown settings \\['chunk'\\]"):
        pa.prefill_with(q, None, None, None, None, None, 1.0, chunk=64)


@pytest.mark.parametrize("mask_free, window", [(True, 0), (False, 0), (True, 5)])
def test_prefill_padded_as_a_cuda_graph_launches_it(mask_free, window):
    """A prefill graph launches more tokens and sequences than its step has (``engine.cuda_graphs``): padding
    tokens past the last sequence's (NaN queries here), absent sequences with no new tokens, context 0 and block
    table rows left from an earlier step. The real tokens' rows equal the unpadded launch's bit for bit."""
    q, k_cache, v_cache, tables, cu, ctx = _prefill_batch()
    tokens, seqs = q.shape[0], tables.shape[0]
    padded_q = torch.full((tokens + 30, *q.shape[1:]), float("nan"), dtype=q.dtype)
    padded_q[:tokens] = q
    padded_tables = torch.full((seqs + 3, tables.shape[1] + 2), 2**30, dtype=torch.int32)  # stale block ids
    padded_tables[:seqs, :tables.shape[1]] = tables
    padded_cu = torch.cat([cu, torch.full((3,), tokens, dtype=torch.int32)])
    padded_ctx = torch.cat([ctx, torch.zeros(3, dtype=torch.int32)])
    settings = dict(block_m=32, block_n=16, mask_free=mask_free, window=window)
    want = pa.prefill_with(q, k_cache, v_cache, tables, cu, ctx, 32 ** -0.5, **settings)
    got = pa.prefill_with(padded_q, k_cache, v_cache, padded_tables, padded_cu, padded_ctx, 32 ** -0.5, **settings)
    assert _same_bits(got[:tokens], want)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_decode_sliding_window(window):
    """With a sliding window each sequence attends over its last ``window`` tokens only (a context shorter than the
    window over all of it), spread over the splits of a wide table as a whole context is."""
    lengths = [1, 17, 130, 64, 300]
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.bfloat16)
    wide = torch.full((len(lengths), 64), -1, dtype=torch.int32)
    wide[:, :tables.shape[1]] = tables
    q = torch.randn(len(lengths), 4, 32, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.decode_with(q, k_cache, v_cache, wide, ctx, 32 ** -0.5, chunk=16, block_n=16, window=window)
    check(out, lambda *a: pa.paged_attention_decode_ref(*a, window=window), q, k_cache, v_cache, tables, ctx,
          32 ** -0.5)
    k_last = pa.gather_kv(k_cache, tables[4], 300)[300 - window:].float()
    v_last = pa.gather_kv(v_cache, tables[4], 300)[300 - window:].float()
    want = torch.nn.functional.scaled_dot_product_attention(  # the 300-token sequence's last `window` keys alone
        q[4].float()[:, None], k_last.repeat_interleave(2, dim=1).transpose(0, 1),
        v_last.repeat_interleave(2, dim=1).transpose(0, 1), scale=32 ** -0.5)[:, 0]
    torch.testing.assert_close(out[4].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_prefill_sliding_window(window, block_m, block_n):
    """Each new token attends over the last ``window`` positions up to its own, across a cached prefix; every tile
    takes the mask (``mask_free`` is ignored with a window); the references agree row for row with decode."""
    q, k_cache, v_cache, tables, cu, ctx = _prefill_batch()
    out = pa.prefill_with(q, k_cache, v_cache, tables, cu, ctx, 32 ** -0.5, block_m=block_m, block_n=block_n,
                          mask_free=True, window=window)
    check(out, lambda *a: pa.paged_attention_prefill_ref(*a, window=window), q, k_cache, v_cache, tables, cu, ctx,
          32 ** -0.5)
    last = pa.paged_attention_decode_ref(q[cu[1:] - 1], k_cache, v_cache, tables, ctx, 32 ** -0.5, window=window)
    assert torch.equal(pa.paged_attention_prefill_ref(q, k_cache, v_cache, tables, cu, ctx, 32 ** -0.5,
                                                      window=window)[cu[1:] - 1], last)


def test_prefill_fp8_cache():
    prefixes, new = [0, 5, 40], [17, 3, 21]
    lengths = [p + n for p, n in zip(prefixes, new)]
    k_cache, v_cache, tables = make_cache(lengths, 1, 32, 8, torch.float32)
    k_cache, v_cache = k_cache.mul(30).to(FP8), v_cache.to(FP8)
    q = torch.randn(sum(new), 3, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.paged_attention_prefill(q, k_cache, v_cache, tables, cu, ctx, 0.2 / 30)
    check(out, pa.paged_attention_prefill_ref, q, k_cache, v_cache, tables, cu, ctx, 0.2 / 30)


def int8_cache(k_cache, v_cache):
    """Float caches quantized as the engine writes them: (k codes, v codes, k scales, v scales), the scales
    head-major ([num_blocks, H, block_size])."""
    (kc, ks), (vc, vs) = kv_cache.quantize_int8_ref(k_cache), kv_cache.quantize_int8_ref(v_cache)
    return kc, vc, ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()


@pytest.mark.parametrize("lengths", [[15, 16, 17, 33], [300, 129]], ids=["no-split", "split"])
@pytest.mark.parametrize("q_heads", [4, 2], ids=["gqa", "mha"])
def test_decode_int8_cache(lengths, q_heads):
    """An int8 cache (codes converted exactly, per-token scales on the scores and on V's weights): the reference
    on the same codes and scales, K of scales near 30x V's."""
    k_cache, v_cache, tables = make_cache(lengths, 2, 64, 16, torch.float32)
    kc, vc, ks, vs = int8_cache(k_cache.mul(30), v_cache)
    q = torch.randn(len(lengths), q_heads, 64, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.paged_attention_decode(q, kc, vc, tables, ctx, 0.125 / 30, ks, vs)
    check(out, pa.paged_attention_decode_ref, q, kc, vc, tables, ctx, 0.125 / 30, ks, vs)


def test_int8_reference_is_the_reference_on_dequantized_values():
    """The references dequantize (codes x scales, fp32), then attend as for any cache: the same bits as on a float
    cache holding the dequantized values; and the dequantized values are within half a step of the originals."""
    lengths, new = [40, 17], [5, 17]
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.float32)
    kc, vc, ks, vs = int8_cache(k_cache, v_cache)
    kd, vd = (kv_cache.dequantize_int8_ref(c, s.transpose(1, 2)) for c, s in ((kc, ks), (vc, vs)))
    assert ((kd - k_cache).abs() <= ks.transpose(1, 2)[..., None] * 0.5001).all() and ks.min() > 0
    ctx = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), 4, 32)
    assert torch.equal(pa.paged_attention_decode_ref(q, kc, vc, tables, ctx, 0.2, ks, vs),
                       pa.paged_attention_decode_ref(q, kd, vd, tables, ctx, 0.2))
    qp = torch.randn(sum(new), 4, 32)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    assert torch.equal(pa.paged_attention_prefill_ref(qp, kc, vc, tables, cu, ctx, 0.2, ks, vs),
                       pa.paged_attention_prefill_ref(qp, kd, vd, tables, cu, ctx, 0.2))


def test_prefill_int8_cache():
    prefixes, new = [0, 5, 40], [17, 3, 21]
    lengths = [p + n for p, n in zip(prefixes, new)]
    k_cache, v_cache, tables = make_cache(lengths, 1, 32, 8, torch.float32)
    kc, vc, ks, vs = int8_cache(k_cache.mul(30), v_cache)
    q = torch.randn(sum(new), 3, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.paged_attention_prefill(q, kc, vc, tables, cu, ctx, 0.2 / 30, ks, vs)
    check(out, pa.paged_attention_prefill_ref, q, kc, vc, tables, cu, ctx, 0.2 / 30, ks, vs)


def test_int8_engine_layout_and_missing_scales():
    """The engine's int8 layout (codes, then scales, in each block's bytes: strided views, K's and V's scales of
    equal strides) reads as contiguous codes and scales do; an int8 cache without its scales is refused."""
    from engine.model_runner import int8_views

    lengths = [33, 70]
    k_cache, v_cache, tables = make_cache(lengths, 2, 32, 16, torch.float32)
    kc, vc, ks, vs = int8_cache(k_cache, v_cache)
    store = torch.zeros(2, kc.shape[0], 16 * 2 * (32 + 4), dtype=torch.uint8)
    (kc2, ks2), (vc2, vs2) = (int8_views(store[i], 16, 2, 32) for i in (0, 1))
    for dst, src in ((kc2, kc), (ks2, ks), (vc2, vc), (vs2, vs)):
        dst.copy_(src)
    assert not kc2.is_contiguous() and ks2.stride() == vs2.stride()
    q = torch.randn(len(lengths), 4, 32, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    want = pa.paged_attention_decode(q, kc, vc, tables, ctx, 0.2, ks, vs)
    assert torch.equal(pa.paged_attention_decode(q, kc2, vc2, tables, ctx, 0.2, ks2, vs2), want)
    for fn in (pa.paged_attention_decode, pa.paged_attention_decode_ref):
        with pytest.raises(ValueError, match="needs fp32 scales"):
            fn(q, kc, vc, tables, ctx, 0.2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    for fn in (pa.paged_attention_prefill, pa.paged_attention_prefill_ref):
        with pytest.raises(ValueError, match="needs fp32 scales"):
            fn(q, kc, vc, tables, cu, ctx, 0.2, ks)


@pytest.mark.parametrize("v_size", [1e-3, 1e-4])
def test_decode_int8_small_values(v_size):
    """V of tokens whose largest value is far below 1, its scales spread over three orders of magnitude: the
    output to 2% of its own size (on the GPU p x scale would sink into fp16's subnormals without
    ``INT8_V_BOOST``: 9% off at 1e-4)."""
    lengths = [300, 129]
    k_cache, v_cache, tables = make_cache(lengths, 2, 64, 16, torch.float32)
    spread = torch.logspace(0, -3, v_cache.shape[1])[None, :, None, None]
    kc, vc, ks, vs = int8_cache(k_cache, v_cache * spread * v_size)
    q = torch.randn(len(lengths), 4, 64, dtype=torch.bfloat16)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = pa.paged_attention_decode(q, kc, vc, tables, ctx, 0.125, ks, vs).float()
    ref = pa.paged_attention_decode_ref(q.float(), kc, vc, tables, ctx, 0.125, ks, vs)
    torch.testing.assert_close(out / v_size, ref / v_size, rtol=2e-2, atol=2e-2)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal calls -0 and +0 equal)."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _attention_f64(q, k, v, scale, window=0):
    """Plain causal attention of the last len(q) positions of a len(k) context in float64 (the references' truth)."""
    q_len, kv_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos, key = torch.arange(kv_len - q_len, kv_len)[:, None], torch.arange(kv_len)[None, :]
    hidden = (key > pos) | (key <= pos - window) if window else key > pos
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(hidden, -torch.inf), dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix,new,q_heads,kv_heads,window", [
    (0, 1, 2, 1, 0),      # one token
    (0, 37, 4, 2, 0),     # row groups (of 8): whole ones, one partial
    (13, 20, 6, 2, 0),    # a prefix inside a row group; GQA group 3
    (16, 16, 3, 3, 0),    # a prefix and a chunk on row-group boundaries; no GQA
    (33, 50, 3, 1, 7),    # a window shorter than a row group
    (5, 60, 9, 3, 20),    # a window across row groups
    (20, 12, 2, 1, 1),    # a window of one key: each row its own
])
def test_reference_rows_equal_decode_and_chunks_bit_for_bit(dtype, prefix, new, q_heads, kv_heads, window):
    """The CPU reference: each new position's row equals, bit for bit, what a decode of that position computes
    (its context only) and what any chunking of the new tokens computes; all are plain attention in float64 within
    the dtype's rounding."""
    kv_len = prefix + new
    q = torch.randn(new, q_heads, 32).to(dtype)
    k, v = (torch.randn(kv_len, kv_heads, 32).to(dtype) for _ in range(2))
    out = pa._attend(q, k, v, 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _attention_f64(q, k, v, 0.2, window), rtol=tol, atol=tol)
    for i in range(new):
        p = prefix + i + 1
        assert _same_bits(pa._attend(q[i:i + 1], k[:p], v[:p], 0.2, window)[0], out[i]), f"row {i}"
    cut = new // 3 + 1  # a chunk boundary inside a row group
    first = pa._attend(q[:cut], k[:prefix + cut], v[:prefix + cut], 0.2, window)
    assert _same_bits(torch.cat([first, pa._attend(q[cut:], k, v, 0.2, window)]) if cut < new else first, out)


def test_reference_keys_past_a_row_get_no_weight_whatever_they_hold():
    """Keys after a row's position (a prefill's later tokens) weigh exactly 0, however large: the row equals its
    decode. (Not NaN: 0 x NaN is NaN; the engine's K/V past a context are zeros or finite tokens.)"""
    q, k, v = torch.randn(1, 2, 32), torch.randn(20, 1, 32), torch.randn(20, 1, 32)
    want = pa._attend(q, k[:5], v[:5], 0.2)
    k[5:], v[5:] = 1e30, -3e38  # scores overflow to +-inf before the mask; 0 x -3e38 = -0
    qs = torch.cat([torch.zeros(4, 2, 32), q, torch.zeros(15, 2, 32)])  # the row at position 4 of a 20-token prefill
    assert _same_bits(pa._attend(qs, k, v, 0.2)[4], want[0])
