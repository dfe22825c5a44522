"""Paged MLA decode (absorbed form), FlashMLA-style, in TileLang.

One CTA handles one query token and ``BH`` of its heads (h_kv = 1, so every head of the token reads the
same latent rows); the rows of a CTA are the heads, and the key axis is walked in tiles of ``BN``
cached tokens gathered from the paged cache through the block table. Scores use the full 576-wide
key (latent + rope); values are the first ``dv`` (512) columns of the same shared-memory tile, so each
cache row is read from HBM once per CTA.

Long contexts with few CTAs split the key axis (``n_split`` CTAs per token and head block, each
writing an fp32 partial output and its log-sum-exp); a second kernel combines them.

Causality inside a multi-token query block (speculative verification, MTP) needs no mask: query j of
a sequence with q_len queries sees the first ``seq_len - q_len + j + 1`` keys, so each CTA just
stops there.
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


def build_combine(H: int, DV: int, dtype: str = "bfloat16"):
    """out[t, h] = sum_s exp2(lse_s - lse) * o_s over the splits that saw any key."""
    T = _tl.language()
    NT, n_split = T.dynamic("NT"), T.dynamic("NSPLIT")
    threads = 128
    accum = "float32"

    @T.prim_func
    def mla_decode_combine(
        OPart: T.Tensor((NT, H, n_split, DV), accum),
        LsePart: T.Tensor((NT, H, n_split), accum),
        Out: T.Tensor((NT, H, DV), dtype),
    ):
        with T.Kernel(H, NT, threads=threads) as (h, t):
            o = T.alloc_fragment((DV,), accum)
            lse_max = T.alloc_var(accum)
            total = T.alloc_var(accum)
            lse_max = -T.infinity(accum)
            for s in T.serial(n_split):
                lse_max = T.max(lse_max, LsePart[t, h, s])
            total = 0
            for s in T.serial(n_split):
                total += T.exp2(LsePart[t, h, s] - lse_max)
            T.fill(o, 0)
            for s in T.serial(n_split):
                if LsePart[t, h, s] > -T.infinity(accum):
                    for i in T.Parallel(DV):
                        o[i] += T.exp2(LsePart[t, h, s] - lse_max) / total * OPart[t, h, s, i]
            T.copy(o, Out[t, h, :])

    return mla_decode_combine


_decode_kernel = _tl.kernel_cache(build_decode)
_combine_kernel = _tl.kernel_cache(build_combine)


def config(H: int, D: int, DV: int, BS: int) -> dict:
    """Tile configuration: BH heads per CTA; BN keys per step. A key tile is one page or a slice of
    one (TileLang lowers a whole-page copy to a TMA load, but not several pages into one tile), so
    small pages mean small key tiles and a deeper pipeline."""
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
    return int(min(64, max(1, round(sms / n_ctas))))


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
    if q.dtype not in (torch.bfloat16, torch.float16) or T_ == 0:
        from kernels_cpu.ops import mla_decode as ref  # float32: tensor cores would round to tf32

        return ref(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)
    R = D - dv
    dv_p, r_p, h_p = _round(dv, 64), _round(R, 16), _round(H, 16)
    if (dv_p, r_p) != (dv, R):  # odd test shapes only: real models have dv 512, rope 64
        q = _pad_last(q, [(dv, dv_p), (R, r_p)])
        cache = _pad_last(cache, [(dv, dv_p), (R, r_p)])
    if h_p != H:
        q = torch.nn.functional.pad(q, (0, 0, 0, h_p - H))
    q = q.contiguous()
    cache = cache.contiguous()
    Dp = dv_p + r_p
    BS = cache.shape[1]
    c = dict(cfg or config(h_p, Dp, dv_p, BS))
    BN = c["BN"]
    if BS < BN and BN % BS:
        BN = c["BN"] = BS
    elif BS > BN and BS % BN:
        raise ValueError(f"mla_decode: block size {BS} must divide or be a multiple of {BN}")
    ragged = T_ != B
    n_ctas = (h_p // c["BH"]) * T_
    if n_split is None:
        n_split = choose_split(n_ctas, _tl.num_sms(q.device.index or 0))
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
    min_blocks = max(1, 256 // BN) if n_split > 1 else 1  # at least 256 keys per split
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
    """(name, thunk -> prim_func) pairs compiled by the CPU CI test: real-model shapes, one of each kind."""
    c128, c16 = config(128, 576, 512, 64), config(16, 576, 512, 16)
    args128 = (c128["BH"], c128["BN"], c128["stages"], c128["threads"])
    args16 = (c16["BH"], c16["BN"], c16["stages"], c16["threads"])
    return [
        ("mla_decode H128 bs64", lambda: build_decode(128, 576, 512, 64, *args128, False, False)),
        ("mla_decode H16 bs16 split ragged", lambda: build_decode(16, 576, 512, 16, *args16, True, True)),
        ("mla_decode combine", lambda: build_combine(128, 512)),
    ]
