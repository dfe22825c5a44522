"""DeepSeek-V4 compressor (``v4_compress``) in TileLang: pool -> RMSNorm -> rope in one launch.

One CTA per closing token; its threads own the Dc output channels. Per channel, the S pooled slots
(S = m plain, 2m overlapped) are read from the paged per-token state cache (float32 rows [kv | gate],
w wide each, from column ``col``): a first pass takes the gate maximum over the valid slots (the
closing token's own slot is always valid, so the maximum is finite), a second the softmax-weighted
sum. Then the row's RMSNorm (one block reduction) and the interleaved rope of the last R channels at
the window's first position, through shared memory (a pair's partner lives in another thread).

Rows whose position closes no window ((p + 1) % m != 0, which the op's contract leaves unspecified)
return zeros without reading the state: the model's decode steps compress every token (no host
synchronisation to pick the closing ones), so that costs nothing.
"""

import torch

from kernels_cuda import _tl

THREADS = 128


def build_compress(Dc: int, w: int, m: int, R: int, BS: int, E: int, col: int):
    T = _tl.language()
    N, NB, B, M, P = T.dynamic("N"), T.dynamic("NB"), T.dynamic("B"), T.dynamic("M"), T.dynamic("P")
    f32 = "float32"
    overlap = w == 2 * Dc
    S = 2 * m if overlap else m
    half = R // 2
    assert w in (Dc, 2 * Dc) and R % 2 == 0 and R <= Dc and col + 2 * w <= E

    @T.prim_func
    def v4_compress_kernel(
        State: T.Tensor((NB, BS, E), f32),
        Tab: T.Tensor((B, M), "int32"),
        SeqIdx: T.Tensor((N,), "int32"),
        ClosePos: T.Tensor((N,), "int32"),
        Ape: T.Tensor((m, w), f32),
        NormW: T.Tensor((Dc,), f32),
        CS: T.Tensor((P, R), f32),
        Out: T.Tensor((N, Dc), f32),
        eps: T.float32,
    ):
        with T.Kernel(N, threads=THREADS) as n:
            mx = T.alloc_fragment((1, Dc), f32)
            den = T.alloc_fragment((1, Dc), f32)
            acc = T.alloc_fragment((1, Dc), f32)
            sq = T.alloc_fragment((1, Dc), f32)
            ss = T.alloc_fragment((1,), f32)
            N_s = T.alloc_shared((Dc,), f32)
            b = SeqIdx[n]
            p = ClosePos[n]
            if (p + 1) % m != 0:  # closes no window (a decode step compresses every token): skip, zeros
                for c in T.Parallel(Dc):
                    Out[n, c] = 0.0
                T.thread_return()
            T.fill(mx, -T.infinity(f32))
            T.fill(den, 0)
            T.fill(acc, 0)
            for s in T.serial(S):
                pos = p - S + 1 + s
                pc = T.max(pos, 0)
                blk = Tab[b, T.min(pc // BS, M - 1)]
                row_ok = (pos >= 0) & (blk >= 0)  # a freed page reads as zeros, as the reference
                for i, c in T.Parallel(1, Dc):
                    ch = c + (Dc if overlap else 0) * T.if_then_else(s >= m, 1, 0)
                    g = T.if_then_else(row_ok, State[T.max(blk, 0), pc % BS, col + w + ch], 0.0) + Ape[pc % m, ch]
                    mx[i, c] = T.if_then_else(pos >= 0, T.max(mx[i, c], g), mx[i, c])
            for s in T.serial(S):
                pos = p - S + 1 + s
                pc = T.max(pos, 0)
                blk = Tab[b, T.min(pc // BS, M - 1)]
                row_ok = (pos >= 0) & (blk >= 0)
                for i, c in T.Parallel(1, Dc):
                    ch = c + (Dc if overlap else 0) * T.if_then_else(s >= m, 1, 0)
                    g = T.if_then_else(row_ok, State[T.max(blk, 0), pc % BS, col + w + ch], 0.0) + Ape[pc % m, ch]
                    kv = T.if_then_else(row_ok, State[T.max(blk, 0), pc % BS, col + ch], 0.0)
                    e = T.if_then_else(pos >= 0, T.exp(g - mx[i, c]), 0.0)
                    den[i, c] += e
                    acc[i, c] += e * kv
            for i, c in T.Parallel(1, Dc):
                acc[i, c] = acc[i, c] / den[i, c]
                sq[i, c] = acc[i, c] * acc[i, c]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(1):
                ss[i] = T.rsqrt(ss[i] / Dc + eps)
            for i, c in T.Parallel(1, Dc):
                N_s[c] = acc[i, c] * ss[i] * NormW[c]
            first = T.max(p - m + 1, 0)  # the window's first position (rows that close nothing: garbage)
            for c in T.Parallel(Dc):
                r = c - (Dc - R)
                k = T.max(r, 0) // 2
                cs = CS[first, k]
                sn = CS[first, half + k]
                x0 = N_s[T.max(c - (r % 2), 0)]
                x1 = N_s[T.min(c + 1 - (r % 2), Dc - 1)]
                rot = T.if_then_else(r % 2 == 0, x0 * cs - x1 * sn, x0 * sn + x1 * cs)
                Out[n, c] = T.if_then_else(r < 0, N_s[c], rot)

    return v4_compress_kernel


_kernel = _tl.kernel_cache(build_compress)


def v4_compress(state, block_tables, seq_idx, close_pos, ape, norm_w, eps, cos_sin, col):
    """Entries [N, Dc] float32 (``kernels_cpu.v4_ops.v4_compress``); sync-free (capturable)."""
    m, w = ape.shape
    Dc = norm_w.shape[0]
    R = cos_sin.shape[-1]
    N = close_pos.shape[0]
    if state.dtype != torch.float32 or N == 0:
        from kernels_cpu.v4_ops import v4_compress as ref

        return ref(state, block_tables, seq_idx, close_pos, ape, norm_w, eps, cos_sin, col)
    out = torch.empty(N, Dc, dtype=torch.float32, device=state.device)
    kern = _kernel(Dc, w, m, R, state.shape[1], state.shape[2], int(col))
    kern(state.contiguous(), block_tables.to(torch.int32).contiguous(), seq_idx.to(torch.int32).contiguous(),
         close_pos.to(torch.int32).contiguous(), ape.float().contiguous(), norm_w.float().contiguous(),
         cos_sin.float().contiguous(), out, float(eps))
    return out


def representative_kernels():
    """V4-Flash CSA main (overlapped, D 512, m 4) and HCA (plain, m' 128) compressors; state rows of the
    CSA group are [kv 2D | gate 2D | index kv 2DI | index gate 2DI] = 2560 wide, HCA [kv D | gate D]."""
    return [
        ("v4_compress CSA D512 m4", lambda: build_compress(512, 1024, 4, 64, 256, 2560, 0)),
        ("v4_compress CSA indexer DI128", lambda: build_compress(128, 256, 4, 64, 256, 2560, 2048)),
        ("v4_compress HCA D512 m128", lambda: build_compress(512, 512, 128, 64, 256, 1024, 0)),
    ]
