"""The engine's start-up step for measured W4A16 plans (engine/kernel_plans.py): which products it measures, the
file it keeps per GPU, and the settings that reach it.

The GPU parts (device key, timing) are replaced by fakes, so the flow runs on CPU: measuring happens once per
(shape, M bucket) and GPU, a second start reads the file, a bad file is measured again.
"""
import contextlib
import json
import logging

import pytest
import torch

from engine import kernel_plans
from engine.config import EngineConfig
from kernels import quant_formats as qf
from kernels import w4a16
from kernels import w4a16_tune as tune

KEY = dict(format=tune.FORMAT, device="Fake GPU", capability="8.6", sms=28, dtype="bfloat16", triton="3.9.0",
           torch="2.13.0", kernels="0123456789ab")


def qweight(k: int, n: int, group: int = 128, bits: int = 4) -> qf.QuantizedWeight:
    pf = 32 // bits
    return qf.QuantizedWeight(torch.zeros(k // pf, n, dtype=torch.int32), torch.zeros(k // group, n // pf,
                              dtype=torch.int32), torch.ones(k // group, n, dtype=torch.float16), None, bits, group,
                              k, n)


class Proj(torch.nn.Module):
    def __init__(self, qw):
        super().__init__()
        self.qweight = qw


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.o_proj = Proj(qweight(512, 768)), Proj(qweight(512, 512))
        self.gate_up_proj, self.down_proj = Proj(qweight(512, 2048)), Proj(qweight(1024, 512))
        self.lm_like = Proj(None)  # a dense layer: no packed weight
        self.eight_bit = Proj(qweight(512, 512, bits=8))


class Model(torch.nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))


TC16 = w4a16.Plan("tc", 16, 64, 128, 256, True, mode=3)
BAD = w4a16.Plan("gemm", 16, 128, 32)  # the plan the fake check says fails on the weights
SHAPES = {tune.Shape(768, 512, 128), tune.Shape(512, 512, 128), tune.Shape(2048, 512, 128),
          tune.Shape(512, 1024, 128, gated=True)}


class Calls(list):
    """The (m, shape, layers, sms) of each measure() call; ``cut``, ``checked``: see fake_gpu."""


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch):
    """A CUDA device that is not there: its key, its multiprocessor count, and a measure() that records calls."""
    calls = Calls()
    calls.cut = set()  # (m, shape) pairs whose measurement the deadline cuts short

    def measure(weights, shape, m, dtype, sms, deadline, log=None):
        calls.append((m, shape, len(weights), sms))
        plan = w4a16.choose_plan(m, shape.n, shape.k, 4, shape.group, sms, True, False)
        faster = tune.candidates(m, shape.n, shape.k, shape.group, sms)[-1]
        return tune.Measurement(m, shape, faster, 1.0, plan, 2.0, complete=(m, shape) not in calls.cut)

    monkeypatch.setattr(tune, "gpu_key", lambda device, dtype: dict(KEY, dtype=str(dtype)[6:]))
    monkeypatch.setattr(tune, "measure", measure)
    monkeypatch.setattr("kernels._triton.num_sms", lambda device: 28)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    checked = calls.checked = []

    def check(r, shape, weights, dtype):  # a saved plan runs once on the model's weights; BAD fails here
        assert (r.m, shape.n, shape.k, shape.group) == r.key and len(weights) == 3
        checked.append(r.key)
        return "RuntimeError: out of resource" if r.plan == BAD else None
    monkeypatch.setattr(kernel_plans, "_check", check)
    tune.install([])
    yield calls
    tune.install([])


def config(tmp_path, **kw):
    return EngineConfig(model=str(tmp_path), kernel_plans_dir=str(tmp_path / "plans"), **kw)


def test_model_shapes_groups_the_layers_packed_4bit_products():
    shapes = kernel_plans.model_shapes(Model(3))
    assert set(shapes) == SHAPES
    assert all(len(ws) == 3 for ws in shapes.values())


def test_first_start_measures_every_shape_and_bucket_then_the_file_serves(tmp_path, fake_gpu):
    cuda = torch.device("cuda")
    summary = kernel_plans.prepare(Model(), config(tmp_path), cuda, torch.bfloat16)
    assert sorted(fake_gpu, key=str) == sorted(((m, s, 3, 28) for s in SHAPES for m in w4a16.M_BUCKETS), key=str)
    assert summary.startswith("W4A16 plans: 24 of 24 measured on this GPU (24 now")
    path = tmp_path / "plans" / tune.file_name(KEY)
    rows = json.loads(path.read_text())["plans"]
    assert len(rows) == 24 and {r["gated"] for r in rows if r["k"] == 1024} == {True}
    for s in SHAPES:  # installed: the whole bucket takes the measured plan
        assert w4a16.choose_plan(5, s.n, s.k, 4, 128, 28) == tune.candidates(8, s.n, s.k, 128, 28)[-1]

    tune.install([])
    fake_gpu.clear()
    summary = kernel_plans.prepare(Model(), config(tmp_path), cuda, torch.bfloat16)
    assert fake_gpu == [] and summary.startswith("W4A16 plans: 24 of 24 measured on this GPU (0 now")
    s = tune.Shape(768, 512, 128)
    assert w4a16.choose_plan(1, s.n, s.k, 4, 128, 28) == tune.candidates(1, s.n, s.k, 128, 28)[-1]


