"""Split-K partial sums left to the next kernel (kernels/split_k.py): a product run with ``defer_sum`` returns a
``SplitK``; rotary with the KV write and SiLU-and-mul add its splits as they load them and must give the bits they
give on ``SplitK.sum()``, the product the GEMV would have stored. On CPU through Triton's interpreter;
KERNEL_TEST_DEVICE=cuda runs them compiled."""
import pytest
import torch
from kernels_testenv import DEVICE, Launches, on_device  # noqa: F401 (autouse fixture)
from test_kernels_w4a16 import check_product, make_weight

from kernels import activation, ops, rotary, split_k, w4a16
from kernels.split_k import SplitK, as_tensor

DTYPES = [torch.bfloat16, torch.float16]


def make_split(splits: int, rows: int, cols: int, dtype, bias: bool) -> SplitK:
    """Random fp32 partial sums [splits, rows, cols] and maybe a bias [cols] in ``dtype``."""
    return SplitK(torch.randn(splits, rows, cols), torch.randn(cols, dtype=dtype) if bias else None, dtype)


@pytest.mark.parametrize("splits", [2, 5, 9])
def test_sum_adds_the_splits_in_order_then_the_bias(splits):
    """fp32 output: the bits of the same additions in torch, from 0 in split order, then the bias."""
    s = make_split(splits, 3, 70, torch.float32, True)
    ref = torch.zeros(3, 70)
    for i in range(splits):
        ref = ref + s.part[i]
    assert torch.equal(s.sum(), ref + s.bias)
    assert torch.equal(SplitK(s.part, None, torch.float32).sum(), ref)


def test_views_split_and_reshape_part_and_bias_together():
    s = make_split(3, 4, 2 * 6 + 2 * 4, torch.float16, True)
    q, k, v = s.split([12, 4, 4])
    assert (q.shape, k.shape, q.splits, q.dtype) == (torch.Size([4, 12]), torch.Size([4, 4]), 3, torch.float16)
    assert torch.equal(k.part, s.part[..., 12:16]) and torch.equal(k.bias, s.bias[12:16])
    heads = q.reshape(-1, 2, 6)
    assert heads.shape == torch.Size([4, 2, 6]) and heads.bias.shape == torch.Size([2, 6])
    assert torch.equal(heads.sum().reshape(4, 12), q.sum())  # the bias repeats every row, not every head
    assert torch.equal(as_tensor(k), k.sum()) and as_tensor(s.part) is s.part
    with pytest.raises(ValueError, match="last dim"):
        s.split([2, 2], dim=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens,inter", [(1, 64), (3, 1100)])
def test_silu_and_mul_adds_the_splits(dtype, splits, bias, tokens, inter):
    s = make_split(splits, tokens, 2 * inter, dtype, bias)
    y = activation.silu_and_mul(s)
    assert y.dtype == dtype and y.shape == (tokens, inter)
    assert torch.equal(y, activation.silu_and_mul(s.sum()))
    # CPU tensors: ops takes the reference of the sum, which the kernel's split-adding output matches
    torch.testing.assert_close(ops.silu_and_mul(s), y)


def _qkv(s: SplitK, q_heads: int, kv_heads: int, dim: int):
    q, k, v = s.split([q_heads * dim, kv_heads * dim, kv_heads * dim])
    return q.reshape(-1, q_heads, dim), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim)


CASES = [(dtype, splits, bias, 1, 4, 2, 64, None) for dtype in DTYPES for splits, bias in ((2, False), (6, True),
                                                                                           (9, False))]
CASES += [(torch.float16, 9, True, 9, 9, 3, 64, None), (torch.bfloat16, 5, False, 5, 4, 2, 64, torch.int8),
          (torch.float32, 3, True, 3, 4, 2, 64, None), (torch.bfloat16, 8, True, 4, 8, 2, 128, None)]  # Llama's 128


