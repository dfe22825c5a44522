"""Weight-streaming fused MoE with FP8 block-scaled experts for decode: ``moe_gemv``'s two launches over
e4m3 weights (``fused_moe_fp8`` when rows per expert are few).

The tensor-core FP8 pipeline (``fp8_gemm.moe_fp8_steps``: align, gather + quantise, gemm1, quantise,
gemm2, combine; 64-row tiles) spends a decode step on six launches and pipeline fill while the job is to
stream each selected expert's e4m3 weights once. Here, as ``moe_gemv``:

1. ``moe_up_fp8``: grid (I / BN columns, NS slots); the CTA of slot s takes expert e = ids[s] unless an
   earlier slot holds e, lists every slot of e, and loads the gate and up rows of its BN columns (16 e4m3
   per 16-byte load, all in flight). Then, per chunk of ``MB`` listed rows, its threads quantise those
   rows of x into shared memory exactly as ``quantize_act_fp8`` (a 128-channel group on 8 lanes: amax by
   shuffles, IEEE division, e4m3 round-to-nearest-even) and each column's ``RT`` threads dot them with the
   rows: per 16 values a float32 sum scaled by ``s_x * w_scale`` (the block promotion), reduced over the
   lanes; gate and up are rounded to x's dtype, SiLU(gate) * up computed in float32 and rounded once to
   H[slot, n] (the reference's rounding points).
2. ``moe_down_fp8``: grid (C / BN columns, tokens). The CTA first quantises its token's K hidden rows
   into shared memory (the reference's per-128 quantisation of the hidden before the second GEMM, so no
   separate launch), then a warp per output column c dots each slot's quantised row with row c of
   W2[ids[slot]] (scaled per 128 block), rounds the slot's result to x's dtype (the reference's
   ``fp8_linear`` output), multiplies by the routing weight in float32 and sums the K slots in slot order;
   out[t, c] is cast once. Slots of another rank's experts (ids < 0 or >= E) load nothing and add nothing.

The up kernel has a tensor-core variant, ``build_up_fp8_mma`` (``moe_up_fp8_mma``): the same inputs, outputs and
rounding points, the per-group e4m3 dot products on ``mma.sync.m16n8k32`` (e4m3 x e4m3 -> float32) instead of
converting each weight to float32 and FMA'ing it (the CUDA-core kernel measured instruction-bound on the H200, about
11 instructions a weight byte). It is the default (``CONFIG["up"]``; ``DEEPINFER_FP8_MOE_UP=fma`` or
``moe_fp8_small_steps(up="fma")`` runs the CUDA-core kernel). On an H100 at V2-Lite (docs/h200/s12) the up launch
takes 25.2 / 36.0 / 79.1 / 201.8 us at 1 / 2 / 4 / 8 tokens against the CUDA-core kernel's 25.9 / 100.1 / 222.1 /
671.2 (V3 at one token: 122.2 against 177.5), so the path now runs up to 4 tokens.

A slot-parallel FP8 down kernel (``moe_down_slots``' layout) measured 33.3 us against this one's 16.0 at one token
(H100, docs/h200/s12): every one of its C / 4 CTAs quantised the token's K hidden rows. It was dropped.

Deterministic (fixed reduction orders; the shared counter only orders the row list). Its float32 sums
are ordered differently from the tensor-core pipeline's, so results differ by rounding between paths.
"""

import os

import torch

from deepinfer_core.config import ConfigError
from kernels_cuda import _tl
from kernels_cuda.fp8_gemv import FP8, GROUP, quant_rows_macro, quant_store_macro
from kernels_cuda.moe_slots import expert_slots_macro
from kernels_cuda.moe_up_fp8_mma import build_up_fp8_mma

#: tokens up to this take this path. Measured on an H100 at V2-Lite (docs/h200/s12) with the tensor-core up kernel,
#: against the six-launch pipeline: 1 token 39.8 / 83.1 us, 2: 62.5 / 119.3, 4: 128.4 / 160.6, 8: 293.6 / 247.1
#: (with the CUDA-core up kernel, docs/h200/s10 on the H200, only up to 2 tokens paid)
MAX_TOKENS = 4
THREADS = 256
VEC = 16  # e4m3 values per 16-byte load


def m_bucket(n: int) -> int:
    """Rows per chunk of the up kernel: the token count rounded up to 1, 2, 4 or 8."""
    return next(b for b in (1, 2, 4, 8) if min(n, 8) <= b)


