"""W4A16 GEMV on the tensor cores for M <= 16: ``mma.sync.m16n8k16`` fed straight from the packed words.

At M = 1 the CUDA-core GEMV (:func:`kernels.w4a16._gemv_kernel`) spends about 4.2 instructions per weight (a
``prmt`` and an FMA per code, plus x, its sums and layout moves) and is issue-bound at about half the memory
bandwidth (Nsight Compute on an H200, bench/RESULTS.md). Here one ``lop3`` puts two codes under a magic exponent
(OFF + c exact in x's dtype: 128 + c in bf16, 1024 + c in fp16; Kim et al., "Who says elephants can't run", 2022)
and one ``mma.sync`` multiplies 256 weights by x; (OFF + z) times the sum of x (one more mma, A all ones) comes off
per K tile, then the scale. About 1.9 SASS instructions per weight in the loop.

No new weight layout. ``qweight`` stays int32 [K/8, N] (word w of column n holds the codes of rows 8w .. 8w + 7,
code j in bits 4j .. 4j + 3). The trick is the k order inside one mma: the product sums over k, so any
permutation of k applied to both operands gives the same result. PTX ISA, "Matrix fragments for mma.m16n8k16":
lane l = 4 gr + tg holds A rows gr and gr + 8 at k slots {2tg, 2tg + 1} (registers a0 / a1) and {2tg + 8, 2tg + 9}
(a2 / a3), B column gr at the same k slots (b0, b1), and C rows gr / gr + 8, columns 2tg, 2tg + 1 (c0 .. c3).
A lop3 of the word shifted by 4j holds codes j and j + 4 in its 16-bit halves, so for the word of rows 8w .. 8w + 7
(w = 4 s + tg in step s) slots 2tg, 2tg + 1 are rows 8w + j, 8w + j + 4 (j = 0, then 2) and slots 2tg + 8, 2tg + 9
are rows 8w + j + 1, 8w + j + 5. B takes x of the same rows, paired the same way.

One warp owns 64 output columns. Per step (32 rows of K) lane (gr, tg) loads 16 bytes at word row 4 s + tg,
columns 4 gr .. 4 gr + 3 (A rows gr of tiles 0 .. 3), and 16 bytes at columns 32 + 4 gr .. + 3 (rows gr + 8): a
warp reads four rows of 256 contiguous bytes. Tile i's A row gr is column 4 gr + i and row gr + 8 is column
32 + 4 gr + i. C column gr is x's row gr (batch row), so up to 8 rows of x ride along for free; a second set of
8 rows costs a second mma per A fragment (``SETS`` = 2). The next K tile's words (and x's) are loaded while this one is
multiplied (a register prefetch; Triton's cp.async pipelining measured 1.3-2.2x slower on an H200).

Every tensor here is [T] (T = 32 x warps, element t on thread t; loads of four words are [T, 4] with the four in
one thread) and the mma is inline PTX, so the layout matters: ``ASM`` is only for compiled kernels. Interpreted
(CPU tests), :func:`_mma` computes the same product from the same per-lane registers with reshapes and sums.
"""
from __future__ import annotations

from ._triton import device_fn, jit, pdl_trigger, pdl_wait, tl


@device_fn
def _split4(v):
    """The four columns of v [T, 4] as four [T] tensors."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@device_fn
def _half(r, h: tl.constexpr, IS_BF16: tl.constexpr):
    """Half h (0: low) of the packed int32 pairs r [T] as fp32."""
    if IS_BF16:
        if h == 0:
            return (r << 16).to(tl.float32, bitcast=True)
        return (r & -65536).to(tl.float32, bitcast=True)
    return ((r >> (16 * h)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@device_fn
def _codes(q, j: tl.constexpr, magic, ASM: tl.constexpr):
    """Codes j and j + 4 of the words q [T] as A registers, OFF + c in x's 16-bit dtype (code j in the low half):
    one ``lop3`` putting the codes under the magic exponent (``magic``: 0x43004300, 128 + c in bf16; 0x64006400,
    1024 + c in fp16; a kernel argument, so in a register: a literal would take the immediate slot the mask needs
    and the and / or would come as two instructions). Interpreted: the same bits from plain integer arithmetic."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;", "=r,r,r", [q >> (4 * j), magic],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return ((q >> (4 * j)) & 0x000F000F) | magic


