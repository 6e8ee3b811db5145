"""kernels/fused_mlp.py (interpreted on CPU; compiled with KERNEL_TEST_DEVICE=cuda): the one-launch gated MLP
gives the bits of the three launches it replaces (the mma GEMV with deferred sums, SiLU-and-mul, the mma GEMV),
launch after launch on the same counters, and stays within bf16 rounding of the torch reference; what it cannot
take is refused by name."""
import dataclasses
import re

import pytest
import torch
from kernels_testenv import DEVICE, on_device  # noqa: F401 (autouse fixture)

from kernels import activation, fused_mlp, w4a16
from kernels import quant_formats as qf

H, I = 256, 256  # two K tiles each: two gate/up splits, two down splits at k_per_split 128


def weight(k: int, n: int, group: int = 128, scale_dtype=torch.float16) -> qf.QuantizedWeight:
    groups = 1 if group == -1 else -(-k // group)  # -1: per-channel
    return qf.from_codes(torch.randint(0, 16, (k, n), dtype=torch.int32), torch.randint(6, 10, (groups, n)),
                         (torch.rand(groups, n) * 0.01 + 0.002).to(scale_dtype), 4, group, source="test")


def three_launches(x, gate_up, down, kps1, kps2):
    plan = lambda kps: w4a16.Plan("mma", 8, 64, 128, kps, num_warps=1, num_stages=1)  # noqa: E731
    return w4a16.run_plan(activation.silu_and_mul(w4a16.run_plan(x, gate_up, None, plan(kps1), defer_sum=True)),
                          down, None, plan(kps2))


@pytest.mark.parametrize("m,dtype,group,i,kps2", [(1, torch.bfloat16, 128, I, 128),
                                                   (3, torch.float16, -1, 384, 256)])  # a last down split of 128
def test_one_launch_gives_the_three_launches_bits_launch_after_launch(m, dtype, group, i, kps2):
    gate_up, down = weight(H, 2 * i, group), weight(i, H, group)
    counters = fused_mlp.MLPCounters(torch.device(DEVICE))
    for launch in range(2):
        x = torch.randn(m, H).to(dtype)
        got = fused_mlp.gated_mlp(x, gate_up, down, counters, 128, kps2)
        assert torch.equal(got, three_launches(x, gate_up, down, 128, kps2))
        ctl, locks = counters.by_plan[(H, i, 128, kps2)]
        splits2 = -(-i // kps2)
        total = (i // 32) * (H // 128) + (H // 64) * splits2
        # tickets and ready counters (32-channel blocks per down split) grow by a launch's worth; split-K counters 0
        ready = [(min(kps2, i - s * kps2) // 32) * (launch + 1) for s in range(splits2)]
        assert ctl.tolist() == [total * (launch + 1), *ready]
        assert not locks.any()


def test_within_bf16_rounding_of_the_reference():
    gate_up, down = weight(H, 2 * I, 128, torch.bfloat16), weight(I, H, 128, torch.bfloat16)
    x = torch.randn(2, H).to(torch.bfloat16)
    got = fused_mlp.gated_mlp(x, gate_up, down, fused_mlp.MLPCounters(torch.device(DEVICE)), 256, 128)
    ref = fused_mlp.gated_mlp_ref(x.float(), gate_up, down)
    assert torch.allclose(got.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.parametrize("change,message", [
    (dict(m=9), "1 to 8 rows (got 9)"),
    (dict(dtype=torch.float32), "fp16/bf16 x"),
    (dict(i=192), "multiples of 128 (got 256, 192)"),
    (dict(group=64), "group sizes multiples of 128"),
    (dict(kps2=192), "k_per_split positive multiples of 128"),
    (dict(kps2=0), "k_per_split positive multiples of 128 (got 128, 0)"),
    (dict(m=0), "1 to 8 rows (got 0)"),
])
def test_what_it_cannot_take_is_refused_by_name(change, message):
    p = dict(m=1, dtype=torch.bfloat16, i=I, group=128, kps2=128) | change
    x = torch.randn(p["m"], H).to(p["dtype"])
    gate_up, down = weight(H, 2 * p["i"], p["group"]), weight(p["i"], H, p["group"])
    with pytest.raises(ValueError, match=re.escape(message)):
        fused_mlp.gated_mlp(x, gate_up, down, fused_mlp.MLPCounters(torch.device(DEVICE)), 128, p["kps2"])


@pytest.mark.skipif(DEVICE != "cpu", reason="the plans of the CPU's 8 stand-in multiprocessors")
def test_the_engine_takes_one_launch_only_when_asked_and_the_plans_are_the_mma_gemv(monkeypatch):
    from types import SimpleNamespace

    from engine.models import layers
    from kernels import ops

    gate_up = SimpleNamespace(qweight=weight(H, 2 * I), bias=None)
    down = SimpleNamespace(qweight=weight(I, H), bias=None)
    x8 = torch.randn(8, H).to(torch.bfloat16)
    monkeypatch.delenv("APPLIANCE_FUSED_MLP", raising=False)
    assert not layers.fused_mlp_on()  # off unless asked
    for value, on in (("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv("APPLIANCE_FUSED_MLP", value)
        assert layers.fused_mlp_on() is on
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    assert layers.fused_mlp_splits(x8, gate_up, down) == (128, 128)
    assert layers.fused_mlp_splits(x8[:1], gate_up, down) is None  # M = 1: the down plan is the CUDA-core GEMV
    assert layers.fused_mlp_splits(torch.randn(9, H).to(torch.bfloat16), gate_up, down) is None
    assert layers.fused_mlp_splits(x8.float(), gate_up, down) is None
    assert layers.fused_mlp_splits(x8, gate_up, SimpleNamespace(qweight=down.qweight, bias=torch.zeros(H))) is None
    assert layers.fused_mlp_splits(x8, SimpleNamespace(qweight=None, bias=None), down) is None  # dense weights
    # a measured plan the kernel does not repeat: the sum left to the next kernel, or two warps over K
    for other in (dict(serial=False), dict(num_warps=2, k_warps=2, block_n=64)):
        plan = w4a16.Plan("mma", 8, 64, 128, 128, num_warps=1, num_stages=1)
        monkeypatch.setitem(w4a16.MEASURED, (8, H, I, 128), dataclasses.replace(plan, **other))
        w4a16.choose_plan.cache_clear()
        assert layers.fused_mlp_splits(x8, gate_up, down) is None
    monkeypatch.delitem(w4a16.MEASURED, (8, H, I, 128))
    w4a16.choose_plan.cache_clear()
    assert layers.fused_mlp_splits(x8, gate_up, down) == (128, 128)
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    assert layers.fused_mlp_splits(x8, gate_up, down) is None  # the torch reference path
