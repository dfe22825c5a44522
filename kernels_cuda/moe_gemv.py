"""Weight-streaming fused MoE for decode (few rows per expert): two launches, no align/gather/combine.

At decode each selected expert sees a handful of rows, so ``kernels_cuda.moe``'s tensor-core pipeline
(align, gather, gemm1, gemm2, combine: five launches) spends its time on launches and pipeline fill
while the job is to stream each selected expert's weights once at HBM speed. Here, GEMV-style:

1. ``moe_up``: grid (I / BN columns, NS slots). The CTA of slot s takes expert e = ids[s] unless an
   earlier slot already holds e (that CTA does the work): its threads scan the slots once and list
   every slot of e (so e's weights are read once for all its rows). A warp group of ``RT`` threads
   owns one column n of the expert: it loads the gate row n and the up row n of W13[e] into registers
   (16-byte vectors, all loads independent so they are in flight together), then for each listed row
   (in chunks of ``MB``) dots them with x[token] and writes SiLU(gate) * up (optionally V4's clamp) to
   H[slot, n] in the activation dtype. CTAs of slots whose expert is elsewhere (ids < 0 or >= E:
   another rank's) or already taken exit before reading any weight.
2. ``moe_down``: grid (C / BN columns, token chunks of ``MB``). A warp group owns output column c
   and, for each token of its chunk and each of the token's K slots in slot order, dots H[slot] with
   row c of W2[ids[slot]], scales by the routing weight and accumulates in float32; the K slots are
   reduced in registers and out[t, c] is written once. Rows of the same expert across tokens hit L1/L2.
   ``CONFIG["down"] = "slots"`` takes ``kernels_cuda.moe_down_slots`` instead: a CTA of K warps, warp j on slot j,
   so all K slots' weight rows of a column are in flight together (see there). ``DEEPINFER_MOE_DOWN=loop|slots``
   picks it for a run without a code edit (``down_choice``; an override of ``small_steps`` still wins), and
   ``examples/engine_warm.py`` run under the same variable warms the kernel it picks.

Deterministic and batch-invariant inside this path: no atomics on data (the shared-memory counter
only orders the row list, and a row's arithmetic does not depend on its place in the list), every
dot product reduces in a fixed order set by the static shape (C or I, RT), and a token's output
depends only on its own rows. Its rounding differs from the tensor-core pipeline's, so a token's
result depends on which path the batch size picks (``applies``); the engine's batch-invariant mode
replaces ``fused_moe`` with ``kernels_cpu.batch_invariant``'s, so it never runs this choice.
"""

import math
import os

import torch

from deepinfer_core.config import ConfigError
from kernels_cuda import _tl
from kernels_cuda.moe_down_slots import build_down_slots
from kernels_cuda.moe_slots import expert_slots_macro

#: decode batches (tokens) up to this take the weight-streaming path (a size rule on shapes only: nothing is
#: read back from the device); above it the tensor-core pipeline of ``kernels_cuda.moe``. Measured on the H200
#: at V2-Lite (docs/decode_fusion.md), against the pipeline: 1 token 40.2 / 75.8 us a layer, 2: 73.8 / 116.5,
#: 4: 124.4 / 163.9, 8: 210.5 / 248.5, 16: 352.8 / 346.4 (so up to 8).
MAX_TOKENS = 8
THREADS = 256
VEC = 8  # 2-byte elements per 16-byte load


def m_bucket(n: int) -> int:
    """Rows per chunk (static): the token count rounded up to 1, 2, 4 or 8; more tokens run in chunks of 8."""
    return next(b for b in (1, 2, 4, 8) if min(n, 8) <= b)


