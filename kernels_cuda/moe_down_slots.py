"""``moe_gemv``'s down kernel with a token's K slots in parallel (``CONFIG["down"] = "slots"``).

``moe_gemv.build_down`` gives an output column to one warp, which walks the token's K slots in turn: at 64
registers a thread the slots' weight rows load one after another (about K dependent memory round trips per
warp). Here a CTA of K warps (``threads=(32, K)``) owns ``BN`` output columns of one token at a time: warp j
takes slot j (expert e = ids[t, j]) and first issues every 16-byte load of rows c .. c + BN - 1 of W2[e] (all
in flight together, ``BN * ceil(I / 256)`` vectors a lane), then dots them with H[t * K + j] (its vectors read
one at a time, from L1/L2: every CTA of the token reads the same K rows) and reduces over the warp. Lane 0
scales the BN sums by the routing weight (float32) into shared memory; after a barrier one thread per column
adds the K slots in slot order and writes out[t, c] once in the activation dtype.

Same guarantees as ``moe_gemv``: no atomics, every sum in an order fixed by the static shapes (lanes: vector
by vector in k order, then the warp's butterfly; slots: 0 .. K-1), a token's output from its own rows only
(deterministic and batch-invariant within this kernel; its rounding differs from ``build_down``'s, which
weights each lane's partial before the warp reduction). A slot whose id is < 0 or >= E (another rank's
expert) loads nothing (a warp-uniform branch) and adds nothing. NS and NT are dynamic; I need not be a
multiple of 256 (the last vector of a lane past I is predicated to zero); ``MB`` tokens a CTA, one after
another (grid y = ceil(NT / MB)).

ptxas for sm_90a (CUDA 12, no spills): V2-Lite (K 8, I 1408: 6 vectors a lane a row) 64 registers at BN 1, 82 at
BN 2 (80 bounded to 3 CTAs an SM), 88 at BN 4, 148 at BN 8; K 16 at BN 2: 82; V3 (K 9, I 2048) 78 at BN 1, 96 at
BN 2 (``build_down`` at V2-Lite, 128 threads: 78).
"""

from kernels_cuda import _tl

VEC = 8  # 2-byte elements per 16-byte load
MIN_REGS = 80  # registers a thread the CTAs-per-SM bound may not go under (BN = 2 holds 48 in weight vectors)


def build_down_slots(E: int, C: int, I: int, K: int, MB: int, BN: int, dtype: str, id_dtype: str, wt_dtype: str,
                     min_blocks: int = 2, pdl: bool = False):
    """Grid (C / BN, ceil(NT / MB)), 32 x K threads. ``min_blocks``: CTAs per SM the register budget must allow
    (2 at K = 8: <= 128 registers a thread), lowered where it would leave fewer than ``MIN_REGS`` (K = 16: 1).
    ``pdl`` (``_tl.PDL_ENV``): it waits for the up kernel at its start (``_tl.pdl_gate``)."""
    min_blocks = max(1, min(min_blocks, 65536 // (32 * K * MIN_REGS)))
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    accum = "float32"
    step = 32 * VEC
    iters = -(-I // step)
    ragged = I % step != 0
    assert C % BN == 0 and I % VEC == 0 and 1 <= BN <= 32 and 1 <= K <= 32 and MB >= 1

    @T.prim_func
    def moe_down_slots(H: T.Tensor((NS, I), dtype), W2: T.Tensor((E, C, I), dtype), Ids: T.Tensor((NT, K), id_dtype),
                       Wt: T.Tensor((NT, K), wt_dtype), Out: T.Tensor((NT, C), dtype)):
        with T.Kernel(C // BN, T.ceildiv(NT, MB), threads=(32, K)) as (bc, tb):
            lane = T.get_thread_binding(0)
            j = T.get_thread_binding(1)  # this warp's slot
            T.annotate_min_blocks_per_sm(min_blocks)
            zero = T.cast(0, dtype)
            part = T.alloc_shared((K, BN), accum)  # slot j's weighted sum for each column
            w_loc = T.alloc_local((BN, iters, VEC), dtype)
            h_loc = T.alloc_local((VEC,), dtype)
            dot = T.alloc_local((BN,), accum)
            acc = T.alloc_local((1,), accum)
            if pdl:
                gate()
            for m in T.serial(MB):
                t = tb * MB + m
                if t < NT:  # the same for the whole CTA (its barriers stay uniform)
                    e = T.cast(Ids[t, j], "int32")
                    for b in T.unroll(BN):
                        dot[b] = 0.0
                    if (e >= 0) & (e < E):  # warp-uniform: another rank's slot loads nothing
                        for b in T.unroll(BN):  # every weight load first: BN * iters vectors in flight
                            for it in T.unroll(iters):
                                k0 = it * step + lane * VEC
                                for v in T.vectorized(VEC):
                                    w_loc[b, it, v] = (W2[e, bc * BN + b, k0 + v] if not ragged else
                                                       T.if_then_else(k0 < I, W2[e, bc * BN + b, k0 + v], zero))
                        for it in T.unroll(iters):
                            k0 = it * step + lane * VEC
                            for v in T.vectorized(VEC):
                                h_loc[v] = (H[t * K + j, k0 + v] if not ragged else
                                            T.if_then_else(k0 < I, H[t * K + j, k0 + v], zero))
                            for v in T.unroll(VEC):
                                for b in T.unroll(BN):
                                    dot[b] += T.cast(h_loc[v], accum) * T.cast(w_loc[b, it, v], accum)
                    for b in T.unroll(BN):
                        dot[b] = T.warp_reduce_sum(dot[b])
                    if lane == 0:
                        for b in T.unroll(BN):
                            part[j, b] = T.cast(T.if_then_else((e >= 0) & (e < E), Wt[t, j], T.cast(0, wt_dtype)),
                                                accum) * dot[b]
                    T.sync_threads()
                    if (j == 0) & (lane < BN):  # one thread per column: the K slots in slot order
                        acc[0] = part[0, lane]
                        if K > 1:
                            for s in T.unroll(K - 1):
                                acc[0] += part[s + 1, lane]
                        Out[t, bc * BN + lane] = T.cast(acc[0], dtype)
                    T.sync_threads()  # part is rewritten by the next token

    return moe_down_slots
