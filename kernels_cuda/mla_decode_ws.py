"""The warp-specialised MLA decode kernel for 64-head tiles (FlashMLA's division of work), over bf16 rows
or FP8 latent rows.

Used by :func:`kernels_cuda.mla_decode.mla_decode` when the heads are a multiple of 64 (V3's 128); same
arguments and outputs as :func:`kernels_cuda.mla_decode.build_decode` (the cache as strided row views;
split partials go through the same combine kernel; a split that is the only live one writes the final
output).
"""

from kernels_cuda import _tl
from kernels_cuda.mla_decode import TILE, key_window_macro


def build_decode_ws(H: int, D: int, DV: int, BS: int, split: bool, ragged: bool, dtype: str = "bfloat16",
                    W: int = 0):
    """The warp-specialised kernel for 64-head tiles (H a multiple of 64), FlashMLA's division of work:

    * warpgroup 0 computes the whole 64 x 64 score tile (one wgmma chain over the 576-wide keys, so
      the row max and sum stay inside the warpgroup), the online softmax, and the left half of
      O (P @ V[:, :256]);
    * warpgroup 1 computes the right half of O from P and the rescale factors in shared memory, while
      warpgroup 0 already computes the next score tile;
    * warpgroup 2 gathers the next key tiles (64 cached tokens through the block table: any page
      size) into a double buffer: bf16 rows with cp.async; FP8 rows (``W`` > 0 bytes) with plain loads
      into registers (two threads per key, issued before the buffer is free), converted and scaled
      there and stored as the bf16 tile (the rope, already bf16, with cp.async).

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
    FP8 = W > 0
    if FP8:
        G = DV // TILE
        lat_t, rope_t, WL, WS, WR = "float8_e4m3", "bfloat16", W, W // 4, W // 2
        assert W % 16 == 0 and dtype == "bfloat16" and DH % TILE == 0
    else:
        G, lat_t, rope_t, WL, WS, WR = 1, dtype, dtype, D, 1, D
    NT, NS, NSS, B, B1, M = (T.dynamic(n) for n in ("NT", "NS", "NSS", "B", "B1", "M"))
    NTP, n_split = T.dynamic("NTP"), T.dynamic("NSPLIT")
    ninf = -T.infinity(accum)
    key_window = key_window_macro(BN, ragged, n_split)

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
    def load_step(i, buf, Kl, Kr, Kt, Lat, Rope, Tables, k_ready, k_free, b, pos0, kv_len):
        T.barrier_wait(k_free[buf], ((i // 2) % 2) ^ 1)
        if BS >= BN:
            # one page (slice) per tile; a tile past the context reads page 0 (masked anyway)
            s0 = T.if_then_else(pos0 < kv_len, Tables[b, T.min(pos0 // BS, M - 1)], 0) * BS + pos0 % BS
            T.async_copy(Lat[s0:s0 + BN, 0:DH], Kl)
            T.async_copy(Lat[s0:s0 + BN, DH:DV], Kr)
            T.async_copy(Rope[s0:s0 + BN, :], Kt)
        else:
            for pg in T.unroll(BN // BS):
                pos = pos0 + pg * BS
                s1 = T.if_then_else(pos < kv_len, Tables[b, T.min(pos // BS, M - 1)], 0) * BS
                T.async_copy(Lat[s1:s1 + BS, 0:DH], Kl[pg * BS:(pg + 1) * BS, :])
                T.async_copy(Lat[s1:s1 + BS, DH:DV], Kr[pg * BS:(pg + 1) * BS, :])
                T.async_copy(Rope[s1:s1 + BS, :], Kt[pg * BS:(pg + 1) * BS, :])
        T.cp_async_barrier_noinc(k_ready[buf])

    @T.macro
    def load_step_fp8(i, buf, Kl, Kr, Kt, Lat, Scales, Rope, Tables, k_ready, k_free, b, pos0, kv_len, r, lat_r, sc_r):
        # thread r of the warpgroup: key row j = r // 2 of the tile, latent half r % 2 (-> Kl or Kr)
        j = r // 2
        pos = pos0 + j
        slot = T.if_then_else(pos < kv_len, Tables[b, T.min(pos // BS, M - 1)], 0) * BS + pos % BS
        for k in T.unroll(DH // 16):  # unrolled: lat_r stays in registers; in flight while the buffer is in use
            for v in T.vectorized(16):
                lat_r[k * 16 + v] = Lat[slot, (r % 2) * DH + k * 16 + v]
        for g in T.unroll(DH // TILE):  # this half's scales, loaded with the latent (not after the wait)
            sc_r[g] = Scales[slot, (r % 2) * (DH // TILE) + g]
        T.barrier_wait(k_free[buf], ((i // 2) % 2) ^ 1)
        if BS >= BN:
            s0 = T.if_then_else(pos0 < kv_len, Tables[b, T.min(pos0 // BS, M - 1)], 0) * BS + pos0 % BS
            T.async_copy(Rope[s0:s0 + BN, :], Kt)
        else:
            for pg in T.unroll(BN // BS):
                s1 = T.if_then_else(pos0 + pg * BS < kv_len, Tables[b, T.min((pos0 + pg * BS) // BS, M - 1)], 0)
                T.async_copy(Rope[s1 * BS:s1 * BS + BS, :], Kt[pg * BS:(pg + 1) * BS, :])
        if r % 2 == 0:
            for k in T.unroll(DH // 16):
                for v in T.vectorized(16):
                    Kl[j, k * 16 + v] = T.cast(T.cast(lat_r[k * 16 + v], accum) * sc_r[(k * 16) // TILE], dtype)
        else:
            for k in T.unroll(DH // 16):
                for v in T.vectorized(16):
                    Kr[j, k * 16 + v] = T.cast(T.cast(lat_r[k * 16 + v], accum) * sc_r[(k * 16) // TILE], dtype)
        T.fence_proxy_async()  # the stores are read by wgmma (async proxy)
        T.barrier_arrive(k_ready[buf])
        T.cp_async_barrier_noinc(k_ready[buf])

    @T.prim_func
    def mla_decode_ws_kernel(
        Q: T.Tensor((NT, H, D), dtype),
        Lat: T.StridedTensor((NS, DV), (WL, 1), lat_t),
        Scales: T.StridedTensor((NSS, G), (WS, 1), "float32"),
        Rope: T.StridedTensor((NS, DPE), (WR, 1), rope_t),
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
            # FP8: each loader thread arrives once for its stores and once through its rope cp.async
            k_ready = T.alloc_barrier(arrive_count=[256, 256] if FP8 else [128, 128])
            k_free = T.alloc_barrier(arrive_count=[256, 256])
            p_ready = T.alloc_barrier(arrive_count=128)
            p_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            b, kv_len, blk0, n_iter, n_blocks = key_window(t, sp, TokSeq, CuQ, SeqLens, min_blocks)

            T.copy(Q[t, hb * BH:(hb + 1) * BH, 0:DH], Q_l)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DH:DV], Q_r)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DV:D], Q_t)
            T.barrier_arrive(bar_q[0])

            if tx < 128:
                T.set_max_nreg(232 if FP8 else 240, 1)
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
                    if sp == 0 and n_iter == n_blocks:  # the only live split: the final output
                        T.copy(acc_l, Out[t, hb * BH:(hb + 1) * BH, 0:DH])
                    else:
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
                    if sp == 0 and n_iter == n_blocks:
                        T.copy(acc_r, Out[t, hb * BH:(hb + 1) * BH, DH:DV])
                    else:
                        T.copy(acc_r, OPart[t, hb * BH:(hb + 1) * BH, sp, DH:DV])
                else:
                    for h, d in T.Parallel(BH, DH):
                        acc_r[h, d] /= l_s[h]
                    T.copy(acc_r, Out[t, hb * BH:(hb + 1) * BH, DH:DV])
            else:
                if FP8:
                    # 64 registers of e4m3 per thread: the loader keeps 104 (not 80), warpgroup 0 takes 232
                    T.set_max_nreg(104, 0)
                    lat_r = T.alloc_local((DH,), lat_t)
                    sc_r = T.alloc_local((DH // TILE,), accum)
                    for i in T.serial(n_iter):
                        if i % 2 == 0:
                            load_step_fp8(i, 0, K0_l, K0_r, K0_t, Lat, Scales, Rope, Tables, k_ready, k_free, b,
                                          (blk0 + i) * BN, kv_len, tx - 256, lat_r, sc_r)
                        else:
                            load_step_fp8(i, 1, K1_l, K1_r, K1_t, Lat, Scales, Rope, Tables, k_ready, k_free, b,
                                          (blk0 + i) * BN, kv_len, tx - 256, lat_r, sc_r)
                else:
                    T.set_max_nreg(80, 0)
                    for i in T.serial(n_iter):
                        if i % 2 == 0:
                            load_step(i, 0, K0_l, K0_r, K0_t, Lat, Rope, Tables, k_ready, k_free, b, (blk0 + i) * BN,
                                      kv_len)
                        else:
                            load_step(i, 1, K1_l, K1_r, K1_t, Lat, Rope, Tables, k_ready, k_free, b, (blk0 + i) * BN,
                                      kv_len)

    return mla_decode_ws_kernel


_decode_ws_kernel = _tl.kernel_cache(build_decode_ws)


def representative_kernels():
    """V3's 128 heads over bf16 pages of 16 and over 656-byte FP8 rows (the CPU CI compile test)."""
    return [("mla_decode H128 bs16 split ragged (warp-specialised)",
             lambda: build_decode_ws(128, 576, 512, 16, True, True)),
            ("mla_decode H128 fp8 rows bs64 split ragged (warp-specialised)",
             lambda: build_decode_ws(128, 576, 512, 64, True, True, "bfloat16", 656))]
