"""Paged MLA decode (absorbed form), FlashMLA-style, in TileLang, over a bf16/fp16 cache or FP8 latent rows.

h_kv = 1: every head of a query token reads the same latent rows, so a CTA takes one query token and
a tile of its heads as the rows of the score matrix, and walks the key axis in tiles of cached tokens
gathered through the block table. Scores use the whole 576-wide key (latent + rope); values are the
first ``dv`` (512) columns of the same shared-memory tile, so each cache row is read once per CTA.

Kernels:

* :func:`build_decode` (any head count padded to 16; V2-Lite's 16): TileLang's automatic TMA pipeline
  with 16/32-head tiles on mma.sync; a key tile is one page or a slice of one. One builder for both row
  formats: the key tile is read through strided views of the cache's rows (latent, scales, rope; slot =
  page * block_size + offset). ``W = 0``: plain rows of ``dtype``. ``W > 0``: FlashMLA's FP8 rows of W
  bytes (``kernels_cpu/kv_fp8.py``: e4m3 latent, a power-of-two float32 scale per 128 values, bf16
  rope), dequantised in the CTA into the bf16 key tile the GEMMs read (``e4m3 * scale`` is exact in
  bf16, so the kernel attends over exactly the reference's keys).
* :func:`kernels_cuda.mla_decode_ws.build_decode_ws` (64-head multiples, V3's 128; both row formats):
  warp-specialised like FlashMLA; with FP8 rows its loader warpgroup converts the latent in registers.
* :func:`build_combine`: merges key splits.

Key splits. A grid that fills less than one wave of SMs splits the key axis: ``n_split`` CTAs per token
and head tile (:func:`choose_split`, from the token count, the head tiles and the SM count: a shape, so
fixed per CUDA-graph bucket), each writing an fp32 partial output and its log-sum-exp. How many of them
get keys is decided on the device from the sequence length: at least ``split_keys`` keys per split
(``SPLIT_KEYS``), so a short context runs a few splits of several tiles each and the rest of the grid
exits at once; the combine reads only the splits that got keys (a prefix).

Causality inside a multi-token query block (speculative verification, MTP) needs no mask: query j of
a sequence with q_len queries sees the first ``seq_len - q_len + j + 1`` keys, so each CTA just stops
there. Nothing synchronises with the host (ragged token -> sequence maps are computed on the device),
so the op can be captured in a CUDA graph.
"""

import math

import torch

from kernels_cuda import _tl

LOG2E = 1.4426950408889634
TILE = 128  # latent values per FP8 scale
MAX_SPLIT = 64  # most key splits per (token, head tile): the combine stages the split scores in registers
#: fewest keys per split (the rest of a split grid idles). Measured on the H200 (docs/mla_decode.md): with the
#: chunked combine, one 64-key tile per split beats 256 and 512 at batch 1 and 8 (a split's partial output
#: costs less than a tile's latency in a CTA's pipeline)
SPLIT_KEYS = 64
SPLIT_OVERHEAD = 0.01  # a split's extra cost as a fraction of a CTA's work (choose_split)


def key_window_macro(BN: int, ragged: bool, n_split):
    """The decode kernels' shared prologue, a macro (t, sp, TokSeq, CuQ, SeqLens, min_blocks) -> (sequence b,
    its keys visible to query token t, split sp's first key tile, its tile count, the sequence's tile count):
    ragged query blocks map tokens to sequences through ``TokSeq``; each split gets at least ``min_blocks`` tiles
    of ``BN`` keys (``n_split``: the grid's split extent)."""
    T = _tl.language()

    @T.macro
    def key_window(t, sp, TokSeq, CuQ, SeqLens, min_blocks):
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
        return b, kv_len, blk0, n_iter, n_blocks

    return key_window


