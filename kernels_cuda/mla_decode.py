"""Paged MLA decode (absorbed form), FlashMLA-style, in TileLang.

h_kv = 1: every head of a query token reads the same latent rows, so a CTA takes one query token and
a tile of its heads as the rows of the score matrix, and walks the key axis in tiles of cached tokens
gathered through the block table. Scores use the whole 576-wide key (latent + rope); values are the
first ``dv`` (512) columns of the same shared-memory tile, so each cache row is read once per CTA.

Two kernels:

* :func:`build_decode_ws` (64-head multiples, e.g. V3's 128): warp-specialised like FlashMLA, see its
  docstring; keys gathered with cp.async, any page size dividing or divisible by 64.
* :func:`build_decode` (fewer heads, e.g. V2-Lite's 16): TileLang's automatic TMA pipeline with
  16/32-head tiles on mma.sync; a key tile is one page or a slice of one.

Long contexts with few CTAs split the key axis (``n_split`` CTAs per token and head tile, each writing
an fp32 partial output and its log-sum-exp; at least 64 keys per split); :func:`build_combine`
merges them.

Causality inside a multi-token query block (speculative verification, MTP) needs no mask: query j of
a sequence with q_len queries sees the first ``seq_len - q_len + j + 1`` keys, so each CTA just stops
there. Nothing synchronises with the host (ragged token -> sequence maps are computed on the device),
so the op can be captured in a CUDA graph.
"""

import torch

from kernels_cuda import _tl

LOG2E = 1.4426950408889634


