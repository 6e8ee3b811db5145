"""Host time per launch (µs, no sync in the loop) on a GPU: Triton's JIT dispatch, our ``Kernel`` wrapper, a
direct ``CompiledKernel`` launch, and torch ops, for a 4-argument kernel; then two of our ops whole (allocation,
checks, launch): ``python3 bench/launch_host.py``.
H200, run 95 (bench/RESULTS.md; two rounds): triton.jit 10.9-11.3 µs, our wrapper 12.6-12.7, a direct
CompiledKernel launch 7.1-7.2, ``torch.add(out=)`` 4.9-5.4; ``ops.rms_norm`` 30-31 and ``ops.silu_and_mul`` 27-28
whole, against the eager 7B prefill step's 38-44 µs of host time per launch."""
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
from kernels import ops  # noqa: E402 - real kernels: host µs of a whole op call (allocation, checks, launch)
from kernels._triton import Kernel  # noqa: E402


def add_fn(x, y, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)


raw = triton.jit(add_fn)
ours = Kernel(add_fn)
x, y, out = (torch.randn(4096, device="cuda") for _ in range(3))


def t(f, n=3000) -> float:
    """Host µs per call of ``f`` (launches queue; the GPU is synchronized only around the loop)."""
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n):
        f()
    e = time.perf_counter()
    torch.cuda.synchronize()
    return (e - s) / n * 1e6


res = {}
for rep in range(2):
    res.setdefault("triton.jit kernel[grid](...)", []).append(t(lambda: raw[(4,)](x, y, out, 4096, BLOCK=1024)))
    res.setdefault("our Kernel wrapper", []).append(t(lambda: ours[(4,)](x, y, out, 4096, BLOCK=1024)))
    res.setdefault("torch.add(out=)", []).append(t(lambda: torch.add(x, y, out=out)))
    res.setdefault("torch.empty(4096)", []).append(t(lambda: torch.empty(4096, device="cuda")))
    res.setdefault("tensor.view/reshape x2", []).append(t(lambda: x.view(64, 64).reshape(4096)))
try:
    ck = raw.warmup(x, y, out, 4096, BLOCK=1024, grid=(4,))
    for rep in range(2):
        res.setdefault("CompiledKernel[grid](all args)", []).append(t(lambda: ck[(4, 1, 1)](x, y, out, 4096, 1024)))
    out.zero_()
    ck[(4, 1, 1)](x, y, out, 4096, 1024)
    torch.cuda.synchronize()
    print("direct launch correct:", torch.equal(out, x + y))
except Exception as e:  # noqa: BLE001 - Triton's internals differ between versions: say which
    print("direct launch failed:", repr(e))

h = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
g = torch.randn(128, 2 * 11008, device="cuda", dtype=torch.bfloat16)
for rep in range(2):
    res.setdefault("ops.rms_norm 128x4096 (+residual)", []).append(t(lambda: ops.rms_norm(h, w, 1e-5, h)))
    res.setdefault("ops.silu_and_mul 128x11008", []).append(t(lambda: ops.silu_and_mul(g)))
for k, v in res.items():
    print(f"{k:36s} " + " / ".join(f"{u:.1f}" for u in v) + " us")
