"""A gated MLP's three decode launches in one: gate/up product, SiLU-and-mul and down product (W4A16, M <= 8).

**Status: a candidate, opt-in.** The engine runs it only with ``APPLIANCE_FUSED_MLP=1``
(``engine.models.layers.fused_mlp_splits``). bench/engine_bench.py ``fused_mlp_rows`` checks it on a GPU and times
it against the three launches it replaces, alone and in the engine (issue 3: at batch 1 every W4A16 product costs
about 5-6 µs above its bytes, a fixed cost per launch; bench/RESULTS.md, session of 2026-12-05 from 19:28 UTC). It
ran under the CPU interpreter and compiled offline only so far (tests/test_kernels_fused_mlp.py,
tests/test_compile_targets.py); it becomes the default only once measured.

**Work items.** One launch of ``C1 S1 + C2 S2`` one-warp programs, each taking a ticket (an atomic counter) and
doing the item of that number: gate/up items first (column block c of C1 = I / 32, K split s of S1), then down
items (K split s2 of S2 major, column block d of C2 = H / 64). Each item is one split of the tensor-core GEMV of
``kernels.w4a16_mma`` (same tiles, same partial sums; ``w4a16.Plan`` ``mma`` with block_k 128 and one warp).

- A gate/up item's lane holds gate channels 32 c + 4 gr .. + 3 (the mma GEMV's ``col_lo``) and the same up
  channels, I columns on (``col_hi``), so the last split of a column block to arrive (the split-K counter of
  ``_gemv_mma_kernel``) adds the fp32 partials in split order, rounds gate and up to x's dtype, applies
  SiLU-and-mul as ``activation.silu_and_mul`` does, writes those 32 channels of act [M, I] and adds 1 to
  ready[s2] (release) for the down split whose K rows they are.
- A down item fetches its first weight tile, then spins (acquire) until ready[s2] holds every 32-channel block of
  its K rows for this launch, reads act through L2 (``.cg``), and sums its splits as the mma GEMV does.

Every output is bit-identical to ``w4a16_linear(silu_and_mul(w4a16_linear(x, gate_up, defer_sum=True)), down)``
with the same plans (the interpreted tests check it). On a GPU that also assumes the tensor cores compute every
row of an mma alike: gate block c sits in the low A rows here, and in the GEMV in the high ones when c is odd
(``fused_mlp_rows`` checks it there). Bias-free MLPs only (Llama, Mistral, Qwen).

**Invariants.** Tickets come in launch order: launch n of one :class:`MLPCounters` takes tickets n T .. n T + T - 1
(T items per launch), so ``ticket // T`` is the launch's number and the counters are never reset; ready[s2] only
grows, by K rows / 32 per launch. That needs every program to take its ticket before its PDL trigger (the trigger
is the last thing it does): no later kernel on the stream, so no later launch on these counters, can start before
all of this launch's tickets are taken. A down item waits only on items of lower tickets, which programs already
running hold, and those wait at most for the kernel before, whose programs all run or are done: no deadlock
whatever the hardware's block order. The
split-K counters return to 0 as in ``_gemv_mma_kernel``. With PDL only gate/up items wait for the kernel before
(x is its output); a down item writes nothing before act it read is ready, which is after some gate/up item's
wait, so no write of this launch lands before the kernel before has finished (the allocator reuses memory in
stream order).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import activation
from ._triton import HAS_TRITON, cdiv, device_fn, dot_f32, early_trigger, jit, pdl, pdl_trigger, pdl_wait, tl
from .quant_formats import QuantizedWeight, reference_linear

if HAS_TRITON:
    from .w4a16_mma import _fetch_w, _fetch_x, _read_parts, _rows, _store, _tile_k

BLOCK_K = 128  # the K tile of both products (their plans' block_k)
MAX_ROWS = 8  # one set of 8 rows of x in the mma (``SETS`` 1)


@device_fn
def _split_product(x_ptr, qw_ptr, s_ptr, z_ptr, N, K, k_lo, k_hi, col_lo, col_hi, gr, tg, M, w_cur, magic,
                   GROUP: tl.constexpr, BLOCK_K: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr,
                   L2: tl.constexpr):
    """The fp32 sums of rows k_lo .. k_hi of x [M, K] (int32 words) times the weight's columns col_lo / col_hi
    (:func:`w4a16_mma._tile_k` order), the first tile's weights ``w_cur`` already fetched; each next tile's
    weights and x are loaded while this one is multiplied (the mma GEMV's loop); x through L2 when ``L2``."""
    STEPS: tl.constexpr = BLOCK_K // 32
    z = tl.zeros([32], tl.float32)
    zero4 = (z, z, z, z)
    acc = ((zero4, zero4, zero4, zero4),)
    xm = tl.minimum(gr, M - 1)  # rows past M repeat the last; their outputs are never stored
    x_cur = (_fetch_x(x_ptr, K, K // 2, tg, xm, k_lo, STEPS, True, L2),)
    k_last = tl.maximum(k_lo, k_hi - BLOCK_K)  # the prefetch past the last tile reads it again
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last)
        w_nxt = _fetch_w(qw_ptr, s_ptr, z_ptr, N, K, col_lo, col_hi, tg, k_next, GROUP, STEPS, True)
        x_nxt = (_fetch_x(x_ptr, K, K // 2, tg, xm, k_next, STEPS, True, L2),)
        acc = _tile_k(w_cur, x_cur, acc, magic, col_lo, col_hi, STEPS, IS_BF16, ASM, 1)
        w_cur = w_nxt
        x_cur = x_nxt
    return acc


@jit
def _gated_mlp_kernel(x_ptr, gu_qw, gu_s, gu_z, dn_qw, dn_s, dn_z, act_ptr, actw_ptr, out_ptr, part1_ptr, part2_ptr,
                      ctl_ptr, lock_ptr, M, H, I, kps1, splits1, kps2, splits2, magic, GROUP1: tl.constexpr,
                      GROUP2: tl.constexpr, BLOCK_K: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr, TRIG: tl.constexpr, AHEAD: tl.constexpr):
    """Grid (C1 S1 + C2 S2,), one warp: see the module doc. x: int32 words [M, H / 2]; gate/up [H -> 2I] and down
    [I -> H] in the internal layout; act [M, I] (``actw``: its int32 words); part1 [S1, M, 2I] and part2 [S2, M, H]
    fp32; ctl int64 [1 + S2] (tickets, ready), lock int32 [C1 + C2] (split-K counters, 0 between launches)."""
    STEPS: tl.constexpr = BLOCK_K // 32
    t = tl.arange(0, 32)
    gr = t // 4
    tg = t % 4
    C1 = I // 32
    C2 = H // 64
    items1 = C1 * splits1
    total = items1 + C2 * splits2
    ready_ptr = ctl_ptr + 1
    got = tl.atomic_add(ctl_ptr, 1, sem="relaxed", scope="gpu")
    launch = got // total
    ticket = (got % total).to(tl.int32)
    if ticket < items1:
        c = ticket // splits1
        s = ticket % splits1
        col_lo = c * 32 + 4 * gr  # gate channels; the same up channels I columns on
        col_hi = col_lo + I
        k_lo = s * kps1
        k_hi = tl.minimum(H, k_lo + kps1)
        w_cur = _fetch_w(gu_qw, gu_s, gu_z, 2 * I, H, col_lo, col_hi, tg, k_lo, GROUP1, STEPS, True)
        pdl_wait(PDL)  # x comes from the kernel before
        acc = _split_product(x_ptr, gu_qw, gu_s, gu_z, 2 * I, H, k_lo, k_hi, col_lo, col_hi, gr, tg, M, w_cur,
                             magic, GROUP1, BLOCK_K, IS_BF16, ASM, False)
        _store(part1_ptr + s * M * 2 * I, _rows(acc[0]), 0, col_lo, col_hi, tg, M, 2 * I, False, part1_ptr)
        tl.debug_barrier()  # every lane's partials are written before the counter moves
        arrived = tl.atomic_add(lock_ptr + c, 1, sem="acq_rel", scope="gpu")
        if arrived == splits1 - 1:
            r = _read_parts(part1_ptr, 0, col_lo, col_hi, tg, M, 2 * I, splits1, AHEAD)
            dt = act_ptr.dtype.element_ty
            cols = col_lo[:, None] + tl.arange(0, 4)[None, :]
            for h in tl.static_range(2):  # C registers h (rows 2 tg + h): gate; h + 2: up
                g = r[h].to(dt).to(tl.float32)
                u = r[h + 2].to(dt).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
                m = (2 * tg + h)[:, None]
                tl.store(act_ptr + m * I + cols, (a * u).to(dt), mask=m < M)
            tl.atomic_xchg(lock_ptr + c, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # every lane's act values are written before ready moves
            tl.atomic_add(ready_ptr + (c * 32) // kps2, 1, sem="release", scope="gpu")
    else:
        j = ticket - items1
        s2 = j // C2
        d = j % C2
        col_lo = d * 64 + 4 * gr
        col_hi = col_lo + 32
        k_lo = s2 * kps2
        k_hi = tl.minimum(I, k_lo + kps2)
        w_cur = _fetch_w(dn_qw, dn_s, dn_z, H, I, col_lo, col_hi, tg, k_lo, GROUP2, STEPS, True)
        need = ((k_hi - k_lo) // 32) * (launch + 1)
        seen = tl.atomic_add(ready_ptr + s2, 0, sem="acquire", scope="gpu")
        while seen < need:
            seen = tl.atomic_add(ready_ptr + s2, 0, sem="acquire", scope="gpu")
        acc = _split_product(actw_ptr, dn_qw, dn_s, dn_z, H, I, k_lo, k_hi, col_lo, col_hi, gr, tg, M, w_cur,
                             magic, GROUP2, BLOCK_K, IS_BF16, ASM, True)
        _store(part2_ptr + s2 * M * H, _rows(acc[0]), 0, col_lo, col_hi, tg, M, H, False, part2_ptr)
        tl.debug_barrier()
        lock2 = lock_ptr + C1 + d
        arrived = tl.atomic_add(lock2, 1, sem="acq_rel", scope="gpu")
        if arrived == splits2 - 1:
            r = _read_parts(part2_ptr, 0, col_lo, col_hi, tg, M, H, splits2, AHEAD)
            _store(out_ptr, r, 0, col_lo, col_hi, tg, M, H, False, out_ptr)
            tl.atomic_xchg(lock2, 0, sem="relaxed", scope="gpu")
    pdl_trigger(TRIG)


@dataclass
class MLPCounters:
    """One gated MLP's counters (module doc), per shape and plan (H, I, k_per_split of gate/up, of down): ctl
    int64 [1 + S2] and split-K counters int32 [I / 32 + H / 64], zeroed at creation, never reset after. Create
    (and first launch) them outside a CUDA graph capture: a capture would take them from the graph's pool and only
    record the zeroing."""

    device: torch.device
    by_plan: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def get(self, h: int, i: int, kps1: int, kps2: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.by_plan.get((h, i, kps1, kps2))
        if found is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("gated_mlp: first launch of this plan inside a CUDA graph capture; run it once "
                                   "before capturing (its counters must not live in the graph's memory pool)")
            found = (torch.zeros(1 + cdiv(i, kps2), dtype=torch.int64, device=self.device),
                     torch.zeros(i // 32 + h // 64, dtype=torch.int32, device=self.device))
            self.by_plan[(h, i, kps1, kps2)] = found
        return found


def plans_fit(plans) -> bool:
    """Whether the two products' ``w4a16.Plan`` s (gate/up, down) are what the kernel repeats bit for bit: the
    one-warp, 64-column mma GEMV with BLOCK_K-row tiles that adds its split-K sums in its own launch."""
    return all(p.path == "mma" and p.block_k == BLOCK_K and p.block_n == 64 and p.num_warps == 1 and p.k_warps <= 1
               and p.serial for p in plans)


def check_fusable(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, kps1: int, kps2: int) -> None:
    """Raises ValueError naming what :func:`gated_mlp` cannot take: x [M, H] fp16/bf16 with 1 <= M <= 8, 4-bit
    weights without act-order, gate_up [H -> 2I] and down [I -> H] with H and I multiples of 128, group sizes
    multiples of 128 (or per-channel), k_per_split values positive multiples of 128."""
    if x.dim() != 2:
        raise ValueError(f"gated_mlp takes x [M, H], got {x.dim()} dimensions")
    m, h = x.shape
    i = down.in_features
    problems = [what for what, bad in (
        (f"1 to {MAX_ROWS} rows (got {m})", m > MAX_ROWS or m < 1),
        (f"fp16/bf16 x (got {x.dtype})", x.dtype not in (torch.float16, torch.bfloat16)),
        ("4-bit weights", gate_up.bits != 4 or down.bits != 4),
        ("no act-order permutation", gate_up.perm is not None or down.perm is not None),
        (f"gate_up [{h} -> 2 x {i}] and down [{i} -> {h}] (got [{gate_up.in_features} -> {gate_up.out_features}], "
         f"[{down.in_features} -> {down.out_features}])",
         gate_up.in_features != h or gate_up.out_features != 2 * i or down.out_features != h),
        (f"hidden and intermediate sizes multiples of {BLOCK_K} (got {h}, {i})", h % BLOCK_K or i % BLOCK_K),
        (f"group sizes multiples of {BLOCK_K} (got {gate_up.group_size}, {down.group_size})",
         any(w.group_size % BLOCK_K and w.group_size < w.in_features for w in (gate_up, down))),
        (f"k_per_split positive multiples of {BLOCK_K} (got {kps1}, {kps2})",
         kps1 % BLOCK_K or kps2 % BLOCK_K or min(kps1, kps2) < BLOCK_K),
    ) if bad]
    if problems:
        raise ValueError(f"gated_mlp takes {', '.join(problems)}")


def gated_mlp(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, counters: MLPCounters,
              kps1: int, kps2: int) -> torch.Tensor:
    """y [M, H] = down(silu(gate) * up) for x [M, H] (fp16/bf16, 1 <= M <= 8): gate_up the stacked cat(gate, up)
    weight [H -> 2I], down [I -> H] (no biases: the kernel adds none), their K split every ``kps1`` / ``kps2``
    rows (the mma plans' k_per_split). One launch; no host sync (graph-safe once the counters exist,
    :class:`MLPCounters`). Raises ValueError as :func:`check_fusable`."""
    check_fusable(x, gate_up, down, kps1, kps2)
    m, h = x.shape
    i = down.in_features
    x = x.contiguous()
    s1, s2 = cdiv(h, kps1), cdiv(i, kps2)
    ctl, locks = counters.get(h, i, kps1, kps2)
    act = torch.empty(m, i, dtype=x.dtype, device=x.device)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    part1 = torch.empty(s1, m, 2 * i, dtype=torch.float32, device=x.device)
    part2 = torch.empty(s2, m, h, dtype=torch.float32, device=x.device)
    total = (i // 32) * s1 + (h // 64) * s2
    _gated_mlp_kernel[(total,)](
        x.view(torch.int32), gate_up.qweight, gate_up.scales, gate_up.qzeros, down.qweight, down.scales,
        down.qzeros, act, act.view(torch.int32), out, part1, part2, ctl, locks, m, h, i, kps1, s1, kps2, s2,
        0x43004300 if x.dtype == torch.bfloat16 else 0x64006400, GROUP1=gate_up.group_size, GROUP2=down.group_size,
        BLOCK_K=BLOCK_K, IS_BF16=x.dtype == torch.bfloat16, ASM=not dot_f32(x), PDL=pdl(x), TRIG=early_trigger(x),
        AHEAD=8, num_warps=1, num_stages=1)
    return out


def gated_mlp_ref(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, counters=None, kps1: int = 0,
                  kps2: int = 0) -> torch.Tensor:
    """Torch reference of :func:`gated_mlp` (same signature; the counters and splits are unused): dequantize, then
    ``F.linear``, SiLU-and-mul, ``F.linear``, in x's dtype."""
    return reference_linear(activation.silu_and_mul_ref(reference_linear(x, gate_up)), down)
