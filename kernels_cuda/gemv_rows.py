"""GEMV for 1 to 8 activation rows, batched over heads, in TileLang: ``linear`` at 2..8 rows and
``head_linear`` (MLA's absorbed W_UK / W_UV at decode) at 1..8 rows.

``gemv.py``'s kernel gives each thread one row of W and reloads the activations for every row of W, so
at 8 rows its loads of X (8 per load of W, behind a row guard) bound it at 3-7x cuBLAS's time. Here a
thread owns ``RN`` rows of W at once, so each 16-byte vector of X it loads and converts to float32 serves
``RN`` rows, and each vector of W serves all ``MB`` activation rows:

* a warp's lanes split K (``RT`` lanes per row group, 32 / RT row groups per warp when K is short: W_UK's
  K = 128 fills half a warp), ``KS`` warps of a CTA split K further and ``BNW`` warps split N;
* a thread first issues its ``CH`` x ``RN`` W vectors (independent 16-byte loads, all in flight), then per
  K vector loads the ``MB`` X vectors (L1/L2 hits: X is a few KB), and does ``MB x RN x 8`` FMAs;
* rows of X past the real M (the bucket is static, M dynamic) and rows of W past N read clamped
  indices (no guard in the hot loop) and are never written;
* partial sums: lane shuffles inside the row group, then shared memory across the ``KS`` warps. One
  launch, no workspace, deterministic.

X and Y are read and written through strides (a head of ``q`` in the fused projection output; the
decode query's latent columns), W is contiguous [H, N, K].
"""

from dataclasses import dataclass

import torch

from deepinfer_core.config import env_flag
from kernels_cuda import _tl

VEC = 8  # 2-byte elements per 16-byte load


