"""W4A16 plans measured on the GPU at hand (kernels/w4a16_tune.py) and their file, and the engine's start-up step
that measures, saves and installs them (engine/kernel_plans.py).

The candidates run through Triton's interpreter on CPU (KERNEL_TEST_DEVICE=cuda: compiled), each product checked
against dequantize-then-matmul in fp32; times come from a fake timer, so the pick is exact.
"""
import dataclasses
import json

import pytest
import torch
from kernels_testenv import DEVICE, on_device  # noqa: F401 (autouse fixture)
from test_kernels_w4a16 import make_weight

from kernels import w4a16
from kernels import w4a16_tune as tune
from kernels.w4a16_tune import Measurement, Shape

KEY = dict(format=tune.FORMAT, device="Test GPU", capability="8.9", sms=8, dtype="bfloat16", triton="3.9.0",
           torch="2.13.0", kernels="0123456789ab")


@pytest.fixture(autouse=True)
def no_measured_plans():
    """Every test starts and ends with no measured plans installed."""
    tune.install([])
    yield
    tune.install([])


def fake_timer(times):
    """A timer that returns ``times`` in order, one per timed candidate, and records how many calls it was given."""
    it = iter(times)
    seen = []

    def timer(calls):
        seen.append(len(calls))
        for c in calls[:1]:
            c()
        return next(it)
    timer.seen = seen
    return timer


@pytest.mark.parametrize("m", [1, 8, 16, 64, 128, 256])
@pytest.mark.parametrize("group", [64, 128, -1])
def test_candidates_start_with_the_default_and_differ(m, group):
    g = 512 if group == -1 else group
    plans = tune.candidates(m, 256, 512, g, 8)
    assert plans[0] == w4a16.choose_plan(m, 256, 512, 4, g, 8, True, False)
    assert len(plans) == len(set(plans)) >= 2
    for p in plans:
        assert p.path == "dequant" or (g % p.block_k == 0 or g >= 512)


@pytest.mark.parametrize("m,group,gated", [(1, 128, False), (1, 64, True), (8, 128, False), (16, -1, True),
                                           (128, 64, False)])
def test_measure_picks_the_fastest_correct_plan(m, group, gated):
    k, n = 256, 128
    qw, _ = make_weight("awq", k, n, group, False, scale_dtype=torch.bfloat16)
    g = qw.group_size
    plans = tune.candidates(m, n, k, g, 8)
    assert len(plans) >= 2
    times = [10.0 + i for i in range(len(plans))]
    times[-1] = 1.0  # the last candidate is ten times faster than the default
    timer = fake_timer(times + [1.5, 9.0])  # confirmed in a second round, whose times are reported
    got = tune.measure([qw, qw], Shape(n, k, g, gated), m, torch.bfloat16, 8, timer=timer)
    assert got == Measurement(m, Shape(n, k, g, gated), plans[-1], 1.5, plans[0], 9.0, True)
    assert timer.seen == [8] * (len(plans) + 2)  # every candidate timed, over at least 8 calls


def test_measure_keeps_the_default_within_the_margin():
    qw, _ = make_weight("gptq", 256, 128, 128, True, scale_dtype=torch.bfloat16)
    plans = tune.candidates(8, 128, 256, 128, 8)
    slower = [20.0] * (len(plans) - 2)
    just_within = 10.0 / (1 + tune.MARGIN) + 0.01
    got = tune.measure([qw], Shape(128, 256, 128), 8, torch.bfloat16, 8,
                       timer=fake_timer([10.0, just_within] + slower + [just_within, 10.0]))
    assert got.plan == plans[0] and got.default == plans[0] and got.us == 10.0
    just_past = 10.0 / (1 + tune.MARGIN) - 0.01
    got = tune.measure([qw], Shape(128, 256, 128), 8, torch.bfloat16, 8,
                       timer=fake_timer([10.0, just_past] + slower + [just_past, 10.0]))
    assert got.plan == plans[1] and got.default == plans[0] and got.us == just_past


def test_a_win_that_does_not_repeat_is_not_taken():
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    plans = tune.candidates(8, 128, 256, 128, 8)
    timer = fake_timer([10.0, 5.0] + [20.0] * (len(plans) - 2) + [14.0, 9.0])  # 5.0 was luck: 14.0 again
    got = tune.measure([qw], Shape(128, 256, 128), 8, torch.bfloat16, 8, timer=timer)
    assert got == Measurement(8, Shape(128, 256, 128), plans[0], 9.0, plans[0], 9.0, True)
    assert len(timer.seen) == len(plans) + 2


