"""Block-scaled FP8 GEMMs (TileLang, DeepGEMM-style), the CUDA side of ``kernels_cpu/fp8_ops.py``.

* ``act_quant``: x[M, K] (bf16/fp16) -> e4m3 q[Mp, K] and float32 scales s[Mp, K/128] (or K-block-major
  s[K/128, Mp]), one scale per token and 128 channels (``max(amax, 1e-4) / 448``, bit-equal to the
  reference); rows M..Mp (padding up to the GEMM's BM) are written as zeros, so the GEMMs never read past
  what was written.
* ``fp8_linear``: at one row (two on a small weight) the weight-streaming ``fp8_gemv`` (one launch, the
  activations quantised in registers); above, ``act_quant`` + cuBLAS's blockwise ``torch._scaled_mm`` where
  this torch has it (faster at every measured size, docs/fp8.md), else ``act_quant`` + ``fp8_gemm``.
* ``fp8_gemm``: C[Mp, N] = sum over 128-wide k blocks of (q_a . q_b) * s_a[row, kb] * s_b[n / 128, kb]:
  each k block runs one e4m3 wgmma chain into a fresh float32 fragment, which is scaled and added to the
  float32 accumulator (DeepGEMM's promotion: the tensor cores' reduced-precision FP8 accumulation never
  spans more than 128 products).
* ``fused_moe_fp8``: ``kernels_cuda.moe``'s align and combine around FP8 stages: gather + quantise the
  rows in expert order, grouped gemm1 (gate and up with their tile scales, SiLU in float32 on the
  x.dtype-rounded halves, as the reference), quantise the hidden, grouped gemm2 scattered to slots;
  at decode (up to 4 tokens, ``moe_gemv_fp8.applies``) the two weight-streaming launches of ``moe_gemv_fp8``;
  the other decode batches (up to a mean of 64 rows per expert) run the same six launches with the operands of
  both GEMMs swapped (``kernels_cuda.moe_stream_fp8``: the weights are the wgmma's M;
  ``DEEPINFER_FP8_MOE_STREAM=0``: the pipeline).

Shapes the kernels take: K (and for MoE, C and I) a multiple of 128, N a multiple of 64 (V2/V3: every
projection). Other shapes, float32 activations and empty batches run the reference.
"""

import logging

import torch

from deepinfer_core.config import env_flag
from kernels_cuda import _tl, fp8_gemv, moe_gemv_fp8

logger = logging.getLogger(__name__)

FP8 = "float8_e4m3fn"
GROUP = 128


