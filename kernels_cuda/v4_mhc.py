"""DeepSeek-V4 hyper-connection mixing (mHC) in TileLang.

``mhc_pre``: the mixing logits come from one float32 GEMM (cuBLAS through torch: raw = h.flat @ fn.T,
[T, (2+n)n]) plus the row's mean square; one kernel then does the rest per token, which the reference
spends about a hundred small launches on: the RMS scale, pre = sigmoid + eps, post = 2 sigmoid,
comb = softmax + eps, the Sinkhorn normalisation (column, then iters-1 row/column rounds) on the n x n
matrix (thread 0, in shared memory: n is 4), and the collapse x = sum_j pre[j] h[j] over C channels
(all threads). (RMS-normalising the row before the GEMM or scaling its output after is the same
product up to rounding.)

``mhc_post``: new h[k] = post[k] y + sum_j comb[j, k] h[j], one CTA per (token, channel tile), with
post and comb rounded to the activation dtype first, as the reference multiplies in that dtype.
"""

import torch

from kernels_cuda import _tl

THREADS = 128


def build_pre(n: int, C: int, iters: int, dtype: str):
    T = _tl.language()
    NT = T.dynamic("NT")
    f32 = "float32"
    MIX = (2 + n) * n
    BC = min(C, 1024)
    assert C % BC == 0

    @T.prim_func
    def mhc_pre_kernel(H: T.Tensor((NT, n, C), dtype), Raw: T.Tensor((NT, MIX), f32), MeanSq: T.Tensor((NT,), f32),
                       Base: T.Tensor((MIX,), f32), Scale: T.Tensor((3,), f32), X: T.Tensor((NT, C), dtype),
                       Post: T.Tensor((NT, n), f32), Comb: T.Tensor((NT, n, n), f32), norm_eps: T.float32,
                       hc_eps: T.float32):
        with T.Kernel(NT, threads=THREADS) as t:
            tx = T.get_thread_binding()
            pre_s = T.alloc_shared((n,), f32)
            cm_s = T.alloc_local((n, n), f32)  # thread 0 only
            acc = T.alloc_fragment((BC,), f32)
            if tx == 0:
                r = T.alloc_var(f32, T.rsqrt(MeanSq[t] + norm_eps))
                for j in T.serial(n):
                    pre_s[j] = 1.0 / (1.0 + T.exp(-(Raw[t, j] * r * Scale[0] + Base[j]))) + hc_eps
                    Post[t, j] = 2.0 / (1.0 + T.exp(-(Raw[t, n + j] * r * Scale[1] + Base[n + j])))
                for j in T.serial(n):  # softmax over k of row j
                    mx = T.alloc_var(f32, -T.infinity(f32))
                    for k in T.serial(n):
                        cm_s[j, k] = Raw[t, 2 * n + j * n + k] * r * Scale[2] + Base[2 * n + j * n + k]
                        mx = T.max(mx, cm_s[j, k])
                    tot = T.alloc_var(f32, 0.0)
                    for k in T.serial(n):
                        cm_s[j, k] = T.exp(cm_s[j, k] - mx)
                        tot += cm_s[j, k]
                    for k in T.serial(n):
                        cm_s[j, k] = cm_s[j, k] / tot + hc_eps
                for it in T.serial(2 * iters - 1):  # column, then (row, column) x (iters - 1)
                    if it % 2 == 0:
                        for k in T.serial(n):
                            cs = T.alloc_var(f32, hc_eps)
                            for j in T.serial(n):
                                cs += cm_s[j, k]
                            for j in T.serial(n):
                                cm_s[j, k] = cm_s[j, k] / cs
                    else:
                        for j in T.serial(n):
                            rs = T.alloc_var(f32, hc_eps)
                            for k in T.serial(n):
                                rs += cm_s[j, k]
                            for k in T.serial(n):
                                cm_s[j, k] = cm_s[j, k] / rs
                for j in T.serial(n):
                    for k in T.serial(n):
                        Comb[t, j, k] = cm_s[j, k]
            T.sync_threads()
            for cb in T.serial(C // BC):
                T.clear(acc)
                for j in T.serial(n):
                    for c in T.Parallel(BC):
                        acc[c] += pre_s[j] * T.cast(H[t, j, cb * BC + c], f32)
                T.copy(acc, X[t, cb * BC:(cb + 1) * BC])

    return mhc_pre_kernel


def build_post(n: int, C: int, dtype: str):
    T = _tl.language()
    NT = T.dynamic("NT")
    f32 = "float32"
    BC = min(C, 512)
    assert C % BC == 0

    @T.prim_func
    def mhc_post_kernel(Y: T.Tensor((NT, C), dtype), H: T.Tensor((NT, n, C), dtype), Post: T.Tensor((NT, n), f32),
                        Comb: T.Tensor((NT, n, n), f32), Out: T.Tensor((NT, n, C), dtype)):
        with T.Kernel(C // BC, NT, threads=THREADS) as (cb, t):
            acc = T.alloc_fragment((n, BC), f32)
            for k, c in T.Parallel(n, BC):
                # products in the activation dtype's precision, as the reference's bf16 matmul rounds them
                acc[k, c] = T.cast(T.cast(T.cast(Post[t, k], dtype), f32) * T.cast(Y[t, cb * BC + c], f32), f32)
            for j in T.serial(n):
                for k, c in T.Parallel(n, BC):
                    acc[k, c] += T.cast(T.cast(Comb[t, j, k], dtype), f32) * T.cast(H[t, j, cb * BC + c], f32)
            T.copy(acc, Out[t, :, cb * BC:(cb + 1) * BC])

    return mhc_post_kernel


_pre = _tl.kernel_cache(build_pre)
_post = _tl.kernel_cache(build_post)


def _use_reference(h: torch.Tensor, C: int) -> bool:
    return h.dtype not in (torch.bfloat16, torch.float16) or C % 64


def mhc_pre(h, fn, base, scale, iters, norm_eps, hc_eps):
    """``kernels_cpu.v4_ops.mhc_pre``: (x[T, C], post[T, n] f32, comb[T, n, n] f32)."""
    T_, n, C = h.shape
    if _use_reference(h, C) or T_ == 0 or iters < 1:
        from kernels_cpu.v4_ops import mhc_pre as ref

        return ref(h, fn, base, scale, iters, norm_eps, hc_eps)
    flat = h.reshape(T_, n * C).float()
    raw = torch.nn.functional.linear(flat, fn.float())  # [T, (2+n)n]
    mean_sq = flat.pow(2).mean(-1)  # [T]
    dev = h.device
    x = torch.empty(T_, C, dtype=h.dtype, device=dev)
    post = torch.empty(T_, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T_, n, n, dtype=torch.float32, device=dev)
    _pre(n, C, int(iters), _tl.tl_dtype(h.dtype))(h.contiguous(), raw.contiguous(), mean_sq.contiguous(),
                                                  base.float().contiguous(), scale.float().contiguous(), x, post,
                                                  comb, float(norm_eps), float(hc_eps))
    return x, post, comb


def mhc_post(y, h, post, comb):
    """``kernels_cpu.v4_ops.mhc_post``: new h [T, n, C]."""
    T_, n, C = h.shape
    if _use_reference(h, C) or T_ == 0 or y.dtype != h.dtype:
        from kernels_cpu.v4_ops import mhc_post as ref

        return ref(y, h, post, comb)
    out = torch.empty_like(h)
    _post(n, C, _tl.tl_dtype(h.dtype))(y.contiguous(), h.contiguous(), post.float().contiguous(),
                                       comb.float().contiguous(), out)
    return out


def representative_kernels():
    """V4-Flash: hidden 4096, 4 streams, 20 Sinkhorn iterations."""
    return [("mhc_pre n4 C4096", lambda: build_pre(4, 4096, 20, "bfloat16")),
            ("mhc_post n4 C4096", lambda: build_post(4, 4096, "bfloat16"))]
