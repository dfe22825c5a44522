"""Fused MoE (TileLang): device-side permutation, grouped expert GEMMs, weighted combine.

1. ``moe_align``: one CTA counts the (token, slot) pairs per expert, lays the experts out in blocks of
   BM rows (each expert's rows padded to a multiple of BM; a thread per expert, its first block from a
   scan over the threads) and scatters every pair to its row; ids
   outside [0, E) (experts of other ranks) are dropped. Grid sizes downstream come from a host-side
   bound (ceil(T*k / BM) + min(E, T*k) blocks), so nothing synchronises with the host.
2. ``gather``: the activations in expert order (so the GEMMs read A tiles with TMA).
3. ``gemm1``: per block, both halves of w13 for BN columns, then SiLU(gate) * up -> H (bf16).
4. ``gemm2``: H @ w2[e].T, each row scattered to its (token, slot) row of Y.
5. ``combine``: out[t] = sum_j weights[t, j] * Y[t*k + j] over the local slots, in float32, in slot
   order (deterministic: no atomics).

Decode batches of at most ``moe_gemv.MAX_TOKENS`` tokens take ``kernels_cuda.moe_gemv`` instead: two
weight-streaming launches that read the top-k ids and weights directly; larger decode batches (a mean of at
most ``moe_stream.MAX_MEAN_ROWS`` rows per expert) take ``kernels_cuda.moe_stream``'s GEMMs, which put the
tokens in the mma's N (the size rules are on shapes only).

Padding rows compute garbage that is never stored. Rows are independent in the GEMMs, so where a
pair lands inside its expert's block does not change its result.
"""

import torch

from kernels_cuda import _tl, moe_gemv, moe_stream


def build_align(E: int, BM: int):
    T = _tl.language()
    NS, CAP, NBLK = T.dynamic("NS"), T.dynamic("CAP"), T.dynamic("NBLK")
    threads = 1024
    assert E <= threads, "one thread per expert in the block-offset scan"
    steps = max(1, (E - 1).bit_length())  # scan steps: 2**steps >= E

    @T.prim_func
    def moe_align(Ids: T.Tensor((NS,), "int64"), RowSlot: T.Tensor((CAP,), "int32"),
                  BlockExpert: T.Tensor((NBLK,), "int32")):
        with T.Kernel(1, threads=threads):
            tx = T.get_thread_binding()
            cnt = T.alloc_shared((E,), "int32")
            cursor = T.alloc_shared((E,), "int32")
            nbs = T.alloc_shared((threads,), "int32")
            part = T.alloc_local((1,), "int32")
            nb = T.alloc_local((1,), "int32")
            first = T.alloc_local((1,), "int32")
            total = T.alloc_local((1,), "int32")
            for it in T.serial(T.ceildiv(E, threads)):
                if it * threads + tx < E:
                    cnt[it * threads + tx] = 0
            T.sync_threads()
            for it in T.serial(T.ceildiv(NS, threads)):
                s = it * threads + tx
                if s < NS:
                    e = Ids[s]
                    if (e >= 0) & (e < E):
                        T.atomic_add(cnt[T.cast(e, "int32")], 1)
            for it in T.serial(T.ceildiv(CAP, threads)):
                if it * threads + tx < CAP:
                    RowSlot[it * threads + tx] = -1
            T.sync_threads()
            # each expert's first block: an inclusive scan of its block counts over the threads (log2 E steps)
            nbs[tx] = 0
            if tx < E:
                nbs[tx] = T.ceildiv(cnt[tx], BM)
            T.sync_threads()
            for st in T.unroll(steps):
                part[0] = nbs[tx]
                if tx >= T.shift_left(1, st):
                    part[0] += nbs[tx - T.shift_left(1, st)]
                T.sync_threads()
                nbs[tx] = part[0]
                T.sync_threads()
            nb[0] = 0
            if tx < E:
                nb[0] = T.ceildiv(cnt[tx], BM)
            first[0] = nbs[tx] - nb[0]
            total[0] = nbs[E - 1]
            if tx < E:
                cursor[tx] = first[0] * BM
            for j in T.serial(nb[0]):
                BlockExpert[first[0] + j] = tx
            for it in T.serial(T.ceildiv(NBLK, threads)):
                b = it * threads + tx
                if (b >= total[0]) & (b < NBLK):
                    BlockExpert[b] = -1
            T.sync_threads()
            for it in T.serial(T.ceildiv(NS, threads)):
                s = it * threads + tx
                if s < NS:
                    e = Ids[s]
                    if (e >= 0) & (e < E):
                        pos = T.atomic_add(cursor[T.cast(e, "int32")], 1, return_prev=True)
                        RowSlot[pos] = s

    return moe_align


