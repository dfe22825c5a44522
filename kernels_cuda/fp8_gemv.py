"""FP8 block-scaled GEMV for 1 to 8 activation rows (``fp8_linear`` at decode), in TileLang.

At decode ``fp8_linear`` reads a whole e4m3 weight for a handful of rows, so the job is to stream W at
HBM speed. The GEMM path (``act_quant`` + cuBLAS ``_scaled_mm`` or the TileLang wgmma GEMM) pads the rows
to a tensor-core tile and spends two launches. Here, one launch, ``gemv_rows``-style:

* a thread owns ``RN`` consecutive rows of W (inside one 128-row scale block) and, per step, one 16-byte
  vector of each (16 e4m3 values); the 32 lanes of a warp take 32 consecutive vectors along K (512
  values), ``KS`` warps of a CTA split K further and ``BNW`` warps split N;
* the activations are quantised in registers, exactly as ``kernels_cpu.fp8_ops.quantize_act_fp8``: a lane
  holds 16 of a 128-channel group, the group's 8 lanes exchange their amax (three shuffles), then
  ``s = max(amax, 1e-4) / 448`` (IEEE division) and ``q = e4m3(clamp(x / s, +-448))`` (round to nearest
  even); each quantised vector serves the thread's ``RN`` rows;
* per vector the 16 products q * w are summed in float32 and scaled by ``s * w_scale[n / 128, k / 128]``
  (the block promotion of the reference's formula; the float32 sums are reordered, which the semantics
  allow), then lanes, then warps reduce in a fixed order and y is cast to x's dtype once.

Rows of X past the real M read the last row (M is dynamic, the bucket static) and are never written;
rows of W past N read row N - 1; lanes past K read the last vector and add nothing. Deterministic.
"""

from dataclasses import dataclass

import torch

from kernels_cuda import _tl

FP8 = "float8_e4m3fn"
GROUP = 128
VEC = 16  # e4m3 values per 16-byte load of W (and activation values per lane per step)
LANES_PER_GROUP = GROUP // VEC  # 8 lanes hold one 128-channel group
MAX_ROWS = 8

#: weights up to this many bytes take the GEMV at 2 rows (``faster_than_gemm``)
SMALL_WEIGHT = 8 << 20


def faster_than_gemm(M: int, N: int, K: int) -> bool:
    """Whether ``fp8_linear`` of M rows takes this GEMV rather than act_quant + ``_scaled_mm`` (measured on the H200,
    docs/h200/s10: at one row faster on V2-Lite's projections and most of V3's; at two rows only on weights up
    to 8 MB (V2-Lite's q+kv_a 8.9 against 13.1 us, V3's kv_a 9.8 / 18.3; V3's shared w2 16.3 / 13.8); at 8
    rows 2-40x slower everywhere (the FMAs and divisions on the CUDA cores))."""
    return M == 1 or (M == 2 and N * K <= SMALL_WEIGHT)


@dataclass(frozen=True)
class Fp8GemvConfig:
    RN: int  # rows of W per thread (divides 128)
    KS: int  # warps along K per CTA
    BNW: int  # warps along N per CTA
    CH: int  # steps (K vectors per row) per thread loaded before their FMAs

    @property
    def rows_per_cta(self) -> int:
        return self.BNW * self.RN


