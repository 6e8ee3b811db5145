"""Shared by the tests/test_kernels_*.py files: where the kernels run.

On CPU (the default, CI) Triton's interpreter runs the kernels; ``KERNEL_TEST_DEVICE=cuda`` runs the very same
checks compiled on a GPU (bench/gpu_suite.py does). Import ``on_device`` into a test module to use it.
"""
import os

import pytest
import torch

DEVICE = os.environ.get("KERNEL_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def on_device():
    """Every test: a fixed seed and new tensors on DEVICE."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        yield