def test_only_missing_entries_are_measured_and_the_file_keeps_the_rest(tmp_path, fake_gpu):
    cuda = torch.device("cuda")
    path = tmp_path / "plans" / tune.file_name(KEY)
    other = tune.Measurement(1, tune.Shape(4096, 4096, 128), w4a16.Plan("gemv"), 7.0, w4a16.Plan("gemv"), 7.0)
    mine = tune.Measurement(16, tune.Shape(512, 512, 128), TC16, 3.0, w4a16.Plan("gemv"), 4.0)
    tune.save(path, KEY, [other, mine])
    kernel_plans.prepare(Model(), config(tmp_path), cuda, torch.bfloat16)
    assert len(fake_gpu) == 23 and (16, tune.Shape(512, 512, 128), 3, 28) not in fake_gpu
    keys = {r.key for r in tune.load(path, KEY)}
    assert len(keys) == 25 and other.key in keys  # another model's plans stay in the file


def test_tune_kernels_off_measures_nothing_but_reads_the_file(tmp_path, fake_gpu):
    cuda = torch.device("cuda")
    mine = tune.Measurement(16, tune.Shape(512, 512, 128), TC16, 3.0, w4a16.Plan("gemv"), 4.0)
    tune.save(tmp_path / "plans" / tune.file_name(KEY), KEY, [mine])
    summary = kernel_plans.prepare(Model(), config(tmp_path, tune_kernels=False), cuda, torch.bfloat16)
    assert fake_gpu == [] and fake_gpu.checked == [mine.key]
    assert summary == "W4A16 plans: 1 of 24 measured on this GPU (0 now, in 0 s); 1 differ from the defaults"
    assert w4a16.choose_plan(16, 512, 512, 4, 128, 28) == TC16


def test_a_saved_plan_that_fails_on_the_weights_is_dropped_and_measured_again(tmp_path, fake_gpu, caplog):
    path = tmp_path / "plans" / tune.file_name(KEY)
    bad = tune.Measurement(16, tune.Shape(512, 512, 128), BAD, 3.0, w4a16.Plan("gemv"), 4.0)
    tune.save(path, KEY, [bad])
    with caplog.at_level(logging.WARNING):
        kernel_plans.prepare(Model(), config(tmp_path), torch.device("cuda"), torch.bfloat16)
    assert "W4A16 plan for M=16" in caplog.text and "out of resource" in caplog.text
    assert (16, tune.Shape(512, 512, 128), 3, 28) in fake_gpu and len(fake_gpu) == 24
    assert {r.key: r.plan for r in tune.load(path, KEY)}[bad.key] != BAD


def test_with_measuring_off_a_failing_saved_plan_leaves_the_file(tmp_path, fake_gpu):
    path = tmp_path / "plans" / tune.file_name(KEY)
    bad = tune.Measurement(16, tune.Shape(512, 512, 128), BAD, 3.0, w4a16.Plan("gemv"), 4.0)
    good = tune.Measurement(1, tune.Shape(512, 512, 128), TC16, 3.0, w4a16.Plan("gemv"), 4.0)
    tune.save(path, KEY, [bad, good])
    kernel_plans.prepare(Model(), config(tmp_path, tune_kernels=False), torch.device("cuda"), torch.bfloat16)
    assert fake_gpu == [] and [r.key for r in tune.load(path, KEY)] == [good.key]
    assert w4a16.choose_plan(16, 512, 512, 4, 128, 28) != BAD


def test_a_pick_the_deadline_cut_short_is_used_but_not_saved(tmp_path, fake_gpu):
    cut = tune.Shape(2048, 512, 128)
    fake_gpu.cut.add((64, cut))
    path = tmp_path / "plans" / tune.file_name(KEY)
    summary = kernel_plans.prepare(Model(), config(tmp_path), torch.device("cuda"), torch.bfloat16)
    assert summary.startswith("W4A16 plans: 24 of 24 measured on this GPU (24 now")
    assert (64, 2048, 512, 128) not in {r.key for r in tune.load(path, KEY)}
    assert w4a16.choose_plan(40, 2048, 512, 4, 128, 28) == tune.candidates(64, 2048, 512, 128, 28)[-1]
    fake_gpu.clear()
    fake_gpu.cut.clear()
    kernel_plans.prepare(Model(), config(tmp_path), torch.device("cuda"), torch.bfloat16)
    assert fake_gpu == [(64, cut, 3, 28)]  # measured again at the next start


def test_an_unreadable_file_is_measured_again_and_replaced(tmp_path, fake_gpu, caplog):
    path = tmp_path / "plans" / tune.file_name(KEY)
    path.parent.mkdir()
    path.write_text("{truncated")
    with caplog.at_level(logging.WARNING):
        kernel_plans.prepare(Model(), config(tmp_path), torch.device("cuda"), torch.bfloat16)
    assert "not a W4A16 plan file" in caplog.text and len(fake_gpu) == 24
    assert len(tune.load(path, KEY)) == 24


def test_an_unwritable_folder_keeps_the_plans_for_this_run(tmp_path, fake_gpu, caplog):
    blocker = tmp_path / "plans"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING):
        summary = kernel_plans.prepare(Model(), config(tmp_path), torch.device("cuda"), torch.bfloat16)
    assert "could not save the W4A16 plans" in caplog.text
    assert summary.startswith("W4A16 plans: 24 of 24")


def test_cpu_and_dense_models_measure_nothing(tmp_path, fake_gpu):
    assert kernel_plans.prepare(Model(), config(tmp_path), torch.device("cpu"), torch.float32) == ""
    dense = torch.nn.Module()
    dense.proj = Proj(None)
    assert kernel_plans.prepare(dense, config(tmp_path), torch.device("cuda"), torch.bfloat16) == ""
    assert fake_gpu == [] and not (tmp_path / "plans").exists()


def test_default_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_plans.default_dir() == tmp_path / "appliance" / "kernel-plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_plans.default_dir() == tmp_path / "home" / ".cache" / "appliance" / "kernel-plans"