@pytest.mark.parametrize("dtype,splits,bias,tokens,q_heads,kv_heads,dim,cache_dtype", CASES)
def test_rotary_write_kv_adds_the_splits(dtype, splits, bias, tokens, q_heads, kv_heads, dim, cache_dtype):
    """The q/k/v projection's SplitK: the same rotated q and the same caches (an int8 cache's scales too) as from
    its sum; slot -1 is skipped (a batch of more than one token has one)."""
    block_size, blocks = 16, 8
    s = make_split(splits, tokens, (q_heads + 2 * kv_heads) * dim, dtype, bias)
    cos_sin = rotary.rope_cos_sin(dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.randperm(blocks * block_size)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    caches = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=cache_dtype or dtype)
    scales = torch.zeros(2, blocks, kv_heads, block_size) if cache_dtype == torch.int8 else None
    refs, ref_scales = caches.clone(), scales.clone() if scales is not None else None
    qo = rotary.rotary_write_kv(positions, *_qkv(s, q_heads, kv_heads, dim), cos_sin, caches[0], caches[1], slots,
                                *(scales if scales is not None else [None, None]))
    summed = s.sum()
    q, k, v = summed.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    qr = rotary.rotary_write_kv(positions, q.view(tokens, -1, dim), k.view(tokens, -1, dim),
                                v.view(tokens, -1, dim), cos_sin, refs[0], refs[1], slots,
                                *(ref_scales if ref_scales is not None else [None, None]))
    assert qo.dtype == dtype and torch.equal(qo, qr)
    assert torch.equal(caches, refs) and (scales is None or torch.equal(scales, ref_scales))
    assert caches.abs().sum() > 0


def test_rotary_refuses_a_mix_of_tensors_and_splits():
    s = make_split(2, 1, 3 * 64, torch.float16, False)
    q, k, v = _qkv(s, 1, 1, 64)
    cos_sin = rotary.rope_cos_sin(64, 16, 10000.0, device=DEVICE)
    caches = torch.zeros(2, 1, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="all be tensors or all views of one SplitK"):
        rotary.rotary_write_kv(torch.zeros(1, dtype=torch.int64), q, k.sum(), v, cos_sin, caches[0], caches[1],
                               torch.zeros(1, dtype=torch.int64))


GEMV = w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32, k_per_split=64)  # 4 splits of K = 256
MMA = w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, k_per_split=64, num_warps=1, num_stages=1)
TC = w4a16.Plan("tc", block_m=16, block_n=64, block_k=32, k_per_split=128, swap=True, num_stages=2)


@pytest.mark.parametrize("plan,rows", [(GEMV, 1), (MMA, 3), (TC, 20)], ids=["gemv", "mma", "tc"])
def test_deferred_product_sums_to_the_stored_one(plan, rows):
    """defer_sum: the GEMV skips its in-launch sum, the GEMM the reduce kernel; the SplitK's sum is the product
    each stores without it, bit for bit."""
    qw, w = make_weight("awq", 256, 128, 64, False)
    x = torch.randn(rows, 256, dtype=torch.float16)
    bias = torch.randn(128, dtype=torch.float16)
    y = w4a16.run_plan(x, qw, bias, plan)
    s = w4a16.run_plan(x, qw, bias, plan, defer_sum=True)
    assert isinstance(s, SplitK) and s.splits == 256 // plan.k_per_split and s.shape == (rows, 128)
    check_product(y, x, w, bias)
    assert torch.equal(s.sum(), y)
    one = w4a16.run_plan(x, qw, bias, w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32), defer_sum=True) \
        if rows == 1 else None
    assert one is None or isinstance(one, torch.Tensor)  # no split: nothing to defer


def test_linear_takes_a_split_input_and_applies_silu_to_its_sum(monkeypatch):
    """A gated product fed a SplitK (the gate/up projection's) adds the splits in the SiLU kernel first, also where
    its plan would fuse SiLU into the GEMV's loads."""
    qw, _ = make_weight("awq", 128, 64, 64, False)
    s = make_split(3, 1, 256, torch.float16, False)
    for plan in (GEMV, MMA):
        monkeypatch.setattr(w4a16, "choose_plan", lambda *a, plan=plan: plan)
        y = w4a16.w4a16_linear(s, qw, None, silu_gated=True)
        assert torch.equal(y, w4a16.run_plan(activation.silu_and_mul(s.sum()), qw, None, plan))


def test_more_splits_than_a_consumer_takes_are_added_by_the_product():
    """Past MAX_SPLITS the GEMV adds its own splits, defer_sum or not (the consumer holds every split in
    registers)."""
    qw, w = make_weight("awq", 32 * (split_k.MAX_SPLITS + 1), 64, 32, False)
    x = torch.randn(1, qw.in_features, dtype=torch.float16)
    y = w4a16.run_plan(x, qw, None, w4a16.Plan("gemv", block_m=1, block_n=64, block_k=32, k_per_split=32),
                       defer_sum=True)
    assert isinstance(y, torch.Tensor)
    check_product(y, x, w)