def split(width: int, threads: int = THREADS) -> tuple[int, int]:
    """(RT threads per column, BN columns per CTA) for a reduction over ``width``: each thread keeps at most
    8 vectors of a weight row in registers (one warp for 2048, four for V3's 7168)."""
    rt = 32
    while rt < threads and -(-width // (rt * VEC)) > 8:
        rt *= 2
    return rt, threads // rt


def build_up(E: int, C: int, I: int, K: int, MB: int, RT: int, BN: int, dtype: str, id_dtype: str,
             limit: float | None = None, pdl: bool = False):
    """The up kernel on the CUDA cores. ``pdl`` (``_tl.PDL_ENV``): it waits for the router (the expert ids and
    X) at its start (``_tl.pdl_gate``): its weight rows depend on the ids."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    accum = "float32"
    step = RT * VEC
    iters = -(-C // step)
    ragged = C % step != 0
    NW = RT // 32
    assert I % BN == 0 and C % VEC == 0
    expert_slots = expert_slots_macro(T)

    @T.macro
    def load_rows(W13, e, n, tk, w_g, w_u):
        """Gate row n and up row n of expert e: this thread's 16-byte vectors, all in flight together."""
        for it in T.unroll(iters):
            k0 = it * step + tk * VEC
            if (not ragged) or (k0 < C):
                for v in T.vectorized(VEC):
                    w_g[it, v] = W13[e, n, k0 + v]
                for v in T.vectorized(VEC):
                    w_u[it, v] = W13[e, I + n, k0 + v]

    @T.prim_func
    def moe_up(X: T.Tensor((NT, C), dtype), W13: T.Tensor((E, 2 * I, C), dtype), Ids: T.Tensor((NS,), id_dtype),
               H: T.Tensor((NS, I), dtype)):
        with T.Kernel(I // BN, NS, threads=(RT, BN)) as (bn, s):
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            T.annotate_min_blocks_per_sm(2)  # <= 128 registers: two CTAs' loads in flight per SM
            lin = tn * RT + tk
            n = bn * BN + tn
            rows = T.alloc_shared((RT * BN,), "int32")  # the slots of this CTA's expert (NS <= RT * BN)
            cnt = T.alloc_shared((1,), "int32")
            first = T.alloc_shared((1,), "int32")
            part = T.alloc_shared((BN, NW, 2 * MB), accum)
            w_g = T.alloc_local((iters, VEC), dtype)
            w_u = T.alloc_local((iters, VEC), dtype)
            x_loc = T.alloc_local((VEC,), dtype)
            acc_g = T.alloc_local((MB,), accum)
            acc_u = T.alloc_local((MB,), accum)
            g = T.alloc_local((1,), accum)
            u = T.alloc_local((1,), accum)
            nr = T.alloc_local((1,), "int32")
            mine = T.alloc_local((1,), "int32")
            if pdl:
                gate()
            e = T.cast(Ids[s], "int32")
            expert_slots(Ids, NS, s, e, lin, rows, cnt, first, nr, mine)
            if (e >= 0) & (e < E) & (mine[0] == 1):
                # (loading before the scan, at one token, measured slower on the H200: 35.5 against 26.1 us)
                load_rows(W13, e, n, tk, w_g, w_u)
                for ch in T.serial(T.ceildiv(nr[0], MB)):
                    for m in T.unroll(MB):
                        acc_g[m] = 0.0
                        acc_u[m] = 0.0
                    for m in T.unroll(MB):
                        # rows past the count repeat the last one (no guard: all loads can be in flight)
                        tok = rows[T.min(ch * MB + m, nr[0] - 1)] // K
                        for it in T.unroll(iters):
                            k0 = it * step + tk * VEC
                            if (not ragged) or (k0 < C):
                                for v in T.vectorized(VEC):
                                    x_loc[v] = X[tok, k0 + v]
                                for v in T.unroll(VEC):
                                    acc_g[m] += T.cast(x_loc[v], accum) * T.cast(w_g[it, v], accum)
                                    acc_u[m] += T.cast(x_loc[v], accum) * T.cast(w_u[it, v], accum)
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
                        T.sync_threads()
                    if tk == 0:
                        for m in T.serial(MB):
                            if ch * MB + m < nr[0]:
                                g[0] = acc_g[m]
                                u[0] = acc_u[m]
                                if limit is not None:
                                    g[0] = T.min(g[0], limit)
                                    u[0] = T.max(T.min(u[0], limit), -limit)
                                H[rows[ch * MB + m], n] = T.cast(g[0] / (1.0 + T.exp(-g[0])) * u[0], dtype)

    return moe_up


def build_up_mma(E: int, C: int, I: int, K: int, dtype: str, id_dtype: str, limit: float | None = None):
    """``moe_up`` on the tensor cores: a CTA owns 8 columns of an expert (their 8 gate and 8 up rows are the M = 16
    of ``mma.m16n8k16``), the listed rows are its N = 8 (in chunks of 8), and its 8 warps split the reduction
    (each 1/8 of C, added through shared memory in warp order). A thread loads 16 contiguous bytes of its gate
    row, up row and activation row per 32 elements of K; the mma's k positions {2t, 2t+1, 2t+8, 2t+9} are mapped
    onto 4 contiguous elements for both operands (any k permutation shared by A and B gives the same dot
    product), so no shuffles. Same loads as the CUDA-core kernel, the FMAs and conversions gone."""
    T = _tl.language()
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    accum = "float32"
    WARPS = THREADS // 32
    BN = 8  # columns per CTA: their 8 gate rows and 8 up rows are the mma's M = 16
    KW = C // WARPS  # each warp's share of the reduction
    assert C % (WARPS * 32) == 0 and I % BN == 0
    steps = KW // 32
    ab = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    expert_slots = expert_slots_macro(T)

    @T.prim_func
    def moe_up_mma(X: T.Tensor((NT, C), dtype), W13: T.Tensor((E, 2 * I, C), dtype), Ids: T.Tensor((NS,), id_dtype),
                   H: T.Tensor((NS, I), dtype)):
        with T.Kernel(I // BN, NS, threads=THREADS) as (bn, s):
            tx = T.get_thread_binding()
            T.annotate_min_blocks_per_sm(2)  # <= 128 registers
            warp = tx // 32
            lane = tx % 32
            g = lane // 4
            t = lane % 4
            rows = T.alloc_shared((THREADS,), "int32")
            cnt = T.alloc_shared((1,), "int32")
            first = T.alloc_shared((1,), "int32")
            red = T.alloc_shared((WARPS, 32, 4), accum)
            wg = T.alloc_local((8,), dtype)
            wu = T.alloc_local((8,), dtype)
            xv = T.alloc_local((8,), dtype)
            a = T.alloc_local((8,), dtype)
            b = T.alloc_local((4,), dtype)
            acc = T.alloc_local((4,), accum)
            nr = T.alloc_local((1,), "int32")
            mine = T.alloc_local((1,), "int32")
            gu = T.alloc_local((2,), accum)
            e = T.cast(Ids[s], "int32")
            expert_slots(Ids, NS, s, e, tx, rows, cnt, first, nr, mine)
            if (e >= 0) & (e < E) & (mine[0] == 1):
                for ch in T.serial(T.ceildiv(nr[0], 8)):
                    for i in T.unroll(4):
                        acc[i] = 0.0
                    tok = rows[T.min(ch * 8 + g, nr[0] - 1)] // K
                    for st in T.unroll(steps):
                        k0 = warp * KW + st * 32 + t * 8
                        for v in T.vectorized(8):
                            wg[v] = W13[e, bn * BN + g, k0 + v]
                        for v in T.vectorized(8):
                            wu[v] = W13[e, I + bn * BN + g, k0 + v]
                        for v in T.vectorized(8):
                            xv[v] = X[tok, k0 + v]
                        for h in T.unroll(2):
                            # the mma's k positions {2t, 2t+1, 2t+8, 2t+9}: this thread's elements 4h .. 4h+3
                            a[0] = wg[4 * h]
                            a[1] = wg[4 * h + 1]
                            a[2] = wu[4 * h]
                            a[3] = wu[4 * h + 1]
                            a[4] = wg[4 * h + 2]
                            a[5] = wg[4 * h + 3]
                            a[6] = wu[4 * h + 2]
                            a[7] = wu[4 * h + 3]
                            for i in T.unroll(4):
                                b[i] = xv[4 * h + i]
                            T.ptx_mma(accum, "m16n8k16", "row", "col", ab, ab, "fp32", a.data, 0, b.data, 0,
                                      acc.data, 0, T.bool(False))
                    for i in T.unroll(4):
                        red[warp, lane, i] = acc[i]
                    T.sync_threads()
                    if warp == 0:
                        for i in T.unroll(4):
                            acc[i] = red[0, lane, i]
                            for w in T.serial(WARPS - 1):
                                acc[i] += red[w + 1, lane, i]
                        # acc[0..1]: gate of column g for chunk rows 2t, 2t+1; acc[2..3]: their up
                        for i in T.unroll(2):
                            if ch * 8 + 2 * t + i < nr[0]:
                                gu[0] = acc[i]
                                gu[1] = acc[2 + i]
                                if limit is not None:
                                    gu[0] = T.min(gu[0], limit)
                                    gu[1] = T.max(T.min(gu[1], limit), -limit)
                                H[rows[ch * 8 + 2 * t + i], bn * BN + g] = T.cast(
                                    gu[0] / (1.0 + T.exp(-gu[0])) * gu[1], dtype)
                    T.sync_threads()

    return moe_up_mma


def build_down(E: int, C: int, I: int, K: int, MB: int, RT: int, BN: int, dtype: str, id_dtype: str, wt_dtype: str,
               min_blocks: int = 4):
    """``min_blocks``: CTAs per SM the register budget must allow (4: <= 64 registers a thread)."""
    T = _tl.language()
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    accum = "float32"
    step = RT * VEC
    iters = -(-I // step)
    ragged = I % step != 0
    NW = RT // 32
    assert C % BN == 0 and I % VEC == 0

    @T.prim_func
    def moe_down(H: T.Tensor((NS, I), dtype), W2: T.Tensor((E, C, I), dtype), Ids: T.Tensor((NT, K), id_dtype),
                 Wt: T.Tensor((NT, K), wt_dtype), Out: T.Tensor((NT, C), dtype)):
        with T.Kernel(C // BN, T.ceildiv(NT, MB), threads=(RT, BN)) as (bc, tb):
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            T.annotate_min_blocks_per_sm(min_blocks)
            c = bc * BN + tn
            zero = T.cast(0, dtype)
            part = T.alloc_shared((BN, NW, MB), accum)
            w_loc = T.alloc_local((VEC,), dtype)
            h_loc = T.alloc_local((VEC,), dtype)
            dot = T.alloc_local((1,), accum)
            acc = T.alloc_local((MB,), accum)
            for m in T.unroll(MB):
                acc[m] = 0.0
            for m in T.unroll(MB):
                t = T.min(tb * MB + m, NT - 1)  # rows past NT repeat the last token (not written)
                for j in T.unroll(K):
                    e = T.cast(Ids[t, j], "int32")
                    ok = (e >= 0) & (e < E)
                    # predicated loads, no branch: every slot's loads can be in flight together; another
                    # rank's slot loads zeros (its H row was never written)
                    dot[0] = 0.0
                    for it in T.unroll(iters):
                        k0 = it * step + tk * VEC
                        live = ok if not ragged else ok & (k0 < I)
                        for v in T.vectorized(VEC):
                            w_loc[v] = T.if_then_else(live, W2[e, c, k0 + v], zero)
                        for v in T.vectorized(VEC):
                            h_loc[v] = T.if_then_else(live, H[t * K + j, k0 + v], zero)
                        for v in T.unroll(VEC):
                            dot[0] += T.cast(h_loc[v], accum) * T.cast(w_loc[v], accum)
                    acc[m] += T.cast(T.if_then_else(ok, Wt[t, j], T.cast(0, wt_dtype)), accum) * dot[0]
            for m in T.unroll(MB):
                acc[m] = T.warp_reduce_sum(acc[m])
            if NW > 1:
                if tk % 32 == 0:
                    for m in T.unroll(MB):
                        part[tn, tk // 32, m] = acc[m]
                T.sync_threads()
                if tk == 0:
                    for m in T.unroll(MB):
                        acc[m] = part[tn, 0, m]
                        for w in T.serial(NW - 1):
                            acc[m] += part[tn, w + 1, m]
            if tk == 0:
                for m in T.serial(MB):
                    if tb * MB + m < NT:
                        Out[tb * MB + m, c] = T.cast(acc[m], dtype)

    return moe_down


_up = _tl.kernel_cache(build_up)
_up_mma = _tl.kernel_cache(build_up_mma)
_down = _tl.kernel_cache(build_down)
_down_slots = _tl.kernel_cache(build_down_slots)

_IDS = {torch.int64: "int64", torch.int32: "int32"}


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            max_tokens: int = MAX_TOKENS) -> bool:
    """Whether ``fused_moe`` takes this path: at most ``MAX_TOKENS`` tokens (the size rule: rows per expert are
    at most the token count when a token's ids are distinct; repeats are handled, in more chunks), 2-byte
    activations with weights of the same dtype, contiguous 16-byte aligned operands, widths the tiles divide."""
    NT, C = x.shape
    if not (1 <= NT <= max_tokens) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w13.dtype != x.dtype or w2.dtype != x.dtype or ids.dtype not in _IDS or ids.dim() != 2:
        return False
    if weights.dtype not in (x.dtype, torch.float32) or weights.shape != ids.shape or ids.shape[0] != NT:
        return False
    E, two_i, C1 = w13.shape
    I = two_i // 2
    if C1 != C or w2.shape != (E, C, I) or NT * ids.shape[1] > THREADS:
        return False
    if C % VEC or I % VEC:  # (then the 1-8 columns per CTA divide them too)
        return False
    if not (w13.is_contiguous() and w2.is_contiguous()) or w13.data_ptr() % 16 or w2.data_ptr() % 16:
        return False
    return x.is_cuda or _tl.dry_run()


def mma_fits(C: int) -> bool:
    """``build_up_mma`` takes the hidden width in whole 32-element steps of each of its 8 warps."""
    return C % (THREADS // 32 * 32) == 0


def fused_moe_small(x, w13, w2, weights, ids, limit: float | None = None, **overrides) -> torch.Tensor:
    """``fused_moe`` (``limit``: ``fused_moe_clamped``) in two launches; ``applies`` must hold (``overrides``: see
    :func:`small_steps`)."""
    steps, finish = small_steps(x, w13, w2, weights, ids, limit, **overrides)
    for _, step in steps:
        step()
    return finish()


#: the tiles, measured on the H200 at V2-Lite (docs/decode_fusion.md): the up kernel on the CUDA cores at one token
#: (25.7 us against 30.2 on the tensor cores) and on the tensor cores from two ("auto"; at 2 / 8 tokens 46.8 /
#: 128.8 us against 93.5 / 306.9), 256 threads; the down kernel with 128 threads and 4 CTAs' registers per SM
#: (15.6-15.9 us; the other shapes swept 15.4-17.8) and one token per CTA (at 8 tokens 83.8 us against 261.1
#: with a CTA per 8 tokens: more tokens share experts through L2, not through one warp's loop).
#: ``down``: "loop" (``build_down``) or "slots" (``moe_down_slots``: K warps a CTA, one per slot; tiles by
#: :func:`slot_tiles`). Measured on an H100 (docs/h200/s12, ``moe_small_bench.py``): slots at 1 / 2 / 4 / 8 tokens
#: 18.1 / 30.4 / 52.2 / 91.2 us a V2-Lite layer against the loop kernel's 19.4 / 35.0 / 58.6 / 113.1.
CONFIG = {"up": "auto", "up_threads": THREADS, "down": "slots", "down_threads": 128, "down_blocks": 4,
          "down_tokens": 1}
DOWNS = ("loop", "slots")
#: ``DEEPINFER_MOE_DOWN=loop|slots`` replaces ``CONFIG["down"]`` (read at each ``small_steps``; unset or empty: CONFIG)
DOWN_ENV = "DEEPINFER_MOE_DOWN"


def down_choice() -> str:
    """The down kernel ``small_steps`` takes without an override: ``DEEPINFER_MOE_DOWN`` where set, else CONFIG's."""
    env = os.environ.get(DOWN_ENV, "").strip().lower()
    if not env:
        return CONFIG["down"]
    if env not in DOWNS:
        raise ConfigError(f"environment variable {DOWN_ENV}={env!r}: expected one of {', '.join(DOWNS)}")
    return env


def slot_tiles(n_tokens: int) -> dict:
    """The slots down kernel's tiles (a size rule; ``small_steps`` overrides replace them): at one token a column a
    CTA and 3 CTAs' registers an SM (18.1 us against 19.4 with 2 columns on the H100); from two tokens 2 columns,
    2 CTAs an SM and the row bucket of tokens a CTA (``down_tokens`` 0: the token rows of an expert then share its
    loads in one CTA; at 2 tokens 30.4 us against 33.2 with a token a CTA)."""
    if n_tokens <= 1:
        return {"down_cols": 1, "down_slot_blocks": 3, "down_tokens": 1}
    return {"down_cols": 2, "down_slot_blocks": 2, "down_tokens": 0}


def small_steps(x, w13, w2, weights, ids, limit: float | None = None, **overrides):
    """The two launches as (name, thunk) pairs plus the output thunk. ``overrides`` replace :data:`CONFIG` keys
    (``examples/moe_small_bench.py`` sweeps them): ``up`` "fma" (``build_up``), "mma" (``build_up_mma``, where
    ``mma_fits``) or "auto" (fma at one token, else mma where it fits), ``up_threads``, ``down_threads``,
    ``down_blocks`` (``build_down``'s ``min_blocks``),
    ``down_tokens`` (tokens per down CTA; 0: the row bucket); ``down`` "loop" (``build_down``, with ``down_threads``
    and ``down_blocks``) or "slots" (``build_down_slots``, with ``down_cols`` columns a CTA, cut to a divisor of
    the hidden width, and ``down_slot_blocks``); without an override, :func:`down_choice`."""
    cfg = {**CONFIG, "down": down_choice(), **overrides}
    if cfg["down"] not in DOWNS:
        raise ValueError(f"down={cfg['down']!r}: expected one of {', '.join(DOWNS)}")
    NT, C = x.shape
    if cfg["down"] == "slots":
        cfg = {**cfg, **slot_tiles(NT), **overrides}
    E, two_i, _ = w13.shape
    I, K = two_i // 2, ids.shape[1]
    assert NT * K <= cfg["up_threads"], "the slot scan lists at most one slot per thread"
    x = x.contiguous()
    if x.data_ptr() % 16:  # 16-byte vector loads
        x = x.clone()
    ids, weights = ids.contiguous(), weights.contiguous()
    dt, id_dt, MB = _tl.tl_dtype(x.dtype), _IDS[ids.dtype], m_bucket(NT)
    h = torch.empty(NT * K, I, dtype=x.dtype, device=x.device)
    out = torch.empty(NT, C, dtype=x.dtype, device=x.device)
    up = cfg["up"] if cfg["up"] != "auto" else ("fma" if NT == 1 else "mma")
    if up == "mma" and mma_fits(C):
        k1 = _up_mma(E, C, I, K, dt, id_dt, limit)
    else:
        k1 = _up(E, C, I, K, MB, *split(C, cfg["up_threads"]), dt, id_dt, limit, *_tl.pdl_arg(NT))
    MD = cfg["down_tokens"] or MB
    wt_dt = _tl.tl_dtype(weights.dtype)
    if cfg["down"] == "slots":
        k2 = _down_slots(E, C, I, K, MD, math.gcd(cfg["down_cols"], C), dt, id_dt, wt_dt, cfg["down_slot_blocks"],
                         *_tl.pdl_arg(NT))
    else:
        k2 = _down(E, C, I, K, MD, *split(I, cfg["down_threads"]), dt, id_dt, wt_dt, cfg["down_blocks"])
    flat = ids.view(-1)
    return [("up", lambda: k1(x, w13, flat, h)), ("down", lambda: k2(h, w2, ids, weights, out))], (lambda: out)


def representative_kernels():
    E, C, I = 66, 2048, 1408  # V2-Lite: 64 routed + 2 shared experts, top-6 + 2
    t1, t2 = slot_tiles(1), slot_tiles(2)
    return [
        ("moe_up V2-Lite MB1", lambda: build_up(E, C, I, 8, 1, *split(C), "bfloat16", "int64")),
        ("moe_down V2-Lite MB2 bf16 weights", lambda: build_down(E, C, I, 8, 2, *split(I), "bfloat16", "int64",
                                                                 "bfloat16")),
        # V3 (hidden 7168: four warps per column) and V4-Flash's clamp
        ("moe_up V3 MB2", lambda: build_up(257, 7168, 2048, 9, 2, *split(7168), "bfloat16", "int64")),
        ("moe_up V4 clamped MB1", lambda: build_up(256, 4096, 2048, 6, 1, *split(4096), "bfloat16", "int64", 10.0)),
        ("moe_up mma V2-Lite", lambda: build_up_mma(E, C, I, 8, "bfloat16", "int64")),
        # the slot-parallel down kernel (CONFIG["down"] = "slots"): V2-Lite's 8 slots (ragged width 1408), V3's 9
        # (width 2048) with float32 routing weights and two tokens a CTA
        ("moe_down slots V2-Lite", lambda: build_down_slots(E, C, I, 8, 1, t1["down_cols"], "bfloat16", "int64",
                                                            "bfloat16", t1["down_slot_blocks"])),
        ("moe_down slots V3 MB2", lambda: build_down_slots(257, 7168, 2048, 9, 2, t2["down_cols"], "bfloat16",
                                                           "int64", "float32", t2["down_slot_blocks"])),
    ]
