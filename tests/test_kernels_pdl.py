"""Programmatic dependent launch (kernels/_triton.py): when kernels launch with it, and that every kernel that can
be launched with it waits for the previous kernel before touching its outputs. The GPU behaviour itself (graphs =
eager = torch reference with PDL on) is checked by bench/gpu_suite.py on an H200."""
import inspect

import pytest
import torch

from kernels import _triton, activation, kv_cache, norm, paged_attention, rotary, w4a16

MODULES = (activation, kv_cache, norm, paged_attention, rotary, w4a16)


def _kernels():
    return [(m.__name__, name, obj) for m in MODULES for name, obj in vars(m).items()
            if isinstance(obj, _triton.Kernel)]


def test_pdl_is_off_on_cpu_and_when_disabled(monkeypatch):
    assert _triton.pdl(torch.zeros(1)) is False
    monkeypatch.setenv("APPLIANCE_PDL", "0")
    assert _triton.pdl(torch.zeros(1)) is False


class _Recorder:
    """Stands in for a compiled Triton kernel: records the launch options it is given."""

    def __init__(self):
        self.meta = None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.meta = meta
        return launch


@pytest.mark.parametrize("flag", [True, False])
def test_launch_pdl_follows_the_pdl_constexpr(flag):
    kernel = _triton.Kernel(lambda x, PDL: None)
    kernel._compiled = _Recorder()
    kernel[(1,)](3, PDL=flag)  # no CPU tensor among the arguments: the compiled path
    assert kernel._compiled.meta.get("launch_pdl", False) is flag
    assert kernel._compiled.meta["PDL"] is flag


def test_every_kernel_takes_pdl_and_waits_before_its_loop():
    found = _kernels()
    assert len(found) >= 12
    for module, name, kernel in found:
        params = inspect.signature(kernel.fn).parameters
        assert "PDL" in params, f"{module}.{name} has no PDL constexpr"
        assert "pdl_wait(PDL)" in inspect.getsource(kernel.fn), f"{module}.{name} never waits"


def test_every_launch_passes_pdl():
    for module in MODULES:
        src = inspect.getsource(module)
        launches = src.count("_kernel[")
        assert launches == src.count("PDL=pdl("), f"{module.__name__}: a launch without PDL=pdl(...)"