def build_decode(H: int, D: int, DV: int, BS: int, BH: int, BN: int, stages: int, threads: int,
                 split: bool, ragged: bool, dtype: str = "bfloat16"):
    """The attention kernel. ``split``: write per-split partials (the split count is the grid's z
    extent, taken from ``OPart``); else the final output. ``ragged``: token -> sequence comes from
    ``TokSeq`` (else token t is sequence t, the all-q_len-1 case)."""
    T = _tl.language()
    DPE = D - DV
    HB = H // BH
    accum = "float32"
    assert H % BH == 0 and DV % 16 == 0 and DPE % 16 == 0
    assert (BN % BS == 0) if BS < BN else (BS % BN == 0)
    NT, NB, B, B1, M = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("B"), T.dynamic("B1"), T.dynamic("M")
    NTP, n_split = T.dynamic("NTP"), T.dynamic("NSPLIT")
    SPLIT = split

    @T.prim_func
    def mla_decode_kernel(
        Q: T.Tensor((NT, H, D), dtype),
        Cache: T.Tensor((NB, BS, D), dtype),
        Tables: T.Tensor((B, M), "int32"),
        CuQ: T.Tensor((B1,), "int64"),
        SeqLens: T.Tensor((B,), "int64"),
        TokSeq: T.Tensor((NT,), "int32"),
        Out: T.Tensor((NT, H, DV), dtype),
        OPart: T.Tensor((NTP, H, n_split, DV), accum),
        LsePart: T.Tensor((NTP, H, n_split), accum),
        scale_log2: T.float32,
        min_blocks: T.int32,
    ):
        with T.Kernel(HB, NT, n_split, threads=threads) as (hb, t, sp):
            Q_s = T.alloc_shared((BH, DV), dtype)
            Qpe_s = T.alloc_shared((BH, DPE), dtype)
            KV_s = T.alloc_shared((BN, DV), dtype)
            Kpe_s = T.alloc_shared((BN, DPE), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            acc_s = T.alloc_fragment((BH, BN), accum)
            acc_o = T.alloc_fragment((BH, DV), accum)
            m_i = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            row_sum = T.alloc_fragment((BH,), accum)
            l_i = T.alloc_fragment((BH,), accum)

            b = T.alloc_var("int32")
            if ragged:
                b = TokSeq[t]
            else:
                b = t
            q_start = T.cast(CuQ[b], "int32")
            q_len = T.cast(CuQ[b + 1], "int32") - q_start
            kv_len = T.cast(SeqLens[b], "int32") - q_len + (t - q_start) + 1
            n_blocks = T.ceildiv(kv_len, BN)
            per_split = T.max(T.ceildiv(n_blocks, n_split), min_blocks)
            blk0 = sp * per_split
            blk1 = T.min(n_blocks, blk0 + per_split)
            n_iter = T.max(blk1 - blk0, 0)

            T.copy(Q[t, hb * BH:(hb + 1) * BH, 0:DV], Q_s)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DV:D], Qpe_s)
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, -T.infinity(accum))

            for kk in T.Pipelined(n_iter, num_stages=stages):
                pos0 = (blk0 + kk) * BN
                if BS >= BN:
                    page = Tables[b, pos0 // BS]
                    off = pos0 % BS
                    T.copy(Cache[page, off:off + BN, 0:DV], KV_s)
                    T.copy(Cache[page, off:off + BN, DV:D], Kpe_s)
                else:
                    for p in T.unroll(BN // BS):
                        # table columns past the context may hold junk page ids: TMA zero-fills
                        # out-of-range coordinates, and those keys are masked anyway
                        page = Tables[b, T.min(pos0 // BS + p, M - 1)]
                        T.copy(Cache[page, 0:BS, 0:DV], KV_s[p * BS:(p + 1) * BS, :])
                        T.copy(Cache[page, 0:BS, DV:D], Kpe_s[p * BS:(p + 1) * BS, :])
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(Qpe_s, Kpe_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.if_then_else(pos0 + j < kv_len, acc_s[i, j], -T.infinity(accum))
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(BH):
                    alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(BH):
                    l_i[i] = l_i[i] * alpha[i] + row_sum[i]
                for i, j in T.Parallel(BH, DV):
                    acc_o[i, j] *= alpha[i]
                T.copy(acc_s, P_s)
                T.gemm(P_s, KV_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

            if SPLIT:
                for i, j in T.Parallel(BH, DV):
                    acc_o[i, j] = T.if_then_else(l_i[i] > 0, acc_o[i, j] / l_i[i], 0)
                for i in T.Parallel(BH):
                    m_prev[i] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i] * scale_log2,
                                               -T.infinity(accum))
                T.copy(m_prev, LsePart[t, hb * BH:(hb + 1) * BH, sp])
                T.copy(acc_o, OPart[t, hb * BH:(hb + 1) * BH, sp, :])
            else:
                for i, j in T.Parallel(BH, DV):
                    acc_o[i, j] /= l_i[i]
                T.copy(acc_o, Out[t, hb * BH:(hb + 1) * BH, :])

    return mla_decode_kernel


MAX_SPLIT = 64  # most key splits per (token, head tile): the combine stages the split scores in registers


def build_combine(H: int, DV: int, dtype: str = "bfloat16"):
    """out[t, h] = sum_s exp2(lse_s - lse) * o_s over the splits that saw any key. The split scores are
    loaded in one parallel pass (a serial loop of dependent loads costs ~0.1 us per split)."""
    T = _tl.language()
    NT, n_split = T.dynamic("NT"), T.dynamic("NSPLIT")
    threads = 128
    accum = "float32"
    S = MAX_SPLIT

    @T.prim_func
    def mla_decode_combine(
        OPart: T.Tensor((NT, H, n_split, DV), accum),
        LsePart: T.Tensor((NT, H, n_split), accum),
        Out: T.Tensor((NT, H, DV), dtype),
    ):
        with T.Kernel(H, NT, threads=threads) as (h, t):
            lse = T.alloc_fragment((1, S), accum)
            wts = T.alloc_fragment((1, S), accum)
            mx = T.alloc_fragment((1,), accum)
            total = T.alloc_fragment((1,), accum)
            w_s = T.alloc_shared((S,), accum)
            o = T.alloc_fragment((DV,), accum)
            for i, s in T.Parallel(1, S):
                lse[i, s] = T.if_then_else(s < n_split, LsePart[t, h, T.min(s, n_split - 1)], -T.infinity(accum))
            T.reduce_max(lse, mx, dim=1)
            for i, s in T.Parallel(1, S):
                wts[i, s] = T.if_then_else(lse[i, s] > -T.infinity(accum), T.exp2(lse[i, s] - mx[i]), 0.0)
            T.reduce_sum(wts, total, dim=1)
            for i, s in T.Parallel(1, S):
                w_s[s] = wts[i, s] / total[i]
            T.fill(o, 0)
            for s in T.serial(n_split):
                if w_s[s] > 0:
                    for i in T.Parallel(DV):
                        o[i] += w_s[s] * OPart[t, h, s, i]
            T.copy(o, Out[t, h, :])

    return mla_decode_combine


def build_decode_ws(H: int, D: int, DV: int, BS: int, split: bool, ragged: bool, dtype: str = "bfloat16"):
    """The warp-specialised kernel for 64-head tiles (H a multiple of 64), FlashMLA's division of work:

    * warpgroup 0 computes the whole 64 x 64 score tile (one wgmma chain over the 576-wide keys, so
      the row max and sum stay inside the warpgroup), the online softmax, and the left half of
      O (P @ V[:, :256]);
    * warpgroup 1 computes the right half of O from P and the rescale factors in shared memory, while
      warpgroup 0 already computes the next score tile;
    * warpgroup 2 gathers the next key tiles (64 cached tokens through the block table: any page
      size) with cp.async into a double buffer.

    Hand-off through mbarriers: k_ready/k_free per buffer, p_ready/p_free for the P tile.
    Same arguments as :func:`build_decode`.
    """
    T = _tl.language()
    DPE = D - DV
    DH = DV // 2
    BH, BN = 64, 64
    HB = H // BH
    accum = "float32"
    assert H % 64 == 0 and DV % 128 == 0 and DPE % 16 == 0 and DPE <= 64
    NT, NB, B, B1, M = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("B"), T.dynamic("B1"), T.dynamic("M")
    NTP, n_split = T.dynamic("NTP"), T.dynamic("NSPLIT")
    ninf = -T.infinity(accum)

    @T.macro
    def score_step(i, buf, Kl, Kr, Kt, Q_l, Q_r, Q_t, acc_s, acc_l, m_i, m_prev, alpha, row_sum, l_i, alpha_s, P_s,
                   k_ready, k_free, p_ready, p_free, pos0, kv_len, scale_log2):
        T.barrier_wait(k_ready[buf], (i // 2) % 2)
        T.wgmma_gemm(Q_l, Kl, acc_s, transpose_B=True, clear_accum=True)  # one wait for the 3 chains
        T.wgmma_gemm(Q_r, Kr, acc_s, transpose_B=True)
        T.wgmma_gemm(Q_t, Kt, acc_s, transpose_B=True)
        T.wait_wgmma(0)
        for h, j in T.Parallel(BH, BN):
            acc_s[h, j] = T.if_then_else(pos0 + j < kv_len, acc_s[h, j], ninf)
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale_log2)
        for h, j in T.Parallel(BH, BN):
            acc_s[h, j] = T.exp2(acc_s[h, j] * scale_log2 - m_i[h] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for h in T.Parallel(BH):
            l_i[h] = l_i[h] * alpha[h] + row_sum[h]
        if i > 0:
            T.barrier_wait(p_free[0], (i - 1) % 2)  # warpgroup 1 is done with the previous P
        T.copy(alpha, alpha_s)
        T.copy(acc_s, P_s)
        T.fence_proxy_async()  # P is read by warpgroup 1's wgmma (async proxy)
        T.barrier_arrive(p_ready[0])  # before our own P @ V: both halves of O run concurrently
        for h, d in T.Parallel(BH, DH):
            acc_l[h, d] *= alpha[h]
        T.gemm(P_s, Kl, acc_l)
        T.barrier_arrive(k_free[buf])

    @T.macro
    def value_step(i, buf, Kr, acc_r, alpha_s, P_s, k_free, p_ready, p_free):
        T.barrier_wait(p_ready[0], i % 2)
        for h, d in T.Parallel(BH, DH):
            acc_r[h, d] *= alpha_s[h]
        T.gemm(P_s, Kr, acc_r)
        T.barrier_arrive(k_free[buf])
        T.barrier_arrive(p_free[0])

    @T.macro
    def load_step(i, buf, Kl, Kr, Kt, Cache, Tables, k_ready, k_free, b, pos0, kv_len):
        T.barrier_wait(k_free[buf], ((i // 2) % 2) ^ 1)
        if BS >= BN:
            # one page (slice) per tile; a tile past the context reads page 0 (masked anyway)
            page = T.if_then_else(pos0 < kv_len, Tables[b, T.min(pos0 // BS, M - 1)], 0)
            T.async_copy(Cache[page, pos0 % BS:pos0 % BS + BN, 0:DH], Kl)
            T.async_copy(Cache[page, pos0 % BS:pos0 % BS + BN, DH:DV], Kr)
            T.async_copy(Cache[page, pos0 % BS:pos0 % BS + BN, DV:D], Kt)
        else:
            for pg in T.unroll(BN // BS):
                pos = pos0 + pg * BS
                page = T.if_then_else(pos < kv_len, Tables[b, T.min(pos // BS, M - 1)], 0)
                T.async_copy(Cache[page, 0:BS, 0:DH], Kl[pg * BS:(pg + 1) * BS, :])
                T.async_copy(Cache[page, 0:BS, DH:DV], Kr[pg * BS:(pg + 1) * BS, :])
                T.async_copy(Cache[page, 0:BS, DV:D], Kt[pg * BS:(pg + 1) * BS, :])
        T.cp_async_barrier_noinc(k_ready[buf])

    @T.prim_func
    def mla_decode_ws_kernel(
        Q: T.Tensor((NT, H, D), dtype),
        Cache: T.Tensor((NB, BS, D), dtype),
        Tables: T.Tensor((B, M), "int32"),
        CuQ: T.Tensor((B1,), "int64"),
        SeqLens: T.Tensor((B,), "int64"),
        TokSeq: T.Tensor((NT,), "int32"),
        Out: T.Tensor((NT, H, DV), dtype),
        OPart: T.Tensor((NTP, H, n_split, DV), accum),
        LsePart: T.Tensor((NTP, H, n_split), accum),
        scale_log2: T.float32,
        min_blocks: T.int32,
    ):
        # the key gather must lower to cp.async: no bounds-check predication (indices are clamped)
        T.annotate_pass_configs({"tl.disable_safe_memory_legalize": True})
        with T.Kernel(HB, NT, n_split, threads=384) as (hb, t, sp):
            Q_l = T.alloc_shared((BH, DH), dtype)
            Q_r = T.alloc_shared((BH, DH), dtype)
            Q_t = T.alloc_shared((BH, DPE), dtype)
            K0_l = T.alloc_shared((BN, DH), dtype)
            K0_r = T.alloc_shared((BN, DH), dtype)
            K0_t = T.alloc_shared((BN, DPE), dtype)
            K1_l = T.alloc_shared((BN, DH), dtype)
            K1_r = T.alloc_shared((BN, DH), dtype)
            K1_t = T.alloc_shared((BN, DPE), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            alpha_s = T.alloc_shared((BH,), accum)
            l_s = T.alloc_shared((BH,), accum)

            acc_s = T.alloc_fragment((BH, BN), accum)
            acc_l = T.alloc_fragment((BH, DH), accum)
            acc_r = T.alloc_fragment((BH, DH), accum)
            m_i = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            row_sum = T.alloc_fragment((BH,), accum)
            l_i = T.alloc_fragment((BH,), accum)

            bar_q = T.alloc_barrier(arrive_count=384)
            k_ready = T.alloc_barrier(arrive_count=[128, 128])
            k_free = T.alloc_barrier(arrive_count=[256, 256])
            p_ready = T.alloc_barrier(arrive_count=128)
            p_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            b = T.alloc_var("int32")
            if ragged:
                b = TokSeq[t]
            else:
                b = t
            q_start = T.cast(CuQ[b], "int32")
            q_len = T.cast(CuQ[b + 1], "int32") - q_start
            kv_len = T.cast(SeqLens[b], "int32") - q_len + (t - q_start) + 1
            n_blocks = T.ceildiv(kv_len, BN)
            per_split = T.max(T.ceildiv(n_blocks, n_split), min_blocks)
            blk0 = sp * per_split
            n_iter = T.max(T.min(n_blocks, blk0 + per_split) - blk0, 0)

            T.copy(Q[t, hb * BH:(hb + 1) * BH, 0:DH], Q_l)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DH:DV], Q_r)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DV:D], Q_t)
            T.barrier_arrive(bar_q[0])

            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(acc_l, 0)
                T.fill(l_i, 0)
                T.fill(m_i, ninf)
                T.barrier_wait(bar_q[0], 0)
                for i in T.serial(n_iter):
                    if i % 2 == 0:
                        score_step(i, 0, K0_l, K0_r, K0_t, Q_l, Q_r, Q_t, acc_s, acc_l, m_i, m_prev, alpha, row_sum,
                                   l_i, alpha_s, P_s, k_ready, k_free, p_ready, p_free, (blk0 + i) * BN, kv_len,
                                   scale_log2)
                    else:
                        score_step(i, 1, K1_l, K1_r, K1_t, Q_l, Q_r, Q_t, acc_s, acc_l, m_i, m_prev, alpha, row_sum,
                                   l_i, alpha_s, P_s, k_ready, k_free, p_ready, p_free, (blk0 + i) * BN, kv_len,
                                   scale_log2)
                for h in T.Parallel(BH):
                    l_s[h] = l_i[h]
                T.barrier_arrive(p_ready[0])  # one more phase: the row sums are in l_s
                if split:
                    for h, d in T.Parallel(BH, DH):
                        acc_l[h, d] = T.if_then_else(l_i[h] > 0, acc_l[h, d] / l_i[h], 0)
                    for h in T.Parallel(BH):
                        m_prev[h] = T.if_then_else(l_i[h] > 0, T.log2(l_i[h]) + m_i[h] * scale_log2, ninf)
                    T.copy(m_prev, LsePart[t, hb * BH:(hb + 1) * BH, sp])
                    T.copy(acc_l, OPart[t, hb * BH:(hb + 1) * BH, sp, 0:DH])
                else:
                    for h, d in T.Parallel(BH, DH):
                        acc_l[h, d] /= l_i[h]
                    T.copy(acc_l, Out[t, hb * BH:(hb + 1) * BH, 0:DH])
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for i in T.serial(n_iter):
                    if i % 2 == 0:
                        value_step(i, 0, K0_r, acc_r, alpha_s, P_s, k_free, p_ready, p_free)
                    else:
                        value_step(i, 1, K1_r, acc_r, alpha_s, P_s, k_free, p_ready, p_free)
                T.barrier_wait(p_ready[0], n_iter % 2)
                if split:
                    for h, d in T.Parallel(BH, DH):
                        acc_r[h, d] = T.if_then_else(l_s[h] > 0, acc_r[h, d] / l_s[h], 0)
                    T.copy(acc_r, OPart[t, hb * BH:(hb + 1) * BH, sp, DH:DV])
                else:
                    for h, d in T.Parallel(BH, DH):
                        acc_r[h, d] /= l_s[h]
                    T.copy(acc_r, Out[t, hb * BH:(hb + 1) * BH, DH:DV])
            else:
                T.set_max_nreg(80, 0)
                for i in T.serial(n_iter):
                    if i % 2 == 0:
                        load_step(i, 0, K0_l, K0_r, K0_t, Cache, Tables, k_ready, k_free, b, (blk0 + i) * BN, kv_len)
                    else:
                        load_step(i, 1, K1_l, K1_r, K1_t, Cache, Tables, k_ready, k_free, b, (blk0 + i) * BN, kv_len)

    return mla_decode_ws_kernel


_decode_kernel = _tl.kernel_cache(build_decode)
_decode_ws_kernel = _tl.kernel_cache(build_decode_ws)
_combine_kernel = _tl.kernel_cache(build_combine)


def config(H: int, D: int, DV: int, BS: int) -> dict:
    """Tile configuration. 64-head multiples take the warp-specialised kernel (64 heads x 64 keys per
    step, any page size that divides or is a multiple of 64). Otherwise BH heads per CTA and BN keys
    per step in the auto-pipelined kernel, where a key tile is one page or a slice of one (TileLang
    lowers a whole-page copy to a TMA load, but not several pages into one tile), so small pages mean
    small key tiles and a deeper pipeline."""
    if H % 64 == 0 and DV % 128 == 0 and (D - DV) % 16 == 0 and D - DV <= 64 and (64 % BS == 0 or BS % 64 == 0):
        return {"kernel": "ws", "BH": 64, "BN": 64}
    BN = min(64, BS)
    stages = 2 if BN >= 64 else (4 if BN >= 16 else 8)
    if H % 64 == 0:
        return {"BH": 64, "BN": BN, "stages": stages, "threads": 256}
    BH = 32 if H % 32 == 0 else 16
    # each warp needs >= 8 key columns of the score tile (FullCol split of the key axis)
    return {"BH": BH, "BN": BN, "stages": stages, "threads": 32 * max(1, min(4, BN // 8))}


def choose_split(n_ctas: int, sms: int) -> int:
    """Split the context when the natural grid fills less than one wave (one CTA per SM: the
    shared-memory tiles take most of it): about one CTA per SM in total."""
    if n_ctas >= sms * 0.75:
        return 1
    return int(min(MAX_SPLIT, max(1, round(sms / n_ctas))))


def _pad_last(x: torch.Tensor, widths: list[tuple[int, int]]) -> torch.Tensor:
    """Re-lay the last dim as the concatenation of (source width, padded width) segments."""
    parts, start = [], 0
    for w, pw in widths:
        seg = x[..., start:start + w]
        if pw > w:
            seg = torch.nn.functional.pad(seg, (0, pw - w))
        parts.append(seg)
        start += w
    return torch.cat(parts, dim=-1).contiguous()


def mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, *, n_split: int | None = None,
               cfg: dict | None = None):
    T_, H, D = q.shape
    B = seq_lens.shape[0]
    fp8_rows = cache.dtype == torch.uint8  # FP8 latent rows (kernels_cpu/kv_fp8.py)
    if q.dtype not in (torch.bfloat16, torch.float16) or T_ == 0 or not (fp8_rows or cache.dtype == q.dtype):
        # float32: tensor cores would round to tf32; a cache of another dtype (kv_cache_dtype "bf16" under a
        # float16 model) is read by the reference
        from kernels_cpu.ops import mla_decode as ref

        return ref(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)
    if fp8_rows:
        from kernels_cuda.mla_decode_fp8 import mla_decode_fp8

        return mla_decode_fp8(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, n_split=n_split)
    R = D - dv
    dv_p, r_p, h_p = _round(dv, 64), _round(R, 16), _round(H, 16)
    if (dv_p, r_p) != (dv, R):  # odd test shapes only: real models have dv 512, rope 64
        q = _pad_last(q, [(dv, dv_p), (R, r_p)])
        cache = _pad_last(cache, [(dv, dv_p), (R, r_p)])
    Dp = dv_p + r_p
    BS = cache.shape[1]
    c = dict(cfg or config(h_p, Dp, dv_p, BS))
    if c.get("kernel") == "ws":
        h_p = _round(H, 64)  # 64-row tiles (also usable for 16 heads with small pages: padded rows)
    if h_p != H:
        q = torch.nn.functional.pad(q, (0, 0, 0, h_p - H))
    q = q.contiguous()
    cache = cache.contiguous()
    BN = c["BN"]
    if BS < BN and BN % BS:
        BN = c["BN"] = BS
    elif BS > BN and BS % BN:
        raise ValueError(f"mla_decode: block size {BS} must divide or be a multiple of {BN}")
    ragged = T_ != B
    n_ctas = (h_p // c["BH"]) * T_
    if n_split is None:
        n_split = choose_split(n_ctas, _tl.num_sms(q.device.index or 0))
    if not 1 <= n_split <= MAX_SPLIT:
        raise ValueError(f"mla_decode: n_split={n_split} is outside 1..{MAX_SPLIT}")
    if c.get("kernel") == "ws":
        kern = _decode_ws_kernel(h_p, Dp, dv_p, BS, n_split > 1, ragged, _tl.tl_dtype(q.dtype))
    else:
        kern = _decode_kernel(h_p, Dp, dv_p, BS, c["BH"], BN, c["stages"], c["threads"], n_split > 1, ragged,
                              _tl.tl_dtype(q.dtype))
    dev = q.device
    if ragged:
        tok_seq = torch.searchsorted(cu_q_lens[1:].to(dev), torch.arange(T_, device=dev), right=True)
        tok_seq = tok_seq.to(torch.int32)
    else:
        tok_seq = torch.empty(T_, dtype=torch.int32, device=dev)  # unused
    out = torch.empty(T_, h_p, dv_p, dtype=q.dtype, device=dev)
    if n_split > 1:
        o_part = torch.empty(T_, h_p, n_split, dv_p, dtype=torch.float32, device=dev)
        lse_part = torch.empty(T_, h_p, n_split, dtype=torch.float32, device=dev)
    else:
        o_part = torch.empty(1, h_p, 1, dv_p, dtype=torch.float32, device=dev)
        lse_part = torch.empty(1, h_p, 1, dtype=torch.float32, device=dev)
    # at least 64 keys per split: shorter splits cost more in partial outputs than they save
    min_blocks = max(1, 64 // BN) if n_split > 1 else 1
    kern(q, cache, block_tables.to(torch.int32).contiguous(), cu_q_lens.to(torch.int64).contiguous(),
         seq_lens.to(torch.int64).contiguous(), tok_seq, out, o_part, lse_part, float(scale * LOG2E), min_blocks)
    if n_split > 1:
        _combine_kernel(h_p, dv_p, _tl.tl_dtype(q.dtype))(o_part, lse_part, out)
    if h_p != H or dv_p != dv:
        out = out[:, :H, :dv].contiguous()
    return out


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def representative_kernels():
    """(name, thunk -> prim_func) pairs compiled by the CPU CI test: one per kernel builder, at real-model
    shapes (576/512 latents; 128 and 16 heads; pages of 16 and 64)."""
    c16 = config(16, 576, 512, 16)
    args16 = (c16["BH"], c16["BN"], c16["stages"], c16["threads"])
    return [
        ("mla_decode H128 bs16 split ragged (warp-specialised)",
         lambda: build_decode_ws(128, 576, 512, 16, True, True)),
        ("mla_decode H16 bs16 split ragged", lambda: build_decode(16, 576, 512, 16, *args16, True, True)),
        ("mla_decode combine", lambda: build_combine(128, 512)),
    ]
