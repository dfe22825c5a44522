"""Small-M linear (up to 8 rows; 2..8 rows of a 2-byte weight through ``gemv_rows``) as a bandwidth-bound GEMV.

At decode a projection reads a whole weight matrix for one to eight rows of activations, so the
kernel's only job is to stream W at HBM speed. cuBLAS picks GEMM tiles for these shapes that leave
much of the bandwidth unused (6.7 us for V2-Lite's 15 MB q+kv_a weight, under 2.3 TB/s). Here:

* a warp-group of ``RT`` threads owns one output column n (a row of W) and splits its K among the
  threads: each thread streams 16-byte vectors of W (8 bf16) at stride ``RT * 8``, all loads of a
  thread independent so they are in flight together, and keeps ``MB`` float32 accumulators (one per
  activation row, ``MB`` in {1, 2, 4, 8} static, the real M <= MB dynamic);
* a CTA holds ``BN`` such groups (BN rows of W); the grid is ceil(N / BN), at least two CTAs per SM
  where N allows. Where N is small (the router's 64 experts) the split goes the other way: one row
  per CTA and up to 256 threads along K (split-K inside the CTA: one launch, no workspace and no
  atomics, so the result is deterministic);
* the per-row partial sums are reduced across the ``RT`` threads (warp shuffles, then shared memory
  across warps) and written in the output dtype: the activation dtype for ``linear``, float32 for
  ``linear_f32`` (the router's logits).
"""

from __future__ import annotations

import torch

from kernels_cuda import _tl

#: the largest M the GEMVs take; more rows go to cuBLAS. One row runs this module's kernel (at M = 1 it beats
#: cuBLAS on 14 of 15 decode projections on the H200, docs/decode_fusion.md), 2..8 rows of a 2-byte weight
#: can run ``gemv_rows`` (each activation vector reused across several rows of W: this kernel reloads it per
#: row, 3-7x slower than cuBLAS at 8 rows); ``linear`` sends it only what it measured faster than cuBLAS
#: (``gemv_rows.faster_than_cublas``). The router's float32 gate stays here at 1..8 rows (2.0-2.5 us against
#: cuBLAS's 6.6-10.9 us with the cast).
MAX_M = 8
_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def vec(w_dtype: torch.dtype) -> int:
    """Elements of W per 16-byte load."""
    return 16 // _BYTES[w_dtype]


def m_bucket(M: int) -> int:
    return next(b for b in (1, 2, 4, 8) if M <= b)


