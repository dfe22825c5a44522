"""RMSNorm and fused residual-add + RMSNorm in TileLang: one CTA per token row, the row held in
registers (float32), one block reduction.

A width that no power-of-two thread count divides (the tiny test model's 24) is padded to a whole
number of elements per thread: the pad reads as zero (adds nothing to the sum of squares, which is
still divided by the real width) and is never written, so every width compiles."""

import torch

from kernels_cuda import _tl


def _threads(C: int) -> int:
    """A power of two (the block reduction needs one), ideally with 16-byte vectors per thread."""
    for vec in (8, 4, 2, 1):
        for t in (1024, 512, 256, 128, 64, 32):
            if C % (t * vec) == 0 and C // (t * vec) <= 8:
                return t
    return 32


def _padded(C: int, threads: int) -> int:
    """C rounded up to a whole number of elements per thread (the fragment layout needs it)."""
    return -(-C // threads) * threads


def build_rms_norm(C: int, dtype: str, fused_add: bool, pdl: bool = False, f32_copy: bool = False):
    """``pdl``: let the next kernel launch at once (``_tl.PDL_ENV``: the GEMV after a norm streams its weight
    meanwhile and waits for this kernel before reading the normed row). ``f32_copy``: also write the normed rows
    (rounded to ``dtype``) as float32 in ``Y32``, what the router's float32 GEMM reads past the fused gate's rows
    (so no cast launch sits between them); the variant without it takes no ``Y32``."""
    T = _tl.language()
    N = T.dynamic("N")
    threads = _threads(C)
    CP = _padded(C, threads)
    if CP != C:
        assert not f32_copy, "the float32 copy is built for widths the threads divide"
        return _build_padded(C, CP, threads, dtype, fused_add)
    if pdl:
        pdl_trigger = _tl.pdl_ops()[0]

    @T.macro
    def body(X, Res, W, Y, ResOut, eps, Y32):
        with T.Kernel(N, threads=threads) as row:
            x = T.alloc_fragment((1, C), "float32")
            sq = T.alloc_fragment((1, C), "float32")
            ss = T.alloc_fragment((1,), "float32")
            if pdl:
                pdl_trigger()
            if fused_add:
                xr = T.alloc_fragment((1, C), dtype)
                for i, j in T.Parallel(1, C):
                    # the residual sum is rounded to the activation dtype first, as in the reference
                    xr[i, j] = T.cast(T.cast(X[row, j], "float32") + T.cast(Res[row, j], "float32"), dtype)
                T.copy(xr, ResOut[row:row + 1, :])
                for i, j in T.Parallel(1, C):
                    x[i, j] = T.cast(xr[i, j], "float32")
            else:
                T.copy(X[row:row + 1, :], x)
            for i, j in T.Parallel(1, C):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(1):
                ss[i] = T.rsqrt(ss[i] / C + eps)
            for i, j in T.Parallel(1, C):
                x[i, j] = T.cast(W[j], "float32") * (x[i, j] * ss[i])
            if f32_copy:
                for i, j in T.Parallel(1, C):
                    x[i, j] = T.cast(T.cast(x[i, j], dtype), "float32")
                T.copy(x, Y32[row:row + 1, :])
            T.copy(x, Y[row:row + 1, :])

    if f32_copy:
        @T.prim_func
        def rms_norm_kernel(X: T.Tensor((N, C), dtype), Res: T.Tensor((N, C), dtype), W: T.Tensor((C,), dtype),
                            Y: T.Tensor((N, C), dtype), ResOut: T.Tensor((N, C), dtype),
                            Y32: T.Tensor((N, C), "float32"), eps: T.float32):
            body(X, Res, W, Y, ResOut, eps, Y32)
    else:
        @T.prim_func
        def rms_norm_kernel(X: T.Tensor((N, C), dtype), Res: T.Tensor((N, C), dtype), W: T.Tensor((C,), dtype),
                            Y: T.Tensor((N, C), dtype), ResOut: T.Tensor((N, C), dtype), eps: T.float32):
            body(X, Res, W, Y, ResOut, eps, None)

    return rms_norm_kernel


def _build_padded(C: int, CP: int, threads: int, dtype: str, fused_add: bool):
    """``build_rms_norm`` for a width C that the threads do not divide: the row in a fragment of CP > C."""
    T = _tl.language()
    N = T.dynamic("N")

    @T.prim_func
    def rms_norm_kernel(
        X: T.Tensor((N, C), dtype),
        Res: T.Tensor((N, C), dtype),
        W: T.Tensor((C,), dtype),
        Y: T.Tensor((N, C), dtype),
        ResOut: T.Tensor((N, C), dtype),
        eps: T.float32,
    ):
        with T.Kernel(N, threads=threads) as row:
            x = T.alloc_fragment((1, CP), "float32")
            sq = T.alloc_fragment((1, CP), "float32")
            ss = T.alloc_fragment((1,), "float32")
            for i, j in T.Parallel(1, CP):
                if j < C:
                    if fused_add:
                        # the residual sum is rounded to the activation dtype first, as in the reference
                        r = T.cast(T.cast(X[row, j], "float32") + T.cast(Res[row, j], "float32"), dtype)
                        ResOut[row, j] = r
                        x[i, j] = T.cast(r, "float32")
                    else:
                        x[i, j] = T.cast(X[row, j], "float32")
                else:
                    x[i, j] = 0.0
            for i, j in T.Parallel(1, CP):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(1):
                ss[i] = T.rsqrt(ss[i] / C + eps)
            for i, j in T.Parallel(1, CP):
                if j < C:
                    Y[row, j] = T.cast(T.cast(W[j], "float32") * (x[i, j] * ss[i]), dtype)

    return rms_norm_kernel


_kernel = _tl.kernel_cache(build_rms_norm)


def _run(x, residual, w, eps, fused, f32_copy=False):
    shape = x.shape
    C = shape[-1]
    x2 = x.reshape(-1, C).contiguous()
    y = torch.empty_like(x2)
    y32 = torch.empty(x2.shape, dtype=torch.float32, device=x.device) if f32_copy else None
    if fused:
        r2 = residual.reshape(-1, C).to(x.dtype).contiguous()
        r_out = torch.empty_like(x2)
    else:
        r2 = r_out = x2  # unused by the kernel
    if x2.shape[0]:
        # (the float32 copy feeds cuBLAS's GEMM, which does not wait programmatically: no PDL build of it)
        kernel = _kernel(C, _tl.tl_dtype(x.dtype), fused, *((False, True) if f32_copy else _tl.pdl_arg(x2.shape[0])))
        kernel(x2, r2, w.to(x.dtype).contiguous(), y, r_out, *((y32,) if f32_copy else ()), float(eps))
    return y.view(shape), (r_out.view(shape) if fused else None), (y32.view(shape) if f32_copy else None)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _run(x, None, w, eps, False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    y, r, _ = _run(x, residual, w, eps, True)
    return y, r


def add_rms_norm_f32(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    """``add_rms_norm`` that also returns the normed rows as float32 (the same values: ``y.float()``) from the same
    launch: (y, new_residual, y32). Widths the norm's threads do not divide (toy models) get ``y.float()``."""
    if _padded(x.shape[-1], _threads(x.shape[-1])) != x.shape[-1]:
        y, r = add_rms_norm(x, residual, w, eps)
        return y, r, y.float()
    return _run(x, residual, w, eps, True, True)


def representative_kernels():
    return [("add_rms_norm C7168", lambda: build_rms_norm(7168, "bfloat16", True)),
            ("add_rms_norm C24 (padded: the tiny model)", lambda: build_rms_norm(24, "bfloat16", True)),
            ("rms_norm C24 (padded)", lambda: build_rms_norm(24, "bfloat16", False)),
            ("add_rms_norm C2048 with the float32 copy (the router's input)",
             lambda: build_rms_norm(2048, "bfloat16", True, False, True))]
