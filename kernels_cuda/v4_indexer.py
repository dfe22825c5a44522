"""DeepSeek-V4 lightning indexer (``v4_indexer_topk``): TileLang scores, then ``torch.topk``.

Scores: one CTA per (query token, tile of BN entries). The BN entry keys [BN, DI] are gathered
through the block table and multiplied with the token's HI query heads on the tensor cores
(K_s @ Q_s.T -> [BN, HI]); relu, times the per-head weight and the scale, summed over the heads
(a row reduction). Entries w >= (p + 1) // ratio score -inf; tiles wholly past the visible count
skip the gather. The score row spans the block table's capacity (columns x entries per block), a
shape-only bound, so nothing synchronises with the host and the op can be captured in a graph.

Top-k: ``torch.topk`` over that row (any order is allowed by the contract; -inf picks become -1).
"""

import torch

from kernels_cuda import _tl

BN, THREADS = 64, 128


def build_scores(HI: int, DI: int, EPB: int, stride_b: int, stride_e: int, ratio: int, dtype: str = "bfloat16"):
    T = _tl.language()
    NT, NB, B, M, NE = T.dynamic("NT"), T.dynamic("NB"), T.dynamic("B"), T.dynamic("M"), T.dynamic("NE")
    f32 = "float32"
    assert HI % 16 == 0 and DI % 16 == 0

    @T.prim_func
    def v4_indexer_scores_kernel(
        Q: T.Tensor((NT, HI, DI), dtype),
        Wt: T.Tensor((NT, HI), f32),
        Keys: T.StridedTensor((NB, EPB, DI), (stride_b, stride_e, 1), dtype),
        Tab: T.Tensor((B, M), "int32"),
        SeqIdx: T.Tensor((NT,), "int32"),
        Pos: T.Tensor((NT,), "int32"),
        Scores: T.Tensor((NT, NE), f32),
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(NE, BN), NT, threads=THREADS) as (et, t):
            Q_s = T.alloc_shared((HI, DI), dtype)
            K_s = T.alloc_shared((BN, DI), dtype)
            W_s = T.alloc_shared((HI,), f32)
            blk_s = T.alloc_shared((BN,), "int32")
            off_s = T.alloc_shared((BN,), "int32")
            acc = T.alloc_fragment((BN, HI), f32)
            sc = T.alloc_fragment((BN,), f32)
            b = SeqIdx[t]
            visible = (Pos[t] + 1) // ratio
            if et * BN < visible:
                T.copy(Q[t, :, :], Q_s)
                for h in T.Parallel(HI):
                    W_s[h] = Wt[t, h] * scale
                for j in T.Parallel(BN):
                    e = T.min(et * BN + j, visible - 1)
                    blk_s[j] = Tab[b, T.min(e // EPB, M - 1)]
                    off_s[j] = e % EPB
                for j, d in T.Parallel(BN, DI):
                    K_s[j, d] = T.if_then_else(blk_s[j] >= 0, Keys[T.max(blk_s[j], 0), off_s[j], d], T.cast(0, dtype))
                T.gemm(K_s, Q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for j, h in T.Parallel(BN, HI):
                    acc[j, h] = T.max(acc[j, h], 0.0) * W_s[h]
                T.reduce_sum(acc, sc, dim=1)
                for j in T.Parallel(BN):
                    if et * BN + j < NE:
                        Scores[t, et * BN + j] = T.if_then_else(et * BN + j < visible, sc[j], -T.infinity(f32))
            else:
                for j in T.Parallel(BN):
                    if et * BN + j < NE:
                        Scores[t, et * BN + j] = -T.infinity(f32)

    return v4_indexer_scores_kernel


_kernel = _tl.kernel_cache(build_scores)


def v4_indexer_scores(q, weights, keys, block_tables, seq_idx, positions, ratio, scale):
    """[T, M * EPB] float32 scores, -inf past each token's visible entries."""
    T_, HI, DI = q.shape
    NE = block_tables.shape[1] * keys.shape[1]
    out = torch.empty(T_, NE, dtype=torch.float32, device=q.device)
    if T_ == 0 or NE == 0:
        return out
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    kern = _kernel(HI, DI, keys.shape[1], keys.stride(0), keys.stride(1), int(ratio), _tl.tl_dtype(q.dtype))
    kern(q.contiguous(), weights.float().contiguous(), keys, block_tables.to(torch.int32).contiguous(),
         seq_idx.to(torch.int32).contiguous(), positions.to(torch.int32).contiguous(), out, float(scale))
    return out


def v4_indexer_topk(q, weights, keys, block_tables, seq_idx, positions, ratio, top_k, scale):
    """``kernels_cpu.v4_ops.v4_indexer_topk``: ids [T, top_k] int64 of the best visible entries, -1 padded."""
    T_, HI, DI = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16) or keys.dtype != q.dtype or HI % 16 or DI % 16:
        from kernels_cpu.v4_ops import v4_indexer_topk as ref  # float32 / odd head counts

        return ref(q, weights, keys, block_tables, seq_idx, positions, ratio, top_k, scale)
    scores = v4_indexer_scores(q, weights, keys, block_tables, seq_idx, positions, ratio, scale)
    out = torch.full((T_, top_k), -1, dtype=torch.int64, device=q.device)
    kk = min(top_k, scores.shape[1])
    if T_ and kk:
        top = scores.topk(kk, dim=-1)
        out[:, :kk] = torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))
    return out


def representative_kernels():
    """V4-Flash indexer: 64 heads of 128, CSA cache rows [512 | 128] (keys = the last 128 columns),
    pages of 256 tokens = 64 entries."""
    return [("v4_indexer scores HI64 DI128", lambda: build_scores(64, 128, 64, 64 * 640, 640, 4))]