def tile_config(N: int, K: int, sms: int, VEC: int = 8) -> tuple[int, int]:
    """(BN rows of W per CTA, RT threads per row): one warp per row with as many rows per CTA as keep at
    least two CTAs per SM; for small N one row per CTA and more threads along K."""
    for bn in (8, 4, 2):
        if -(-N // bn) >= 2 * sms:
            return bn, 32
    rt = 32
    while rt < 256 and K >= rt * 2 * VEC * 4:  # each thread keeps >= 4 vectors of K
        rt *= 2
    return 1, rt


def build_gemv(N: int, K: int, MB: int, BN: int, RT: int, dtype: str, w_dtype: str, out_dtype: str,
               pdl: bool = False):
    """``pdl``: programmatic dependent launch (``_tl.PDL_ENV``; ``gemv_bench.py`` measures it chained): the
    kernel lets the next launch start at once, issues its W loads, then waits for the previous kernel
    before reading X, so a GEMV's weight stream overlaps the tail of the kernel before it."""
    T = _tl.language()
    if pdl:
        pdl_trigger, pdl_sync = _tl.pdl_ops()
    M = T.dynamic("M")
    accum = "float32"
    VEC = 16 // (4 if w_dtype == "float32" else 2)
    assert RT == 32 or BN == 1, (RT, BN)
    step = RT * VEC
    iters = -(-K // step)

    @T.macro
    def fma(X, w_loc, x_loc, acc, tk):
        for it in T.unroll(iters):
            k0 = it * step + tk * VEC
            if k0 < K:
                for m in T.unroll(MB):
                    if m < M:
                        for v in T.vectorized(VEC):
                            x_loc[v] = X[m, k0 + v]
                        for v in T.unroll(VEC):
                            acc[m] += T.cast(x_loc[v], accum) * T.cast(w_loc[it, v], accum)

    @T.prim_func
    def gemv_kernel(X: T.Tensor((M, K), dtype), W: T.Tensor((N, K), w_dtype), Y: T.Tensor((M, N), out_dtype)):
        with T.Kernel(T.ceildiv(N, BN), threads=(RT, BN)) as bn:
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            n = bn * BN + tn
            w_loc = T.alloc_local((iters, VEC), w_dtype)
            x_loc = T.alloc_local((VEC,), dtype)
            acc = T.alloc_local((MB,), accum)
            red = T.alloc_local((1,), accum)
            for m in T.serial(MB):
                acc[m] = 0.0
            if pdl:
                pdl_trigger()
            if n < N:
                # every W vector of this thread first (independent loads, all in flight), then the FMAs
                for it in T.unroll(iters):
                    k0 = it * step + tk * VEC
                    if k0 < K:
                        for v in T.vectorized(VEC):
                            w_loc[it, v] = W[n, k0 + v]
                if not pdl:
                    fma(X, w_loc, x_loc, acc, tk)
            if pdl:
                pdl_sync()  # X is the previous kernel's output
                if n < N:
                    fma(X, w_loc, x_loc, acc, tk)
            for m in T.unroll(MB):
                acc[m] = T.warp_reduce_sum(acc[m])
            if RT == 32:
                if (tk == 0) & (n < N):
                    for m in T.serial(MB):
                        if m < M:
                            Y[m, n] = T.cast(acc[m], out_dtype)
            else:  # one row per CTA (BN == 1): the warps' sums through shared memory
                part = T.alloc_shared((MB, RT // 32), accum)
                if tk % 32 == 0:
                    for m in T.serial(MB):
                        part[m, tk // 32] = acc[m]
                T.sync_threads()
                if (tk < MB) & (tk < M) & (n < N):
                    red[0] = 0.0
                    for w in T.serial(RT // 32):
                        red[0] += part[tk, w]
                    Y[tk, n] = T.cast(red[0], out_dtype)

    return gemv_kernel


_kernel = _tl.kernel_cache(build_gemv)


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x @ w.T`` takes a GEMV: 2-byte float activations, a weight of the same dtype or float32 (the
    router's), at most ``MAX_M`` rows, K a whole number of 16-byte vectors of W, on a CUDA device."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype not in (x.dtype, torch.float32) or w.dim() != 2:
        return False
    K = w.shape[1]
    if x.shape[-1] != K or K % vec(w.dtype) or not w.is_contiguous() or not (x.is_cuda or _tl.dry_run()):
        return False
    if w.data_ptr() % 16:  # 16-byte vector loads (a view at an odd offset)
        return False
    M = x.numel() // K if K else 0
    return 1 <= M <= MAX_M


def gemv(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x[..., K] @ w[N, K].T`` in float32 accumulation, written as ``out_dtype`` (``applies`` must hold)."""
    N, K = w.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > 1 and w.dtype == x.dtype:
        from kernels_cuda.gemv_rows import _aligned, gemv_rows

        x3 = x2[:, None]
        if not _aligned(x3):
            x3 = x3.clone(memory_format=torch.contiguous_format)
        y = torch.empty(M, 1, N, dtype=out_dtype, device=x.device)
        return gemv_rows(x3, w[None], out=y).view(*x.shape[:-1], N)
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:  # a view at an odd offset: the kernel loads 16-byte vectors
        x2 = x2.clone()
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    sms = _tl.num_sms(x.device.index or 0) if x.is_cuda else _tl.num_sms()
    bn, rt = tile_config(N, K, sms, vec(w.dtype))
    args = (N, K, m_bucket(M), bn, rt, _tl.tl_dtype(x.dtype), _tl.tl_dtype(w.dtype), _tl.tl_dtype(out_dtype))
    kernel = _kernel(*args, *_tl.pdl_arg(M))
    kernel(x2, w, y)
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The registry's ``linear``: without bias, 2..8 rows on the tensor-core GEMV where it measured faster than
    cuBLAS (``gemv_mma.wins``), one row (and 2..4 rows of a small weight, ``gemv_rows.faster_than_cublas``) on
    the GEMVs, cuBLAS (the reference) otherwise. In a dry run cuBLAS's share computes nothing either."""
    from kernels_cuda import gemv_mma
    from kernels_cuda.gemv_rows import faster_than_cublas

    if bias is None and w.dtype == x.dtype and applies(x, w):
        N, K = w.shape
        M = x.numel() // K
        x2 = x.reshape(M, K)
        if M > 1 and gemv_mma.applies(x2, w) and gemv_mma.wins(N, K):  # the tensor cores (measured)
            return gemv_mma.gemv_mma(x2, w).view(*x.shape[:-1], N)
        if faster_than_cublas(M, w.numel() * w.element_size()):
            return gemv(x, w, x.dtype)
    if _tl.dry_run():
        return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.result_type(x, w))
    from kernels_cpu import ops as ref

    return ref.linear(x, w, bias)


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The registry's ``linear_f32``: float32 logits from 2-byte activations and a 2-byte or float32 weight (the
    router's gate is kept in float32), without casting either."""
    if applies(x, w):
        return gemv(x, w, torch.float32)
    from kernels_cpu import fused as ref

    return ref.linear_f32(x, w)


def representative_kernels():
    return [
        ("gemv M1 N3648 K2048 (V2-Lite q+kv_a)",
         lambda: build_gemv(3648, 2048, 1, *tile_config(3648, 2048, 132), "bfloat16", "bfloat16", "bfloat16")),
        ("gemv M8 N64 K2048 f32 weight and out (router)",
         lambda: build_gemv(64, 2048, 8, *tile_config(64, 2048, 132, 4), "bfloat16", "float32", "float32")),
    ]