def test_rotary_alone_adds_the_splits():
    s = make_split(4, 3, (4 + 2 * 2) * 64, torch.float16, True)
    q, k, _ = _qkv(s, 4, 2, 64)
    cos_sin = rotary.rope_cos_sin(64, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (3,))
    got = rotary.rotary(positions, q, k, cos_sin)
    want = rotary.rotary(positions, q.sum(), k.sum(), cos_sin)
    assert all(a.dtype == torch.float16 and torch.equal(a, b) for a, b in zip(got, want))
    # CPU tensors: ops takes the reference of the sums, which equals the kernel's output in fp16
    assert all(torch.equal(a, b) for a, b in zip(ops.rotary(positions, q, k, cos_sin), got))


def test_a_split_with_a_strided_last_dim_is_refused():
    """A consumer cannot copy a SplitK to make it contiguous (the copy would hold split 0 alone)."""
    s = SplitK(torch.randn(2, 3, 128, 2)[..., 0], None, torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        activation.silu_and_mul(s)
    q, k, v = _qkv(SplitK(torch.randn(2, 1, 3 * 64, 2)[..., 0], None, torch.float16), 1, 1, 64)
    caches = torch.zeros(2, 1, 16, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        rotary.rotary_write_kv(torch.zeros(1, dtype=torch.int64), q, k, v, rotary.rope_cos_sin(64, 16, 1e4),
                               caches[0], caches[1], torch.zeros(1, dtype=torch.int64))


def test_reshape_gives_the_bias_the_columns_dims():
    s = make_split(2, 6, 8, torch.float16, True)
    assert s.reshape(2, 3, 8).bias.shape == (8,) and s.reshape(6, 2, 4).bias.shape == (2, 4)
    assert torch.equal(s.reshape(2, 3, 8).sum(), s.sum().reshape(2, 3, 8))
    with pytest.raises(ValueError, match="trailing dims"):
        s.reshape(4, 12)
    with pytest.raises(ValueError, match="trailing dims"):  # the bias would span two rows
        make_split(2, 1, 8, torch.float16, True).reshape(2, 4)


def test_a_deferred_product_of_three_dim_x_with_a_bias(monkeypatch):
    qw, _ = make_weight("awq", 256, 128, 64, False)
    x = torch.randn(3, 2, 256, dtype=torch.float16)
    bias = torch.randn(128, dtype=torch.float16)
    monkeypatch.setattr(w4a16, "choose_plan", lambda *a: MMA)
    s = w4a16.w4a16_linear(x, qw, bias, defer_sum=True)
    assert isinstance(s, SplitK) and s.shape == (3, 2, 128) and s.bias.shape == (128,)
    assert torch.equal(s.sum(), w4a16.run_plan(x.reshape(6, 256), qw, bias, MMA).reshape(3, 2, 128))


@pytest.mark.parametrize("plan,rows,kernel", [(GEMV, 1, "_gemv_kernel"), (MMA, 3, "mma")], ids=["gemv", "mma"])
def test_a_deferred_gemv_skips_its_own_sum(monkeypatch, plan, rows, kernel):
    """defer_sum: the GEMV launches without its in-launch sum (SERIAL false) and nothing else runs after it."""
    from kernels import split_k as sk
    from kernels import w4a16_mma
    owner = w4a16_mma if kernel == "mma" else w4a16
    name = "_gemv_mma_kernel" if kernel == "mma" else kernel
    gemv, reduce = Launches(getattr(owner, name)), Launches(sk._reduce_kernel)
    monkeypatch.setattr(owner, name, gemv)
    monkeypatch.setattr(sk, "_reduce_kernel", reduce)
    qw, _ = make_weight("awq", 256, 128, 64, False)
    x = torch.randn(rows, 256, dtype=torch.float16)
    w4a16.run_plan(x, qw, None, plan, defer_sum=True)
    w4a16.run_plan(x, qw, None, plan)
    assert [c["SERIAL"] for c in gemv.calls] == [False, True] and reduce.calls == []


class _Checkpoint:
    """Just enough of ``engine.models.loader.CheckpointReader`` for one decoder layer: AWQ weights, a q/k/v bias."""

    def __init__(self, shapes: dict[str, tuple[int, int]], hidden: int):
        self.weights = {name: make_weight("awq", k, n, 32, False)[0] for name, (k, n) in shapes.items()}
        self.biases = {name: torch.randn(n, dtype=torch.float16) for name, (_, n) in shapes.items()
                       if name.endswith(("q_proj", "k_proj", "v_proj"))}
        self.norms = {"input_layernorm": torch.rand(hidden) + 0.5, "post_attention_layernorm": torch.rand(hidden) + 0.5}

    def linear(self, prefix):
        return self.weights[prefix.split(".")[-1]]

    def bias(self, prefix):
        return self.biases.get(prefix.split(".")[-1])

    def tensor(self, name):
        return self.norms[name.split(".")[-2]]

    def has(self, name):  # no Qwen3 q/k norms here
        return name.split(".")[-2] in self.norms


def test_a_decoder_layer_gives_the_same_bits_with_deferred_sums(monkeypatch):
    """The Llama layer on the Triton kernels (interpreted here; ``ops.use_triton`` forced), every product split in
    two: q/k/v and gate/up leave their sums to rotary and SiLU-and-mul, or (``defer_sum`` dropped) add them
    themselves. Hidden state, residual and KV cache come out the same, bit for bit."""
    from engine.attention import AttentionMetadata
    from engine.models.layers import RotaryEmbedding
    from engine.models.llama import LlamaDecoderLayer
    from kernels.quant_formats import concat_out_features

    hidden, heads, kv_heads, dim, inter = 128, 4, 2, 32, 128
    shapes = {"q_proj": (hidden, heads * dim), "k_proj": (hidden, kv_heads * dim), "v_proj": (hidden, kv_heads * dim),
              "o_proj": (heads * dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    ckpt = _Checkpoint(shapes, hidden)
    cfg = {"hidden_size": hidden, "rms_norm_eps": 1e-5, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    layer = LlamaDecoderLayer(cfg, ckpt, "model.layers.0", torch.float16, torch.device(DEVICE))
    for lin, parts in ((layer.qkv_proj, ("q_proj", "k_proj", "v_proj")), (layer.o_proj, ("o_proj",)),
                       (layer.gate_up_proj, ("gate_proj", "up_proj")), (layer.down_proj, ("down_proj",))):
        lin.qweight, lin.weight = concat_out_features([ckpt.weights[p] for p in parts]), None  # as on CUDA
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    monkeypatch.setattr(w4a16, "choose_plan", lambda *a: MMA)  # K = 128: two splits everywhere
    rotary_emb = RotaryEmbedding(dim, 64, 10000.0, torch.device(DEVICE))
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([4, 24]),
                             block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                             context_lens=torch.tensor([5, 9], dtype=torch.int32))
    x, residual = torch.randn(2, hidden, dtype=torch.float16), torch.randn(2, hidden, dtype=torch.float16)
    caches = torch.randn(2, 2, 16, kv_heads, dim, dtype=torch.float16)
    deferred = []  # what rotary and SiLU-and-mul were given: SplitKs when the sums are deferred
    for owner, name in ((ops.rotary_mod, "rotary_write_kv"), (ops.activation, "silu_and_mul")):
        real_fn = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real_fn=real_fn, name=name:
                            deferred.append((name, any(isinstance(v, SplitK) for v in a))) or real_fn(*a))
    outs = []
    for defer in (True, False):
        if not defer:
            real = w4a16.w4a16_linear
            monkeypatch.setattr(w4a16, "w4a16_linear", lambda x, qw, bias=None, silu_gated=False, defer_sum=False:
                                real(x, qw, bias, silu_gated))
        layer.attn.k_cache, layer.attn.v_cache = caches.clone()
        out = layer(torch.tensor([4, 8]), x, residual, meta, rotary_emb)
        outs.append((*out, layer.attn.k_cache, layer.attn.v_cache))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not torch.equal(outs[0][2], caches[0])  # the step's k was written
    assert deferred == [("rotary_write_kv", True), ("silu_and_mul", True), ("rotary_write_kv", False),
                        ("silu_and_mul", False)]