def build_act_quant(K: int, dtype: str, scale_t: bool = False):
    """``scale_t``: the scales are written K-block-major, ``S[K/128, MP]`` (what ``torch._scaled_mm``'s 1x128
    blockwise mode and the GEMMs staging a tile's scales with one copy read), else ``S[MP, K/128]``."""
    T = _tl.language()
    M, MP = T.dynamic("M"), T.dynamic("MP")
    BMq = 32
    s_shape = (K // GROUP, MP) if scale_t else (MP, K // GROUP)

    def s_index(kb, row):
        return (kb, row) if scale_t else (row, kb)

    @T.prim_func
    def act_quant(X: T.Tensor((M, K), dtype), Q: T.Tensor((MP, K), FP8), S: T.Tensor(s_shape, "float32")):
        with T.Kernel(K // GROUP, T.ceildiv(MP, BMq), threads=128) as (kb, bm):
            xf = T.alloc_fragment((BMq, GROUP), "float32")
            amax = T.alloc_fragment((BMq,), "float32")
            for i, j in T.Parallel(BMq, GROUP):
                row = bm * BMq + i
                xf[i, j] = T.if_then_else(row < M, T.cast(X[T.min(row, M - 1), kb * GROUP + j], "float32"), 0.0)
            T.reduce_absmax(xf, amax, dim=1)
            for i in T.Parallel(BMq):
                amax[i] = T.max(amax[i], 1e-4) / 448.0
            for i, j in T.Parallel(BMq, GROUP):
                row = bm * BMq + i
                if row < MP:
                    Q[row, kb * GROUP + j] = T.cast(T.clamp(xf[i, j] / amax[i], -448.0, 448.0), FP8)
            for i in T.Parallel(BMq):
                row = bm * BMq + i
                if row < MP:
                    S[s_index(kb, row)] = amax[i]

    return act_quant


def build_fp8_gemm(N: int, K: int, BM: int, BN: int, stages: int, threads: int, out_dtype: str, BK: int = GROUP):
    """``BK``: the k width of one pipeline stage and of one fresh float32 fragment (the promotion interval;
    128 = one scale block, 32 = one wgmma)."""
    T = _tl.language()
    MP = T.dynamic("MP")
    KB = K // GROUP
    assert K % GROUP == 0 and GROUP % BK == 0 and N % BN == 0 and (GROUP % BN == 0 or BN % GROUP == 0)

    @T.prim_func
    def fp8_gemm(A: T.Tensor((MP, K), FP8), SA: T.Tensor((MP, KB), "float32"), B: T.Tensor((N, K), FP8),
                 SB: T.Tensor((T.ceildiv(N, GROUP), KB), "float32"), C: T.Tensor((MP, N), out_dtype)):
        with T.Kernel(N // BN, T.ceildiv(MP, BM), threads=threads) as (bn, bm):
            A_s = T.alloc_shared((BM, BK), FP8)
            B_s = T.alloc_shared((BN, BK), FP8)
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            C_s = T.alloc_shared((BM, BN), out_dtype)
            T.clear(acc)
            for k in T.Pipelined(K // BK, num_stages=stages):
                T.copy(A[bm * BM:(bm + 1) * BM, k * BK:(k + 1) * BK], A_s)
                T.copy(B[bn * BN:(bn + 1) * BN, k * BK:(k + 1) * BK], B_s)
                T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BM, BN):
                    acc[i, j] += part[i, j] * SA[bm * BM + i, k * BK // GROUP] * \
                        SB[(bn * BN + j) // GROUP, k * BK // GROUP]
            T.copy(acc, C_s)
            T.copy(C_s, C[bm * BM:(bm + 1) * BM, bn * BN:(bn + 1) * BN])

    return fp8_gemm


_act_quant = _tl.kernel_cache(build_act_quant)
_gemm = _tl.kernel_cache(build_fp8_gemm)


def gemm_config(M: int, N: int) -> dict:
    """Decode batches stream the weights (BM 64, one warpgroup, narrow tiles for more CTAs); large M is
    matrix-bound (BM 128, two warpgroups, 128-wide tiles)."""
    bn = 128 if N % 128 == 0 and M > 64 else 64
    return {"BM": 64, "BN": bn, "stages": 4, "threads": 128} if M <= 64 else \
        {"BM": 128, "BN": bn, "stages": 3, "threads": 256}


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def quantize(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x[M, K] -> (q[rows, K] e4m3, s[rows, K/128] f32), rows >= M zero-padded."""
    M, K = x.shape
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, K // GROUP, dtype=torch.float32, device=x.device)
    _act_quant(K, _tl.tl_dtype(x.dtype))(x, q, s)
    return q, s


def quantize_t(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`quantize`, with the scales K-block-major: s[K/128, rows] (``s.t()`` is what
    ``torch._scaled_mm`` takes for 1x128 blocks)."""
    M, K = x.shape
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(K // GROUP, rows, dtype=torch.float32, device=x.device)
    _act_quant(K, _tl.tl_dtype(x.dtype), True)(x, q, s)
    return q, s


#: ``DEEPINFER_FP8_GEMV=0`` keeps decode sizes on the GEMM paths (act_quant + ``_scaled_mm``, the six-launch MoE):
#: a benchmark's before
GEMV_ENV = "DEEPINFER_FP8_GEMV"


def gemv_enabled() -> bool:
    return env_flag(GEMV_ENV, True)


def _fits(K: int, N: int) -> bool:
    return K % GROUP == 0 and N % 64 == 0


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16) or M == 0 or not _fits(K, N):
        from kernels_cpu.fp8_ops import fp8_linear as ref

        return ref(x, w, w_scale)
    x2, ws = x2.contiguous(), w_scale.float().contiguous()
    if fp8_gemv.faster_than_gemm(M, N, K) and gemv_enabled() and fp8_gemv.applies(x2, w, ws):  # decode: one launch
        return fp8_gemv.fp8_gemv(x2, w, ws).view(*lead, N)
    # cuBLAS's blockwise FP8 GEMM behind our act_quant wherever this torch has it: on the H200 it was
    # 1.7-3.9x the TileLang fp8_gemm at 512 and 4096 tokens; at 64 faster on 6 of 9 V3 shapes (docs/fp8.md)
    if x.dtype == torch.bfloat16 and scaled_mm_blockwise(x.device):
        return linear_scaled_mm(x2, w, ws).view(*lead, N)
    return linear_tilelang(x2, w, ws).view(*lead, N)


def linear_scaled_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x[M, K] (bf16, contiguous) through ``act_quant`` (scales K-block-major) and ``torch._scaled_mm``."""
    M = x.shape[0]
    q, s = quantize_t(x, _round(M, 4))  # the scales' M-major rows 16-byte aligned
    if _tl.dry_run() and x.device.type != "cuda":  # compile-only run: act_quant is built, nothing runs
        return torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device)
    return torch._scaled_mm(q, w.t(), s.t(), w_scale.t(), out_dtype=x.dtype)[:M]


_SCALED_MM_OK: dict[int, bool] = {}


def scaled_mm_blockwise(device: torch.device) -> bool:
    """Whether this torch / cuBLAS runs ``_scaled_mm`` with 1x128 x 128x128 block scales on ``device``
    (CUDA 12.9+ on sm_90); probed once per device, outside graph capture."""
    if device.type != "cuda":
        return _tl.dry_run()  # compile-only runs build the kernels of this path too
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SCALED_MM_OK:
        if torch.cuda.is_current_stream_capturing():
            return False
        q = torch.zeros(16, 256, dtype=torch.float8_e4m3fn, device=device)
        w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device=device)
        try:  # shapes no other scaling mode matches: scales [16, 2] (M-major) and [2, 2]
            torch._scaled_mm(q, w.t(), torch.ones(2, 16, device=device).t(), torch.ones(2, 2, device=device).t(),
                             out_dtype=torch.bfloat16)
            _SCALED_MM_OK[idx] = True
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            logger.warning("torch._scaled_mm has no 1x128/128x128 block scaling here (%s): dense FP8 GEMMs "
                           "run the TileLang fp8_gemm at every size", str(exc)[:200])
            _SCALED_MM_OK[idx] = False
    return _SCALED_MM_OK[idx]


def linear_tilelang(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x[M, K] (bf16/fp16, contiguous) through ``act_quant`` and the TileLang ``fp8_gemm``."""
    M, K = x.shape
    N = w.shape[0]
    c = gemm_config(M, N)
    mp = _round(M, c["BM"])
    q, s = quantize(x, mp)
    out = torch.empty(mp, N, dtype=x.dtype, device=x.device)
    _gemm(N, K, c["BM"], c["BN"], c["stages"], c["threads"], _tl.tl_dtype(x.dtype))(q, s, w, w_scale, out)
    return out[:M]


# ---- grouped (MoE) ------------------------------------------------------------------------------------

def build_gather_quant(C: int, K: int, BM: int, dtype: str):
    """Rows of X in expert order (``RowSlot``, as ``moe.build_gather``), quantised per 128 channels."""
    T = _tl.language()
    NT, CAP, NBLK = T.dynamic("NT"), T.dynamic("CAP"), T.dynamic("NBLK")

    @T.prim_func
    def moe_gather_quant(X: T.Tensor((NT, C), dtype), RowSlot: T.Tensor((CAP,), "int32"),
                         BlockExpert: T.Tensor((NBLK,), "int32"), Q: T.Tensor((CAP, C), FP8),
                         S: T.Tensor((CAP, C // GROUP), "float32")):
        with T.Kernel(C // GROUP, NBLK, threads=128) as (kb, blk):
            xf = T.alloc_fragment((BM, GROUP), "float32")
            amax = T.alloc_fragment((BM,), "float32")
            if BlockExpert[blk] >= 0:
                for i, j in T.Parallel(BM, GROUP):
                    slot = RowSlot[blk * BM + i]
                    xf[i, j] = T.if_then_else(slot >= 0, T.cast(X[T.max(slot, 0) // K, kb * GROUP + j], "float32"),
                                              0.0)
                T.reduce_absmax(xf, amax, dim=1)
                for i in T.Parallel(BM):
                    amax[i] = T.max(amax[i], 1e-4) / 448.0
                for i, j in T.Parallel(BM, GROUP):
                    Q[blk * BM + i, kb * GROUP + j] = T.cast(T.clamp(xf[i, j] / amax[i], -448.0, 448.0), FP8)
                for i in T.Parallel(BM):
                    S[blk * BM + i, kb] = amax[i]

    return moe_gather_quant


def build_gemm1_fp8(E: int, C: int, I: int, BM: int, BN: int, stages: int, threads: int, dtype: str):
    """H = silu(gate) * up per expert block; gate and up rounded to ``dtype`` first (the reference's
    fp8_linear outputs), SiLU and product in float32, H rounded once."""
    T = _tl.language()
    CAP, NBLK = T.dynamic("CAP"), T.dynamic("NBLK")
    CB = C // GROUP
    assert I % BN == 0 and C % GROUP == 0 and I % GROUP == 0 and GROUP % BN == 0

    @T.prim_func
    def moe_gemm1_fp8(Xq: T.Tensor((CAP, C), FP8), Sx: T.Tensor((CAP, CB), "float32"),
                      W13: T.Tensor((E, 2 * I, C), FP8), S13: T.Tensor((E, 2 * I // GROUP, CB), "float32"),
                      BlockExpert: T.Tensor((NBLK,), "int32"), Hs: T.Tensor((CAP, I), dtype)):
        with T.Kernel(I // BN, NBLK, threads=threads) as (bn, blk):
            A_s = T.alloc_shared((BM, GROUP), FP8)
            G_s = T.alloc_shared((BN, GROUP), FP8)
            U_s = T.alloc_shared((BN, GROUP), FP8)
            part_g = T.alloc_fragment((BM, BN), "float32")
            part_u = T.alloc_fragment((BM, BN), "float32")
            acc_g = T.alloc_fragment((BM, BN), "float32")
            acc_u = T.alloc_fragment((BM, BN), "float32")
            H_s = T.alloc_shared((BM, BN), dtype)
            e = BlockExpert[blk]
            ee = T.max(e, 0)
            n_iter = T.if_then_else(e >= 0, CB, 0)
            T.clear(acc_g)
            T.clear(acc_u)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(Xq[blk * BM:(blk + 1) * BM, k * GROUP:(k + 1) * GROUP], A_s)
                T.copy(W13[ee, bn * BN:(bn + 1) * BN, k * GROUP:(k + 1) * GROUP], G_s)
                T.copy(W13[ee, I + bn * BN:I + (bn + 1) * BN, k * GROUP:(k + 1) * GROUP], U_s)
                T.gemm(A_s, G_s, part_g, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(A_s, U_s, part_u, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                sg = S13[ee, (bn * BN) // GROUP, k]
                su = S13[ee, (I + bn * BN) // GROUP, k]
                for i, j in T.Parallel(BM, BN):
                    sa = Sx[blk * BM + i, k]
                    acc_g[i, j] += part_g[i, j] * sa * sg
                    acc_u[i, j] += part_u[i, j] * sa * su
            if e >= 0:
                for i, j in T.Parallel(BM, BN):
                    g = T.cast(T.cast(acc_g[i, j], dtype), "float32")
                    u = T.cast(T.cast(acc_u[i, j], dtype), "float32")
                    acc_g[i, j] = g / (1.0 + T.exp(-g)) * u
                T.copy(acc_g, H_s)
                T.copy(H_s, Hs[blk * BM:(blk + 1) * BM, bn * BN:(bn + 1) * BN])

    return moe_gemm1_fp8


def build_gemm2_fp8(E: int, C: int, I: int, BM: int, BN: int, stages: int, threads: int, dtype: str):
    """Y[slot] = quantised H @ w2[e].T with the tile scales, each row stored at its (token, slot) row."""
    T = _tl.language()
    CAP, NBLK, NS = T.dynamic("CAP"), T.dynamic("NBLK"), T.dynamic("NS")
    IB = I // GROUP
    assert C % BN == 0 and I % GROUP == 0 and (GROUP % BN == 0 or BN % GROUP == 0)

    @T.prim_func
    def moe_gemm2_fp8(Hq: T.Tensor((CAP, I), FP8), Sh: T.Tensor((CAP, IB), "float32"),
                      W2: T.Tensor((E, C, I), FP8), S2: T.Tensor((E, T.ceildiv(C, GROUP), IB), "float32"),
                      BlockExpert: T.Tensor((NBLK,), "int32"), RowSlot: T.Tensor((CAP,), "int32"),
                      Y: T.Tensor((NS, C), dtype)):
        with T.Kernel(C // BN, NBLK, threads=threads) as (bn, blk):
            A_s = T.alloc_shared((BM, GROUP), FP8)
            B_s = T.alloc_shared((BN, GROUP), FP8)
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            e = BlockExpert[blk]
            ee = T.max(e, 0)
            n_iter = T.if_then_else(e >= 0, IB, 0)
            T.clear(acc)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(Hq[blk * BM:(blk + 1) * BM, k * GROUP:(k + 1) * GROUP], A_s)
                T.copy(W2[ee, bn * BN:(bn + 1) * BN, k * GROUP:(k + 1) * GROUP], B_s)
                T.gemm(A_s, B_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(BM, BN):
                    acc[i, j] += part[i, j] * Sh[blk * BM + i, k] * S2[ee, (bn * BN + j) // GROUP, k]
            if e >= 0:
                for i, j in T.Parallel(BM, BN):
                    slot = RowSlot[blk * BM + i]
                    if slot >= 0:
                        Y[slot, bn * BN + j] = acc[i, j]

    return moe_gemm2_fp8


_gather_quant = _tl.kernel_cache(build_gather_quant)
_gemm1 = _tl.kernel_cache(build_gemm1_fp8)
_gemm2 = _tl.kernel_cache(build_gemm2_fp8)

#: MoE tiles (k blocks are always 128 wide: one scale per block)
MOE_SMALL = {"BM": 64, "BN1": 64, "BN2": 128, "stages": 4, "threads": 128}
MOE_LARGE = {"BM": 128, "BN1": 128, "BN2": 128, "stages": 3, "threads": 256}


def fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, weights, ids, *, cfg: dict | None = None):
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    if x.dtype not in (torch.bfloat16, torch.float16) or NT == 0 or C % GROUP or I % GROUP:
        from kernels_cpu.fp8_ops import fused_moe_fp8 as ref

        return ref(x, w13, w13_scale, w2, w2_scale, weights, ids)
    if cfg is None and gemv_enabled() and moe_gemv_fp8.applies(x, w13, w13_scale, w2, w2_scale, weights, ids):
        return moe_gemv_fp8.fused_moe_fp8_small(x, w13, w13_scale, w2, w2_scale, weights, ids)  # decode: 2 launches
    steps, finish = moe_fp8_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, cfg=cfg)
    for _, step in steps:
        step()
    return finish()


def moe_fp8_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, *, cfg: dict | None = None,
                  buffers: dict | None = None):
    """The launches of :func:`fused_moe_fp8` as (name, thunk) pairs, plus a thunk returning the output: decode
    batches (``moe_stream_fp8.applies``, where ``moe_stream_fp8.enabled``) take the weight-streaming GEMMs of
    ``kernels_cuda.moe_stream_fp8``, others (or a ``cfg`` of this module's tiles) the pipeline. ``buffers``, when
    given, receives the intermediate tensors by name (for ``examples/fp8_diag.py`` and ``tests/fp8_moe_stages.py``).
    ``cfg = {"stream": True}``: the stream path whatever the switch says (its conformance tests)."""
    from kernels_cuda import moe_stream_fp8

    forced = cfg == {"stream": True}
    if forced or (cfg is None and moe_stream_fp8.enabled()
                  and moe_stream_fp8.applies(x, w13, w13_scale, w2, w2_scale, ids)):
        return moe_stream_fp8.stream_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, buffers=buffers)

    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    c = dict(cfg or (MOE_SMALL if NT * ids.shape[1] <= 48 * E else MOE_LARGE))
    BM, dt = c["BM"], _tl.tl_dtype(x.dtype)
    k_gemm1 = _gemm1(E, C, I, BM, c["BN1"], c["stages"], c["threads"], dt)
    k_gemm2 = _gemm2(E, C, I, BM, c["BN2"], c["stages"], c["threads"], dt)
    return moe_fp8_launches(x, w13, w13_scale, w2, w2_scale, weights, ids, BM, k_gemm1, k_gemm2, buffers)


def moe_fp8_launches(x, w13, w13_scale, w2, w2_scale, weights, ids, BM: int, k_gemm1, k_gemm2,
                     buffers: dict | None = None):
    """The six launches of the FP8 MoE around its two grouped GEMMs over blocks of ``BM`` rows an expert (the
    pipeline's, or ``moe_stream_fp8``'s with the operands swapped; both take the same arguments): align, gather +
    quantise, ``k_gemm1`` (gate and up, SiLU), quantise H, ``k_gemm2`` (scattered to slots), combine. Returns
    (steps, output thunk); ``buffers`` receives the intermediate tensors by name."""
    from kernels_cuda.moe import _align, _combine

    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = ids.shape[1]
    NS = NT * K
    dt = _tl.tl_dtype(x.dtype)
    dev = x.device
    nblk = (NS + BM - 1) // BM + min(E, NS)
    cap = nblk * BM
    x = x.contiguous()
    ids2 = ids.to(torch.int64).contiguous()
    ids_flat = ids2.view(-1)
    wts = weights.to(torch.float32).contiguous()
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    row_slot = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblk, dtype=torch.int32, device=dev)
    xq = torch.empty(cap, C, dtype=torch.float8_e4m3fn, device=dev)
    sx = torch.empty(cap, C // GROUP, dtype=torch.float32, device=dev)
    hs = torch.empty(cap, I, dtype=x.dtype, device=dev)
    hq = torch.empty(cap, I, dtype=torch.float8_e4m3fn, device=dev)
    sh = torch.empty(cap, I // GROUP, dtype=torch.float32, device=dev)
    y = torch.empty(NS, C, dtype=x.dtype, device=dev)
    out = torch.empty(NT, C, dtype=x.dtype, device=dev)
    k_align = _align(E, BM)
    k_gather = _gather_quant(C, K, BM, dt)
    k_quant = _act_quant(I, dt)
    k_combine = _combine(C, K, E, dt)
    steps = [
        ("align", lambda: k_align(ids_flat, row_slot, block_expert)),
        ("gather_quant", lambda: k_gather(x, row_slot, block_expert, xq, sx)),
        ("gemm1_fp8", lambda: k_gemm1(xq, sx, w13, s13, block_expert, hs)),
        ("quant_hidden", lambda: k_quant(hs, hq, sh)),
        ("gemm2_fp8", lambda: k_gemm2(hq, sh, w2, s2, block_expert, row_slot, y)),
        ("combine", lambda: k_combine(y, wts, ids2, out)),
    ]
    if buffers is not None:
        buffers.update(BM=BM, row_slot=row_slot, block_expert=block_expert, xq=xq, sx=sx, hs=hs, hq=hq, sh=sh, y=y)
    return steps, (lambda: out)


def representative_kernels():
    s, g = MOE_SMALL, MOE_LARGE
    E, C, I = 256, 7168, 2048
    return [
        ("fp8_act_quant K7168", lambda: build_act_quant(7168, "bfloat16")),
        ("fp8_act_quant K7168 scales K-block-major", lambda: build_act_quant(7168, "bfloat16", True)),
        ("fp8_gemm q_b decode", lambda: build_fp8_gemm(24576, 1536, 64, 64, 4, 128, "bfloat16")),
        ("fp8_gemm kv_a prefill", lambda: build_fp8_gemm(576, 7168, 128, 64, 3, 256, "bfloat16")),
        ("fp8_gemm o_proj prefill", lambda: build_fp8_gemm(7168, 16384, 128, 128, 3, 256, "bfloat16")),
        ("moe_gather_quant C7168", lambda: build_gather_quant(C, 8, s["BM"], "bfloat16")),
        ("moe_gemm1_fp8 small", lambda: build_gemm1_fp8(E, C, I, s["BM"], s["BN1"], s["stages"], s["threads"],
                                                        "bfloat16")),
        ("moe_gemm2_fp8 large", lambda: build_gemm2_fp8(E, C, I, g["BM"], g["BN2"], g["stages"], g["threads"],
                                                        "bfloat16")),
    ]
