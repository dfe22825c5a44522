"""GEMV for 2..8 activation rows on the tensor cores (``mma.m16n8k16``): measured by ``gemv_bench.py``
against ``gemv_rows`` (CUDA-core FMAs, 25-58 % of the read ceiling at 8 rows on the H200) and cuBLAS; the
backend's ``linear`` sends it 2..8 rows where it measured faster (``wins``).

A warp owns 16 rows of W (the mma's M), the activation rows are its N = 8 (rows past M read row M - 1, never
written), and ``KS`` warps of a CTA split K (partial sums added through shared memory in warp order: one
launch, deterministic). A thread loads 16 contiguous bytes of each of its two W rows (g and g + 8) and of its
activation row per 32 elements of K; the mma's k positions {2t, 2t+1, 2t+8, 2t+9} are mapped onto 4 contiguous
elements for both operands (any k permutation shared by A and B gives the same dot product), so no shuffles:
the technique of moegemv's ``moe_up`` tensor-core kernel (``kernels_cuda/moe_gemv.py``), for dense weights.
"""

import torch

from kernels_cuda import _tl

U = 8  # K steps of 32 unrolled per loop iteration (loads of a thread in flight together)
#: the widest weight (rows) ``linear`` sends here: on the H200 (docs/decode_fusion.md, round 2) it beat cuBLAS at
#: 2..8 rows on every weight of at most 4096 rows whose K splits into an even number of 32-element steps per
#: warp (V2-Lite q+kv_a 58 against 52 % of the read ceiling, o 45 against 32 %, kv_b 32 against 24 %; V3
#: q_a+kv_a 66 against 54 %, shared w13 74 against 70 %), and lost on wider weights (dense w13 74 against 79 %)
#: and odd step counts (no unroll: V2-Lite shared w2 at K 2816, 30 against 37 %)
MAX_ROWS = 4096


def wins(N: int, K: int, sms: int = 132) -> bool:
    """Whether ``linear`` takes this kernel for 2..8 rows of an [N, K] weight (measured; see ``MAX_ROWS``)."""
    cfg = mma_config(N, K, sms)
    if cfg is None or N > MAX_ROWS:
        return False
    steps = K // cfg[0] // 32
    return steps < 2 or steps % 2 == 0


def mma_config(N: int, K: int, sms: int) -> tuple[int, int] | None:
    """(KS warps along K, BNW warps along N) of a 256-thread CTA: K split until about 16 warps per SM are in
    flight; None if K is not a whole number of 32-element steps per warp."""
    tiles = -(-N // 16)
    for ks in (1, 2, 4, 8):
        if K % (ks * 32):
            return None if ks == 1 else (ks // 2, 16 // ks)
        if tiles * ks >= 16 * sms or ks == 8:
            return ks, 8 // ks
    return None


def build_gemv_mma(N: int, K: int, KS: int, BNW: int, dtype: str, out_dtype: str):
    T = _tl.language()
    M = T.dynamic("M")
    accum = "float32"
    threads = 32 * KS * BNW
    ROWS = 16 * BNW
    KW = K // KS
    steps = KW // 32
    u = next(d for d in (U, 4, 2, 1) if steps % d == 0)
    ab = {"bfloat16": "bf16", "float16": "fp16"}[dtype]

    @T.prim_func
    def gemv_mma_kernel(X: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), Y: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, ROWS), threads=threads) as bx:
            tx = T.get_thread_binding()
            warp = tx // 32
            lane = tx % 32
            ks = warp % KS
            wn = warp // KS
            g = lane // 4
            t = lane % 4
            red = T.alloc_shared((KS, BNW, 32, 4), accum)
            w0 = T.alloc_local((8,), dtype)
            w1 = T.alloc_local((8,), dtype)
            xv = T.alloc_local((8,), dtype)
            a = T.alloc_local((8,), dtype)
            b = T.alloc_local((4,), dtype)
            acc = T.alloc_local((4,), accum)
            for i in T.unroll(4):
                acc[i] = 0.0
            n0 = bx * ROWS + wn * 16 + g
            tok = T.min(g, M - 1)
            for c in T.serial(steps // u):
                for st in T.unroll(u):
                    k0 = ks * KW + (c * u + st) * 32 + t * 8
                    for v in T.vectorized(8):
                        w0[v] = W[T.min(n0, N - 1), k0 + v]
                    for v in T.vectorized(8):
                        w1[v] = W[T.min(n0 + 8, N - 1), k0 + v]
                    for v in T.vectorized(8):
                        xv[v] = X[tok, k0 + v]
                    for h in T.unroll(2):
                        a[0] = w0[4 * h]
                        a[1] = w0[4 * h + 1]
                        a[2] = w1[4 * h]
                        a[3] = w1[4 * h + 1]
                        a[4] = w0[4 * h + 2]
                        a[5] = w0[4 * h + 3]
                        a[6] = w1[4 * h + 2]
                        a[7] = w1[4 * h + 3]
                        for i in T.unroll(4):
                            b[i] = xv[4 * h + i]
                        T.ptx_mma(accum, "m16n8k16", "row", "col", ab, ab, "fp32", a.data, 0, b.data, 0,
                                  acc.data, 0, T.bool(False))
            # acc[0..1]: row n0 for activation rows 2t, 2t+1; acc[2..3]: row n0 + 8
            if KS > 1:
                for i in T.unroll(4):
                    red[ks, wn, lane, i] = acc[i]
                T.sync_threads()
                if ks == 0:
                    for i in T.unroll(4):
                        for j in T.serial(KS - 1):
                            acc[i] += red[j + 1, wn, lane, i]
            if ks == 0:
                for i in T.unroll(2):
                    if 2 * t + i < M:
                        if n0 < N:
                            Y[2 * t + i, n0] = T.cast(acc[i], out_dtype)
                        if n0 + 8 < N:
                            Y[2 * t + i, n0 + 8] = T.cast(acc[2 + i], out_dtype)

    return gemv_mma_kernel


_kernel = _tl.kernel_cache(build_gemv_mma)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """2..8 rows of 2-byte activations against a same-dtype contiguous weight whose K splits into 32-element
    steps, 16-byte aligned, on a CUDA device."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or w.dim() != 2 or x.dim() != 2:
        return False
    N, K = w.shape
    if x.shape[1] != K or not 2 <= x.shape[0] <= 8 or mma_config(N, K, 132) is None:
        return False
    if not (x.is_contiguous() and w.is_contiguous()) or x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return x.is_cuda or _tl.dry_run()


def gemv_mma(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int] | None = None) -> torch.Tensor:
    """``x[M, K] @ w[N, K].T`` for 2..8 rows (``applies`` must hold), float32 accumulation, in x's dtype."""
    N, K = w.shape
    sms = _tl.num_sms(x.device.index or 0) if x.is_cuda else _tl.num_sms()
    KS, BNW = cfg or mma_config(N, K, sms)
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    _kernel(N, K, KS, BNW, _tl.tl_dtype(x.dtype), _tl.tl_dtype(x.dtype))(x, w, y)
    return y


def representative_kernels():
    return [("gemv_mma N3648 K2048 (V2-Lite q+kv_a at 2..8 rows, tensor cores)",
             lambda: build_gemv_mma(3648, 2048, *mma_config(3648, 2048, 132), "bfloat16", "bfloat16"))]