def break_plans(monkeypatch, failures: dict):
    """Make the products of some plans fail: {plan: an exception to raise, or a factor that spoils the result}."""
    real = tune._call

    def call(x, w, plan, gated):
        what = failures.get(plan)
        if isinstance(what, Exception):
            raise what
        return real(x, w, plan, gated) * (what or 1)
    monkeypatch.setattr(tune, "_call", call)


def test_a_wrong_or_failing_plan_never_wins(monkeypatch):
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    plans = tune.candidates(8, 128, 256, 128, 8)
    assert len(plans) >= 3
    break_plans(monkeypatch, {plans[1]: 1.1, plans[2]: RuntimeError("out of shared memory")})  # 10% off: wrong
    lines = []
    timer = fake_timer([5.0] + [6.0] * (len(plans) - 3))
    got = tune.measure([qw], Shape(128, 256, 128), 8, torch.bfloat16, 8, timer=timer, log=lines.append)
    assert got.plan == plans[0] and got.us == 5.0
    assert len(timer.seen) == len(plans) - 2
    assert sum("skipped" in line and "wrong product: relative error" in line for line in lines) == 1
    assert sum("skipped" in line and "out of shared memory" in line for line in lines) == 1


def test_when_the_default_fails_the_others_still_compete(monkeypatch):
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    plans = tune.candidates(16, 128, 256, 128, 8)
    break_plans(monkeypatch, {plans[0]: RuntimeError("out of resource: shared memory, Required: 115456")})
    times = [9.0 - i for i in range(len(plans) - 1)]
    got = tune.measure([qw], Shape(128, 256, 128), 16, torch.bfloat16, 8, timer=fake_timer(times))
    assert got == Measurement(16, Shape(128, 256, 128), plans[-1], times[-1], plans[0], None, True)


def test_a_cuda_error_that_breaks_the_context_is_raised(monkeypatch):
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    plans = tune.candidates(8, 128, 256, 128, 8)
    break_plans(monkeypatch, {plans[1]: RuntimeError("CUDA error: an illegal memory access was encountered")})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tune.measure([qw], Shape(128, 256, 128), 8, torch.bfloat16, 8, timer=fake_timer([1.0] * 20))


def test_measure_stops_at_the_deadline_after_the_default():
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    plans = tune.candidates(1, 128, 256, 128, 8)
    timer = fake_timer([3.0, 1.0])
    got = tune.measure([qw], Shape(128, 256, 128), 1, torch.bfloat16, 8, deadline=0.0, timer=timer)
    assert got == Measurement(1, Shape(128, 256, 128), plans[0], 3.0, plans[0], 3.0, False)
    assert len(timer.seen) == 1


def test_check_names_what_is_wrong_with_a_plan():
    qw, _ = make_weight("awq", 256, 128, 128, False, scale_dtype=torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert tune.check(x, qw, tune.candidates(8, 128, 256, 128, 8)[0], False) is None
    assert "gemv path takes one row" in tune.check(x, qw, w4a16.Plan("gemv", 1, 128, 128), False)
    assert "must divide the group size" in tune.check(x, qw, w4a16.Plan("tc", 16, 64, 96, swap=True), False)


def test_installed_plans_are_what_choose_plan_picks():
    default = w4a16.choose_plan(8, 12288, 4096, 4, 128, 132)
    mine = w4a16.Plan("tc", 16, 64, 128, 1024, True, mode=3)
    tune.install([Measurement(8, Shape(12288, 4096, 128), mine, 1.0, default, 2.0)])
    assert w4a16.choose_plan(8, 12288, 4096, 2, 128, 132) != mine  # 2-bit weights
    for m in range(2, 9):  # the whole bucket
        assert w4a16.choose_plan(m, 12288, 4096, 4, 128, 132) == mine
    assert w4a16.choose_plan(8, 12288, 4096, 4, 128, 132, True, False) == default
    assert w4a16.choose_plan(9, 12288, 4096, 4, 128, 132) != mine  # next bucket
    assert w4a16.choose_plan(8, 12288, 4096, 4, 64, 132) != mine  # another group size
    tune.install([])
    assert w4a16.choose_plan(8, 12288, 4096, 4, 128, 132) == default


def test_an_mma_plan_is_not_used_for_fp32_activations():
    mma = w4a16.Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1)
    tune.install([Measurement(1, Shape(4096, 4096, 128), mma, 1.0, mma, 1.0)])
    assert w4a16.choose_plan(1, 4096, 4096, 4, 128, 132) == mma
    assert w4a16.choose_plan(1, 4096, 4096, 4, 128, 132, False).path == "gemv"


