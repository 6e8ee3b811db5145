"""Triton import shim shared by the kernel files.

``@jit`` kernels run compiled on CUDA tensors and in Triton's interpreter on CPU tensors, whatever
``TRITON_INTERPRET`` said when the module was imported (the CPU tests run the very same kernel code). The modules
that hold the torch references import this file, so it must import without Triton: kernels then raise on launch.

Triton's library functions (``tl.sum``, ``tl.max``...) are themselves ``@triton.jit`` functions, interpretable only
when ``TRITON_INTERPRET=1`` was set before Triton was imported; :func:`_interpreting` lets interpreted kernels call
them whatever the import order was (pytest imports many modules first).

The interpreter gets arithmetic on bf16 values and bf16 ``tl.dot`` wrong: kernels compute in fp32 and take a
``DOT_F32`` constexpr (:func:`dot_f32`) that upcasts dot operands when interpreted.

Programmatic dependent launch (PDL, CUDA compute capability >= 9.0; CUDA Programming Guide, "Programmatic
Dependent Launch and Synchronization"): a kernel launched with a true ``PDL`` constexpr (:func:`pdl`) is launched
with ``launch_pdl``, so it may start while the kernel before it on the stream is still running (also inside a
CUDA graph). Such a kernel must, in every program, call :func:`pdl_wait` (PTX ``griddepcontrol.wait``: the
previous kernel has finished and its writes are visible) before it reads anything a previous kernel wrote or writes
anything one reads. Before that it may only read what the kernel just before it cannot be writing: weights, the
rotary table, the rotary kernel's positions and the decode attention's context lengths (step inputs written before
the forward pass's first kernel, which is torch's and launched without PDL, so all work before it is complete); a
program that then finds nothing to do (a decode-attention split past its sequence's context) may leave without
waiting, as it reads and writes nothing else, as long as some programs of every grid wait. Every such kernel also
calls :func:`pdl_trigger` (a ``TRIG`` constexpr, :func:`early_trigger`) once, at top level, right after its main loop or
its last loads (PTX ``griddepcontrol.launch_dependents``; a program counts as triggered when its first thread gets
there): once every program has, the next kernel launches and runs its prologue (the GEMV's first weight tile) while
this one stores and, for a split-K GEMV, adds its partial sums. Correctness does not depend on where the trigger
sits, as long as it comes after the wait: the next kernel's ``pdl_wait`` still waits for this whole grid, and as
this kernel triggers only after its own wait, the next one starts only once the kernel before this one has
finished, so "the kernel just before" in the rule above stays the only one that can still be running.

On an H200 (bench/RESULTS.md): PDL alone measured 2-6% faster per kernel in a chain and 0-2% per 7B decode step;
with the trigger a 7B batch-1 step took 2,100 us against 2,277 (1.08x, same call; builds of one engine vary by up to
5%) and a step of 8 sequences 4% less. There each GEMV is followed by a small kernel (rotary, norm, SiLU). Where a
GEMV is followed by another (the benchmark's chains of one shape; in a model, the gate/up GEMV before a down GEMV
that fuses SiLU, which the CUDA-core GEMV does at M = 1 on shapes without a measured plan) the trigger measured up
to 16% slower: the next grid's programs take multiprocessors while this one's last programs finish. Triggering at
the start of each program measured up to 1.6x slower.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the references still work, the kernels raise on launch
    triton = tl = gdc_wait = gdc_launch_dependents = None

HAS_TRITON = triton is not None


class Kernel:
    """A Triton kernel launched as ``kernel[grid](*args, **meta)``: compiled for CUDA tensors, interpreted for CPU
    (the device of the first tensor argument decides: looking at every argument cost about 8 µs a launch under a
    profiler on the H200's host, some 3 ms of a 7B prefill step's 353 launches). A launch whose tensors are on
    different devices is an error either way: compiled, Triton refuses a CPU tensor."""

    def __init__(self, fn, do_not_specialize: tuple[str, ...] = ()):
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self._compiled = None
        self._interpreted = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **meta):
        if triton is None:
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed (pip install 'edge-appliance[triton]')")
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)  # the kernels' tensors share a device
        if first is not None and first.device.type == "cpu":
            if self._interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction
                self._interpreted = InterpretedFunction(self.fn)
            with _interpreting():
                return self._interpreted[grid](*args, **meta)
        if self._compiled is None:
            self._compiled = triton.jit(self.fn, do_not_specialize=self.do_not_specialize)
        if meta.get("PDL"):
            meta["launch_pdl"] = True
        # FP contraction (a * b + c as one FMA) as every kernel was written and measured with: Triton 3.9 warns
        # that its default turns to off in 3.10, which would change the rounding and the instruction count of the
        # GEMVs' inner loops. Kernels that round like torch pass False themselves.
        meta.setdefault("enable_fp_fusion", True)
        return self._compiled[grid](*args, **meta)


@contextlib.contextmanager
def _interpreting():
    """While it lasts, a compiled-mode ``@triton.jit`` function called from interpreted code is interpreted too.

    Triton's interpreter swaps interpreted versions into ``triton.language`` while a kernel runs, and puts them back
    after, except those a device function's call swaps in (``InterpretedFunction.__call__`` keeps no record, Triton
    3.9): ``triton.language.core``'s builtins stayed swapped, and every later compile in the process failed (a CPU
    test run that interpreted kernels, then compiled for a GPU target: tests/compile_targets.py). So this puts back
    whatever changed in those modules and classes too."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__  # outside a kernel it only raises, so compiled launches are unaffected
    spaces = (tl, tl.core, tl.math, tl.core.tensor, tl.core.tensor_descriptor_base)
    saved = [(space, dict(vars(space))) for space in spaces]
    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
    try:
        yield
    finally:
        JITFunction.__call__ = original
        for space, before in saved:
            for name, value in list(vars(space).items()):
                if name.startswith("__"):
                    continue
                if name not in before:
                    delattr(space, name)
                elif before[name] is not value:
                    setattr(space, name, before[name])


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(fn)


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """Decorator: see :class:`Kernel`. ``@jit(do_not_specialize=("n",))``: Triton compiles one variant whatever the
    integer argument ``n`` is (by default it specializes 1 and multiples of 16: a new compile, at serving time,
    for an argument that changes from step to step)."""
    if fn is None:
        return lambda f: Kernel(f, do_not_specialize)
    return Kernel(fn, do_not_specialize)


