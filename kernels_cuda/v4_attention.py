"""DeepSeek-V4 sparse attention (``v4_sparse_attention``) in TileLang: one shared K=V head over the
sliding window of the token's sequence plus its chosen compressed entries, with a per-head sink.

One CTA per (query token, tile of BH heads); decode and prefill take the same kernel (every query
token carries its own position and sequence row, so a prefill chunk is just many tokens). The key
axis is walked in tiles of BN keys gathered row by row through the block tables: first the window
(positions p-W+1..p, paged by ``swa_tables``), then the compressed entries ``comp_ids[t]`` (paged
by ``comp_tables``; -1 = none). Scores and values use the same gathered rows (K == V), the first D
channels of a cache row (the CSA cache row is [K=V D | indexer key DI]).

The sink enters the online softmax as its initial state: running max m = sink / scale and running
sum l = 1 (the sink's own exp(sink - m)), output 0. So the running max is finite from the start and
fully masked tiles (a window reaching before position 0) need no special case.

Small batches (decode at batch 1 has 4 CTAs of work per layer on a 132-SM chip) take the split-KV form
(flash decoding): a third grid axis deals the token's key tiles to splits, each split writes its partial
state and ``combine_splits`` merges them, adding the sink exactly once. ``choose_splits`` decides from
the token count alone, so large batches and prefill keep the one-pass kernel.
"""

import torch

from kernels_cuda import _tl

LOG2E = 1.4426950408889634
#: heads per CTA and keys per tile (the 16-head tile configuration of ``mla_decode``: four warps, each
#: owning 16 key columns of the score tile and 128 output channels)
BH, BN, THREADS = 16, 64, 128
COMBINE_THREADS = 128