def build_decode(H: int, DV: int, DPE: int, BS: int, BH: int, BN: int, stages: int, threads: int,
                 split: bool, ragged: bool, dtype: str = "bfloat16", W: int = 0, mma: str | None = None,
                 pdl: bool = False):
    """The attention kernel. ``split``: write per-split partials (the split count is the grid's z
    extent, taken from ``OPart``); else the final output. ``ragged``: token -> sequence comes from
    ``TokSeq`` (else token t is sequence t, the all-q_len-1 case). ``W``: 0 for a cache of ``dtype`` rows
    (DV + DPE values: ``Scales`` is unused), else the byte width of FP8 rows (module docstring). ``mma``: the
    dtype of the shared tiles and the tensor-core math when not ``dtype``: "float16" under a bf16 model with
    FP8 rows, where e4m3 -> f16 is one instruction per pair and the power-of-two scale one f16 multiply (q,
    the latents and P fit f16's range; it keeps 3 more mantissa bits than bf16). ``pdl`` (``_tl.PDL_ENV``): it
    waits for the kernel before it (the query and the new cache entry) at its start (``_tl.pdl_gate``)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    FP8 = W > 0
    D = DV + DPE
    HB = H // BH
    accum = "float32"
    assert H % BH == 0 and DV % 16 == 0 and DPE % 16 == 0
    assert (BN % BS == 0) if BS < BN else (BS % BN == 0)
    if FP8:
        G = -(-DV // TILE)
        lat_t, rope_t, WL, WS, WR = "float8_e4m3", "bfloat16", W, W // 4, W // 2
        # TMA needs 16-byte aligned row strides and view starts: true for the real 656-byte rows (L = 512);
        # narrower latents (test shapes, the tiny model) load with plain copies
        tma = W % 16 == 0 and (DV + 4 * G) % 16 == 0
        assert W % 4 == 0
    else:
        G, lat_t, rope_t, WL, WS, WR, tma = 1, dtype, dtype, D, 1, D, True
    stages = stages if tma else 1  # TileLang 0.1.15 fails to generate multi-stage cp.async for those rows
    cdt = mma or dtype  # the tiles' and the tensor cores' dtype
    rope_cast = rope_t != cdt
    NT, NS, NSS, B, B1, M = (T.dynamic(n) for n in ("NT", "NS", "NSS", "B", "B1", "M"))
    NTP, n_split = T.dynamic("NTP"), T.dynamic("NSPLIT")
    ninf = -T.infinity(accum)
    SPLIT = split

    key_window = key_window_macro(BN, ragged, n_split)

    @T.prim_func
    def mla_decode_kernel(
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
        with T.Kernel(HB, NT, n_split, threads=threads) as (hb, t, sp):
            Q_s = T.alloc_shared((BH, DV), cdt)
            Qpe_s = T.alloc_shared((BH, DPE), cdt)
            Kq_s = T.alloc_shared((BN, DV) if FP8 else (1, 16), lat_t)
            Ks_s = T.alloc_shared((BN, G) if FP8 else (1, 4), "float32")
            KV_s = T.alloc_shared((BN, DV), cdt)
            Kr_s = T.alloc_shared((BN, DPE), rope_t)
            Kpe_s = T.alloc_shared((BN, DPE) if rope_cast else (1, 16), cdt)
            P_s = T.alloc_shared((BH, BN), cdt)
            acc_s = T.alloc_fragment((BH, BN), accum)
            acc_o = T.alloc_fragment((BH, DV), accum)
            m_i = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            row_sum = T.alloc_fragment((BH,), accum)
            l_i = T.alloc_fragment((BH,), accum)
            if pdl:
                gate()

            b, kv_len, blk0, n_iter, n_blocks = key_window(t, sp, TokSeq, CuQ, SeqLens, min_blocks)

            T.copy(Q[t, hb * BH:(hb + 1) * BH, 0:DV], Q_s)
            T.copy(Q[t, hb * BH:(hb + 1) * BH, DV:D], Qpe_s)
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, ninf)

            for kk in T.Pipelined(n_iter, num_stages=stages):
                pos0 = (blk0 + kk) * BN
                if BS >= BN:
                    s0 = Tables[b, pos0 // BS] * BS + pos0 % BS
                    if FP8:
                        T.copy(Lat[s0:s0 + BN, :], Kq_s, disable_tma=not tma)
                        T.copy(Scales[s0:s0 + BN, :], Ks_s, disable_tma=not tma)
                    else:
                        T.copy(Lat[s0:s0 + BN, :], KV_s)
                    T.copy(Rope[s0:s0 + BN, :], Kr_s, disable_tma=not tma)
                else:
                    for p in T.unroll(BN // BS):
                        # table columns past the context may hold junk or -1 page ids: masked keys, read
                        # from page 0 at worst
                        s1 = T.max(Tables[b, T.min(pos0 // BS + p, M - 1)], 0) * BS
                        if FP8:
                            T.copy(Lat[s1:s1 + BS, :], Kq_s[p * BS:(p + 1) * BS, :], disable_tma=not tma)
                            T.copy(Scales[s1:s1 + BS, :], Ks_s[p * BS:(p + 1) * BS, :], disable_tma=not tma)
                        else:
                            T.copy(Lat[s1:s1 + BS, :], KV_s[p * BS:(p + 1) * BS, :])
                        T.copy(Rope[s1:s1 + BS, :], Kr_s[p * BS:(p + 1) * BS, :], disable_tma=not tma)
                if FP8:
                    for j, d in T.Parallel(BN, DV):
                        if cdt == "float16":  # e4m3 -> f16 is one instruction per pair; the scale is exact
                            KV_s[j, d] = T.cast(Kq_s[j, d], cdt) * T.cast(Ks_s[j, d // TILE], cdt)
                        else:
                            KV_s[j, d] = T.cast(T.cast(Kq_s[j, d], accum) * Ks_s[j, d // TILE], cdt)
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                if rope_cast:
                    for j, d in T.Parallel(BN, DPE):
                        Kpe_s[j, d] = T.cast(Kr_s[j, d], cdt)
                    T.gemm(Qpe_s, Kpe_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                else:
                    T.gemm(Qpe_s, Kr_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.if_then_else(pos0 + j < kv_len, acc_s[i, j], ninf)
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
                    m_prev[i] = T.if_then_else(l_i[i] > 0, T.log2(l_i[i]) + m_i[i] * scale_log2, ninf)
                T.copy(m_prev, LsePart[t, hb * BH:(hb + 1) * BH, sp])
                if sp == 0 and n_iter == n_blocks:  # the only live split: the final output (the combine skips it)
                    T.copy(acc_o, Out[t, hb * BH:(hb + 1) * BH, :])
                else:
                    T.copy(acc_o, OPart[t, hb * BH:(hb + 1) * BH, sp, :])
            else:
                for i, j in T.Parallel(BH, DV):
                    acc_o[i, j] /= l_i[i]
                T.copy(acc_o, Out[t, hb * BH:(hb + 1) * BH, :])

    return mla_decode_kernel


def split_weights_macro(T, S: int):
    """A macro: the merge weights of token t, head h's key splits (``S`` = ``MAX_SPLIT`` slots, ``n_split`` of them
    in the grid) from their log-sum-exps: ``w_s[s]`` = exp2(lse_s - max) / sum into shared memory, and ``n_s[0]``
    the live splits (a split with no keys has lse -inf; the live ones are a prefix). The fragments are scratch.
    Shared by the combine and ``mla_decode_uv``'s merge, so both weigh the splits alike."""
    ninf = -T.infinity("float32")

    @T.macro
    def split_weights(LsePart, t, h, lse, wts, live, mx, total, n_live, w_s, n_s):
        for i, s in T.Parallel(1, S):  # LsePart.shape[2]: the grid's split extent (the kernel's dynamic NSPLIT)
            lse[i, s] = T.if_then_else(s < LsePart.shape[2], LsePart[t, h, T.min(s, LsePart.shape[2] - 1)], ninf)
        T.reduce_max(lse, mx, dim=1)
        for i, s in T.Parallel(1, S):
            wts[i, s] = T.if_then_else(lse[i, s] > ninf, T.exp2(lse[i, s] - mx[i]), 0.0)
            live[i, s] = T.if_then_else(lse[i, s] > ninf, 1.0, 0.0)
        T.reduce_sum(wts, total, dim=1)
        T.reduce_sum(live, n_live, dim=1)
        for i, s in T.Parallel(1, S):
            w_s[s] = wts[i, s] / total[i]
        for i in T.Parallel(1):
            n_s[0] = T.cast(n_live[i], "int32")

    return split_weights


