"""The GPU suite of issue 3, in one call on one GPU: correctness of every kernel, then the kernel rows of the
benchmark table, each a ratio to a baseline timed in the same run.

    PYTHONUNBUFFERED=1 python bench/gpu_suite.py [--sweep] [--skip-tests] [--results bench/RESULTS.md]

1. Correctness: ``tests/test_kernels_*.py`` with ``KERNEL_TEST_DEVICE=cuda`` (every kernel against its torch
   reference, compiled; bf16 results bit for bit where the kernel copies the reference's rounding), plus checks at
   the benchmark shapes below.
2. Measured device-to-device copy bandwidth (bytes read + written).
3. W4A16 at M = 1/16/64/256 on the four Llama shapes vs torch bf16 ``F.linear`` and (M=1)
   ``torch.ops.aten._weight_int4pack_mm`` fed the same 4-bit weights.
4. Paged decode attention (32 q / 8 kv heads, D 128, block 16) vs SDPA on the same K/V in a contiguous cache;
   paged prefill attention (the same heads; one 2,048-token prompt, a 2,048-token chunk after 6,144 cached tokens,
   four 512-token chunks after 512) vs causal SDPA per sequence.
5. ``--sweep``: every candidate tile configuration for those shapes (the data behind ``w4a16.choose_plan`` and
   ``paged_attention.DECODE_CONFIG``), written to ``$OUT/sweep.json`` when $OUT is set.
6. Engine-level rows: functions registered with :func:`engine_rows` (7B-shaped decode, graphs vs eager,
   256-request throughput) add their rows to the same table.

Timing: all calls of one measurement are captured into one CUDA graph, rotating over enough copies of the inputs
to exceed the 60 MB L2 several times, and the graph is replayed; the median replay over the number of calls is the
time per call (ours and baselines alike). The markdown table (with date, GPU, versions, peak memory) is printed
last and appended to ``--results`` (and written to ``$OUT/results.md``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import paged_attention as pa  # noqa: E402
from kernels import quant_formats as qf  # noqa: E402
from kernels import w4a16, w4a16_tune  # noqa: E402
from kernels.kv_cache import dequantize_int8_ref, quantize_int8_ref  # noqa: E402
from kernels._triton import cdiv, num_sms, pdl, without_early_trigger, without_pdl  # noqa: E402

ROTATE_BYTES = 256 << 20  # inputs touched per graph replay: > 4x the H200's 60 MB L2
MIN_CALLS = 24  # calls per captured graph, at least
W4_SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # (in K, out N)
W4_TARGETS = {1: 3.0, 16: 2.0, 64: 1.0, 256: 0.85}
DECODE_CASES = [(b, ctx) for b in (1, 16, 64) for ctx in (1024, 4096, 16384)]
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DEV = "cuda"  # "cpu" with --dry-run: tiny shapes through the interpreter, to check this script without a GPU


@dataclass
class Row:
    """One line of the table: ratio = baseline time / our time (higher is better), met when ratio >= goal."""

    measure: str
    shape: str
    ours_us: float
    baseline: str
    base_us: float
    goal: float | None = None
    note: str = ""
    ratio: float = field(init=False)

    def __post_init__(self):
        self.ratio = self.base_us / self.ours_us if self.ours_us > 0 else float("nan")

    def markdown(self) -> str:
        goal = f"≥ {self.goal:g}×" if self.goal is not None else ""
        met = "" if self.goal is None else ("yes" if self.ratio >= self.goal else "**no**")
        return (f"| {self.measure} | {self.shape} | {self.ours_us:.1f} | {self.baseline} | {self.base_us:.1f} | "
                f"{self.ratio:.2f}× | {goal} | {met} | {self.note} |")


#: Engine-level rows (issue 3's 7B-shaped decode, graphs vs eager, 256 requests): functions ctx -> list[Row],
#: registered with @engine_rows; ctx holds "copy_bw" (bytes/s) and "args". They run after the kernel rows.
ENGINE_ROWS: list[Callable[[dict], list[Row]]] = []


def engine_rows(fn: Callable[[dict], list[Row]]) -> Callable[[dict], list[Row]]:
    ENGINE_ROWS.append(fn)
    return fn


def _without_default_device(fn: Callable[[dict], list[Row]], ctx: dict) -> list[Row]:
    """Run engine rows as a server runs the engine: with no default torch device. (A default device routes every
    torch call through a Python TorchFunctionMode: in the 256-request run it took 38% of the host's time.)"""
    torch.set_default_device(None)
    try:
        return fn(ctx)
    finally:
        torch.set_default_device(DEV)


# ----------------------------------------------------------------------------------------------------------------
# timing

def time_calls(calls: list[Callable[[], object]], replays: int = 15) -> float:
    """Median microseconds per call, with every call captured into one CUDA graph (see the module doc; the engine's
    plan measurements time the same way, ``kernels.w4a16_tune.time_graph``)."""
    if DEV == "cpu":
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    return w4a16_tune.time_graph(calls, replays)


def time_calls_under(context, calls: list[Callable[[], object]]) -> float:
    """:func:`time_calls` with every kernel launched (and captured) inside ``context``: ``without_pdl()`` (no
    programmatic dependent launch) or ``without_early_trigger()`` (PDL, each kernel's next one launched as its
    programs exit)."""
    with context:
        return time_calls(calls)


def rotation(bytes_per_call: int, cap: int = 64) -> int:
    """How many input copies one graph cycles through so that it reads ROTATE_BYTES."""
    return max(1, min(cap, cdiv(ROTATE_BYTES, max(bytes_per_call, 1))))


def schedule(copies: int, min_calls: int = 24) -> list[int]:
    """Copy index of each captured call: every copy at least once, at least ``min_calls`` calls."""
    return [i % copies for i in range(max(copies, min(min_calls, MIN_CALLS)))]


def copy_bandwidth() -> float:
    """Bytes per second (read + written) of a 2 GiB device-to-device copy."""
    n = 2 << 30 if DEV == "cuda" else 1 << 20
    a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    a.random_()
    if DEV == "cpu":
        return 2 * n / (time_calls([lambda: b.copy_(a)]) * 1e-6)
    b.copy_(a)  # eager, as a captured copy becomes a (slower) copy-engine memcpy node
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del a, b
    return 2 * n / statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# W4A16

def random_w4(k: int, n: int, group: int = 128) -> qf.QuantizedWeight:
    """A random asymmetric 4-bit weight in the internal layout (random words are random codes), fp16 scales."""
    g = cdiv(k, group)
    qweight = torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (g, n // 8), dtype=torch.int32)
    scales = (torch.rand(g, n) * 0.01 + 0.002).half()
    return qf.QuantizedWeight(qweight, qzeros, scales, None, 4, group, k, n, "bench")


def int4pack_of(qw: qf.QuantizedWeight):
    """The same weight for torch's tinygemm kernel: (packed, scales_and_zeros). Tinygemm computes
    (q - 8) * scale + zero, so zero = (8 - z) * s (rounded to bf16)."""
    q, z = qf.unpack_codes(qw)  # [K, N], [G, N]
    qt = q.t().contiguous()
    w_u8 = ((qt[:, 0::2] << 4) | qt[:, 1::2]).to(torch.uint8)  # [N, K/2], first code in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, 8)
    s = qw.scales.float()
    sz = torch.stack([s, (8 - z).float() * s], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
    return packed, sz


def w4a16_rows(log: dict, tuned: dict | None = None) -> list[Row]:
    """The W4A16 rows; ``tuned`` {(k, n, m): Plan} (from the sweep in this run) replaces choose_plan's pick."""
    rows = []
    tuned = tuned or {}
    for k, n in W4_SHAPES:
        bytes_w4 = k * n // 2 + cdiv(k, 128) * n * 2 + cdiv(k, 128) * n // 2
        copies4, copies16 = rotation(bytes_w4), rotation(k * n * 2)
        qws = [random_w4(k, n) for _ in range(copies4)]
        w16 = [qf.dequantize(qws[0]).to(torch.bfloat16)] + [
            torch.randn(n, k, dtype=torch.bfloat16) for _ in range(copies16 - 1)]
        int4 = None
        try:
            int4 = [int4pack_of(qw) for qw in qws]
        except Exception as e:  # noqa: BLE001 - the baseline may not exist on this build
            print(f"int4pack baseline unavailable: {str(e).splitlines()[0]}")
        for m in (1, 8, 16, 64, 256):  # M=8 (no target): the batched decode of a few requests
            x = torch.randn(m, k, dtype=torch.bfloat16)
            plan = tuned.get((k, n, m)) or w4a16.choose_plan(m, n, k, 4, 128, num_sms(x.device))
            y = w4a16.run_plan(x, qws[0], None, plan)
            ref = x.float() @ w16[0].float().t()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            check(f"w4a16 M={m} {k}->{n} rel err {err:.1e}", err < 1e-2)
            ours = time_calls([lambda i=i: w4a16.run_plan(x, qws[i], None, plan) for i in schedule(copies4)])
            base = time_calls([lambda i=i: F.linear(x, w16[i]) for i in schedule(copies16)])
            shape = f"{k}→{n}, M={m}"
            note = (f"{plan_str(plan, k)}{' (swept)' if (k, n, m) in tuned else ''}; "
                    f"{bytes_w4 / ours / 1e6:.2f} TB/s")
            if pdl(x):  # each call may start while the previous one ends: time without too
                calls = [lambda i=i: w4a16.run_plan(x, qws[i], None, plan) for i in schedule(copies4)]
                alone = time_calls_under(without_pdl(), calls)
                late = time_calls_under(without_early_trigger(), calls)
                note += (f"; without PDL {alone:.1f} µs ({base / alone:.2f}×), without the early trigger "
                         f"{late:.1f} µs ({base / late:.2f}×)")
            rows.append(Row("W4A16 vs bf16 F.linear", shape, ours, "F.linear bf16", base, W4_TARGETS.get(m), note))
            log.setdefault("w4a16", []).append(dict(k=k, n=n, m=m, plan=plan.__dict__, ours_us=ours, bf16_us=base))
            if int4 is not None and m == 1:
                try:
                    yi = torch.ops.aten._weight_int4pack_mm(x, int4[0][0], 128, int4[0][1])
                    ierr = ((yi.float() - ref).norm() / ref.norm()).item()
                    t4 = time_calls([lambda i=i: torch.ops.aten._weight_int4pack_mm(x, int4[i][0], 128, int4[i][1])
                                     for i in schedule(copies4)])
                    rows.append(Row("W4A16 vs torch int4 (tinygemm)", shape, ours, "_weight_int4pack_mm", t4, 1.0,
                                    f"baseline rel err {ierr:.1e}"))
                except Exception as e:  # noqa: BLE001
                    print(f"int4pack_mm failed at M={m}: {str(e).splitlines()[0]}")
        del qws, w16, int4
        torch.cuda.empty_cache()
    return rows


def w4a16_candidates(m: int, n: int, k: int, sms: int) -> list[w4a16.Plan]:
    """The plans the sweep times for one shape: the default first, then the contiguous-x tensor-core kernel
    (path "tc", ``_gemm_tc_kernel``) in order of promise (the time slice may run out), then the older fused GEMM
    variants that won in earlier runs, and dequantize-then-cuBLAS above M = 64."""
    plans = [w4a16.choose_plan(m, n, k, 4, 128, sms)]
    P = w4a16.Plan
    bm = 16 if m <= 16 else 64 if m <= 64 else 128

    def tc(bm_, bn, bk, swap, warps, stages, mode, programs=(1,)):
        tiles = cdiv(m, bm_) * cdiv(n, bn)
        for p in programs:
            kps = w4a16._split(k, bk, tiles, p * sms) if p else k
            plans.append(P("tc", bm_, bn, bk, kps, swap, warps, stages, mode=mode))

    if 1 < m <= 16:
        tc(16, 64, 128, True, 4, 3, 3, (1, 2, 3, 4))
        tc(16, 64, 128, True, 4, 3, 1, (2, 3, 4))
        tc(16, 64, 128, True, 4, 3, 2, (2, 3, 4))
        tc(16, 64, 128, True, 4, 4, 1, (2,))
        tc(16, 64, 64, True, 4, 4, 1, (2,))
        tc(16, 128, 128, True, 8, 3, 3, (2,))
    elif m <= 64:
        tc(64, 64, 128, True, 4, 3, 3, (1, 2, 3))
        tc(64, 64, 128, True, 4, 3, 1, (1, 2, 3))
        tc(64, 64, 128, True, 4, 3, 2, (1, 2))
        tc(64, 64, 128, True, 4, 4, 1, (2,))
        tc(64, 64, 64, True, 4, 4, 1, (2,))
        tc(64, 128, 128, True, 8, 3, 3, (1,))
    elif m <= 256:
        tc(128, 64, 64, True, 4, 3, 3, (0, 1))
        tc(128, 64, 64, True, 4, 3, 1, (0, 1))
        tc(256, 128, 64, True, 8, 3, 3, (0,))
        tc(256, 64, 64, True, 4, 3, 3, (1,))
        tc(256, 64, 64, True, 4, 3, 1, (1,))
        tc(128, 64, 128, True, 4, 3, 3, (0,))
        tc(128, 64, 128, True, 4, 3, 1, (0,))
        tc(128, 64, 64, True, 4, 4, 1, (0,))
        tc(64, 64, 128, True, 4, 3, 3, (0,))
        plans.append(P("dequant"))
    else:
        tc(128, 64, 64, True, 4, 3, 3, (0,))
        tc(256, 128, 64, True, 8, 3, 3, (0,))
        plans.append(P("dequant"))
    if m <= 16:  # the tensor-core GEMV: one or two warps per program, K split to 6-24 warps per SM
        for warps in (1, 2):
            for per_sm in (6, 8, 12, 16, 24):
                kps = w4a16._split(k, 128, cdiv(n, 64 * warps), per_sm * sms // warps)
                plans.append(P("mma", 8 if m <= 8 else 16, 64 * warps, 128, kps, num_warps=warps, num_stages=1))
        for splits in (3, 8):  # two warps per 64 columns sharing each split's K (k_warps): the M = 8 winners
            kps = cdiv(cdiv(cdiv(k, 128), splits), 2) * 256
            plans.append(P("mma", 8 if m <= 8 else 16, 128, 128, kps, num_warps=4, num_stages=1, k_warps=2))
    if m == 1:
        for bn, bk, warps, programs in ((128, 128, 4, 2), (128, 128, 4, 4), (128, 128, 4, 1), (128, 128, 8, 2),
                                        (64, 128, 4, 2), (64, 128, 4, 4), (256, 128, 8, 1), (256, 128, 8, 2),
                                        (128, 64, 4, 4), (256, 64, 8, 2), (64, 64, 2, 4), (128, 128, 4, 8)):
            plans.append(P("gemv", 1, bn, bk, w4a16._split(k, bk, cdiv(n, bn), programs * sms), False, warps, 3))
        plans.append(P("gemv", 1, 128, 128, w4a16._split(k, 128, cdiv(n, 128), 2 * sms), False, 4, 3,
                       serial=False))
        plans += [P("gemv", 1, 128, 128, cdiv(cdiv(k, 128), s) * 128, False, 4, 3) for s in range(2, 13)]
    elif m <= 64:
        for bn, bk, swap, fast in ((256, 128, False, True), (128, 128, True, False), (128, 64, True, False)):
            tiles = cdiv(m, bm) * cdiv(n, bn)
            plans.append(P("gemm", bm, bn, bk, w4a16._split(k, bk, tiles, 2 * sms), swap, 4, 3, fast=fast))
    return list(dict.fromkeys(plans))


#: the M values the sweep times (``--sweep-m``)
SWEEP_MS = (1, 8, 16, 64, 256, 1024, 4096)
#: seconds the sweep may spend on one (shape, M), compiles included (the first shape pays most of them)
SWEEP_SLICE = {1: 30, 8: 20, 16: 30, 64: 30, 256: 30, 1024: 6, 4096: 6}


def plan_str(p: w4a16.Plan, k: int) -> str:
    """A plan in one short line."""
    return (f"{p.path} {p.block_m}x{p.block_n}x{p.block_k} split {cdiv(k, p.k_per_split)} w{p.num_warps} "
            f"s{p.num_stages}{' swap' if p.swap else ''}{' fast' if p.fast else ''}"
            f"{f' mode {p.mode}' if p.path == 'tc' else ''}{f' kw{p.k_warps}' if p.k_warps > 1 else ''}")


def sweep_w4a16(log: dict) -> dict:
    """Time the candidate plans; returns {(k, n, m): best Plan}. Each (shape, M) gets SWEEP_SLICE seconds."""
    sms = num_sms(torch.device(DEV))
    best = {}
    for k, n in W4_SHAPES:
        copies = rotation(k * n // 2 + cdiv(k, 128) * n * 5 // 2)
        qws = [random_w4(k, n) for _ in range(copies)]
        w16 = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(rotation(k * n * 2))]
        for m in SWEEP_MS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            ref = x.float() @ w4a16.dequantize_triton(qws[0], torch.float32)
            results = []
            deadline = time.monotonic() + SWEEP_SLICE.get(m, 6)
            for plan in w4a16_candidates(m, n, k, sms):
                if time.monotonic() > deadline:
                    break
                try:
                    err = ((w4a16.run_plan(x, qws[0], None, plan).float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:  # a wrong plan never wins
                        print(f"  WRONG {plan}: rel err {err:.2e}")
                        continue
                    us = time_calls([lambda i=i: w4a16.run_plan(x, qws[i], None, plan) for i in schedule(copies, 8)],
                                    replays=5)
                    results.append((us, plan))
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                    print(f"  skip {plan}: {type(e).__name__}: {str(e)[:120]}")
            if not results:
                continue
            base = time_calls([lambda i=i: F.linear(x, w16[i]) for i in schedule(len(w16), 8)], replays=5)
            results.sort(key=lambda r: r[0])
            best[(k, n, m)] = results[0][1]
            if m in w4a16.M_BUCKETS:  # the engine rows of this run use the winners too (choose_plan reads TUNED)
                w4a16.TUNED[(m, n, k)] = results[0][1]
                w4a16.choose_plan.cache_clear()
            print(f"sweep {k}->{n} M={m}: bf16 {base:.1f} us; {len(results)} plans; default "
                  f"{w4a16.choose_plan(m, n, k, 4, 128, sms)}")
            for us, plan in results[:6]:
                print(f"    {us:8.1f} us  {base / us:5.2f}x  {plan_str(plan, k)}")
            log.setdefault("sweep_w4a16", []).append(
                dict(k=k, n=n, m=m, bf16_us=base, results=[(us, p.__dict__) for us, p in results]))
        del qws, w16
        torch.cuda.empty_cache()
    return best


# ----------------------------------------------------------------------------------------------------------------
# paged decode attention

def decode_setup(batch: int, ctx: int, copies: int):
    """Per copy: (q, paged k/v pool, scattered block tables, context lens) and the same K/V contiguous for SDPA."""
    nb = ctx // BLOCK
    pool_k = torch.empty(copies * batch * nb, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    pool_v = torch.empty_like(pool_k)
    sets = []
    perm = torch.randperm(copies * batch * nb).to(torch.int32)
    for c in range(copies):
        k = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        v = torch.randn(batch, ctx, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        tables = perm[c * batch * nb:(c + 1) * batch * nb].view(batch, nb).contiguous()
        pool_k[tables.long()] = k.view(batch, nb, BLOCK, KV_HEADS, HEAD_DIM)
        pool_v[tables.long()] = v.view(batch, nb, BLOCK, KV_HEADS, HEAD_DIM)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        sdpa = (q[:, :, None, :], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
        sets.append((q, tables, lens, sdpa))
        del k, v
    return pool_k, pool_v, sets


DECODE_SWEEP_CASES = {(1, 4096), (16, 1024), (16, 4096), (16, 16384)}


def decode_candidates(batch: int) -> list[dict]:
    """Decode settings the sweep times: KV tile, warps, stages; chunk sizes where the kernel splits."""
    cands = [dict(block_n=64, num_warps=4, num_stages=st) for st in (2, 3, 4)] + [dict(block_n=32, num_warps=4,
                                                                                        num_stages=3)]
    if batch * KV_HEADS < 2 * num_sms(torch.device(DEV)):
        cands += [dict(block_n=bn, num_warps=4, num_stages=st, chunk=c) for c in (64, 128, 256, 512, 1024, 2048)
                  for bn, st in ((64, 3), (64, 2), (32, 3))]
    return cands


def sdpa_decode(q4, k4, v4):
    return F.scaled_dot_product_attention(q4, k4, v4, scale=HEAD_DIM ** -0.5, enable_gqa=True)


def sdpa_backend(backend: str):
    """The context the SDPA baseline runs in: FlashAttention only when it was available ("flash"), else torch's
    default choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if backend == "flash" else contextlib.nullcontext()


def decode_fp8_row(batch: int, ctx: int, pool_k, pool_v, sets, copies: int, base: float, backend: str,
                   copy_bw: float, log: dict) -> Row:
    """The decode kernel on the same K/V in an fp8 e4m3 cache (shipped settings), against the bf16 SDPA time; its
    output checked against SDPA on the fp8-rounded K/V. The fp8 pool is repeated so that a graph replay still
    reads ROTATE_BYTES (the copies of the bf16 pool hold half as many fp8 bytes)."""
    kv8_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM
    reps = cdiv(rotation(kv8_bytes, cap=64), copies)
    k8, v8 = pool_k.to(torch.float8_e4m3fn).repeat(reps, 1, 1, 1), pool_v.to(torch.float8_e4m3fn).repeat(reps, 1, 1, 1)
    sets = [(q, tables + r * pool_k.shape[0], lens, sdpa) for r in range(reps) for q, tables, lens, sdpa in sets]
    copies = len(sets)
    scale = HEAD_DIM ** -0.5
    q, tables, lens, (q4, k4, v4) = sets[0]
    out = pa.paged_attention_decode(q, k8, v8, tables, lens, scale)
    rounded = (q4, k4.to(torch.float8_e4m3fn).to(torch.bfloat16), v4.to(torch.float8_e4m3fn).to(torch.bfloat16))
    with sdpa_backend(backend):
        ref = sdpa_decode(*rounded)[:, :, 0]
    err = (out.float() - ref.float()).abs().max().item()
    check(f"decode fp8 B={batch} ctx={ctx} vs SDPA on fp8-rounded K/V max err {err:.1e}", err < 2e-2)
    us = time_calls([lambda i=i: pa.paged_attention_decode(sets[i][0], k8, v8, sets[i][1], sets[i][2], scale)
                     for i in schedule(copies)])
    frac = kv8_bytes / (us * 1e-6) / copy_bw
    log.setdefault("decode_fp8", []).append(dict(batch=batch, ctx=ctx, ours_us=us, sdpa_us=base, bw_frac=frac))
    del k8, v8
    return Row("paged decode, fp8 KV cache, vs SDPA (bf16)", f"B={batch}, ctx={ctx}", us,
               f"SDPA ({backend}), contiguous bf16", base, None, f"{frac:.0%} of copy BW (fp8 bytes)")


def decode_int8_row(batch: int, ctx: int, pool_k, pool_v, sets, copies: int, base: float, backend: str,
                    copy_bw: float, log: dict) -> Row:
    """The decode kernel on the same K/V in an int8 cache (codes and per-token, per-head scales, shipped settings),
    against the bf16 SDPA time; its output checked against SDPA on the dequantized K/V. As for fp8, the pool is
    repeated so that a graph replay still reads ROTATE_BYTES; bytes moved count the scales."""
    kv_bytes = 2 * batch * ctx * KV_HEADS * (HEAD_DIM + 4)
    reps = cdiv(rotation(kv_bytes, cap=64), copies)
    (kc, ks), (vc, vs) = quantize_int8_ref(pool_k), quantize_int8_ref(pool_v)
    ks, vs = ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()  # the kernels' head-major scales
    kc, vc, ks, vs = (t.repeat(reps, *([1] * (t.dim() - 1))) for t in (kc, vc, ks, vs))
    sets = [(q, tables + r * pool_k.shape[0], lens, sdpa) for r in range(reps) for q, tables, lens, sdpa in sets]
    copies = len(sets)
    scale = HEAD_DIM ** -0.5
    q, tables, lens, (q4, k4, v4) = sets[0]
    out = pa.paged_attention_decode(q, kc, vc, tables, lens, scale, ks, vs)
    deq = [dequantize_int8_ref(*quantize_int8_ref(t)).to(torch.bfloat16) for t in (k4, v4)]  # rows: (token, head)
    with sdpa_backend(backend):
        ref = sdpa_decode(q4, *deq)[:, :, 0]
    err = (out.float() - ref.float()).abs().max().item()
    check(f"decode int8 B={batch} ctx={ctx} vs SDPA on dequantized K/V max err {err:.1e}", err < 2e-2)
    us = time_calls([lambda i=i: pa.paged_attention_decode(sets[i][0], kc, vc, sets[i][1], sets[i][2], scale, ks, vs)
                     for i in schedule(copies)])
    frac = kv_bytes / (us * 1e-6) / copy_bw
    log.setdefault("decode_int8", []).append(dict(batch=batch, ctx=ctx, ours_us=us, sdpa_us=base, bw_frac=frac))
    del kc, vc, ks, vs
    return Row("paged decode, int8 KV cache, vs SDPA (bf16)", f"B={batch}, ctx={ctx}", us,
               f"SDPA ({backend}), contiguous bf16", base, None, f"{frac:.0%} of copy BW (int8 + scale bytes)")


def decode_rows(log: dict, copy_bw: float, sweep: bool) -> list[Row]:
    rows = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    scale = HEAD_DIM ** -0.5
    for batch, ctx in DECODE_CASES:
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        copies = rotation(kv_bytes, cap=32)
        pool_k, pool_v, sets = decode_setup(batch, ctx, copies)

        def ours(i, **cfg):
            q, tables, lens, _ = sets[i]
            return pa.decode_with(q, pool_k, pool_v, tables, lens, scale, **cfg) if cfg else \
                pa.paged_attention_decode(q, pool_k, pool_v, tables, lens, scale)

        backend = "flash"
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                base_out = sdpa_decode(*sets[0][3])
        except RuntimeError:
            backend = "default"
            base_out = sdpa_decode(*sets[0][3])
        best_cfg = {}
        if sweep and (batch, ctx) in DECODE_SWEEP_CASES:
            results = []
            deadline = time.monotonic() + 15
            for cfg in decode_candidates(batch):
                if time.monotonic() > deadline:
                    break
                try:
                    t = time_calls([lambda i=i: ours(i, **cfg) for i in schedule(copies, 8)], replays=5)
                    results.append((t, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
            results.sort(key=lambda r: r[0])
            print(f"sweep decode B={batch} ctx={ctx}:")
            for t, cfg in results[:5]:
                print(f"    {t:8.1f} us  {cfg}")
            log.setdefault("sweep_decode", []).append(dict(batch=batch, ctx=ctx, results=results))
            best_cfg = results[0][1] if results else {}
        out = ours(0, **best_cfg)
        err = (out.float() - base_out[:, :, 0].float()).abs().max().item()
        check(f"decode B={batch} ctx={ctx} vs SDPA max err {err:.1e}", err < 2e-2)
        us = time_calls([lambda i=i: ours(i, **best_cfg) for i in schedule(copies)])
        with sdpa_backend(backend):
            base = time_calls([lambda i=i: sdpa_decode(*sets[i][3]) for i in schedule(copies)])
        frac = kv_bytes / (us * 1e-6) / copy_bw
        note = f"{frac:.0%} of copy BW" + (" (target ≥ 70%)" if batch == 64 else "")
        if pdl(sets[0][0]):
            alone = time_calls_under(without_pdl(), [lambda i=i: ours(i, **best_cfg) for i in schedule(copies)])
            note += f"; without PDL {alone:.1f} µs ({base / alone:.2f}×)"
        if best_cfg:
            note += f"; swept {best_cfg}"
        rows.append(Row("paged decode vs SDPA", f"B={batch}, ctx={ctx}", us, f"SDPA ({backend}), contiguous", base,
                        1.0, note))
        log.setdefault("decode", []).append(dict(batch=batch, ctx=ctx, ours_us=us, sdpa_us=base, bw_frac=frac,
                                                 cfg=best_cfg))
        rows.append(decode_fp8_row(batch, ctx, pool_k, pool_v, sets, copies, base, backend, copy_bw, log))
        rows.append(decode_int8_row(batch, ctx, pool_k, pool_v, sets, copies, base, backend, copy_bw, log))
        del pool_k, pool_v, sets
        torch.cuda.empty_cache()
    return rows


#: Prefill cases (each sequence: cached prefix, new tokens): one prompt, the last chunk of an 8k-token prompt
#: (chunked prefill's 2,048-token steps), four 512-token chunks after 512 cached tokens
PREFILL_CASES = {"1 x 2048 new": [(0, 2048)], "2048 new after 6144": [(6144, 2048)],
                 "4 x 512 new after 512": [(512, 512)] * 4}


def prefill_setup(seqs: list[tuple[int, int]]):
    """(q [T, Hq, D], paged K/V pools, block tables, cu_seqlens, context lens, per-sequence SDPA inputs
    (q [1, Hq, n, D], k / v [1, Hkv, prefix + n, D], the same K/V contiguous))."""
    blocks = [cdiv(p + n, BLOCK) for p, n in seqs]
    pool_k = torch.empty(sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    pool_v = torch.empty_like(pool_k)
    perm = torch.randperm(sum(blocks)).to(torch.int32)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    qs, sdpa, at = [], [], 0
    for i, ((p, n), nb) in enumerate(zip(seqs, blocks)):
        k = torch.randn(nb * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables[i, :nb] = perm[at:at + nb]
        at += nb
        pool_k[tables[i, :nb].long()] = k.view(nb, BLOCK, KV_HEADS, HEAD_DIM)
        pool_v[tables[i, :nb].long()] = v.view(nb, BLOCK, KV_HEADS, HEAD_DIM)
        q = torch.randn(n, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        qs.append(q)
        sdpa.append((q.transpose(0, 1)[None].contiguous(), k[:p + n].transpose(0, 1)[None].contiguous(),
                     v[:p + n].transpose(0, 1)[None].contiguous()))
    cu = torch.tensor([0] + [sum(n for _, n in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    lens = torch.tensor([p + n for p, n in seqs], dtype=torch.int32)
    return torch.cat(qs), pool_k, pool_v, tables, cu, lens, sdpa


def sdpa_prefill(q4, k4, v4):
    """Causal SDPA of the last q_len positions of a context (lower-right aligned, as a prefill after a prefix)."""
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q4.shape[2], k4.shape[2])
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=HEAD_DIM ** -0.5, enable_gqa=True)


def prefill_rows(log: dict) -> list[Row]:
    """The prefill kernel (shipped settings) against SDPA on the same K/V, contiguous, one call per sequence (torch
    picks the backend for a lower-right causal mask itself, whatever ``sdpa_kernel`` says); outputs checked against
    it. No target (issue 3 sets none): the rows show where prefill stands."""
    rows = []
    for name, seqs in PREFILL_CASES.items():
        q, pool_k, pool_v, tables, cu, lens, sdpa = prefill_setup(seqs)
        scale = HEAD_DIM ** -0.5
        out = pa.paged_attention_prefill(q, pool_k, pool_v, tables, cu, lens, scale)
        ref = torch.cat([sdpa_prefill(*s)[0].transpose(0, 1) for s in sdpa])
        err = (out.float() - ref.float()).abs().max().item()
        check(f"prefill {name} vs SDPA max err {err:.1e}", err < 2e-2)
        us = time_calls([lambda: pa.paged_attention_prefill(q, pool_k, pool_v, tables, cu, lens, scale)])
        base = time_calls([lambda: [sdpa_prefill(*s) for s in sdpa]])
        flops = sum(4 * n * (p + (n + 1) / 2) * HEAD_DIM * Q_HEADS for p, n in seqs)  # causal QK^T and PV
        rows.append(Row("paged prefill vs SDPA", f"{name}, {Q_HEADS}/{KV_HEADS} heads", us,
                        "SDPA (torch's pick for a lower-right causal mask), contiguous, per sequence", base, None,
                        f"{flops / (us * 1e-6) / 1e12:.0f} TFLOPS; settings {pa.prefill_config(q)}"))
        log.setdefault("prefill", []).append(dict(case=name, ours_us=us, sdpa_us=base))
        del q, pool_k, pool_v, sdpa
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------------------

FAILURES: list[str] = []


def check(what: str, ok: bool) -> None:
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        FAILURES.append(what)


def run_tests() -> str:
    """The kernel test files, compiled on this GPU; returns pytest's summary line."""
    env = dict(os.environ, KERNEL_TEST_DEVICE="cuda")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rf"]
    try:
        import xdist  # noqa: F401
        cmd += ["-n", "8"]
    except ImportError:
        pass
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_kernels_*.py"))
    try:
        proc = subprocess.run(cmd + files, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        print(str(e.stdout)[-3000:])
        check("kernel tests on the GPU finished within 300 s", False)
        return "timed out"
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    check(f"kernel tests on the GPU: {summary}", proc.returncode == 0)
    return summary


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0


def header() -> str:
    import triton
    if DEV == "cpu":
        return f"### dry run on CPU, torch {torch.__version__}, triton {triton.__version__}"
    props = torch.cuda.get_device_properties(0)
    return (f"### {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC — {props.name} "
            f"({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
            f"triton {triton.__version__}, CUDA {torch.version.cuda}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile configuration too")
    ap.add_argument("--sweep-m", help="comma-separated M values for --sweep (default all)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the kernel test files")
    ap.add_argument("--only", help="comma-separated sections to run: w4a16, decode, engine (default all)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global SWEEP_MS
    unknown = set((args.only or "w4a16").split(",")) - {"w4a16", "decode", "engine"}
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from w4a16, decode, engine")
    if args.sweep_m:
        SWEEP_MS = tuple(int(m) for m in args.sweep_m.split(","))
    if args.dry_run:
        global DEV, W4_SHAPES, DECODE_CASES, DECODE_SWEEP_CASES, Q_HEADS, KV_HEADS, HEAD_DIM, ROTATE_BYTES, MIN_CALLS
        global PREFILL_CASES
        ROTATE_BYTES, MIN_CALLS = 1, 1
        PREFILL_CASES = {"1 x 40 new": [(0, 40)], "2 x 20 new after 30": [(30, 20)] * 2}
        DEV, W4_SHAPES, DECODE_CASES, DECODE_SWEEP_CASES = "cpu", [(256, 64)], [(1, 64), (4, 32)], {(1, 64)}
        Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
        SWEEP_SLICE.update({m: 0.5 for m in SWEEP_SLICE})
        args.skip_tests = True
    elif not torch.cuda.is_available():
        print("no CUDA device: this suite runs on a GPU (the CPU tests are tests/test_kernels_*.py)")
        return 2
    torch.manual_seed(0)
    torch.set_default_device(DEV)
    print(header())
    log: dict = {}
    tests = "skipped" if args.skip_tests else run_tests()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    rows: list[Row] = []
    tuned: dict = {}

    def w4_section():
        if args.sweep:
            tuned.update(sweep_w4a16(log))
        return w4a16_rows(log, tuned)

    sections = [("w4a16", w4_section), ("decode", lambda: decode_rows(log, copy_bw, args.sweep) + prefill_rows(log))]
    ctx = {"copy_bw": copy_bw, "args": args, "log": log}
    from bench import engine_bench
    for fn in engine_bench.SUITE_ROWS:
        engine_rows(lambda c, fn=fn: fn(c, Row))
    sections += [("engine", lambda fn=fn: _without_default_device(fn, ctx)) for fn in ENGINE_ROWS]
    for name, fn in sections:
        if args.only and name not in args.only.split(","):
            continue
        try:
            rows += fn()
        except Exception:  # noqa: BLE001 - one broken section must not lose the others
            traceback.print_exc()
            FAILURES.append(f"section {name} raised")
        print(f"[{name}] done, peak memory {peak_gib():.1f} GiB", flush=True)
        write_out(render(rows, copy_bw, tests), log)  # a run cut short still leaves its rows
    table = render(rows, copy_bw, tests)
    print("\n" + table)
    if not args.dry_run:
        with open(args.results, "a") as f:
            f.write("\n" + table)
    write_out(table, log)
    return 1 if FAILURES else 0


def write_out(table: str, log: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)  # a sub-folder of the device's $OUT, one per call
        Path(out, "results.md").write_text(table)
        Path(out, "sweep.json").write_text(json.dumps(log, default=str))


def render(rows: list[Row], copy_bw: float, tests: str) -> str:
    return "\n".join([
        header(), "",
        f"Copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write). Kernel tests on the GPU: {tests}. "
        f"Checks failed: {len(FAILURES)}{' (' + '; '.join(FAILURES) + ')' if FAILURES else ''}. "
        f"Peak GPU memory {peak_gib():.1f} GiB. "
        "Times: CUDA-graph replays rotating over > 256 MB of inputs; ratio = baseline / ours.", "",
        "| measure | shape | ours (µs) | baseline | baseline (µs) | ratio | target | met | note |",
        "|---|---|---|---|---|---|---|---|---|",
        *[r.markdown() for r in rows], ""])


if __name__ == "__main__":
    sys.exit(main())