@dataclass(frozen=True)
class RowsConfig:
    RN: int  # rows of W per thread
    RT: int  # lanes along K per row group (a power of two <= 32)
    KS: int  # warps along K per CTA
    BNW: int  # warps along N per CTA
    CH: int  # K vectors per thread loaded before their FMAs

    @property
    def rows_per_cta(self) -> int:
        return self.BNW * (32 // self.RT) * self.RN


def rows_config(H: int, N: int, K: int, MB: int, sms: int) -> RowsConfig:
    """Enough warps in flight to cover HBM latency (about 16 per SM), K split across warps when N alone
    does not give them, and at most 16 W vectors per thread in registers."""
    RT = 32
    while RT > 1 and RT * VEC > K:
        RT //= 2
    RN = 4 if MB >= 2 else 2
    groups = H * -(-N // RN)  # row groups of RN rows
    warps_n = -(-groups // (32 // RT))
    KS = 1
    while KS < 8 and warps_n * KS < 16 * sms and (KS * 2) * RT * VEC <= K:
        KS *= 2
    BNW = max(1, 8 // KS)
    iters = -(-K // (KS * RT * VEC))
    CH = max(1, min(iters, 16 // RN))
    return RowsConfig(RN, RT, KS, BNW, CH)


def build_gemv_rows(H: int, N: int, K: int, MB: int, cfg: RowsConfig, sx: tuple[int, int], sy: tuple[int, int],
                    dtype: str, out_dtype: str, R: int = 0, table_dtype: str = "float32", pdl: bool = False,
                    kv: tuple[int, int, int] | None = None):
    """The GEMV kernel; with ``R`` > 0 also the rope of ``R`` columns per head (``mla_q_absorb``): XR, YR are
    views at the same strides as X, Y (the columns after the no-rope part and after the latent part).
    ``pdl``: programmatic dependent launch (``_tl.PDL_ENV``), as ``gemv.build_gemv``. ``kv`` = (L, BS, stride of
    kv_a's rows): also MLA's cache write (``mla_q_absorb_kv_write``), one more column of CTAs (``kv_write_body``)."""
    T = _tl.language()
    if pdl:
        pdl_trigger, pdl_sync = _tl.pdl_ops()
    M, P = T.dynamic("M"), T.dynamic("P")
    half = R // 2
    RN, RT, KS, BNW, CH = cfg.RN, cfg.RT, cfg.KS, cfg.BNW, cfg.CH
    G = 32 // RT  # row groups per warp
    ROWS = cfg.rows_per_cta
    step = KS * RT * VEC
    iters = -(-K // step)
    chunks = -(-iters // CH)
    threads = 32 * KS * BNW
    accum = "float32"
    LOG_RT = RT.bit_length() - 1
    sxm, sxh = sx
    sym, syh = sy

    @T.macro
    def gemv_body(X, W, Y, bx, h):
        tid = T.get_thread_binding(0)
        lane = tid % 32
        warp = tid // 32
        ks = warp % KS
        wn = warp // KS
        lk = lane % RT
        g = wn * G + lane // RT  # row group of this thread in the CTA
        kt = ks * RT + lk  # this thread's K vector within a step
        w_loc = T.alloc_local((CH, RN, VEC), dtype)
        xb = T.alloc_local((VEC,), dtype)
        xf = T.alloc_local((VEC,), accum)
        wf = T.alloc_local((RN, VEC), accum)
        acc = T.alloc_local((RN, MB), accum)
        for r, m in T.grid(RN, MB):
            acc[r, m] = 0.0
        if pdl:
            pdl_trigger()
        for c in T.serial(chunks):
            for i in T.unroll(CH):
                k0 = ((c * CH + i) * KS * RT + kt) * VEC
                if k0 < K:
                    for r in T.unroll(RN):
                        for v in T.vectorized(VEC):
                            w_loc[i, r, v] = W[h, T.min(bx * ROWS + g * RN + r, N - 1), k0 + v]
            if pdl:
                pdl_sync()  # X is the previous kernel's output (a no-op after the first chunk)
            for i in T.unroll(CH):
                k0 = ((c * CH + i) * KS * RT + kt) * VEC
                if k0 < K:
                    for r in T.unroll(RN):
                        for v in T.unroll(VEC):
                            wf[r, v] = T.cast(w_loc[i, r, v], accum)
                    for m in T.unroll(MB):
                        for v in T.vectorized(VEC):
                            xb[v] = X[T.min(m, M - 1), h, k0 + v]
                        for v in T.unroll(VEC):
                            xf[v] = T.cast(xb[v], accum)
                        for r in T.unroll(RN):
                            for v in T.unroll(VEC):
                                acc[r, m] += xf[v] * wf[r, v]
        # the row group's lanes (contiguous, RT of them) sum their partials
        for r, m in T.grid(RN, MB):
            for j in T.unroll(LOG_RT):
                acc[r, m] += T.shfl_xor(acc[r, m], RT >> (j + 1))
        if KS == 1:
            if lk == 0:
                for r in T.unroll(RN):
                    n = bx * ROWS + g * RN + r
                    if n < N:
                        for m in T.serial(MB):
                            if m < M:
                                Y[m, h, n] = T.cast(acc[r, m], out_dtype)
        else:  # the KS warps of a row group through shared memory
            part = T.alloc_shared((KS, BNW * G, RN, MB), accum)
            s = T.alloc_local((1,), accum)
            if lk == 0:
                for r, m in T.grid(RN, MB):
                    part[ks, g, r, m] = acc[r, m]
            T.sync_threads()
            if (ks == 0) & (lk == 0):
                for r in T.unroll(RN):
                    n = bx * ROWS + g * RN + r
                    if n < N:
                        for m in T.serial(MB):
                            if m < M:
                                s[0] = 0.0
                                for j in T.serial(KS):
                                    s[0] += part[j, g, r, m]
                                Y[m, h, n] = T.cast(s[0], out_dtype)

    if not R:
        @T.prim_func
        def gemv_rows_kernel(
            X: T.StridedTensor((M, H, K), (sxm, sxh, 1), dtype),
            W: T.Tensor((H, N, K), dtype),
            Y: T.StridedTensor((M, H, N), (sym, syh, 1), out_dtype),
        ):
            with T.Kernel(T.ceildiv(N, ROWS), H, threads=threads) as (bx, h):
                gemv_body(X, W, Y, bx, h)

        return gemv_rows_kernel

    if kv is not None:
        return _q_absorb_kv_write_kernel(T, M, P, H, N, K, ROWS, threads, R, sx, sy, dtype, out_dtype, table_dtype,
                                         kv, gemv_body, pdl_sync if pdl else None)

    @T.prim_func
    def gemv_rows_rope_kernel(
        X: T.StridedTensor((M, H, K), (sxm, sxh, 1), dtype),
        W: T.Tensor((H, N, K), dtype),
        Y: T.StridedTensor((M, H, N), (sym, syh, 1), out_dtype),
        XR: T.StridedTensor((M, H, R), (sxm, sxh, 1), dtype),
        YR: T.StridedTensor((M, H, R), (sym, syh, 1), out_dtype),
        Pos: T.Tensor((M,), "int64"),
        CS: T.Tensor((P, R), table_dtype),
    ):
        # one more CTA per head rotates the head's rope columns (mla_q_absorb: no separate rope launch)
        with T.Kernel(T.ceildiv(N, ROWS) + 1, H, threads=threads) as (bx, h):
            if bx < T.ceildiv(N, ROWS):
                gemv_body(X, W, Y, bx, h)
            else:
                if pdl:
                    pdl_sync()  # XR is the previous kernel's output
                tid = T.get_thread_binding(0)
                for j in T.serial(T.ceildiv(M * half, threads)):
                    e = j * threads + tid
                    if e < M * half:
                        m = e // half
                        i = e % half
                        p = Pos[m]
                        x0 = T.cast(XR[m, h, 2 * i], "float32")
                        x1 = T.cast(XR[m, h, 2 * i + 1], "float32")
                        c = T.cast(CS[p, i], "float32")
                        sn = T.cast(CS[p, half + i], "float32")
                        YR[m, h, 2 * i] = T.cast(x0 * c - x1 * sn, out_dtype)
                        YR[m, h, 2 * i + 1] = T.cast(x0 * sn + x1 * c, out_dtype)

    return gemv_rows_rope_kernel


def _rope_body(T, R: int, threads: int, out_dtype: str):
    """A macro: rows 0..M-1 of head h of XR rotated into YR (one CTA)."""
    half = R // 2

    @T.macro
    def rope_body(XR, YR, Pos, CS, M, h, tid):
        for j in T.serial(T.ceildiv(M * half, threads)):
            e = j * threads + tid
            if e < M * half:
                m = e // half
                i = e % half
                p = Pos[m]
                x0 = T.cast(XR[m, h, 2 * i], "float32")
                x1 = T.cast(XR[m, h, 2 * i + 1], "float32")
                c = T.cast(CS[p, i], "float32")
                sn = T.cast(CS[p, half + i], "float32")
                YR[m, h, 2 * i] = T.cast(x0 * c - x1 * sn, out_dtype)
                YR[m, h, 2 * i + 1] = T.cast(x0 * sn + x1 * c, out_dtype)

    return rope_body


def kv_write_body(T, L: int, R: int, BS: int, threads: int, dtype: str):
    """A macro: MLA's cache entry of token t (``mla_kv_write``: RMSNorm of the L latent values, rope of the R key
    values, both written to the token's cache slot unless it is -1) by one CTA of ``threads`` threads. The
    numerics are the reference's: float32 sum of squares (per thread, warp shuffles, warps in order),
    ``w * (x * rsqrt(mean + eps))`` rounded once, the rope in float32 rounded once."""
    per = -(-L // (threads * VEC))
    half = R // 2

    @T.macro
    def kv_body(KV, NW, Pos, CS, Cache, Slots, t, tid, eps):
        xv = T.alloc_local((VEC,), dtype)
        xr = T.alloc_local((per, VEC), "float32")
        nw = T.alloc_local((per, VEC), dtype)
        ss = T.alloc_local((1,), "float32")
        tot = T.alloc_local((1,), "float32")
        part = T.alloc_shared((threads // 32,), "float32")
        slot = Slots[t]
        p = Pos[t]
        ss[0] = 0.0
        for it in T.unroll(per):
            k0 = (it * threads + tid) * VEC
            if k0 < L:
                for v in T.vectorized(VEC):
                    nw[it, v] = NW[k0 + v]
                for v in T.vectorized(VEC):
                    xv[v] = KV[t, k0 + v]
                for v in T.unroll(VEC):
                    xr[it, v] = T.cast(xv[v], "float32")
                    ss[0] += xr[it, v] * xr[it, v]
        ss[0] = T.warp_reduce_sum(ss[0])
        if tid % 32 == 0:
            part[tid // 32] = ss[0]
        T.sync_threads()
        tot[0] = 0.0
        for w in T.serial(threads // 32):
            tot[0] += part[w]
        tot[0] = T.rsqrt(tot[0] / L + eps)
        if slot >= 0:
            for it in T.unroll(per):
                k0 = (it * threads + tid) * VEC
                if k0 < L:
                    for v in T.unroll(VEC):
                        xv[v] = T.cast(T.cast(nw[it, v], "float32") * (xr[it, v] * tot[0]), dtype)
                    for v in T.vectorized(VEC):
                        Cache[slot // BS, slot % BS, k0 + v] = xv[v]
            for j in T.serial(T.ceildiv(half, threads)):
                i = j * threads + tid
                if i < half:
                    x0 = T.cast(KV[t, L + 2 * i], "float32")
                    x1 = T.cast(KV[t, L + 2 * i + 1], "float32")
                    c = T.cast(CS[p, i], "float32")
                    sn = T.cast(CS[p, half + i], "float32")
                    Cache[slot // BS, slot % BS, L + 2 * i] = T.cast(x0 * c - x1 * sn, dtype)
                    Cache[slot // BS, slot % BS, L + 2 * i + 1] = T.cast(x0 * sn + x1 * c, dtype)
        T.sync_threads()  # ``part`` is reused by the next token of this CTA

    return kv_body


def _q_absorb_kv_write_kernel(T, M, P, H, N, K, ROWS, threads, R, sx, sy, dtype, out_dtype, table_dtype, kv,
                              gemv_body, pdl_sync=None):
    """``mla_q_absorb``'s kernel with one more column of CTAs: CTA (last, h) writes the cache entries of tokens
    h, h + H, ... (``kv_write_body``), so the decode query and the cache write are one launch. ``pdl_sync``
    (programmatic dependent launch): the rope and cache-write CTAs wait for the kernel before them first (the
    GEMV CTAs wait inside ``gemv_body``, after their weight loads)."""
    L, BS, skv = kv
    NB = T.dynamic("NB")
    sxm, sxh = sx
    sym, syh = sy
    rope_body = _rope_body(T, R, threads, out_dtype)
    kv_body = kv_write_body(T, L, R, BS, threads, dtype)

    @T.prim_func
    def gemv_rows_rope_kv_kernel(
        X: T.StridedTensor((M, H, K), (sxm, sxh, 1), dtype),
        W: T.Tensor((H, N, K), dtype),
        Y: T.StridedTensor((M, H, N), (sym, syh, 1), out_dtype),
        XR: T.StridedTensor((M, H, R), (sxm, sxh, 1), dtype),
        YR: T.StridedTensor((M, H, R), (sym, syh, 1), out_dtype),
        Pos: T.Tensor((M,), "int64"),
        CS: T.Tensor((P, R), table_dtype),
        KV: T.StridedTensor((M, L + R), (skv, 1), dtype),
        NW: T.Tensor((L,), dtype),
        Cache: T.Tensor((NB, BS, L + R), dtype),
        Slots: T.Tensor((M,), "int64"),
        eps: T.float32,
    ):
        nblk = T.ceildiv(N, ROWS)
        with T.Kernel(nblk + 2, H, threads=threads) as (bx, h):
            tid = T.get_thread_binding(0)
            if bx < nblk:
                gemv_body(X, W, Y, bx, h)
            elif bx == nblk:
                if pdl_sync is not None:
                    pdl_sync()
                rope_body(XR, YR, Pos, CS, M, h, tid)
            else:
                if pdl_sync is not None:
                    pdl_sync()
                for j in T.serial(T.ceildiv(M, H)):
                    if j * H + h < M:
                        kv_body(KV, NW, Pos, CS, Cache, Slots, j * H + h, tid, eps)

    return gemv_rows_rope_kv_kernel


_kernel = _tl.kernel_cache(build_gemv_rows)


#: Measured on the H200 (docs/decode_fusion.md, gemv_bench round 1): at one row the GEMVs beat cuBLAS on every
#: decode projection; at 2..4 rows only on small weights (V2-Lite's per-head W_UK / W_UV of 2 MB, o, kv_b); at
#: 8 rows cuBLAS's tensor-core tiles win everywhere (this kernel's FMAs on the CUDA cores reach 25-58 % of the
#: read ceiling there). ``mla_q_absorb`` also saves two launches (rope, cat), so it takes the kernel up to 4 rows
#: for any weight.
SMALL_WEIGHT = 4 << 20


def faster_than_cublas(M: int, weight_bytes: int) -> bool:
    """Whether M rows against a weight of ``weight_bytes`` go to these GEMVs rather than cuBLAS (measured)."""
    return M == 1 or (M <= 4 and weight_bytes <= SMALL_WEIGHT)


def m_bucket(M: int) -> int:
    return next(b for b in (1, 2, 4, 8) if M <= b)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte vectors: the base and every stride but the last a multiple of 8 elements."""
    return t.data_ptr() % 16 == 0 and all(s % VEC == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x[M, H, K] (any strides with a unit last one) against w[H, N, K] of the same 2-byte dtype, M in 1..8,
    K a whole number of 16-byte vectors, on a CUDA device."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or x.dim() != 3 or w.dim() != 3:
        return False
    M, H, K = x.shape
    if w.shape[0] != H or w.shape[2] != K or K % VEC or not 1 <= M <= 8 or not w.is_contiguous():
        return False
    return _aligned(x) and w.data_ptr() % 16 == 0 and (x.is_cuda or _tl.dry_run())


def gemv_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
              cfg: RowsConfig | None = None) -> torch.Tensor:
    """``y[m, h] = w[h] @ x[m, h]`` (float32 accumulation) for x[M, H, K], w[H, N, K] (``applies`` must hold);
    written into ``out`` [M, H, N] (any strides with a unit last one, 16-byte aligned) when given."""
    M, H, K = x.shape
    N = w.shape[1]
    y = torch.empty(M, H, N, dtype=x.dtype, device=x.device) if out is None else out
    sms = _tl.num_sms(x.device.index or 0) if x.is_cuda else _tl.num_sms()
    MB = m_bucket(M)
    cfg = cfg or rows_config(H, N, K, MB, sms)
    sx, sy = x.stride()[:2], y.stride()[:2]
    args = (H, N, K, MB, cfg, sx, sy, _tl.tl_dtype(x.dtype), _tl.tl_dtype(y.dtype))
    kernel = _kernel(*args, 0, "float32", True) if _tl.pdl(M) else _kernel(*args)
    kernel(x, w, y)
    return y


def head_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The registry's ``head_linear`` (x[T, H, K], w[H, N, K] -> [T, H, N]): the GEMV where it is faster than the
    reference's batched GEMM (cuBLAS) (``faster_than_cublas``), cuBLAS elsewhere. ``out`` (this backend's callers):
    [T, H, N] with a unit last stride, e.g. columns of wider rows, written in place."""
    if applies(x, w) and faster_than_cublas(x.shape[0], w.numel() * w.element_size()):
        return gemv_rows(x, w, out=out)
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    return _bmm_heads(x, w, out)


def _bmm_heads(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = w[h] @ x[t, h]`` as one batched GEMM over the heads (cuBLAS) that reads x's and writes out's
    [T, H, .] layouts in place: x[T, H, K] and out[T, H, N] may be column slices of wider rows (a unit last
    stride), taken as batches of row stride H x width. Before, the reference's einsum wrote [H, T, N] and a copy
    made it [T, H, N] (at V2-Lite b256 two such copies and the query's cat took 2 % of a decode step). In a dry run
    it computes nothing, as the kernels do (the CPU would spend minutes on bf16 GEMMs whose values nobody reads)."""
    if _tl.dry_run():
        return out
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


def mla_q_absorb(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The registry's ``mla_q_absorb``: one launch writing [W_UK q_nope | rope(q_pe)] (the GEMV's CTAs and one
    rope CTA per head) for up to 4 tokens, or 8 on a small W_UK; otherwise ``head_linear`` and ``rope`` of this backend
    (tests/test_cuda_dispatch.py)."""
    T_, H, D = q.shape
    L, NN = w_uk.shape[1], w_uk.shape[2]
    R = D - NN
    nope = q[..., :NN]
    wide = T_ > 4 and not faster_than_cublas(T_, w_uk.numel() * w_uk.element_size())
    if (wide or not applies(nope, w_uk) or R <= 0 or R % 2 or L % VEC or cos_sin.shape[-1] != R
            or cos_sin.dtype not in (torch.float32, q.dtype)):
        from kernels_cuda.elementwise import rope

        # the reference's composition with this backend's ops (its rope is one launch, the reference's ten), the
        # batched GEMM writing its columns of the output in place
        out = torch.empty(T_, H, L + R, dtype=q.dtype, device=q.device)
        head_linear(nope, w_uk, out=out[..., :L])
        if no_cast_launches():
            rope(q[..., NN:], positions, cos_sin, out=out[..., L:])  # in place: no copy launch after it
        else:
            out[..., L:] = rope(q[..., NN:], positions, cos_sin)
        return out
    out = torch.empty(T_, H, L + R, dtype=q.dtype, device=q.device)
    sms = _tl.num_sms(q.device.index or 0) if q.is_cuda else _tl.num_sms()
    MB = m_bucket(T_)
    cfg = rows_config(H, L, NN, MB, sms)
    kernel = _kernel(H, L, NN, MB, cfg, q.stride()[:2], out.stride()[:2], _tl.tl_dtype(q.dtype),
                     _tl.tl_dtype(q.dtype), R, _tl.tl_dtype(cos_sin.dtype), *_tl.pdl_arg(T_))
    kernel(nope, w_uk, out[..., :L], q[..., NN:], out[..., L:], positions.long().contiguous(), cos_sin.contiguous())
    return out


def mla_q_absorb_kv_write(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """The registry's ``mla_q_absorb_kv_write``: ``mla_q_absorb``'s launch with one more CTA per token writing
    its cache entry; ``mla_kv_write`` then ``mla_q_absorb`` (the backend's, two launches) where it does not apply."""
    from kernels_cuda import mla_kv_write as kvw

    T_, H, D = q.shape
    L, NN = w_uk.shape[1], w_uk.shape[2]
    R, Lkv = D - NN, norm_w.shape[0]
    wide = T_ > 4 and not faster_than_cublas(T_, w_uk.numel() * w_uk.element_size())
    if (wide or not applies(q[..., :NN], w_uk) or R <= 0 or R % 2 or L % VEC or cos_sin.shape[-1] != R
            or cos_sin.dtype not in (torch.float32, q.dtype) or kv_a.shape != (T_, Lkv + R) or Lkv % VEC
            or not kvw._kernel_applies(kv_a, norm_w, cos_sin, cache) or not kv_fusion_enabled()):
        kvw.mla_kv_write(kv_a, norm_w, eps, positions, cos_sin, cache, slot_mapping)
        return mla_q_absorb(q, w_uk, positions, cos_sin)
    out = torch.empty(T_, H, L + R, dtype=q.dtype, device=q.device)
    sms = _tl.num_sms(q.device.index or 0) if q.is_cuda else _tl.num_sms()
    cfg = rows_config(H, L, NN, m_bucket(T_), sms)
    kernel = _kernel(H, L, NN, m_bucket(T_), cfg, q.stride()[:2], out.stride()[:2], _tl.tl_dtype(q.dtype),
                     _tl.tl_dtype(q.dtype), R, _tl.tl_dtype(cos_sin.dtype), _tl.pdl(T_),
                     (Lkv, cache.shape[1], kv_a.stride(0)))
    kernel(q[..., :NN], w_uk, out[..., :L], q[..., NN:], out[..., L:], positions.long().contiguous(),
           cos_sin.contiguous(), kv_a, norm_w.to(q.dtype).contiguous(), cache, slot_mapping.long().contiguous(),
           float(eps))
    return out


#: ``DEEPINFER_KV_FUSION=0`` runs ``mla_kv_write`` and ``mla_q_absorb`` as two launches (a benchmark's before)
KV_FUSION_ENV = "DEEPINFER_KV_FUSION"


def kv_fusion_enabled() -> bool:
    return env_flag(KV_FUSION_ENV, True)


#: Past the fused rows, two copy launches a layer followed a kernel (``direct_copy`` x 53 at V2-Lite b256 on the
#: H200, 0.21 ms a step: docs/h200/s15); now the wide decode query's rope is written into its columns in place
#: (``rope(..., out=)``), and the router's float32 input by the norm launch (``norm.add_rms_norm_f32``) instead of a
#: cast. ``DEEPINFER_NO_CAST_LAUNCHES=0`` brings the copies back (a benchmark's before).
NO_CAST_ENV = "DEEPINFER_NO_CAST_LAUNCHES"


def no_cast_launches() -> bool:
    return env_flag(NO_CAST_ENV, True)


def representative_kernels():
    """V2-Lite's GEMVs as the engine launches them. Its decode query (no q_lora) is the first H x (N + R) columns
    of the fused q + kv_a projection's output: at two or more rows its row stride is that output's width,
    H x (N + R) + L + R = 3648; one row's view has a contiguous query's, H x (N + R) = 3072 (the GEMVs compile
    per stride)."""
    c = rows_config
    fused = 16 * 192 + 512 + 64  # the q + kv_a projection's output width: the query's row stride at >= 2 rows
    return [
        ("gemv_rows M8 N3648 K2048 (V2-Lite q+kv_a at 8 rows)",
         lambda: build_gemv_rows(1, 3648, 2048, 8, c(1, 3648, 2048, 8, 132), (2048, 2048), (3648, 3648),
                                 "bfloat16", "bfloat16")),
        ("gemv_rows M1 H16 N512 K128 (V2-Lite W_UK into the decode query's latent columns)",
         lambda: build_gemv_rows(16, 512, 128, 1, c(16, 512, 128, 1, 132), (16 * 192, 192), (16 * 576, 576),
                                 "bfloat16", "bfloat16")),
        ("mla_q_absorb M1 H16 L512 N128 R64 (V2-Lite decode query; programmatic dependent launch, as at one row)",
         lambda: build_gemv_rows(16, 512, 128, 1, c(16, 512, 128, 1, 132), (16 * 192, 192), (16 * 576, 576),
                                 "bfloat16", "bfloat16", 64, "float32", True)),
        ("mla_q_absorb_kv_write M4 H16 L512 N128 R64 bs64 (V2-Lite decode query at 3-4 rows + cache write)",
         lambda: build_gemv_rows(16, 512, 128, 4, c(16, 512, 128, 4, 132), (fused, 192), (16 * 576, 576),
                                 "bfloat16", "bfloat16", 64, "float32", False, (512, 64, fused))),
        ("gemv_rows M4 H16 N128 K512 (V2-Lite W_UV)",
         lambda: build_gemv_rows(16, 128, 512, 4, c(16, 128, 512, 4, 132), (16 * 512, 512), (16 * 128, 128),
                                 "bfloat16", "bfloat16")),
    ]