def build_combine(H: int, DV: int, dtype: str = "bfloat16", chunk: int = 16, stages: int = 2):
    """out[t, h] = sum_s exp2(lse_s - lse) * o_s over the splits that saw any key (a prefix of them: a
    split's key range starts at split * keys_per_split). The split scores are loaded in one parallel
    pass; the partial outputs of the live splits arrive ``chunk`` splits per copy (one TMA load of
    chunk x DV floats, ``stages`` in flight), so 32 live splits cost two loads' latency, not 32. A
    single live split has written the output itself (short contexts at small batch): nothing to do."""
    T = _tl.language()
    NT, n_split = T.dynamic("NT"), T.dynamic("NSPLIT")
    threads = 128
    accum = "float32"
    S = MAX_SPLIT
    split_weights = split_weights_macro(T, S)

    @T.prim_func
    def mla_decode_combine(
        OPart: T.Tensor((NT, H, n_split, DV), accum),
        LsePart: T.Tensor((NT, H, n_split), accum),
        Out: T.Tensor((NT, H, DV), dtype),
    ):
        with T.Kernel(H, NT, threads=threads) as (h, t):
            lse = T.alloc_fragment((1, S), accum)
            wts = T.alloc_fragment((1, S), accum)
            live = T.alloc_fragment((1, S), accum)
            mx = T.alloc_fragment((1,), accum)
            total = T.alloc_fragment((1,), accum)
            n_live = T.alloc_fragment((1,), accum)
            w_s = T.alloc_shared((S,), accum)
            n_s = T.alloc_shared((1,), "int32")
            o_s = T.alloc_shared((chunk, DV), accum)
            o = T.alloc_fragment((DV,), accum)
            split_weights(LsePart, t, h, lse, wts, live, mx, total, n_live, w_s, n_s)
            n = T.alloc_var("int32")
            n = n_s[0]
            if n_s[0] != 1:  # one live split wrote the output itself
                T.fill(o, 0)
                for c in T.Pipelined(T.ceildiv(n, chunk), num_stages=stages):
                    # rows past the live splits (or past n_split: zero-filled) hold stale partials: masked
                    T.copy(OPart[t, h, c * chunk:(c + 1) * chunk, :], o_s)
                    for d in T.Parallel(DV):
                        for j in T.serial(chunk):
                            o[d] += T.if_then_else(c * chunk + j < n, w_s[T.min(c * chunk + j, S - 1)] * o_s[j, d],
                                                   0.0)
                T.copy(o, Out[t, h, :])

    return mla_decode_combine