def build_gather(C: int, K: int, BM: int, dtype: str):
    T = _tl.language()
    NT, CAP, NBLK = T.dynamic("NT"), T.dynamic("CAP"), T.dynamic("NBLK")
    threads = 256
    BC = min(C, 1024)
    assert C % BC == 0

    @T.prim_func
    def moe_gather(X: T.Tensor((NT, C), dtype), RowSlot: T.Tensor((CAP,), "int32"),
                   BlockExpert: T.Tensor((NBLK,), "int32"), Xs: T.Tensor((CAP, C), dtype)):
        with T.Kernel(C // BC, NBLK, threads=threads) as (bc, blk):
            if BlockExpert[blk] >= 0:
                for i, j in T.Parallel(BM, BC):
                    slot = RowSlot[blk * BM + i]
                    if slot >= 0:
                        Xs[blk * BM + i, bc * BC + j] = X[slot // K, bc * BC + j]

    return moe_gather


def build_gemm1(E: int, C: int, I: int, BM: int, BN: int, BK: int, stages: int, threads: int, dtype: str,
                limit: float | None = None, blocks: int = 1):
    """``limit``: V4's clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit). ``blocks`` > 1: CTAs an
    SM the registers must fit (``kernels_cuda.moe_stream``), without setmaxnreg."""
    T = _tl.language()
    CAP, NBLK = T.dynamic("CAP"), T.dynamic("NBLK")
    accum = "float32"
    assert I % BN == 0 and C % BK == 0

    @T.prim_func
    def moe_gemm1(Xs: T.Tensor((CAP, C), dtype), W13: T.Tensor((E, 2 * I, C), dtype),
                  BlockExpert: T.Tensor((NBLK,), "int32"), Hs: T.Tensor((CAP, I), dtype)):
        with T.Kernel(I // BN, NBLK, threads=threads) as (bn, blk):
            if blocks > 1:
                T.annotate_min_blocks_per_sm(blocks)
                T.disable_warp_group_reg_alloc()
            A_s = T.alloc_shared((BM, BK), dtype)
            G_s = T.alloc_shared((BN, BK), dtype)
            U_s = T.alloc_shared((BN, BK), dtype)
            acc_g = T.alloc_fragment((BM, BN), accum)
            acc_u = T.alloc_fragment((BM, BN), accum)
            H_s = T.alloc_shared((BM, BN), dtype)
            e = BlockExpert[blk]
            n_iter = T.if_then_else(e >= 0, C // BK, 0)
            T.clear(acc_g)
            T.clear(acc_u)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(Xs[blk * BM:(blk + 1) * BM, k * BK:(k + 1) * BK], A_s)
                T.copy(W13[e, bn * BN:(bn + 1) * BN, k * BK:(k + 1) * BK], G_s)
                T.copy(W13[e, I + bn * BN:I + (bn + 1) * BN, k * BK:(k + 1) * BK], U_s)
                # each warpgroup owns whole rows: m64nBN wgmma chains, the widest the tile allows
                T.gemm(A_s, G_s, acc_g, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(A_s, U_s, acc_u, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if e >= 0:
                if limit is not None:
                    for i, j in T.Parallel(BM, BN):
                        acc_g[i, j] = T.min(acc_g[i, j], limit)
                        acc_u[i, j] = T.max(T.min(acc_u[i, j], limit), -limit)
                for i, j in T.Parallel(BM, BN):
                    acc_g[i, j] = acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j]
                T.copy(acc_g, H_s)
                T.copy(H_s, Hs[blk * BM:(blk + 1) * BM, bn * BN:(bn + 1) * BN])

    return moe_gemm1


def build_gemm2(E: int, C: int, I: int, BM: int, BN: int, BK: int, stages: int, threads: int, dtype: str,
                blocks: int = 1):
    T = _tl.language()
    CAP, NBLK, NS = T.dynamic("CAP"), T.dynamic("NBLK"), T.dynamic("NS")
    accum = "float32"
    assert C % BN == 0 and I % BK == 0

    @T.prim_func
    def moe_gemm2(Hs: T.Tensor((CAP, I), dtype), W2: T.Tensor((E, C, I), dtype),
                  BlockExpert: T.Tensor((NBLK,), "int32"), RowSlot: T.Tensor((CAP,), "int32"),
                  Y: T.Tensor((NS, C), dtype)):
        with T.Kernel(C // BN, NBLK, threads=threads) as (bn, blk):
            if blocks > 1:
                T.annotate_min_blocks_per_sm(blocks)
                T.disable_warp_group_reg_alloc()
            A_s = T.alloc_shared((BM, BK), dtype)
            B_s = T.alloc_shared((BN, BK), dtype)
            acc = T.alloc_fragment((BM, BN), accum)
            e = BlockExpert[blk]
            n_iter = T.if_then_else(e >= 0, I // BK, 0)
            T.clear(acc)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(Hs[blk * BM:(blk + 1) * BM, k * BK:(k + 1) * BK], A_s)
                T.copy(W2[e, bn * BN:(bn + 1) * BN, k * BK:(k + 1) * BK], B_s)
                T.gemm(A_s, B_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if e >= 0:
                for i, j in T.Parallel(BM, BN):
                    slot = RowSlot[blk * BM + i]
                    if slot >= 0:
                        Y[slot, bn * BN + j] = acc[i, j]

    return moe_gemm2


def build_combine(C: int, K: int, E: int, dtype: str):
    T = _tl.language()
    NT, NS = T.dynamic("NT"), T.dynamic("NS")
    threads = 128
    BC = min(C, 1024)
    assert C % BC == 0

    @T.prim_func
    def moe_combine(Y: T.Tensor((NS, C), dtype), Wt: T.Tensor((NT, K), "float32"),
                    Ids: T.Tensor((NT, K), "int64"), Out: T.Tensor((NT, C), dtype)):
        with T.Kernel(C // BC, NT, threads=threads) as (bc, t):
            acc = T.alloc_fragment((BC,), "float32")
            T.clear(acc)
            for j in T.serial(K):
                e = Ids[t, j]
                if (e >= 0) & (e < E):
                    for c in T.Parallel(BC):
                        acc[c] += Wt[t, j] * T.cast(Y[t * K + j, bc * BC + c], "float32")
            T.copy(acc, Out[t, bc * BC:(bc + 1) * BC])

    return moe_combine


_align = _tl.kernel_cache(build_align)
_gather = _tl.kernel_cache(build_gather)
_gemm1 = _tl.kernel_cache(build_gemm1)
_gemm2 = _tl.kernel_cache(build_gemm2)
_combine = _tl.kernel_cache(build_combine)

#: GEMM tiles: small batches stream weights (BM 64, one warpgroup, narrow N tiles for more CTAs);
#: large batches are matrix-bound (BM 128, two warpgroups).
SMALL = {"BM": 64, "BN1": 64, "BN2": 128, "BK": 64, "stages": 4, "threads": 128}
LARGE = {"BM": 128, "BN1": 128, "BN2": 256, "BK": 64, "stages": 3, "threads": 256}


def choose_config(n_slots: int, E: int) -> dict:
    return SMALL if n_slots <= 48 * E else LARGE


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _pad_weights(w13, w2, C, I, Cp, Ip):
    """Odd test shapes only: zero-pad the expert weights to tile multiples (real models: C 2048/7168,
    I 1408/2048 need none)."""
    E = w13.shape[0]
    w13p = w13.new_zeros(E, 2 * Ip, Cp)
    w13p[:, :I, :C] = w13[:, :I]
    w13p[:, Ip:Ip + I, :C] = w13[:, I:]
    w2p = w2.new_zeros(E, Cp, Ip)
    w2p[:, :C, :I] = w2
    return w13p, w2p


def fused_moe(x, w13, w2, weights, ids, *, cfg: dict | None = None):
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] == 0:
        from kernels_cpu.ops import fused_moe as ref  # float32: tensor cores would round to tf32

        return ref(x, w13, w2, weights, ids)
    if cfg is None and moe_gemv.applies(x, w13, w2, weights, ids):  # decode: stream the weights, 2 launches
        return moe_gemv.fused_moe_small(x, w13, w2, weights, ids)
    if cfg is None and moe_stream.applies(x, w13, w2, ids):  # decode batches: tokens as the mma's N
        return moe_stream.fused_moe_stream(x, w13, w2, weights, ids)
    return _fused(x, w13, w2, weights, ids, cfg, None)


def fused_moe_clamped(x, w13, w2, weights, ids, limit, *, cfg: dict | None = None):
    """``fused_moe`` with DeepSeek-V4's SwiGLU clamp (``kernels_cpu.v4_ops.fused_moe_clamped``)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] == 0:
        from kernels_cpu.v4_ops import fused_moe_clamped as ref

        return ref(x, w13, w2, weights, ids, limit)
    lim = None if limit is None else float(limit)
    if cfg is None and moe_gemv.applies(x, w13, w2, weights, ids):
        return moe_gemv.fused_moe_small(x, w13, w2, weights, ids, lim)
    if cfg is None and moe_stream.applies(x, w13, w2, ids):
        return moe_stream.fused_moe_stream(x, w13, w2, weights, ids, lim)
    return _fused(x, w13, w2, weights, ids, cfg, lim)


def _fused(x, w13, w2, weights, ids, cfg, limit):
    steps, finish = moe_steps(x, w13, w2, weights, ids, cfg=cfg, limit=limit)
    for _, step in steps:
        step()
    return finish()


def moe_steps(x, w13, w2, weights, ids, *, cfg: dict | None = None, limit: float | None = None):
    """The launches of :func:`fused_moe` as (name, thunk) pairs, plus a thunk returning the output
    (``examples/kernel_bench.py`` times each stage)."""
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = ids.shape[1]
    NS = NT * K
    c = dict(cfg or choose_config(NS, E))
    BM, BK = c["BM"], c["BK"]
    Cp = _round(C, max(BK, c["BN2"]))
    Ip = _round(I, max(BK, c.get("BK2", BK), c["BN1"]))
    if (Cp, Ip) != (C, I):
        w13, w2 = _pad_weights(w13, w2, C, I, Cp, Ip)
        x = torch.nn.functional.pad(x, (0, Cp - C))
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    dt = _tl.tl_dtype(x.dtype)
    dev = x.device
    nblk = (NS + BM - 1) // BM + min(E, NS)
    cap = nblk * BM
    ids2 = ids.to(torch.int64).contiguous()
    ids_flat = ids2.view(-1)
    wts = weights.to(torch.float32).contiguous()
    row_slot = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblk, dtype=torch.int32, device=dev)
    xs = torch.empty(cap, Cp, dtype=x.dtype, device=dev)
    hs = torch.empty(cap, Ip, dtype=x.dtype, device=dev)
    y = torch.empty(NS, Cp, dtype=x.dtype, device=dev)
    out = torch.empty(NT, Cp, dtype=x.dtype, device=dev)
    k_align = _align(E, BM)
    k_gather = _gather(Cp, K, BM, dt)
    k_gemm1 = _gemm1(E, Cp, Ip, BM, c["BN1"], BK, c["stages"], c["threads"], dt, limit, c.get("blocks", 1))
    # gemm2's K is the expert width (1408 for V2-Lite: 22 steps of 64): its own k-tile and stages ("BK2",
    # "stages2"; default those of gemm1) so that a short K can trade stages for wider steps
    k_gemm2 = _gemm2(E, Cp, Ip, BM, c["BN2"], c.get("BK2", BK), c.get("stages2", c["stages"]), c["threads"], dt,
                     c.get("blocks", 1))
    k_combine = _combine(Cp, K, E, dt)
    steps = [
        ("align", lambda: k_align(ids_flat, row_slot, block_expert)),
        ("gather", lambda: k_gather(x, row_slot, block_expert, xs)),
        ("gemm1", lambda: k_gemm1(xs, w13, block_expert, hs)),
        ("gemm2", lambda: k_gemm2(hs, w2, block_expert, row_slot, y)),
        ("combine", lambda: k_combine(y, wts, ids2, out)),
    ]
    return steps, (lambda: out if Cp == C else out[:, :C].contiguous())


def representative_kernels():
    s, g = SMALL, LARGE
    E, C, I = 256, 7168, 2048
    return [
        ("moe_align E256", lambda: build_align(E, s["BM"])),
        ("moe_gather C7168", lambda: build_gather(C, 8, s["BM"], "bfloat16")),
        ("moe_gemm1 small", lambda: build_gemm1(E, C, I, s["BM"], s["BN1"], s["BK"], s["stages"], s["threads"],
                                                "bfloat16")),
        ("moe_gemm2 large", lambda: build_gemm2(E, C, I, g["BM"], g["BN2"], g["BK"], g["stages"], g["threads"],
                                                "bfloat16")),
        ("moe_combine", lambda: build_combine(C, 8, E, "bfloat16")),
        # V4-Flash experts (hidden 4096, width 2048) with the SwiGLU clamp at 10
        ("moe_gemm1 small clamped V4", lambda: build_gemm1(256, 4096, 2048, s["BM"], s["BN1"], s["BK"], s["stages"],
                                                           s["threads"], "bfloat16", 10.0)),
    ]