def device_fn(fn):
    """Decorator for a device function that kernels call (plain ``triton.jit``; interpreted within interpreted
    kernels through :func:`_interpreting`). Without Triton, the plain Python function (never called)."""
    return triton.jit(fn) if triton is not None else fn


def dot_f32(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` run interpreted (CPU), where dot operands must be upcast to fp32."""
    return t.device.type == "cpu"


def hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device of compute capability 9.0 or newer: PDL (:func:`pdl`), and PTX's packed
    bf16 ``sub`` / ``mul`` (``sub.rn.bf16x2``, ``mul.rn.bf16x2``; sm_80 - sm_89 have only ``fma.rn.bf16x2``, so the
    kernels that use them take a ``HOPPER`` constexpr and write the same values as fma on older GPUs)."""
    if t.device.type != "cuda":
        return False
    return _cuda_capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` launch with programmatic dependent launch (see the module doc): :func:`hopper`,
    and ``APPLIANCE_PDL`` is not "0". Read at every launch: eager launches follow the environment of the moment, a
    captured CUDA graph keeps the launches of its capture."""
    return os.environ.get("APPLIANCE_PDL", "1") != "0" and hopper(t)


def early_trigger(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` that launch with PDL also let the next kernel launch after their main loop
    (:func:`pdl_trigger`, see the module doc): :func:`pdl` and ``APPLIANCE_PDL_TRIGGER`` is not "0". Read at every
    launch, like :func:`pdl`."""
    return pdl(t) and os.environ.get("APPLIANCE_PDL_TRIGGER", "1") != "0"


@contextlib.contextmanager
def _env_zero(name: str):
    """While it lasts, the environment variable ``name`` is "0"; its previous value (or absence) comes back after."""
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def without_pdl():
    """While it lasts, kernels launch without programmatic dependent launch (``APPLIANCE_PDL=0``); the previous
    value of the variable comes back after (the benchmark's baseline)."""
    return _env_zero("APPLIANCE_PDL")


def without_early_trigger():
    """While it lasts, kernels launched with PDL do not trigger their dependents early
    (``APPLIANCE_PDL_TRIGGER=0``; the benchmark's baseline for the trigger)."""
    return _env_zero("APPLIANCE_PDL_TRIGGER")


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


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


def _pdl_wait(PDL: tl.constexpr):
    """In a kernel launched with PDL (a true constexpr): wait until the previous kernel has finished and its
    writes are visible (see the module doc). Nothing when PDL is false."""
    if PDL:
        gdc_wait()


pdl_wait = device_fn(_pdl_wait) if triton is not None else _pdl_wait


def _pdl_trigger(TRIG: tl.constexpr):
    """In a kernel launched with PDL and a true ``TRIG`` constexpr (:func:`early_trigger`): let the next kernel on
    the stream launch once every program of this one has passed here (see the module doc). Nothing when false."""
    if TRIG:
        gdc_launch_dependents()


pdl_trigger = device_fn(_pdl_trigger) if triton is not None else _pdl_trigger
