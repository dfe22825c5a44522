"""The FP8 weight-streaming MoE's up kernel on the e4m3 tensor cores (``moe_gemv_fp8``'s ``up="mma"``): the same
meaning and rounding points as ``moe_gemv_fp8.build_up_fp8`` with the products summed by ``mma.sync m16n8k32``
instead of float conversions and FMAs (the CUDA-core kernel measured instruction-bound on the H200)."""

from kernels_cuda import _tl
from kernels_cuda.fp8_gemv import FP8, GROUP, VEC, quant_rows_macro
from kernels_cuda.moe_slots import expert_slots_macro

THREADS = 256


def build_up_fp8_mma(E: int, C: int, I: int, K: int, MB: int, dtype: str, id_dtype: str, min_blocks: int = 2,
                     pdl: bool = False, batch: int = 4):
    """``moe_up_fp8`` on the e4m3 tensor cores (``mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32``), in
    ``moe_gemv.build_up_mma``'s layout. A CTA (8 warps) owns the ``BN`` = 8 columns n = bn * 8 + g of its expert:
    their gate rows are the mma's M rows g, their up rows the rows g + 8. The chunk's listed rows are its N = 8
    columns (a chunk is ``MB`` rows quantised as ``build_up_fp8``; columns >= MB read the chunk's last row and are
    discarded), and the warps split C (C / 8 each). Thread (g = lane / 4, t = lane % 4) loads 16 contiguous bytes
    of gate row g, of up row g and of column g's quantised row per 64 values of K; bytes 8h .. 8h + 3 are mma h's
    k quad {4t .. 4t + 3} and bytes 8h + 4 .. 8h + 7 its quad {4t + 16 .. 4t + 19}, for A and B alike (a k
    permutation inside a 128 group shared by both operands; the scales are per group), so no shuffles:
    A = {gate[8h..8h+3], up[8h..8h+3], gate[8h+4..8h+7], up[8h+4..8h+7]}, B = {x[8h..8h+3], x[8h+4..8h+7]}, C =
    {gate(col 2t), gate(col 2t+1), up(col 2t), up(col 2t+1)} of column n = bn * 8 + g.
    Per 128 group (64 values where a warp's share is not whole groups) the e4m3 products are summed in float32 by
    the mmas into a zeroed fragment, which is added to the float32 sums times s_x[token, group] * w_scale (the gate
    rows' tile for fragment rows g, the up rows' for g + 8): the reference's block promotion, its sums reordered.
    The warps' sums are added through shared memory in warp order; warp 0 rounds gate and up to x's dtype and
    writes SiLU(gate) * up (float32, rounded once) as ``build_up_fp8``. ``batch``: 64-value chunks of weights a
    thread loads before their mmas (8 registers each; the next batch is loaded while one is multiplied, and the
    first while x is quantised)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None  # (``_tl.PDL_ENV``: it waits at its start)
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    WARPS = THREADS // 32
    BN = 8  # columns per CTA: 8 gate rows and 8 up rows are the mma's M = 16
    KC = 64  # K values per 16-byte load of a thread quad: two m16n8k32
    KW = C // WARPS  # each warp's share of the reduction
    assert C % (WARPS * KC) == 0 and I % BN == 0 and MB in (1, 2, 4, 8)
    CPS = 2 if KW % GROUP == 0 else 1  # chunks per scale step: a whole 128 group, or half of one
    NSC = KW // (KC * CPS)  # scale steps per warp
    SB = min(NSC, max(1, batch // CPS))  # scale steps per weight batch
    NB = -(-NSC // SB)
    NBUF = 1 if NB == 1 else 2
    CB, TV = C // GROUP, MB * C // VEC
    PAD = 64 if MB > 1 else 0  # q_s rows 64 bytes apart in the banks: a quarter warp's two rows don't conflict
    quant_rows = quant_rows_macro(T, THREADS, TV, C, K)
    expert_slots = expert_slots_macro(T)

    @T.macro
    def load_batch(W13, S13, e, n0, g, t, warp, bt, buf, wg, wu, sg, su):
        """Batch ``bt`` of this thread's gate and up row vectors and their tiles' scales into buffer ``buf``."""
        for j in T.unroll(SB):
            if bt * SB + j < NSC:
                for hc in T.unroll(CPS):
                    k0 = warp * KW + ((bt * SB + j) * CPS + hc) * KC + t * VEC
                    for v in T.vectorized(VEC):
                        wg[buf, j, hc, v] = W13[e, n0 + g, k0 + v]
                    for v in T.vectorized(VEC):
                        wu[buf, j, hc, v] = W13[e, I + n0 + g, k0 + v]
                kg = (warp * KW + (bt * SB + j) * CPS * KC) // GROUP
                sg[buf, j] = S13[e, n0 // GROUP, kg]
                su[buf, j] = S13[e, (I + n0) // GROUP, kg]

    @T.prim_func
    def moe_up_fp8_mma(X: T.Tensor((NT, C), dtype), W13: T.Tensor((E, 2 * I, C), FP8),
                       S13: T.Tensor((E, 2 * I // GROUP, CB), "float32"), Ids: T.Tensor((NS,), id_dtype),
                       H: T.Tensor((NS, I), dtype)):
        with T.Kernel(I // BN, NS, threads=THREADS) as (bn, s):
            tx = T.get_thread_binding()
            T.annotate_min_blocks_per_sm(min_blocks)
            warp = tx // 32
            lane = tx % 32
            g = lane // 4
            t = lane % 4
            n0 = bn * BN
            rows = T.alloc_shared((THREADS,), "int32")
            cnt = T.alloc_shared((1,), "int32")
            first = T.alloc_shared((1,), "int32")
            red = T.alloc_shared((WARPS, 32, 4), "float32")
            q_s = T.alloc_shared((MB, C + PAD), FP8)
            sx_s = T.alloc_shared((MB, CB), "float32")
            wg = T.alloc_local((NBUF, SB, CPS, VEC), FP8)
            wu = T.alloc_local((NBUF, SB, CPS, VEC), FP8)
            sg = T.alloc_local((NBUF, SB), "float32")
            su = T.alloc_local((NBUF, SB), "float32")
            xq = T.alloc_local((VEC,), FP8)
            a = T.alloc_local((16,), FP8)
            b = T.alloc_local((8,), FP8)
            frag = T.alloc_local((4,), "float32")
            acc = T.alloc_local((4,), "float32")
            xb = T.alloc_local((VEC,), dtype)
            xf = T.alloc_local((VEC,), "float32")
            qf = T.alloc_local((VEC,), "float32")
            qv = T.alloc_local((VEC,), FP8)
            sc = T.alloc_local((1,), "float32")
            gu = T.alloc_local((2,), "float32")
            nr = T.alloc_local((1,), "int32")
            mine = T.alloc_local((1,), "int32")
            if pdl:
                gate()  # the expert ids and X come from the router
            e = T.cast(Ids[s], "int32")
            expert_slots(Ids, NS, s, e, tx, rows, cnt, first, nr, mine)
            if (e >= 0) & (e < E) & (mine[0] == 1):
                if NB == 1:  # every weight of the thread: loaded once, in flight while x is quantised
                    load_batch(W13, S13, e, n0, g, t, warp, 0, 0, wg, wu, sg, su)
                for ch in T.serial(T.ceildiv(nr[0], MB)):
                    if NB > 1:  # the first batch, in flight while x is quantised
                        load_batch(W13, S13, e, n0, g, t, warp, 0, 0, wg, wu, sg, su)
                    # the chunk's rows of x, quantised into shared memory (rows past the count repeat the last)
                    quant_rows(X, rows, nr, ch, tx, xb, xf, qf, qv, sc, q_s, sx_s)
                    T.sync_threads()
                    for i in T.unroll(4):
                        acc[i] = 0.0
                    for bt in T.unroll(NB):
                        if bt + 1 < NB:  # the next batch in flight while this one is multiplied
                            load_batch(W13, S13, e, n0, g, t, warp, bt + 1, (bt + 1) % NBUF, wg, wu, sg, su)
                        for j in T.unroll(SB):
                            if bt * SB + j < NSC:
                                for i in T.unroll(4):
                                    frag[i] = 0.0
                                for hc in T.unroll(CPS):
                                    k0 = warp * KW + ((bt * SB + j) * CPS + hc) * KC + t * VEC
                                    for v in T.vectorized(VEC):
                                        xq[v] = q_s[T.min(g, MB - 1), k0 + v]
                                    for h in T.unroll(2):
                                        # A: a0 row g / a1 row g + 8 at k {4t..4t+3}, a2 / a3 at {4t+16..4t+19}
                                        for v in T.vectorized(4):
                                            a[v] = wg[bt % NBUF, j, hc, 8 * h + v]
                                        for v in T.vectorized(4):
                                            a[4 + v] = wu[bt % NBUF, j, hc, 8 * h + v]
                                        for v in T.vectorized(4):
                                            a[8 + v] = wg[bt % NBUF, j, hc, 8 * h + 4 + v]
                                        for v in T.vectorized(4):
                                            a[12 + v] = wu[bt % NBUF, j, hc, 8 * h + 4 + v]
                                        # B: b0 column g at k {4t..4t+3}, b1 at {4t+16..4t+19}
                                        for v in T.vectorized(8):
                                            b[v] = xq[8 * h + v]
                                        T.ptx_mma("float32", "m16n8k32", "row", "col", "e4m3", "e4m3", "fp32",
                                                  a.data, 0, b.data, 0, frag.data, 0, T.bool(False))
                                # frag (g, 2t + i) / (g + 8, 2t + i): gate / up of column n for chunk row 2t + i
                                kg = (warp * KW + (bt * SB + j) * CPS * KC) // GROUP
                                for i in T.unroll(2):
                                    acc[i] += frag[i] * (sx_s[T.min(2 * t + i, MB - 1), kg] * sg[bt % NBUF, j])
                                    acc[2 + i] += frag[2 + i] * (sx_s[T.min(2 * t + i, MB - 1), kg] * su[bt % NBUF, j])
                    for i in T.unroll(4):
                        red[warp, lane, i] = acc[i]
                    T.sync_threads()
                    if warp == 0:  # the warps' sums in warp order
                        for i in T.unroll(4):
                            acc[i] = red[0, lane, i]
                            for w in T.serial(WARPS - 1):
                                acc[i] += red[w + 1, lane, i]
                        for i in T.unroll(2):
                            if (2 * t + i < MB) & (ch * MB + 2 * t + i < nr[0]):
                                # gate and up as the reference's fp8_linear outputs (x's dtype), then SiLU * up
                                gu[0] = T.cast(T.cast(acc[i], dtype), "float32")
                                gu[1] = T.cast(T.cast(acc[2 + i], dtype), "float32")
                                H[rows[ch * MB + 2 * t + i], n0 + g] = T.cast(
                                    gu[0] / (1.0 + T.exp(-gu[0])) * gu[1], dtype)
                    T.sync_threads()  # q_s and red are rewritten by the next chunk

    return moe_up_fp8_mma
