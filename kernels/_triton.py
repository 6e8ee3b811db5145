"""Triton import shim shared by the kernel files.

``@jit`` kernels run compiled on CUDA tensors and in Triton's interpreter on CPU tensors, whatever
``TRITON_INTERPRET`` said when the module was imported (the CPU tests run the very same kernel code). The modules
that hold the torch references import this file, so it must import without Triton: kernels then raise on launch.

Triton's library functions (``tl.sum``, ``tl.max``...) are themselves ``@triton.jit`` functions, interpretable only
when ``TRITON_INTERPRET=1`` was set before Triton was imported; :func:`_interpreting` lets interpreted kernels call
them whatever the import order was (pytest imports many modules first).

The interpreter gets arithmetic on bf16 values and bf16 ``tl.dot`` wrong: kernels compute in fp32 and take a
``DOT_F32`` constexpr (:func:`dot_f32`) that upcasts dot operands when interpreted.
"""
from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references still work, the kernels raise on launch
    triton = tl = None

HAS_TRITON = triton is not None


class Kernel:
    """A Triton kernel launched as ``kernel[grid](*args, **meta)``: compiled for CUDA tensors, interpreted for CPU."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self._interpreted = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **meta):
        if triton is None:
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed (pip install 'edge-appliance[triton]')")
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction
                self._interpreted = InterpretedFunction(self.fn)
            with _interpreting():
                return self._interpreted[grid](*args, **meta)
        if self._compiled is None:
            self._compiled = triton.jit(self.fn)
        return self._compiled[grid](*args, **meta)


@contextlib.contextmanager
def _interpreting():
    """While it lasts, a compiled-mode ``@triton.jit`` function called from interpreted code is interpreted too."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__  # outside a kernel it only raises, so compiled launches are unaffected
    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(fn)


def jit(fn) -> Kernel:
    """Decorator: see :class:`Kernel`."""
    return Kernel(fn)


def device_fn(fn):
    """Decorator for a device function that kernels call (plain ``triton.jit``; interpreted within interpreted
    kernels through :func:`_interpreting`). Without Triton, the plain Python function (never called)."""
    return triton.jit(fn) if triton is not None else fn


def dot_f32(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` run interpreted (CPU), where dot operands must be upcast to fp32."""
    return t.device.type == "cpu"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (132 on an H200); 8 for the CPU interpreter."""
    if device.type != "cuda":
        return 8
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
