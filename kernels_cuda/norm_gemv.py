"""RMSNorm (with the residual add) in the prologue of the one-row GEMV that follows it: ``add_rms_norm_linear``.

At batch-1 decode a layer's ``add_rms_norm`` is a 1.8 us launch for 8 KB of activations, and the projection
after it (q + kv_a) streams a 15 MB weight. Here every CTA of the GEMV (``gemv.build_gemv``'s tiling: a warp
per weight row, 16-byte loads) first issues its weight loads, then, while they are in flight, recomputes the
norm of the C-wide row itself: it reads x and the residual (L2 hits after the first CTA), sums them (rounded to
the activation dtype, as the reference), reduces the sum of squares across the CTA and writes the normed row
to shared memory, from which the FMAs read it. CTA 0 also writes the new residual. One launch instead of two;
the norm's latency hides behind the weight stream. Every CTA reduces in the same fixed order, so all of them
see the same normed row (deterministic, no atomics).

``DEEPINFER_NORM_GEMV=0`` runs the two kernels instead (the before of a benchmark).
"""

from __future__ import annotations

import torch

from deepinfer_core.config import env_flag
from kernels_cuda import _tl
from kernels_cuda.gemv import tile_config

ENV = "DEEPINFER_NORM_GEMV"
VEC = 8  # 2-byte elements per 16-byte load


def enabled() -> bool:
    return env_flag(ENV, True)