@device_fn
def _slots(r0, r1, WARPS: tl.constexpr, IS_BF16: tl.constexpr):
    """The four k slots of one lane (r0: 2tg, 2tg + 1; r1: 2tg + 8, 2tg + 9) as fp32 [WARPS, 8, 4, 4] (warp, group
    gr, thread-in-group tg, slot), the slots in the order 2tg, 2tg + 8, 2tg + 1, 2tg + 9 (``tl.join`` adds the last
    dim); A and B share it, and the product sums over it."""
    v = tl.join(tl.join(_half(r0, 0, IS_BF16), _half(r0, 1, IS_BF16)),
                tl.join(_half(r1, 0, IS_BF16), _half(r1, 1, IS_BF16)))
    return tl.reshape(v, [WARPS, 8, 4, 4])


@device_fn
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, WARPS: tl.constexpr, IS_BF16: tl.constexpr,
         ASM: tl.constexpr):
    """D = A B + C for each warp, A 16x16 and B 16x8 in x's 16-bit dtype, C and D fp32, in the PTX fragment
    layout (module doc): every argument is [T], one register per lane. Returns (d0, d1, d2, d3)."""
    if ASM:
        if IS_BF16:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    T: tl.constexpr = WARPS * 32
    b = _slots(b0, b1, WARPS, IS_BF16)[:, None, :, :, :]  # [W, 1, 8 (column gr), 4, 4]
    top = tl.sum(tl.sum(_slots(a0, a2, WARPS, IS_BF16)[:, :, None, :, :] * b, axis=4), axis=3)  # [W, 8 (row), 8 (col)]
    bot = tl.sum(tl.sum(_slots(a1, a3, WARPS, IS_BF16)[:, :, None, :, :] * b, axis=4), axis=3)
    e0, e1 = tl.split(tl.reshape(top, [WARPS, 8, 4, 2]))  # lane (gr, tg) takes columns 2tg, 2tg + 1 of row gr
    e2, e3 = tl.split(tl.reshape(bot, [WARPS, 8, 4, 2]))
    return (c0 + tl.reshape(e0, [T]), c1 + tl.reshape(e1, [T]), c2 + tl.reshape(e2, [T]),
            c3 + tl.reshape(e3, [T]))


