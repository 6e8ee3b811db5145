"""Shared by the tests/test_kernels_*.py files: where the kernels run.

On CPU (the default, CI) Triton's interpreter runs the kernels; ``KERNEL_TEST_DEVICE=cuda`` runs the very same
checks compiled on a GPU (bench/gpu_suite.py does). Import ``on_device`` into a test module to use it.
"""
import os

import pytest
import torch

DEVICE = os.environ.get("KERNEL_TEST_DEVICE", "cpu")
FP8 = torch.float8_e4m3fn


def fp8_safe(x: torch.Tensor) -> torch.Tensor:
    """x on CPU made exactly representable in fp8 e4m3 as a normal number (or 0), so that converting it is exact:
    Triton's interpreter rounds to fp8 wrongly (ties, subnormals, saturation), the GPU is checked on raw values.
    Unchanged on a GPU."""
    if DEVICE != "cpu":
        return x
    x = x.to(FP8).to(x.dtype)
    return torch.where(x.abs() < 2 ** -6, torch.zeros_like(x), x)


@pytest.fixture(autouse=True)
def on_device():
    """Every test: a fixed seed and new tensors on DEVICE."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        yield


class Launches:
    """Stands in for a Triton kernel in a test: appends each launch's keyword arguments to ``calls``, then runs the
    real kernel."""

    def __init__(self, real, calls: list | None = None):
        self.real, self.calls = real, [] if calls is None else calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)
            return self.real[grid](*args, **kw)
        return launch