def split(width: int, threads: int = THREADS) -> tuple[int, int]:
    """(RT threads per column, BN columns per CTA): at most 8 vectors of a row per thread (a warp for 2048,
    two for V3's 7168)."""
    rt = 32
    while rt < threads and -(-width // (rt * VEC)) > 8:
        rt *= 2
    return rt, threads // rt


def build_up_fp8(E: int, C: int, I: int, K: int, MB: int, RT: int, BN: int, dtype: str, id_dtype: str,
                 min_blocks: int = 2):
    """``min_blocks``: CTAs per SM the register budget must allow."""
    T = _tl.language()
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    step = RT * VEC
    iters = C // step
    NW = RT // 32
    CB, NTH, TV = C // GROUP, RT * BN, MB * C // VEC
    assert C % step == 0 and I % BN == 0 and RT % 32 == 0
    quant_rows = quant_rows_macro(T, NTH, TV, C, K)
    expert_slots = expert_slots_macro(T)

    @T.prim_func
    def moe_up_fp8(X: T.Tensor((NT, C), dtype), W13: T.Tensor((E, 2 * I, C), FP8),
                   S13: T.Tensor((E, 2 * I // GROUP, CB), "float32"), Ids: T.Tensor((NS,), id_dtype),
                   H: T.Tensor((NS, I), dtype)):
        with T.Kernel(I // BN, NS, threads=(RT, BN)) as (bn, s):
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            T.annotate_min_blocks_per_sm(min_blocks)
            lin = tn * RT + tk
            n = bn * BN + tn
            rows = T.alloc_shared((NTH,), "int32")
            cnt = T.alloc_shared((1,), "int32")
            first = T.alloc_shared((1,), "int32")
            part = T.alloc_shared((BN, NW, 2 * MB), "float32")
            q_s = T.alloc_shared((MB, C), FP8)
            sx_s = T.alloc_shared((MB, CB), "float32")
            w_g = T.alloc_local((iters, VEC), FP8)
            w_u = T.alloc_local((iters, VEC), FP8)
            s_g = T.alloc_local((iters,), "float32")
            wgf = T.alloc_local((VEC,), "float32")
            wuf = T.alloc_local((VEC,), "float32")
            s_u = T.alloc_local((iters,), "float32")
            xb = T.alloc_local((VEC,), dtype)
            xf = T.alloc_local((VEC,), "float32")
            qf = T.alloc_local((VEC,), "float32")
            qv = T.alloc_local((VEC,), FP8)
            sc = T.alloc_local((1,), "float32")
            pg = T.alloc_local((1,), "float32")
            pu = T.alloc_local((1,), "float32")
            acc_g = T.alloc_local((MB,), "float32")
            acc_u = T.alloc_local((MB,), "float32")
            g = T.alloc_local((1,), "float32")
            u = T.alloc_local((1,), "float32")
            nr = T.alloc_local((1,), "int32")
            mine = T.alloc_local((1,), "int32")
            e = T.cast(Ids[s], "int32")
            expert_slots(Ids, NS, s, e, lin, rows, cnt, first, nr, mine)
            if (e >= 0) & (e < E) & (mine[0] == 1):
                for it in T.unroll(iters):  # the gate and up rows of column n: all loads in flight
                    k0 = it * step + tk * VEC
                    for v in T.vectorized(VEC):
                        w_g[it, v] = W13[e, n, k0 + v]
                    for v in T.vectorized(VEC):
                        w_u[it, v] = W13[e, I + n, k0 + v]
                    s_g[it] = S13[e, n // GROUP, k0 // GROUP]
                    s_u[it] = S13[e, (I + n) // GROUP, k0 // GROUP]
                for ch in T.serial(T.ceildiv(nr[0], MB)):
                    # the chunk's rows of x, quantised into shared memory (rows past the count repeat the last)
                    quant_rows(X, rows, nr, ch, lin, xb, xf, qf, qv, sc, q_s, sx_s)
                    T.sync_threads()
                    for m in T.unroll(MB):
                        acc_g[m] = 0.0
                        acc_u[m] = 0.0
                        for it in T.unroll(iters):
                            k0 = it * step + tk * VEC
                            for v in T.vectorized(VEC):
                                qv[v] = q_s[m, k0 + v]
                            pg[0] = 0.0
                            pu[0] = 0.0
                            # vectorised casts: e4m3 pairs through one cvt.f16x2.e4m3x2 (a scalar cast is one each)
                            for v in T.vectorized(VEC):
                                qf[v] = T.cast(qv[v], "float32")
                            for v in T.vectorized(VEC):
                                wgf[v] = T.cast(w_g[it, v], "float32")
                            for v in T.vectorized(VEC):
                                wuf[v] = T.cast(w_u[it, v], "float32")
                            for v in T.unroll(VEC):
                                pg[0] += qf[v] * wgf[v]
                                pu[0] += qf[v] * wuf[v]
                            acc_g[m] += pg[0] * (sx_s[m, k0 // GROUP] * s_g[it])
                            acc_u[m] += pu[0] * (sx_s[m, k0 // GROUP] * s_u[it])
                    for m in T.unroll(MB):
                        acc_g[m] = T.warp_reduce_sum(acc_g[m])
                        acc_u[m] = T.warp_reduce_sum(acc_u[m])
                    if NW > 1:  # the column's warps add their sums through shared memory, in warp order
                        if tk % 32 == 0:
                            for m in T.unroll(MB):
                                part[tn, tk // 32, m] = acc_g[m]
                                part[tn, tk // 32, MB + m] = acc_u[m]
                        T.sync_threads()
                        if tk == 0:
                            for m in T.unroll(MB):
                                acc_g[m] = part[tn, 0, m]
                                acc_u[m] = part[tn, 0, MB + m]
                                for w in T.serial(NW - 1):
                                    acc_g[m] += part[tn, w + 1, m]
                                    acc_u[m] += part[tn, w + 1, MB + m]
                    if tk == 0:
                        for m in T.serial(MB):
                            if ch * MB + m < nr[0]:
                                # gate and up as the reference's fp8_linear outputs (x's dtype), then SiLU * up
                                g[0] = T.cast(T.cast(acc_g[m], dtype), "float32")
                                u[0] = T.cast(T.cast(acc_u[m], dtype), "float32")
                                H[rows[ch * MB + m], n] = T.cast(g[0] / (1.0 + T.exp(-g[0])) * u[0], dtype)
                    T.sync_threads()  # q_s and part are rewritten by the next chunk

    return moe_up_fp8


def build_down_fp8(E: int, C: int, I: int, K: int, BN: int, dtype: str, id_dtype: str, wt_dtype: str,
                   min_blocks: int = 2, pdl: bool = False):
    """One token per CTA, one warp per output column (``RT`` = 32); ``min_blocks`` as ``build_up_fp8``. ``pdl``
    (``_tl.PDL_ENV``): it waits for the up kernel at its start (``_tl.pdl_gate``)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    RT = 32
    step = RT * VEC
    iters = -(-I // step)
    IB, CB, NTH, TV = I // GROUP, -(-C // GROUP), RT * BN, K * I // VEC
    assert I % GROUP == 0 and C % BN == 0
    quant_store = quant_store_macro(T, NTH, TV)

    @T.prim_func
    def moe_down_fp8(H: T.Tensor((NS, I), dtype), W2: T.Tensor((E, C, I), FP8),
                     S2: T.Tensor((E, CB, IB), "float32"), Ids: T.Tensor((NT, K), id_dtype),
                     Wt: T.Tensor((NT, K), wt_dtype), Out: T.Tensor((NT, C), dtype)):
        with T.Kernel(C // BN, NT, threads=(RT, BN)) as (bc, t):
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            T.annotate_min_blocks_per_sm(min_blocks)
            lin = tn * RT + tk
            c = bc * BN + tn
            q_s = T.alloc_shared((K, I), FP8)
            sh_s = T.alloc_shared((K, IB), "float32")
            xb = T.alloc_local((VEC,), dtype)
            xf = T.alloc_local((VEC,), "float32")
            qf = T.alloc_local((VEC,), "float32")
            qv = T.alloc_local((VEC,), FP8)
            w_loc = T.alloc_local((VEC,), FP8)
            wf = T.alloc_local((VEC,), "float32")
            sc = T.alloc_local((1,), "float32")
            p = T.alloc_local((1,), "float32")
            dot = T.alloc_local((1,), "float32")
            acc = T.alloc_local((1,), "float32")
            if pdl:
                gate()
            # the token's K hidden rows, quantised per 128 channels into shared memory (another rank's slots
            # are quantised too, from a row nobody wrote, and never used)
            for j in T.serial(T.ceildiv(TV, NTH)):
                idx = T.min(j * NTH + lin, TV - 1)
                slot = idx // (I // VEC)
                kv = idx % (I // VEC)
                for v in T.vectorized(VEC):
                    xb[v] = H[t * K + slot, kv * VEC + v]
                quant_store(xb, xf, qf, qv, sc, j, lin, q_s, sh_s, slot, kv)
            T.sync_threads()
            acc[0] = 0.0
            for j in T.unroll(K):
                e = T.cast(Ids[t, j], "int32")
                ok = (e >= 0) & (e < E)
                ee = T.max(T.min(e, E - 1), 0)
                dot[0] = 0.0
                for it in T.unroll(iters):
                    k0 = T.min(it * step + tk * VEC, I - VEC)
                    live = ok & (it * step + tk * VEC < I)
                    for v in T.vectorized(VEC):
                        w_loc[v] = T.if_then_else(live, W2[ee, c, k0 + v], T.cast(0, FP8))
                    for v in T.vectorized(VEC):
                        qv[v] = q_s[j, k0 + v]
                    p[0] = 0.0
                    for v in T.vectorized(VEC):
                        qf[v] = T.cast(qv[v], "float32")
                    for v in T.vectorized(VEC):
                        wf[v] = T.cast(w_loc[v], "float32")
                    for v in T.unroll(VEC):
                        p[0] += qf[v] * wf[v]
                    dot[0] += T.if_then_else(live, p[0] * (sh_s[j, k0 // GROUP] * S2[ee, c // GROUP, k0 // GROUP]),
                                             0.0)
                dot[0] = T.warp_reduce_sum(dot[0])
                # the slot's output as the reference's fp8_linear (x's dtype), times its routing weight
                acc[0] += T.if_then_else(ok, T.cast(Wt[t, j], "float32") * T.cast(T.cast(dot[0], dtype), "float32"),
                                         0.0)
            if tk == 0:
                Out[t, c] = T.cast(acc[0], dtype)

    return moe_down_fp8


_up = _tl.kernel_cache(build_up_fp8)
_up_mma = _tl.kernel_cache(build_up_fp8_mma)
_down = _tl.kernel_cache(build_down_fp8)

_IDS = {torch.int64: "int64", torch.int32: "int32"}


def applies(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
            weights: torch.Tensor, ids: torch.Tensor, max_tokens: int = MAX_TOKENS) -> bool:
    """Whether ``fused_moe_fp8`` takes this path: 1..``MAX_TOKENS`` tokens of 2-byte activations, e4m3 experts with
    128x128 tile scales, C and I multiples of 128 (C also of a column's 16-byte vectors), at most ``THREADS`` slots
    (the slot scan), contiguous 16-byte aligned weights, a down CTA's quantised hidden rows within 48 KB."""
    NT, C = x.shape
    if not (1 <= NT <= max_tokens) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    fp8 = torch.float8_e4m3fn
    if w13.dtype != fp8 or w2.dtype != fp8 or ids.dtype not in _IDS or ids.dim() != 2:
        return False
    if weights.dtype not in (x.dtype, torch.float32) or weights.shape != ids.shape or ids.shape[0] != NT:
        return False
    E, two_i, C1 = w13.shape
    I = two_i // 2
    if C1 != C or w2.shape != (E, C, I) or NT * ids.shape[1] > THREADS or C % GROUP or I % GROUP:
        return False
    rt, _ = split(C)
    if C % (rt * VEC) or ids.shape[1] * I > 48 * 1024:
        return False
    if tuple(w13_scale.shape) != (E, two_i // GROUP, C // GROUP) or tuple(w2_scale.shape) != (E, -(-C // GROUP),
                                                                                              I // GROUP):
        return False
    if not (w13.is_contiguous() and w2.is_contiguous()) or w13.data_ptr() % 16 or w2.data_ptr() % 16:
        return False
    return x.is_cuda or _tl.dry_run()


#: the up kernel: "fma" (``build_up_fp8``, CUDA cores) or "mma" (``build_up_fp8_mma``, e4m3 tensor cores, where
#: ``mma_fits``; module docstring: its figures)
CONFIG = {"up": "mma"}
#: overrides ``CONFIG["up"]`` where the default is applied (``moe_fp8_small_steps`` without ``up``): set to "mma" to
#: run the engine (or a benchmark) on ``build_up_fp8_mma`` without a code change
UP_ENV = "DEEPINFER_FP8_MOE_UP"


def mma_fits(C: int) -> bool:
    """``build_up_fp8_mma`` takes the hidden width in whole 64-value chunks of each of its 8 warps."""
    return C % (THREADS // 32 * 64) == 0


def up_kind(C: int = 2048, up: str | None = None) -> str:
    """The up kernel a call takes: ``up``, else ``$DEEPINFER_FP8_MOE_UP``, else ``CONFIG["up"]``; "mma" only where
    ``mma_fits`` (else "fma")."""
    env = os.environ.get(UP_ENV, "").strip().lower()
    if env not in ("", "fma", "mma"):
        raise ConfigError(f"environment variable {UP_ENV}={os.environ[UP_ENV]!r}: expected fma or mma")
    kind = up or env or CONFIG["up"]
    if kind not in ("fma", "mma"):
        raise ValueError(f"moe_gemv_fp8 up kernel {kind!r}: 'fma' or 'mma'")
    return "mma" if kind == "mma" and mma_fits(C) else "fma"


def moe_fp8_small_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, min_blocks: int = 2, up: str | None = None):
    """The two launches as (name, thunk) pairs plus the output thunk (and the hidden, for the tests):
    ``applies`` must hold. ``min_blocks``: both kernels' CTAs per SM (``examples/fp8_gemv_bench.py`` tries 4);
    ``up``: the up kernel, "fma" or "mma" (None: ``$DEEPINFER_FP8_MOE_UP`` or ``CONFIG["up"]``, see ``up_kind``)."""
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I, K = two_i // 2, ids.shape[1]
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    ids, weights = ids.contiguous(), weights.contiguous()
    s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    dt, id_dt = _tl.tl_dtype(x.dtype), _IDS[ids.dtype]
    h = torch.empty(NT * K, I, dtype=x.dtype, device=x.device)
    out = torch.empty(NT, C, dtype=x.dtype, device=x.device)
    if up_kind(C, up) == "mma":
        k1 = _up_mma(E, C, I, K, m_bucket(NT), dt, id_dt, min_blocks, *_tl.pdl_arg(NT, by_default=False))
    else:
        k1 = _up(E, C, I, K, m_bucket(NT), *split(C), dt, id_dt, min_blocks)
    k2 = _down(E, C, I, K, THREADS // 32, dt, id_dt, _tl.tl_dtype(weights.dtype), min_blocks,
               *_tl.pdl_arg(NT, by_default=False))
    flat = ids.view(-1)
    steps = [("up_fp8", lambda: k1(x, w13, s13, flat, h)), ("down_fp8", lambda: k2(h, w2, s2, ids, weights, out))]
    return steps, (lambda: out), h


def fused_moe_fp8_small(x, w13, w13_scale, w2, w2_scale, weights, ids, min_blocks: int = 2,
                        up: str | None = None) -> torch.Tensor:
    """``fused_moe_fp8`` in two launches (``applies`` must hold; ``up`` as ``moe_fp8_small_steps``)."""
    steps, finish, _ = moe_fp8_small_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, min_blocks, up)
    for _, step in steps:
        step()
    return finish()


def representative_kernels():
    E, C, I = 66, 2048, 1408  # V2-Lite: 64 routed + 2 shared experts, top-6 + 2
    return [
        ("moe_up_fp8 V2-Lite MB1", lambda: build_up_fp8(E, C, I, 8, 1, *split(C), "bfloat16", "int64")),
        ("moe_down_fp8 V2-Lite", lambda: build_down_fp8(E, C, I, 8, 8, "bfloat16", "int64", "float32")),
        ("moe_up_fp8 V3 MB8", lambda: build_up_fp8(257, 7168, 2048, 9, 8, *split(7168), "bfloat16", "int64")),
        # the e4m3 tensor-core up kernel (mma.sync m16n8k32)
        ("moe_up_fp8_mma V2-Lite MB8", lambda: build_up_fp8_mma(E, C, I, 8, 8, "bfloat16", "int64")),
        ("moe_up_fp8_mma V3 MB1", lambda: build_up_fp8_mma(257, 7168, 2048, 9, 1, "bfloat16", "int64")),
        ("moe_down_fp8 V3 bf16 weights", lambda: build_down_fp8(257, 7168, 2048, 9, 8, "bfloat16", "int64",
                                                                "bfloat16")),
    ]