def _attend_macro(T, D: int, accum: str):
    """One key tile of the online softmax (K == V): scores, masked by ok_s, rescale, accumulate."""

    @T.macro
    def attend(K_s, Q_s, acc_s, P_s, acc_o, m_i, m_prev, alpha, row_sum, l_i, ok_s, scale_log2):
        T.gemm(Q_s, K_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
        for i, j in T.Parallel(BH, BN):
            acc_s[i, j] = T.if_then_else(ok_s[j] != 0, acc_s[i, j], -T.infinity(accum))
        T.copy(m_i, m_prev)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        for i in T.Parallel(BH):
            alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
        for i, j in T.Parallel(BH, BN):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(BH):
            l_i[i] = l_i[i] * alpha[i] + row_sum[i]
        for i, j in T.Parallel(BH, D):
            acc_o[i, j] *= alpha[i]
        T.copy(acc_s, P_s)
        T.gemm(P_s, K_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    return attend


def build_sparse_attention(H: int, D: int, W: int, BS: int, DS: int, DC: int, dtype: str = "bfloat16"):
    """H heads (a multiple of BH), head dim D, window W, window page size BS, cache row widths DS (window)
    and DC (compressed; rows' first D channels are the keys)."""
    T = _tl.language()
    NT, NB, NB2, EPB = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("NB2"), T.dynamic("EPB")
    B, M, M2, K = T.dynamic("B"), T.dynamic("M"), T.dynamic("M2"), T.dynamic("K")
    accum = "float32"
    NWT = (W + BN - 1) // BN  # window tiles
    assert H % BH == 0 and D % 64 == 0

    attend = _attend_macro(T, D, accum)

    @T.prim_func
    def v4_sparse_attention_kernel(
        Q: T.Tensor((NT, H, D), dtype),
        Swa: T.Tensor((NB, BS, DS), dtype),
        SwaTab: T.Tensor((B, M), "int32"),
        Comp: T.Tensor((NB2, EPB, DC), dtype),
        CompTab: T.Tensor((B, M2), "int32"),
        Ids: T.Tensor((NT, K), "int32"),
        SeqIdx: T.Tensor((NT,), "int32"),
        Pos: T.Tensor((NT,), "int32"),
        Sinks: T.Tensor((H,), accum),
        Out: T.Tensor((NT, H, D), dtype),
        scale_log2: T.float32,
    ):
        with T.Kernel(H // BH, NT, threads=THREADS) as (hb, t):
            Q_s = T.alloc_shared((BH, D), dtype)
            K_s = T.alloc_shared((BN, D), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            blk_s = T.alloc_shared((BN,), "int32")
            off_s = T.alloc_shared((BN,), "int32")
            ok_s = T.alloc_shared((BN,), "int32")
            acc_s = T.alloc_fragment((BH, BN), accum)
            acc_o = T.alloc_fragment((BH, D), accum)
            m_i = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            row_sum = T.alloc_fragment((BH,), accum)
            l_i = T.alloc_fragment((BH,), accum)

            b = SeqIdx[t]
            p = Pos[t]
            T.copy(Q[t, hb * BH:(hb + 1) * BH, :], Q_s)
            T.fill(acc_o, 0)
            for i in T.Parallel(BH):
                m_i[i] = Sinks[hb * BH + i] * LOG2E / scale_log2  # the sink, in raw score units
                l_i[i] = 1.0

            for wt in T.serial(NWT):  # the window: positions p-W+1..p, page by page
                for j in T.Parallel(BN):
                    pos = p - W + 1 + wt * BN + j
                    pc = T.max(pos, 0)
                    blk = SwaTab[b, T.min(pc // BS, M - 1)]
                    ok_s[j] = T.if_then_else((wt * BN + j < W) & (pos >= 0) & (blk >= 0), 1, 0)
                    blk_s[j] = T.max(blk, 0)
                    off_s[j] = pc % BS
                for j, d in T.Parallel(BN, D):
                    K_s[j, d] = T.if_then_else(ok_s[j] != 0, Swa[blk_s[j], off_s[j], d], T.cast(0, dtype))
                attend(K_s, Q_s, acc_s, P_s, acc_o, m_i, m_prev, alpha, row_sum, l_i, ok_s, scale_log2)

            for ct in T.serial(T.ceildiv(K, BN)):  # the chosen compressed entries
                for j in T.Parallel(BN):
                    jj = ct * BN + j
                    e = T.if_then_else(jj < K, Ids[t, T.min(jj, K - 1)], -1)
                    ec = T.max(e, 0)
                    blk = CompTab[b, T.min(ec // EPB, M2 - 1)]
                    ok_s[j] = T.if_then_else((e >= 0) & (blk >= 0), 1, 0)
                    blk_s[j] = T.max(blk, 0)
                    off_s[j] = ec % EPB
                for j, d in T.Parallel(BN, D):
                    K_s[j, d] = T.if_then_else(ok_s[j] != 0, Comp[blk_s[j], off_s[j], d], T.cast(0, dtype))
                attend(K_s, Q_s, acc_s, P_s, acc_o, m_i, m_prev, alpha, row_sum, l_i, ok_s, scale_log2)

            for i, j in T.Parallel(BH, D):
                acc_o[i, j] /= l_i[i]
            T.copy(acc_o, Out[t, hb * BH:(hb + 1) * BH, :])

    return v4_sparse_attention_kernel


def build_sparse_attention_split(H: int, D: int, W: int, BS: int, DS: int, DC: int, dtype: str = "bfloat16"):
    """Flash-decoding form of ``build_sparse_attention`` for small batches: grid (head tile, token, split);
    the key tiles of a token (window tiles, then compressed tiles) are dealt to the splits in contiguous
    runs of ``tiles_per_split``. A split writes its unnormalised output, running max (raw score units)
    and running sum; ``combine_splits`` merges them and adds the sink once. Every split starts its
    running max at the sink (finite, so an all-masked split stays NaN-free) with a running sum of 0."""
    T = _tl.language()
    NT, NB, NB2, EPB = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("NB2"), T.dynamic("EPB")
    B, M, M2, K, S = T.dynamic("B"), T.dynamic("M"), T.dynamic("M2"), T.dynamic("K"), T.dynamic("S")
    accum = "float32"
    NWT = (W + BN - 1) // BN
    assert H % BH == 0 and D % 64 == 0
    attend = _attend_macro(T, D, accum)

    @T.prim_func
    def v4_sparse_attention_split_kernel(
        Q: T.Tensor((NT, H, D), dtype),
        Swa: T.Tensor((NB, BS, DS), dtype),
        SwaTab: T.Tensor((B, M), "int32"),
        Comp: T.Tensor((NB2, EPB, DC), dtype),
        CompTab: T.Tensor((B, M2), "int32"),
        Ids: T.Tensor((NT, K), "int32"),
        SeqIdx: T.Tensor((NT,), "int32"),
        Pos: T.Tensor((NT,), "int32"),
        Sinks: T.Tensor((H,), accum),
        Opart: T.Tensor((NT, S, H, D), accum),
        Mpart: T.Tensor((NT, S, H), accum),
        Lpart: T.Tensor((NT, S, H), accum),
        scale_log2: T.float32,
        tiles_per_split: T.int32,
    ):
        with T.Kernel(H // BH, NT, S, threads=THREADS) as (hb, t, sp):
            Q_s = T.alloc_shared((BH, D), dtype)
            K_s = T.alloc_shared((BN, D), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            blk_s = T.alloc_shared((BN,), "int32")
            off_s = T.alloc_shared((BN,), "int32")
            ok_s = T.alloc_shared((BN,), "int32")
            acc_s = T.alloc_fragment((BH, BN), accum)
            acc_o = T.alloc_fragment((BH, D), accum)
            m_i = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            row_sum = T.alloc_fragment((BH,), accum)
            l_i = T.alloc_fragment((BH,), accum)

            b = SeqIdx[t]
            p = Pos[t]
            T.copy(Q[t, hb * BH:(hb + 1) * BH, :], Q_s)
            T.fill(acc_o, 0)
            for i in T.Parallel(BH):
                m_i[i] = Sinks[hb * BH + i] * LOG2E / scale_log2
                l_i[i] = 0.0  # the sink's own mass is added once, by the combine

            for it in T.serial(tiles_per_split):
                tile = sp * tiles_per_split + it  # < NWT: a window tile; else compressed tile tile - NWT
                for j in T.Parallel(BN):
                    wj = tile * BN + j
                    pos = p - W + 1 + wj
                    pc = T.max(pos, 0)
                    wblk = SwaTab[b, T.min(pc // BS, M - 1)]
                    jj = (tile - NWT) * BN + j
                    e = T.if_then_else((jj >= 0) & (jj < K), Ids[t, T.min(T.max(jj, 0), K - 1)], -1)
                    ec = T.max(e, 0)
                    cblk = CompTab[b, T.min(ec // EPB, M2 - 1)]
                    ok_s[j] = T.if_then_else(
                        tile < NWT, T.if_then_else((wj < W) & (pos >= 0) & (wblk >= 0), 1, 0),
                        T.if_then_else((e >= 0) & (cblk >= 0), 1, 0))
                    blk_s[j] = T.if_then_else(tile < NWT, T.max(wblk, 0), T.max(cblk, 0))
                    off_s[j] = T.if_then_else(tile < NWT, pc % BS, ec % EPB)
                for j, d in T.Parallel(BN, D):
                    K_s[j, d] = T.if_then_else(
                        ok_s[j] != 0,
                        T.if_then_else(tile < NWT, Swa[blk_s[j], off_s[j], d], Comp[blk_s[j], off_s[j], d]),
                        T.cast(0, dtype))
                attend(K_s, Q_s, acc_s, P_s, acc_o, m_i, m_prev, alpha, row_sum, l_i, ok_s, scale_log2)

            T.copy(acc_o, Opart[t, sp, hb * BH:(hb + 1) * BH, :])
            for i in T.Parallel(BH):
                Mpart[t, sp, hb * BH + i] = m_i[i]
                Lpart[t, sp, hb * BH + i] = l_i[i]

    return v4_sparse_attention_split_kernel


def build_split_combine(H: int, D: int, dtype: str = "bfloat16"):
    """The split-KV combine as one launch (the math of ``combine_splits``): a CTA per (head, token), each
    thread holding D / 128 output channels; the max, the weights and the sum are per-thread scalars over
    the S splits (all threads compute them: S is small)."""
    T = _tl.language()
    NT, S = T.dynamic("NT"), T.dynamic("S")
    accum = "float32"

    @T.prim_func
    def v4_split_combine_kernel(
        Opart: T.Tensor((NT, S, H, D), accum),
        Mpart: T.Tensor((NT, S, H), accum),
        Lpart: T.Tensor((NT, S, H), accum),
        Sinks: T.Tensor((H,), accum),
        Out: T.Tensor((NT, H, D), dtype),
        scale_log2: T.float32,
    ):
        with T.Kernel(H, NT, threads=COMBINE_THREADS) as (h, t):
            acc = T.alloc_fragment((D,), accum)
            m = T.alloc_local((1,), accum)
            den = T.alloc_local((1,), accum)
            w = T.alloc_local((1,), accum)
            m[0] = Sinks[h] * LOG2E / scale_log2
            for s in T.serial(S):
                m[0] = T.max(m[0], Mpart[t, s, h])
            den[0] = T.exp2((Sinks[h] * LOG2E / scale_log2 - m[0]) * scale_log2)
            T.fill(acc, 0)
            for s in T.serial(S):
                w[0] = T.exp2((Mpart[t, s, h] - m[0]) * scale_log2)
                den[0] += Lpart[t, s, h] * w[0]
                for d in T.Parallel(D):
                    acc[d] += Opart[t, s, h, d] * w[0]
            for d in T.Parallel(D):
                Out[t, h, d] = T.cast(acc[d] / den[0], dtype)

    return v4_split_combine_kernel


_kernel = _tl.kernel_cache(build_sparse_attention)
_split_kernel = _tl.kernel_cache(build_sparse_attention_split)
_combine_kernel = _tl.kernel_cache(build_split_combine)


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def choose_splits(num_tokens: int, heads: int, key_tiles: int, sms: int) -> int:
    """Splits of the key tiles per (token, head tile): none once the unsplit grid fills the chip (large
    batches, prefill), else enough for about two CTAs per SM, at most one per key tile."""
    ctas = num_tokens * (heads // BH)
    if ctas >= sms:
        return 1
    return max(1, min(key_tiles, -(-2 * sms // ctas)))


def combine_splits(o_part, m_part, l_part, sinks, scale: float):
    """The combine's math in torch (the specification ``build_split_combine`` implements in one launch;
    the tests compare the two). Merge the splits' (unnormalised output, running max in raw score units,
    running sum) and the sink, counted once:
    out = sum_s O_s 2^((m_s - M) c) / (sum_s l_s 2^((m_s - M) c) + e^(sink - M scale)),
    with c = scale log2(e) and M the largest split max (>= sink / scale: every exponent is <= 0)."""
    c = scale * LOG2E
    m = m_part.amax(dim=1, keepdim=True)  # [T, 1, H]
    w = torch.exp2((m_part - m) * c)  # [T, S, H]
    m = m.squeeze(1)
    den = (l_part * w).sum(dim=1) + torch.exp(sinks - m * scale)  # [T, H]
    return torch.einsum("tshd,tsh->thd", o_part, w) / den.unsqueeze(-1)


def v4_sparse_attention(q, swa_cache, swa_tables, comp_cache, comp_tables, comp_ids, seq_idx, positions, window,
                        sinks, scale, splits: int | None = None):
    """q[T, H, D] over the window of swa_cache[NB, BS, >=D] plus comp_ids[T, K] rows of comp_cache[NB2, EPB, >=D]
    (``kernels_cpu.v4_ops.v4_sparse_attention``). Sync-free: capturable in a CUDA graph. ``splits`` (tests)
    forces the number of key splits; by default ``choose_splits`` picks it from the token count (a shape,
    so a captured graph keeps its choice)."""
    T_, H, D = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16) or T_ == 0 or D % 64 or swa_cache.dtype != q.dtype:
        from kernels_cpu.v4_ops import v4_sparse_attention as ref  # float32: tf32 tensor cores would miss

        return ref(q, swa_cache, swa_tables, comp_cache, comp_tables, comp_ids, seq_idx, positions, window, sinks,
                   scale)
    dev = q.device
    Hp = _round(H, BH)
    sinks = sinks.float()
    if Hp != H:  # odd test shapes only (V4-Flash/Pro: 64/128 heads); padded heads are dropped
        q = torch.nn.functional.pad(q, (0, 0, 0, Hp - H))
        sinks = torch.nn.functional.pad(sinks, (0, Hp - H))
    if comp_ids is None or comp_ids.shape[1] == 0:  # window only: one compressed tile, every key masked
        comp_cache = swa_cache[:1, :1, :D]
        comp_tables = swa_tables[:, :1]
        comp_ids = torch.full((T_, 1), -1, dtype=torch.int32, device=dev)  # (no zero-size tensor for TileLang)
    if comp_cache.stride(-1) != 1 or comp_cache.dtype != q.dtype:
        comp_cache = comp_cache.contiguous().to(q.dtype)
    W = int(window)
    key_tiles = -(-W // BN) + -(-comp_ids.shape[1] // BN)
    if splits is None:
        splits = choose_splits(T_, Hp, key_tiles, _tl.num_sms(dev.index or 0))
    splits = max(1, min(int(splits), key_tiles))
    config = (Hp, D, W, swa_cache.shape[1], swa_cache.shape[2], comp_cache.shape[2], _tl.tl_dtype(q.dtype))
    args = (q.contiguous(), swa_cache, swa_tables.to(torch.int32).contiguous(), comp_cache.contiguous(),
            comp_tables.to(torch.int32).contiguous(), comp_ids.to(torch.int32).contiguous(),
            seq_idx.to(torch.int32).contiguous(), positions.to(torch.int32).contiguous(), sinks.contiguous())
    if splits == 1:
        out = torch.empty(T_, Hp, D, dtype=q.dtype, device=dev)
        _kernel(*config)(*args, out, float(scale * LOG2E))
    else:
        tps = -(-key_tiles // splits)
        splits = -(-key_tiles // tps)  # no split left without a tile
        o_part = torch.empty(T_, splits, Hp, D, dtype=torch.float32, device=dev)
        m_part = torch.empty(T_, splits, Hp, dtype=torch.float32, device=dev)
        l_part = torch.empty(T_, splits, Hp, dtype=torch.float32, device=dev)
        _split_kernel(*config)(*args, o_part, m_part, l_part, float(scale * LOG2E), tps)
        out = torch.empty(T_, Hp, D, dtype=q.dtype, device=dev)
        _combine_kernel(Hp, D, _tl.tl_dtype(q.dtype))(o_part, m_part, l_part, sinks.contiguous(), out,
                                                      float(scale * LOG2E))
    return out if Hp == H else out[:, :H].contiguous()


def representative_kernels():
    """V4-Flash: 64 heads, D 512, window 128, pages of 256 tokens; CSA rows 512 + 128 wide."""
    return [("v4_sparse_attention H64 D512 W128 CSA", lambda: build_sparse_attention(64, 512, 128, 256, 512, 640)),
            ("v4_sparse_attention split-KV H64 D512 W128 CSA",
             lambda: build_sparse_attention_split(64, 512, 128, 256, 512, 640)),
            ("v4 split-KV combine H64 D512", lambda: build_split_combine(64, 512))]