@device_fn
def _fetch_w(qw_ptr, s_ptr, z_ptr, N, K, col_lo, col_hi, tg, k0, GROUP: tl.constexpr, STEPS: tl.constexpr,
             EVEN: tl.constexpr):
    """The weight loads of the K tile from row k0 (a scalar, or [T]: each warp's own tile), all issued before any
    is used: per step s the lane's words [T, 4] at word row w = k0 / 8 + 4 s + tg, columns col_lo .. + 3 and
    col_hi .. + 3; then the tile's scales [T, 4] (their dtype) and zero words [T] for both column sets. EVEN: every
    load is inside the tensors (no masks); else rows past K and columns past N read 0."""
    ar = tl.arange(0, 4)[None, :]
    steps = ()
    for s in tl.static_range(STEPS):
        w = k0 // 8 + 4 * s + tg
        q_lo = qw_ptr + w[:, None] * N + col_lo[:, None] + ar
        q_hi = qw_ptr + w[:, None] * N + col_hi[:, None] + ar
        if EVEN:
            steps = steps + ((tl.load(q_lo), tl.load(q_hi)),)
        else:
            ok = (w < K // 8)[:, None]
            steps = steps + ((tl.load(q_lo, mask=ok & (col_lo[:, None] + ar < N), other=0),
                              tl.load(q_hi, mask=ok & (col_hi[:, None] + ar < N), other=0)),)
    grp = k0 // GROUP
    k_ok = (k0 + col_lo * 0) < K
    if EVEN:
        s_lo = tl.load(s_ptr + (grp * N + col_lo)[:, None] + ar)
        s_hi = tl.load(s_ptr + (grp * N + col_hi)[:, None] + ar)
        z_lo = tl.load(z_ptr + grp * (N // 8) + col_lo // 8)
        z_hi = tl.load(z_ptr + grp * (N // 8) + col_hi // 8)
    else:
        s_lo = tl.load(s_ptr + (grp * N + col_lo)[:, None] + ar, mask=(col_lo[:, None] + ar < N) & k_ok[:, None],
                       other=0)
        s_hi = tl.load(s_ptr + (grp * N + col_hi)[:, None] + ar, mask=(col_hi[:, None] + ar < N) & k_ok[:, None],
                       other=0)
        z_lo = tl.load(z_ptr + grp * (N // 8) + col_lo // 8, mask=(col_lo < N) & k_ok, other=0)
        z_hi = tl.load(z_ptr + grp * (N // 8) + col_hi // 8, mask=(col_hi < N) & k_ok, other=0)
    return steps, (s_lo, s_hi, z_lo, z_hi)


@device_fn
def _fetch_x(x_ptr, K, x_row, tg, xm, k0, STEPS: tl.constexpr, EVEN: tl.constexpr):
    """x's loads for the K tile from row k0: per step, row ``xm`` [T] at rows 8 w .. 8 w + 7 as int32 words
    [T, 4] (pairs (0, 1), (2, 3), (4, 5), (6, 7))."""
    ar = tl.arange(0, 4)[None, :]
    steps = ()
    for s in tl.static_range(STEPS):
        w = k0 // 8 + 4 * s + tg
        xp = x_ptr + xm[:, None] * x_row + (4 * w)[:, None] + ar
        if EVEN:
            steps = steps + (tl.load(xp),)
        else:
            steps = steps + (tl.load(xp, mask=(w < K // 8)[:, None], other=0),)
    return steps


@device_fn
def _fetch_xs(x_ptr, K, x_row, gr, tg, M, k0, SETS: tl.constexpr, STEPS: tl.constexpr, EVEN: tl.constexpr):
    """:func:`_fetch_x` for each set b of 8 rows of x: B column gr is x's row 8 b + gr (rows past M repeat the
    last row; their C values are never stored)."""
    out = ()
    for b in tl.static_range(SETS):
        out = out + (_fetch_x(x_ptr, K, x_row, tg, tl.minimum(gr + 8 * b, M - 1), k0, STEPS, EVEN),)
    return out


@device_fn
def _x_pairs(xv):
    """B registers from x's words [T, 4] (rows 8w .. 8w + 7 as pairs (0, 1), (2, 3), (4, 5), (6, 7)): the pairs
    (j, j + 4) for j = 0 .. 3."""
    p01, p23, p45, p67 = _split4(xv)
    return ((p01 & 0xFFFF) | (p45 << 16), ((p01 >> 16) & 0xFFFF) | (p45 & -65536),
            (p23 & 0xFFFF) | (p67 << 16), ((p23 >> 16) & 0xFFFF) | (p67 & -65536))


@device_fn
def _zeros(word, col):
    """Zeros [T, 4] int32 of columns col .. col + 3 (col a multiple of 4) from their qzeros word [T]."""
    return (word[:, None] >> (((col[:, None] + tl.arange(0, 4)[None, :]) % 8) * 4)) & 15


@device_fn
def _tile(q, magic, xbs, accs, j: tl.constexpr, WARPS: tl.constexpr, IS_BF16: tl.constexpr, ASM: tl.constexpr):
    """The mmas of one column tile (A rows: one column of the lane's words q = (low half, high half)) over the k
    slots of code pairs (j, j + 4) and (j + 1, j + 5): A built once, one mma per set of 8 rows of x (``xbs``: B
    registers per set; ``accs``: (c0, c1, c2, c3) per set). Returns the new ``accs``."""
    q_lo, q_hi = q
    a0 = _codes(q_lo, j, magic, ASM)
    a1 = _codes(q_hi, j, magic, ASM)
    a2 = _codes(q_lo, j + 1, magic, ASM)
    a3 = _codes(q_hi, j + 1, magic, ASM)
    out = ()
    for b in tl.static_range(len(xbs)):
        c0, c1, c2, c3 = accs[b]
        xb = xbs[b]
        out = out + (_mma(a0, a1, a2, a3, xb[j], xb[j + 1], c0, c1, c2, c3, WARPS, IS_BF16, ASM),)
    return out


@device_fn
def _vec4(a, b, c, d):
    """[T, 4] from four [T] tensors (each thread's four values stay in its registers)."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), [a.shape[0], 4])  # join adds the last dim


@device_fn
def _rows(acc):
    """The lane's 16 outputs as four [T, 4] vectors, one per C register h: tile i's value in column i (tiles
    0 .. 3 are four adjacent output columns)."""
    return (_vec4(acc[0][0], acc[1][0], acc[2][0], acc[3][0]), _vec4(acc[0][1], acc[1][1], acc[2][1], acc[3][1]),
            _vec4(acc[0][2], acc[1][2], acc[2][2], acc[3][2]), _vec4(acc[0][3], acc[1][3], acc[2][3], acc[3][3]))


@device_fn
def _k_start(k_lo, t, CW: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first K row of each thread's tiles: k_lo (a scalar) with KW = 1, else [T]: warp group kw = t // (32 CW)
    reads tiles kw, kw + KW, ... of the split."""
    if KW == 1:
        k = k_lo
    else:
        k = k_lo + (t // (32 * CW)) * BLOCK_K
    return k


@device_fn
def _sum_kw(v, KW: tl.constexpr):
    """v [T, 4] (T = 32 KW CW: warp group kw = t // (32 CW) outermost) summed over the KW groups: [32 CW, 4]."""
    return tl.sum(tl.reshape(v, [KW, v.shape[0] // KW, 4]), axis=0)


@device_fn
def _store(ptr, rows, row0: tl.constexpr, col_lo, col_hi, tg, M, N, HAS_BIAS: tl.constexpr, bias_ptr):
    """The lane's outputs for x rows row0 .. row0 + 7 (:func:`_rows`: C register h holds y row row0 + 2tg + h % 2
    at columns col_lo .. + 3 for h < 2, col_hi .. + 3 for h >= 2) to ``ptr`` [M, N], + bias [N] when HAS_BIAS, in
    ptr's dtype: one vector store of four columns per C register."""
    ar = tl.arange(0, 4)[None, :]
    for h in tl.static_range(4):
        col = (col_lo if h < 2 else col_hi)[:, None] + ar
        m = (row0 + 2 * tg + h % 2)[:, None]
        v = rows[h]
        if HAS_BIAS:
            v += tl.load(bias_ptr + col, mask=col < N, other=0.0).to(tl.float32)
        tl.store(ptr + m * N + col, v.to(ptr.dtype.element_ty), mask=(m < M) & (col < N))


@device_fn
def _read_parts(part_ptr, row0: tl.constexpr, col_lo, col_hi, tg, M, N, splits, AHEAD: tl.constexpr):
    """The sums over splits of the lane's partial outputs for rows row0 .. in ``part`` [splits, M, N] fp32
    (:func:`_rows` order), added in split order; the loads of AHEAD splits are issued together (one at a time,
    each would wait a full L2 round trip)."""
    ar = tl.arange(0, 4)[None, :]
    lo, hi = col_lo[:, None] + ar, col_hi[:, None] + ar
    m0, m1 = (row0 + 2 * tg)[:, None], (row0 + 2 * tg + 1)[:, None]
    z = tl.zeros([col_lo.shape[0], 4], tl.float32)
    r0, r1, r2, r3 = z, z, z, z
    for s0 in range(0, splits, AHEAD):
        got = ()
        for u in tl.static_range(AHEAD):
            base = part_ptr + (s0 + u) * M * N
            ok = (s0 + u + tg * 0 < splits)[:, None]
            got = got + ((tl.load(base + m0 * N + lo, mask=(m0 < M) & (lo < N) & ok, other=0.0, cache_modifier=".cg"),
                          tl.load(base + m1 * N + lo, mask=(m1 < M) & (lo < N) & ok, other=0.0, cache_modifier=".cg"),
                          tl.load(base + m0 * N + hi, mask=(m0 < M) & (hi < N) & ok, other=0.0, cache_modifier=".cg"),
                          tl.load(base + m1 * N + hi, mask=(m1 < M) & (hi < N) & ok, other=0.0, cache_modifier=".cg")),)
        for u in tl.static_range(AHEAD):
            r0 += got[u][0]
            r1 += got[u][1]
            r2 += got[u][2]
            r3 += got[u][3]
    return r0, r1, r2, r3


@device_fn
def _tile_k(w_cur, x_cur, acc, magic, col_lo, col_hi, STEPS: tl.constexpr, IS_BF16: tl.constexpr,
            ASM: tl.constexpr, WARPS: tl.constexpr):
    """acc + one fetched K tile (:func:`_fetch_w`, and :func:`_fetch_x` per set of 8 rows of x): per step and
    column tile two mmas per set into fp32 tile sums of x (OFF + c), then (OFF + z) times the tile's x sum taken
    off (sum x (c - z); the cancellation costs about log2(OFF / 8) of fp32's 24 bits), and the sums times the
    scales added to acc (acc[set][tile] = (c0, c1, c2, c3))."""
    SETS: tl.constexpr = len(x_cur)
    T: tl.constexpr = WARPS * 32
    OFF: tl.constexpr = 128 if IS_BF16 else 1024  # A holds OFF + c
    w_steps, group = w_cur
    s_lo, s_hi, zw_lo, zw_hi = group
    zl, zh = _split4(_zeros(zw_lo, col_lo)), _split4(_zeros(zw_hi, col_hi))
    sl, sh = _split4(s_lo.to(tl.float32)), _split4(s_hi.to(tl.float32))
    m = magic + col_lo * 0
    z = tl.zeros([T], tl.float32)
    zero4 = (z, z, z, z)
    part = ()  # [tile][set] = (c0, c1, c2, c3)
    for i in tl.static_range(4):
        sets = ()
        for b in tl.static_range(SETS):
            sets = sets + (zero4,)
        part = part + (sets,)
    xs = ()  # the sum of x over the tile per set and C column: an mma with A all ones (1.0 in x's dtype)
    for b in tl.static_range(SETS):
        xs = xs + (zero4,)
    one = col_lo * 0 + (0x3F803F80 if IS_BF16 else 0x3C003C00)
    for s in tl.static_range(STEPS):
        q_lo, q_hi = w_steps[s]
        ql, qh = _split4(q_lo), _split4(q_hi)
        xbs = ()
        for b in tl.static_range(SETS):
            xbs = xbs + (_x_pairs(x_cur[b][s]),)
        new = ()
        for b in tl.static_range(SETS):
            xb = xbs[b]
            c = xs[b]
            c = _mma(one, one, one, one, xb[0], xb[1], c[0], c[1], c[2], c[3], WARPS, IS_BF16, ASM)
            c = _mma(one, one, one, one, xb[2], xb[3], c[0], c[1], c[2], c[3], WARPS, IS_BF16, ASM)
            new = new + (c,)
        xs = new
        new = ()
        for i in tl.static_range(4):
            a = _tile((ql[i], qh[i]), m, xbs, part[i], 0, WARPS, IS_BF16, ASM)
            a = _tile((ql[i], qh[i]), m, xbs, a, 2, WARPS, IS_BF16, ASM)
            new = new + (a,)
        part = new
    out = ()
    for b in tl.static_range(SETS):
        tiles = ()
        for i in tl.static_range(4):
            p = part[i][b]  # A held OFF + c: take (OFF + z) sum(x) off
            x0, x1 = xs[b][0], xs[b][1]
            p = (p[0] - (zl[i] + OFF).to(tl.float32) * x0, p[1] - (zl[i] + OFF).to(tl.float32) * x1,
                 p[2] - (zh[i] + OFF).to(tl.float32) * x0, p[3] - (zh[i] + OFF).to(tl.float32) * x1)
            q = acc[b][i]
            tiles = tiles + ((q[0] + p[0] * sl[i], q[1] + p[1] * sl[i], q[2] + p[2] * sh[i], q[3] + p[3] * sh[i]),)
        out = out + (tiles,)
    return out


@jit
def _gemv_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, x_row,
                     k_per_split, splits, magic, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr, SERIAL: tl.constexpr, IS_BF16: tl.constexpr,
                     ASM: tl.constexpr, WARPS: tl.constexpr, SETS: tl.constexpr, EVEN: tl.constexpr,
                     PDL: tl.constexpr, TRIG: tl.constexpr, AHEAD: tl.constexpr, KW: tl.constexpr = 1):
    """Grid (cdiv(N, 64 CW), splits), ``WARPS`` = CW KW warps per program (num_warps must equal it): warp v of
    program p computes y[:M, 64 (CW p + v % CW) ..][:64] (M <= 8 SETS; SETS 1 or 2) over the K tiles v // CW,
    v // CW + KW, ... of rows k_per_split p1 .. (a multiple of BLOCK_K KW, the caller checks); the KW warps of a
    column block add their sums through shared memory before the store. x: int32 words [M, x_row] (two 16-bit
    values each). With two sets of 8 rows of x each A fragment meets two B fragments (two mmas for one
    dequantization). EVEN: K is a multiple of BLOCK_K KW and N of 64 CW (no masks). BLOCK_K (a multiple of 32
    rows: one step each) divides GROUP, or GROUP >= K: one scale per column per K tile, applied to the tile's fp32
    mma sums. SPLIT / SERIAL: as
    :func:`kernels.w4a16._gemv_kernel` (fp32 partials in part [splits, M, N]; the last program of a column block to
    arrive adds them in split order, the loads of AHEAD splits in flight at a time)."""
    T: tl.constexpr = WARPS * 32
    CW: tl.constexpr = WARPS // KW  # warps side by side over the columns; KW of each share them, splitting K
    STEPS: tl.constexpr = BLOCK_K // 32
    t = tl.arange(0, T)
    gr = (t % 32) // 4
    tg = t % 4
    col_lo = (tl.program_id(0) * CW + (t // 32) % CW) * 64 + 4 * gr
    col_hi = col_lo + 32
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    k_me = _k_start(k_lo, t, CW, KW, BLOCK_K)
    w_cur = _fetch_w(qw_ptr, s_ptr, z_ptr, N, K, col_lo, col_hi, tg, k_me, GROUP, STEPS, EVEN)
    pdl_wait(PDL)  # the first weight tile is on its way while the previous kernel finishes; x comes after
    z = tl.zeros([T], tl.float32)
    zero4 = (z, z, z, z)
    acc = ()
    for b in tl.static_range(SETS):
        acc = acc + ((zero4, zero4, zero4, zero4),)
    # x one tile ahead too, also with two sets (up to 4 registers spilled at BLOCK_K 128 and one warp, yet
    # 4096 -> 22016 M = 16 runs in 26.3 us against 28.4 with x loaded at its tile; bench/RESULTS.md, eighth session)
    x_cur = _fetch_xs(x_ptr, K, x_row, gr, tg, M, k_me, SETS, STEPS, EVEN)
    k_last = tl.maximum(k_lo, k_hi - BLOCK_K * KW)  # EVEN: the last tiles; the prefetch past them reads them again
    for k0 in range(k_lo, k_hi, BLOCK_K * KW):
        k_next = k0 + BLOCK_K * KW
        if EVEN:
            k_next = tl.minimum(k_next, k_last)
        k_next = k_next - k_lo + k_me
        w_nxt = _fetch_w(qw_ptr, s_ptr, z_ptr, N, K, col_lo, col_hi, tg, k_next, GROUP, STEPS, EVEN)
        x_nxt = _fetch_xs(x_ptr, K, x_row, gr, tg, M, k_next, SETS, STEPS, EVEN)
        acc = _tile_k(w_cur, x_cur, acc, magic, col_lo, col_hi, STEPS, IS_BF16, ASM, WARPS)
        w_cur = w_nxt
        x_cur = x_nxt
    pdl_trigger(TRIG)
    if KW > 1:  # add the KW warp groups' sums (through shared memory); lane indices of the reduced tensors
        t = tl.arange(0, CW * 32)
        gr = (t % 32) // 4
        tg = t % 4
        col_lo = (tl.program_id(0) * CW + t // 32) * 64 + 4 * gr
        col_hi = col_lo + 32
    for b in tl.static_range(SETS):
        rows = _rows(acc[b])
        if KW > 1:
            rows = (_sum_kw(rows[0], KW), _sum_kw(rows[1], KW), _sum_kw(rows[2], KW), _sum_kw(rows[3], KW))
        if SPLIT:
            _store(part_ptr + tl.program_id(1) * M * N, rows, 8 * b, col_lo, col_hi, tg, M, N, False, bias_ptr)
        else:
            _store(out_ptr, rows, 8 * b, col_lo, col_hi, tg, M, N, HAS_BIAS, bias_ptr)
    if SPLIT and SERIAL:
        tl.debug_barrier()  # every thread's partial sums are written before the counter moves
        pid_n = tl.program_id(0)
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            for b in tl.static_range(SETS):
                rows = _read_parts(part_ptr, 8 * b, col_lo, col_hi, tg, M, N, splits, AHEAD)
                _store(out_ptr, rows, 8 * b, col_lo, col_hi, tg, M, N, HAS_BIAS, bias_ptr)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