def norm_prologue(T, K: int, threads: int, fused_add: bool, dtype: str, write_normed: bool = False):
    """A macro: the normed row ``xs[0, :K]`` (shared, ``dtype``) of ``X[t] (+ Res[t])`` for a CTA of ``threads``
    threads (thread id ``tid``); where ``write`` holds, the CTA also writes the residual sum to ``ResOut[t]`` and
    (``write_normed``) the normed row to ``Normed[t]``. Sum of squares in float32: per thread, warp shuffles, then
    the warps' partials in warp order (every CTA gets the same bits)."""
    per = -(-K // (threads * VEC))
    warps = threads // 32

    @T.macro
    def prologue(X, Res, NW, ResOut, Normed, xs, part, t, tid, write, eps):
        xv = T.alloc_local((VEC,), dtype)
        rv = T.alloc_local((VEC,), dtype)
        xr = T.alloc_local((per, VEC), "float32")  # this thread's elements of the (summed) row
        nw = T.alloc_local((per, VEC), dtype)
        ss = T.alloc_local((1,), "float32")
        tot = T.alloc_local((1,), "float32")
        ss[0] = 0.0
        for it in T.unroll(per):
            k0 = (it * threads + tid) * VEC
            if k0 < K:
                for v in T.vectorized(VEC):
                    nw[it, v] = NW[k0 + v]
                for v in T.vectorized(VEC):
                    xv[v] = X[t, k0 + v]
                if fused_add:
                    for v in T.vectorized(VEC):
                        rv[v] = Res[t, k0 + v]
                    for v in T.unroll(VEC):
                        xv[v] = T.cast(T.cast(xv[v], "float32") + T.cast(rv[v], "float32"), dtype)
                    if write:
                        for v in T.vectorized(VEC):
                            ResOut[t, k0 + v] = xv[v]
                for v in T.unroll(VEC):
                    xr[it, v] = T.cast(xv[v], "float32")
                    ss[0] += xr[it, v] * xr[it, v]
        ss[0] = T.warp_reduce_sum(ss[0])
        if tid % 32 == 0:
            part[tid // 32] = ss[0]
        T.sync_threads()
        tot[0] = 0.0
        for w in T.serial(warps):
            tot[0] += part[w]
        tot[0] = T.rsqrt(tot[0] / K + eps)
        for it in T.unroll(per):
            k0 = (it * threads + tid) * VEC
            if k0 < K:
                for v in T.unroll(VEC):
                    xv[v] = T.cast(T.cast(nw[it, v], "float32") * (xr[it, v] * tot[0]), dtype)
                for v in T.vectorized(VEC):
                    xs[0, k0 + v] = xv[v]
                if write_normed:
                    if write:
                        for v in T.vectorized(VEC):
                            Normed[t, k0 + v] = xv[v]
        T.sync_threads()

    return prologue


def build_norm_gemv(N: int, K: int, BN: int, RT: int, fused_add: bool, dtype: str, pdl: bool = False):
    """One activation row: Y[0, n] = W[n] . rms_norm(X[0] (+ Res[0])) for every n; ResOut[0] = X[0] + Res[0].
    ``pdl`` (``_tl.PDL_ENV``): launched early, the kernel issues its weight loads, then waits for the kernel
    before it (``_tl.pdl_gate``) before it reads X or the residual or writes anything."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    accum = "float32"
    threads = RT * BN
    assert RT == 32 or BN == 1, (RT, BN)
    step = RT * VEC
    iters = -(-K // step)
    prologue = norm_prologue(T, K, threads, fused_add, dtype)

    @T.prim_func
    def norm_gemv_kernel(X: T.Tensor((1, K), dtype), Res: T.Tensor((1, K), dtype), NW: T.Tensor((K,), dtype),
                         W: T.Tensor((N, K), dtype), Y: T.Tensor((1, N), dtype), ResOut: T.Tensor((1, K), dtype),
                         eps: T.float32):
        with T.Kernel(T.ceildiv(N, BN), threads=(RT, BN)) as bn:
            tk = T.get_thread_binding(0)
            tn = T.get_thread_binding(1)
            tid = tn * RT + tk
            n = bn * BN + tn
            w_loc = T.alloc_local((iters, VEC), dtype)
            x_loc = T.alloc_local((VEC,), dtype)
            acc = T.alloc_local((1,), accum)
            red = T.alloc_local((1,), accum)
            xs = T.alloc_shared((1, K), dtype)
            part = T.alloc_shared((threads // 32,), accum)
            acc[0] = 0.0
            if n < N:  # the weight stream first: its loads are in flight while the norm is computed
                for it in T.unroll(iters):
                    k0 = it * step + tk * VEC
                    if k0 < K:
                        for v in T.vectorized(VEC):
                            w_loc[it, v] = W[n, k0 + v]
            if pdl:
                gate()
            prologue(X, Res, NW, ResOut, ResOut, xs, part, 0, tid, bn == 0, eps)
            if n < N:
                for it in T.unroll(iters):
                    k0 = it * step + tk * VEC
                    if k0 < K:
                        for v in T.vectorized(VEC):
                            x_loc[v] = xs[0, k0 + v]
                        for v in T.unroll(VEC):
                            acc[0] += T.cast(x_loc[v], accum) * T.cast(w_loc[it, v], accum)
            acc[0] = T.warp_reduce_sum(acc[0])
            if RT == 32:
                if (tk == 0) & (n < N):
                    Y[0, n] = T.cast(acc[0], dtype)
            else:  # one row per CTA (BN == 1): the warps' sums through shared memory
                psum = T.alloc_shared((RT // 32,), accum)
                if tk % 32 == 0:
                    psum[tk // 32] = acc[0]
                T.sync_threads()
                if (tk == 0) & (n < N):
                    red[0] = 0.0
                    for w in T.serial(RT // 32):
                        red[0] += psum[w]
                    Y[0, n] = T.cast(red[0], dtype)

    return norm_gemv_kernel


_kernel = _tl.kernel_cache(build_norm_gemv)


def applies(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, w: torch.Tensor) -> bool:
    """One row of 2-byte activations (and residual) against a same-dtype contiguous weight, K a whole number of
    16-byte vectors and at most 16 K elements (the normed row sits in shared memory), on a CUDA device."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or w.dim() != 2 or x.dim() != 2:
        return False
    K = w.shape[1]
    if x.shape != (1, K) or K % VEC or K > 16384 or norm_w.shape != (K,) or not enabled():
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return False
    tensors = (x, w) if residual is None else (x, w, residual)
    if any(not t.is_contiguous() or t.data_ptr() % 16 for t in tensors):
        return False
    return x.is_cuda or _tl.dry_run()


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The registry's ``add_rms_norm_linear``: one launch for one row (``applies``); the backend's norm and
    ``linear`` otherwise."""
    if not applies(x, residual, norm_w, w):
        from kernels_cuda import gemv, norm

        if residual is None:
            return gemv.linear(norm.rms_norm(x, norm_w, eps), w), x
        normed, res = norm.add_rms_norm(x, residual, norm_w, eps)
        return gemv.linear(normed, w), res
    N, K = w.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    sms = _tl.num_sms(x.device.index or 0) if x.is_cuda else _tl.num_sms()
    bn, rt = tile_config(N, K, sms, VEC)
    kernel = _kernel(N, K, bn, rt, residual is not None, _tl.tl_dtype(x.dtype), *_tl.pdl_arg())
    kernel(x, x if residual is None else residual, norm_w.to(x.dtype).contiguous(), w, y, res_out, float(eps))
    return y, res_out


def representative_kernels():
    return [
        ("add_rms_norm + gemv M1 N3648 K2048 (V2-Lite input norm + q+kv_a)",
         lambda: build_norm_gemv(3648, 2048, *tile_config(3648, 2048, 132), True, "bfloat16")),
        ("rms_norm + gemv M1 N2112 K7168 (V3 first layer's norm + q_a+kv_a)",
         lambda: build_norm_gemv(2112, 7168, *tile_config(2112, 7168, 132), False, "bfloat16")),
    ]