def _measurements():
    p = w4a16.Plan("mma", 8, 128, 128, 1536, num_warps=4, num_stages=1, k_warps=2)
    d = w4a16.Plan("gemv", 1, 128, 128, 512)
    return [Measurement(8, Shape(4096, 11008, 128, True), p, 14.7, d, 16.2),
            Measurement(1, Shape(6144, 4096, 128), d, 9.0, d, None)]


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "plans" / tune.file_name(KEY)
    tune.save(path, KEY, _measurements())
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    assert path.name == "w4a16-Test_GPU-sm8.9-8sms-bfloat16-triton3.9.0-torch2.13.0.json"
    assert tune.load(path, KEY) == sorted(_measurements(), key=lambda r: r.key)
    lines = []
    assert tune.load(path, {**KEY, "triton": "3.6.0"}, lines.append) == []
    assert "measuring again" in lines[0]
    assert tune.load(tmp_path / "missing.json", KEY) == []


def test_load_drops_bad_entries_and_rejects_bad_files(tmp_path):
    path = tmp_path / "p.json"
    tune.save(path, KEY, _measurements())
    data = json.loads(path.read_text())
    data["plans"][0]["plan"]["block_k"] = "128"
    data["plans"].append({**data["plans"][1], "m": 3})
    data["plans"].append({**data["plans"][1], "plan": {**data["plans"][1]["plan"], "path": "magic"}})
    data["plans"].append({**data["plans"][1], "plan": {**data["plans"][1]["plan"], "tile": 3}})
    data["plans"].append({**data["plans"][1], "gated": "false"})
    data["plans"] += [1, {**data["plans"][1], "plan": None}]
    path.write_text(json.dumps(data))
    lines = []
    kept = tune.load(path, KEY, lines.append)
    assert [r.key for r in kept] == [(8, 4096, 11008, 128)]
    assert len(lines) == 7
    assert "block_k" in lines[0] and "M bucket" in lines[1] and "magic" in lines[2] and "tile" in lines[3]
    assert "gated must be true or false" in lines[4]
    assert "not an object with a 'plan' object" in lines[5] and "not an object" in lines[6]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a W4A16 plan file"):
        tune.load(path, KEY)
    path.write_text(json.dumps({"key": KEY}))
    with pytest.raises(ValueError, match="no 'plans' list"):
        tune.load(path, KEY)


def test_save_adds_to_what_the_file_holds(tmp_path):
    path = tmp_path / "p.json"
    a, b = _measurements()
    tune.save(path, KEY, [a])
    newer = dataclasses.replace(a, us=1.0)
    tune.save(path, KEY, [b, newer])  # another engine's entry stays, the same key is replaced
    assert tune.load(path, KEY) == sorted([newer, b], key=lambda r: r.key)
    path.write_text("{broken")
    tune.save(path, KEY, [b])  # an unreadable file is replaced
    assert tune.load(path, KEY) == [b]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_the_key_follows_the_kernels_code_not_the_plan_tables(monkeypatch):
    before = tune.kernels_version()
    assert len(before) == 12 and before == tune.kernels_version()
    monkeypatch.setitem(w4a16.TUNED, (1, 1, 1), w4a16.Plan("gemv"))  # a table entry: the same kernels
    assert tune.kernels_version() == before
    kernel = w4a16._dequant_kernel

    def changed(*args):  # a kernel whose source differs
        return None
    monkeypatch.setattr(kernel, "fn", changed)
    changed.__module__ = w4a16.__name__
    assert tune.kernels_version() != before


def test_sticky_errors_are_told_from_recoverable_ones():
    assert tune._sticky(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert tune._sticky(RuntimeError("Triton Error [CUDA]: misaligned address"))
    assert not tune._sticky(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert not tune._sticky(RuntimeError("out of resource: shared memory, Required: 115456"))
    assert not tune._sticky(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_plan_json_names_every_plan_field():
    row = json.loads(tune.to_json(KEY, _measurements()))["plans"][0]
    assert set(row["plan"]) == {f.name for f in dataclasses.fields(w4a16.Plan)}
    assert row["gated"] is False and row["m"] == 1