_decode_kernel = _tl.kernel_cache(build_decode)
_combine_kernel = _tl.kernel_cache(build_combine)


def config(H: int, D: int, DV: int, BS: int, fp8: bool = False, ws: bool = True) -> dict:
    """Tile configuration. 64-head multiples over a bf16 cache take the warp-specialised kernel (64 heads
    x 64 keys per step, any page size that divides or is a multiple of 64). Otherwise BH heads per CTA
    and BN keys per step in the auto-pipelined kernel, where a key tile is one page or a slice of one
    (TileLang lowers a whole-page copy to a TMA load, but not several pages into one tile), so small
    pages mean small key tiles and a deeper pipeline. FP8 rows in the tile kernel: the dequantised bf16
    key tile sits beside the staged e4m3 one, so at most 32 heads per CTA (a 64-head Q tile plus both
    would overflow shared memory at L = 512); 64-head multiples take the ws kernel, whose loader
    warpgroup converts the rows in registers."""
    ws_ok = DV % 128 == 0 and (D - DV) % 16 == 0 and D - DV <= 64 and (64 % BS == 0 or BS % 64 == 0)
    if H % 64 == 0 and ws_ok and ws:
        return {"kernel": "ws", "BH": 64, "BN": 64}
    BN = min(64, BS)
    stages = 2 if BN >= 64 else (4 if BN >= 16 else 8)
    if H % 64 == 0 and not fp8:
        return {"BH": 64, "BN": BN, "stages": stages, "threads": 256}
    BH = 32 if H % 32 == 0 else 16
    # each warp needs >= 8 key columns of the score tile (FullCol split of the key axis); FP8 rows take 8
    # consumer warps at 64-key tiles: twice the hands for the dequantisation pass, and TileLang then
    # places one barrier before it instead of one per 8-value chunk
    warps = 8 if fp8 and BN >= 64 else max(1, min(4, BN // 8))
    return {"BH": BH, "BN": BN, "stages": stages, "threads": 32 * warps}


def choose_split(n_ctas: int, sms: int) -> int:
    """Key splits per (token, head tile) for a grid of ``n_ctas`` (one CTA per SM: the shared-memory tiles
    take most of it). ``s`` splits run ``s * n_ctas`` CTAs of 1/s of the keys each in ``ceil(s * n_ctas /
    sms)`` waves, and each split costs ~``SPLIT_OVERHEAD`` of a CTA (its partial output, the combine's
    read of it): the count with the least modelled time. So a grid short of one wave fills it (batch 1:
    64 splits, sized on the device by ``SPLIT_KEYS``), and a grid of 1.1 waves (151 CTAs on 132 SMs) is
    cut into ~7 well-packed waves instead of running a nearly empty second wave at full length."""
    def cost(s: int) -> float:
        return math.ceil(s * n_ctas / sms) / s * (1 + SPLIT_OVERHEAD * (s - 1))

    return min(range(1, MAX_SPLIT + 1), key=lambda s: (cost(s), s))


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


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _fp8_views(q, cache, dv):
    """The e4m3 latent, scales and rope views of FP8 rows, and their width W (checked against q and dv)."""
    from kernels_cpu.kv_fp8 import latent_dims
    from kernels_cuda.kv_cache import fp8_row_views

    W = cache.shape[-1]
    L, _ = latent_dims(q.shape[-1], W)
    if L != dv:
        raise ValueError(f"mla_decode: FP8 latent rows of {W} bytes hold a {L}-wide latent, but dv is {dv}")
    if not cache.is_contiguous():
        raise ValueError("mla_decode: the FP8 cache must be contiguous")
    return (*fp8_row_views(cache, L), W)


def _attend(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, n_split: int | None = None,
            cfg: dict | None = None, split_keys: int = SPLIT_KEYS):
    """The attention launch of :func:`mla_decode` (the reference's result where no kernel applies: float32, a
    cache of another dtype). Returns ``(out, None)`` from the reference, else ``(out, split)``: ``out`` [T, h_p,
    dv_p] (padded heads and latent columns) holds the final output unless ``split`` (``(o_part, lse_part)``: the
    key splits' partials, to be merged by the combine or ``mla_decode_uv``'s kernel) is not None; then it holds a
    token and head tile's output only where its one live split wrote it (the combine skips those)."""
    T_, H, D = q.shape
    B = seq_lens.shape[0]
    fp8 = cache.dtype == torch.uint8
    if q.dtype not in (torch.bfloat16, torch.float16) or T_ == 0 or not (fp8 or cache.dtype == q.dtype):
        # float32: tensor cores would round to tf32; a cache of another dtype (kv_cache_dtype "bf16" under a
        # float16 model) is read by the reference
        from kernels_cpu.ops import mla_decode as ref

        return ref(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv), None
    BS = cache.shape[1]
    R = D - dv
    dv_p, r_p = (dv, R) if fp8 else (_round(dv, 64), _round(R, 16))
    if (dv_p, r_p) != (dv, R):  # odd test shapes only: real models have dv 512, rope 64
        q = _pad_last(q, [(dv, dv_p), (R, r_p)])
        cache = _pad_last(cache, [(dv, dv_p), (R, r_p)])
    # the ws kernel's FP8 loader converts into bf16 tiles and loads 16-byte vectors of the rows
    ws = not fp8 or (q.dtype == torch.bfloat16 and cache.shape[-1] % 16 == 0)
    c = dict(cfg or config(_round(H, 16), dv_p + r_p, dv_p, BS, fp8, ws))
    h_p = _round(H, c["BH"])  # 64-row tiles of the ws kernel are also usable for 16 heads: padded rows
    if h_p != H:
        q = torch.nn.functional.pad(q, (0, 0, 0, h_p - H))
    q, cache = q.contiguous(), cache.contiguous()
    BN = c["BN"]
    if BS < BN and BN % BS:
        BN = c["BN"] = BS
    elif BS > BN and BS % BN:
        raise ValueError(f"mla_decode: block size {BS} must divide or be a multiple of {BN}")
    ragged = T_ != B
    if n_split is None:
        n_split = choose_split((h_p // c["BH"]) * T_, _tl.num_sms(q.device.index or 0))
    if not 1 <= n_split <= MAX_SPLIT:
        raise ValueError(f"mla_decode: n_split={n_split} is outside 1..{MAX_SPLIT}")
    dev = q.device
    if ragged:
        tok_seq = torch.searchsorted(cu_q_lens[1:].to(dev), torch.arange(T_, device=dev), right=True)
        tok_seq = tok_seq.to(torch.int32)
    else:
        tok_seq = torch.empty(T_, dtype=torch.int32, device=dev)  # unused
    out = torch.empty(T_, h_p, dv_p, dtype=q.dtype, device=dev)
    parts = T_ if n_split > 1 else 1
    o_part = torch.empty(parts, h_p, n_split, dv_p, dtype=torch.float32, device=dev)
    lse_part = torch.empty(parts, h_p, n_split, dtype=torch.float32, device=dev)
    min_blocks = max(1, split_keys // BN) if n_split > 1 else 1
    meta = (block_tables.to(torch.int32).contiguous(), cu_q_lens.to(torch.int64).contiguous(),
            seq_lens.to(torch.int64).contiguous(), tok_seq, out, o_part, lse_part, float(scale * LOG2E), min_blocks)
    dt = _tl.tl_dtype(q.dtype)
    if fp8:
        lat, scales, rope, W = _fp8_views(q, cache, dv)
    else:
        rows = cache.view(-1, dv_p + r_p)
        lat, rope, W = rows[:, :dv_p], rows[:, dv_p:], 0
        scales = torch.empty(1, 1, dtype=torch.float32, device=dev)  # unused
    if c.get("kernel") == "ws":
        from kernels_cuda.mla_decode_ws import _decode_ws_kernel

        kern = _decode_ws_kernel(h_p, dv_p + r_p, dv_p, BS, n_split > 1, ragged, dt, W)
    else:
        kern = _decode_kernel(h_p, dv_p, r_p, BS, c["BH"], BN, c["stages"], c["threads"], n_split > 1, ragged, dt, W,
                              c.get("mma"), *_tl.pdl_arg(T_))
    kern(q, lat, scales, rope, *meta)
    return out, ((o_part, lse_part) if n_split > 1 else None)


def mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, *, n_split: int | None = None,
               cfg: dict | None = None, split_keys: int = SPLIT_KEYS):
    """q[T, H, dv + rope] over ``cache`` (``[NB, BS, dv + rope]`` of q's dtype, or uint8 FP8 rows
    ``[NB, BS, W]``) -> [T, H, dv]. ``n_split`` forces the split count, ``cfg`` the tile configuration,
    ``split_keys`` the fewest keys per split (benchmarks)."""
    T_, H, _ = q.shape
    out, split = _attend(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, n_split, cfg, split_keys)
    if split is not None:
        h_p, dv_p = out.shape[1:]
        # a small grid (batch 1) pipelines 16-split loads; a large one keeps the shared tiles small so that
        # many CTAs share an SM (2 x 32 KB stages cost V3's batch 8 three waves, measured 5-14 % slower)
        small_grid = h_p * T_ <= 2 * _tl.num_sms(q.device.index or 0)
        _combine_kernel(h_p, dv_p, _tl.tl_dtype(q.dtype), *((16, 2) if small_grid else (8, 1)))(*split, out)
    if out.shape[1:] != (H, dv):
        out = out[:, :H, :dv].contiguous()
    return out


def representative_kernels():
    """(name, thunk -> prim_func) pairs compiled by the CPU CI test, at real-model shapes (576/512
    latents): V2-Lite's 16 heads over bf16 pages of 16 and over 656-byte FP8 rows (TMA), the tiny
    model's 100-byte FP8 rows (cp.async), and the combine."""
    c16 = config(16, 576, 512, 16)
    args16 = (c16["BH"], c16["BN"], c16["stages"], c16["threads"])
    return [
        ("mla_decode H16 bs16 split ragged", lambda: build_decode(16, 512, 64, 16, *args16, True, True)),
        ("mla_decode fp8 rows H16 bs16 split ragged",
         lambda: build_decode(16, 512, 64, 16, *args16, True, True, "bfloat16", 656)),
        ("mla_decode fp8 rows H16 L64 R16 (100-byte rows: no TMA)",
         lambda: build_decode(16, 64, 16, 16, *args16, False, True, "bfloat16", 100)),
        ("mla_decode combine", lambda: build_combine(128, 512)),
    ]