def gemv_config(N: int, K: int, MB: int, sms: int) -> Fp8GemvConfig:
    """At one row on weights over 4 M values: 16 rows per thread (each quantised activation vector, 16 IEEE
    divisions, serves 16 rows), K split across warps until about 800 warps run and a warp's K is at most 4096
    (measured on the H200, docs/h200/s10: V3's o_proj 43.0 us against 56.8 with 8 rows and no split, the dense
    w13 89.7 against 114.0, the shared w13 14.3 against 22.1; V2-Lite's q+kv_a 5.5 against 5.8 with 4 rows).
    Otherwise 4 rows per thread (2 from 5 rows) and about 16 warps per SM; at most 16 W vectors per thread."""
    big = MB == 1 and N * K > 4 << 20
    RN = 16 if big else 4 if MB <= 4 else 2
    warps_n = -(-N // RN)
    KS = 1
    if big:
        while KS < 8 and (warps_n * KS < 800 or K // KS > 4096) and (KS * 2) * 32 * VEC <= K:
            KS *= 2
    else:
        while KS < 8 and warps_n * KS < 16 * sms and (KS * 2) * 32 * VEC <= K:
            KS *= 2
    BNW = max(1, 8 // KS)
    iters = -(-K // (KS * 32 * VEC))
    CH = max(1, min(iters, 16 // RN))
    return Fp8GemvConfig(RN, KS, BNW, CH)


def quant_group_macro(T):
    """A macro quantising one lane's 16 float32 activation values ``xf`` of a 128-channel group held by 8
    consecutive lanes: ``qf`` (the e4m3 values as float32) and ``s[0]`` (the group's scale). Every lane of
    the warp must call it (three ``shfl_xor`` of the whole warp)."""

    @T.macro
    def quant_group(xf, qf, s):
        s[0] = 0.0
        for v in T.unroll(VEC):
            s[0] = T.max(s[0], T.abs(xf[v]))
        for j in T.unroll(3):
            s[0] = T.max(s[0], T.shfl_xor(s[0], 1 << j))
        s[0] = T.max(s[0], 1e-4) / 448.0
        for v in T.unroll(VEC):
            qf[v] = T.cast(T.cast(T.clamp(xf[v] / s[0], -448.0, 448.0), FP8), "float32")

    return quant_group


def quant_store_macro(T, NTH: int, TV: int):
    """A macro: thread ``lin``'s 16 activation values ``xb`` (x's dtype; ``xf``, ``qf``, ``qv`` and ``sc`` its
    scratch) at pass ``j`` over the ``TV`` 16-value vectors of the rows being quantised (``NTH`` threads a pass),
    quantised as ``fp8_gemv.quant_group_macro`` (every lane of the warp must call it: the group's amax is shuffled)
    and, for a vector inside the ``TV``, stored as e4m3 into the shared ``Q[row]`` at vector ``kv``, the group's scale
    into ``S[row]`` by the group's first lane. (The bound is tested here, not passed in: a macro binds an expression
    argument to a new variable, and the kernels' simplification of the stores under it would change.)"""
    quant_group = quant_group_macro(T)

    @T.macro
    def quant_store(xb, xf, qf, qv, sc, j, lin, Q, S, row, kv):
        for v in T.unroll(VEC):
            xf[v] = T.cast(xb[v], "float32")
        quant_group(xf, qf, sc)
        if j * NTH + lin < TV:
            for v in T.unroll(VEC):
                qv[v] = T.cast(qf[v], FP8)
            for v in T.vectorized(VEC):
                Q[row, kv * VEC + v] = qv[v]
            if kv % (GROUP // VEC) == 0:
                S[row, kv // (GROUP // VEC)] = sc[0]

    return quant_store


def quant_rows_macro(T, NTH: int, TV: int, C: int, K: int):
    """A macro: the weight-streaming MoE up kernels' activation prologue. The ``NTH`` threads (thread ``lin``)
    quantise the rows of chunk ``ch`` of ``X`` (``TV`` 16-value vectors: MB rows of C; row m is the token of listed
    slot ``rows[ch * MB + m]``, rows past the count ``nr[0]`` repeat the last) into the shared ``Q`` / ``S`` with
    :func:`quant_store_macro`; ``xb`` .. ``sc`` its scratch."""
    quant_store = quant_store_macro(T, NTH, TV)
    MB = TV * VEC // C

    @T.macro
    def quant_rows(X, rows, nr, ch, lin, xb, xf, qf, qv, sc, Q, S):
        for j in T.serial(T.ceildiv(TV, NTH)):
            idx = T.min(j * NTH + lin, TV - 1)
            m = idx // (C // VEC)
            kv = idx % (C // VEC)
            tok = rows[T.min(ch * MB + m, nr[0] - 1)] // K
            for v in T.vectorized(VEC):
                xb[v] = X[tok, kv * VEC + v]
            quant_store(xb, xf, qf, qv, sc, j, lin, Q, S, m, kv)

    return quant_rows


def build_fp8_gemv(N: int, K: int, MB: int, cfg: Fp8GemvConfig, dtype: str, pdl: bool = False):
    """y[M, N] (dtype) = fp8_linear(x[M, K] (dtype), w[N, K] e4m3, w_scale[ceil(N/128), K/128] f32), M <= MB.
    ``pdl`` (``_tl.PDL_ENV``): the first chunk's weights and scales load before the wait for the kernel that
    wrote x (``_tl.pdl_gate``; a no-op at the later chunks)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    M = T.dynamic("M")
    RN, KS, BNW, CH = cfg.RN, cfg.KS, cfg.BNW, cfg.CH
    assert K % GROUP == 0 and GROUP % RN == 0
    KB, NB = K // GROUP, -(-N // GROUP)
    ROWS = cfg.rows_per_cta  # a warp works on RN rows (its lanes split K)
    step = KS * 32 * VEC
    iters = -(-K // step)
    chunks = -(-iters // CH)
    threads = 32 * KS * BNW
    quant_group = quant_group_macro(T)

    @T.prim_func
    def fp8_gemv(X: T.Tensor((M, K), dtype), W: T.Tensor((N, K), FP8), WS: T.Tensor((NB, KB), "float32"),
                 Y: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, ROWS), threads=threads) as bx:
            tid = T.get_thread_binding(0)
            lane = tid % 32
            warp = tid // 32
            ks = warp % KS
            wn = warp // KS
            row0 = bx * ROWS + wn * RN  # this warp's first row
            nb = T.min(row0, N - 1) // GROUP
            w_loc = T.alloc_local((CH, RN, VEC), FP8)
            ws = T.alloc_local((CH,), "float32")
            xb = T.alloc_local((VEC,), dtype)
            xf = T.alloc_local((VEC,), "float32")
            qf = T.alloc_local((VEC,), "float32")
            wf = T.alloc_local((VEC,), "float32")
            s = T.alloc_local((1,), "float32")
            p = T.alloc_local((RN,), "float32")
            acc = T.alloc_local((RN, MB), "float32")
            for r, m in T.grid(RN, MB):
                acc[r, m] = 0.0
            for c in T.serial(chunks):
                for i in T.unroll(CH):
                    kw = ((c * CH + i) * KS + ks) * 32 * VEC  # the warp's first K value at this step
                    if kw < K:
                        k0 = T.min(kw + lane * VEC, K - VEC)
                        for r in T.unroll(RN):
                            for v in T.vectorized(VEC):
                                w_loc[i, r, v] = W[T.min(row0 + r, N - 1), k0 + v]
                        ws[i] = WS[nb, k0 // GROUP]
                if pdl:
                    gate()
                for i in T.unroll(CH):
                    kw = ((c * CH + i) * KS + ks) * 32 * VEC
                    if kw < K:  # (uniform in the warp: the shuffles below see every lane)
                        k0 = T.min(kw + lane * VEC, K - VEC)
                        live = kw + lane * VEC < K
                        for m in T.unroll(MB):
                            for v in T.vectorized(VEC):
                                xb[v] = X[T.min(m, M - 1), k0 + v]
                            for v in T.unroll(VEC):
                                xf[v] = T.cast(xb[v], "float32")
                            quant_group(xf, qf, s)
                            for r in T.unroll(RN):
                                p[r] = 0.0
                                # a vectorised cast: e4m3 pairs through one cvt.f16x2.e4m3x2
                                for v in T.vectorized(VEC):
                                    wf[v] = T.cast(w_loc[i, r, v], "float32")
                                for v in T.unroll(VEC):
                                    p[r] += qf[v] * wf[v]
                                acc[r, m] += T.if_then_else(live, p[r] * (s[0] * ws[i]), 0.0)
            for r, m in T.grid(RN, MB):
                for j in T.unroll(5):
                    acc[r, m] += T.shfl_xor(acc[r, m], 16 >> j)
            if KS == 1:
                if lane == 0:
                    for r in T.unroll(RN):
                        if row0 + r < N:
                            for m in T.serial(MB):
                                if m < M:
                                    Y[m, row0 + r] = T.cast(acc[r, m], dtype)
            else:  # the KS warps of a row group, in warp order, through shared memory
                part = T.alloc_shared((KS, BNW, RN, MB), "float32")
                tot = T.alloc_local((1,), "float32")
                if lane == 0:
                    for r, m in T.grid(RN, MB):
                        part[ks, wn, r, m] = acc[r, m]
                T.sync_threads()
                if (ks == 0) & (lane < RN * MB):
                    rr = lane // MB
                    mm = lane % MB
                    if (row0 + rr < N) & (mm < M):
                        tot[0] = 0.0
                        for j in T.serial(KS):
                            tot[0] += part[j, wn, rr, mm]
                        Y[mm, row0 + rr] = T.cast(tot[0], dtype)

    return fp8_gemv


_kernel = _tl.kernel_cache(build_fp8_gemv)


def m_bucket(M: int) -> int:
    return next(b for b in (1, 2, 4, 8) if M <= b)


def applies(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """x[M, K] bf16/fp16 (contiguous, 16-byte aligned) with M in 1..8, w[N, K] e4m3 contiguous and aligned,
    K a multiple of 128, w_scale [ceil(N/128), K/128]; on a CUDA device (or a dry run)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != torch.float8_e4m3fn or x.dim() != 2:
        return False
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_ROWS or w.dim() != 2 or w.shape[1] != K or K % GROUP:
        return False
    if tuple(w_scale.shape) != (-(-N // GROUP), K // GROUP):
        return False
    if not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return x.is_cuda or _tl.dry_run()


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             cfg: Fp8GemvConfig | None = None) -> torch.Tensor:
    """``fp8_linear`` for x[M, K] (``applies`` must hold) in one launch -> [M, N] in x.dtype."""
    M, K = x.shape
    N = w.shape[0]
    sms = _tl.num_sms(x.device.index or 0) if x.is_cuda else _tl.num_sms()
    MB = m_bucket(M)
    cfg = cfg or gemv_config(N, K, MB, sms)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pdl = _tl.pdl_arg(M, by_default=False)  # (measured no faster at one row: ``_tl.PDL_ENV``)
    _kernel(N, K, MB, cfg, _tl.tl_dtype(x.dtype), *pdl)(x, w, w_scale.float().contiguous(), y)
    return y


def representative_kernels():
    c = gemv_config
    return [
        ("fp8_gemv M1 N3648 K2048 (V2-Lite q+kv_a)",
         lambda: build_fp8_gemv(3648, 2048, 1, c(3648, 2048, 1, 132), "bfloat16")),
        ("fp8_gemv M8 N7168 K16384 (V3 o_proj at 8 rows)",
         lambda: build_fp8_gemv(7168, 16384, 8, c(7168, 16384, 8, 132), "bfloat16")),
        ("fp8_gemv M2 N576 K7168 (V3 kv_a, ragged K split)",
         lambda: build_fp8_gemv(576, 7168, 2, c(576, 7168, 2, 132), "bfloat16")),
    ]
