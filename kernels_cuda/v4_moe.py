"""DeepSeek-V4 MoE gate (``moe_route_v4``) in one TileLang kernel, and the clamped fused MoE.

Gate: one CTA per token, one thread per expert. scores = sqrt(softplus(logit)) | sigmoid(logit);
hash layers take their k expert ids from ``hash_ids`` (``tid2eid[token]``), learned layers the top
k of scores + bias by rank (each thread counts the experts that beat it; ties go to the lower id);
weights = the unbiased scores of the chosen ids, renormalised, times the scale. Replaces about ten
small torch launches per MoE layer. The experts themselves run ``kernels_cuda.moe`` with the
SwiGLU clamp fused into its first GEMM's epilogue (``fused_moe_clamped``).
"""

import torch

from kernels_cuda import _tl
from kernels_cuda.moe import fused_moe_clamped  # noqa: F401  (registered from here with the gate)


def build_route_v4(E: int, K: int, sqrtsoftplus: bool, has_bias: bool, hashed: bool):
    T = _tl.language()
    NT = T.dynamic("NT")
    f32 = "float32"
    threads = max(32, (E + 31) // 32 * 32)

    @T.prim_func
    def moe_route_v4_kernel(Logits: T.Tensor((NT, E), f32), Bias: T.Tensor((E,), f32),
                            HashIds: T.Tensor((NT, K), "int64"), Wt: T.Tensor((NT, K), f32),
                            Ids: T.Tensor((NT, K), "int64"), scale: T.float32):
        with T.Kernel(NT, threads=threads) as t:
            tx = T.get_thread_binding()
            S_s = T.alloc_shared((E,), f32)  # unbiased scores
            C_s = T.alloc_shared((E,), f32)  # selection scores
            Sel_s = T.alloc_shared((K,), f32)
            if tx < E:
                x = Logits[t, tx]
                s = T.alloc_var(f32, 0.0)
                if sqrtsoftplus:  # softplus(x) = max(x, 0) + log(1 + exp(-|x|)), stable for large |x|
                    s = T.sqrt(T.max(x, 0.0) + T.log(1.0 + T.exp(-T.abs(x))))
                else:
                    s = 1.0 / (1.0 + T.exp(-x))
                S_s[tx] = s
                if has_bias:
                    C_s[tx] = s + Bias[tx]
                else:
                    C_s[tx] = s
            T.sync_threads()
            if hashed:
                if tx < K:
                    e = HashIds[t, tx]
                    Sel_s[tx] = S_s[T.cast(e, "int32")]
                    Ids[t, tx] = e
            else:
                if tx < E:
                    r = T.alloc_var("int32", 0)
                    mine = C_s[tx]
                    for e in T.serial(E):
                        if (C_s[e] > mine) | ((C_s[e] == mine) & (e < tx)):
                            r += 1
                    if r < K:
                        Sel_s[r] = S_s[tx]
                        Ids[t, r] = tx
            T.sync_threads()
            if tx < K:
                tot = T.alloc_var(f32, 0.0)
                for j in T.serial(K):
                    tot += Sel_s[j]
                Wt[t, tx] = Sel_s[tx] / (tot + 1e-20) * scale

    return moe_route_v4_kernel


_kernel = _tl.kernel_cache(build_route_v4)


def moe_route_v4(logits, bias, hash_ids, top_k, scoring, scale):
    """``kernels_cpu.v4_ops.moe_route_v4``: (weights [T, k] f32, ids [T, k] i64)."""
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"moe_route_v4: scoring must be 'sqrtsoftplus' or 'sigmoid', got {scoring!r}")
    NT, E = logits.shape
    K = hash_ids.shape[1] if hash_ids is not None else int(top_k)
    dev = logits.device
    if E > 1024:
        from kernels_cpu.v4_ops import moe_route_v4 as ref

        return ref(logits, bias, hash_ids, top_k, scoring, scale)
    weights = torch.empty(NT, K, dtype=torch.float32, device=dev)
    ids = torch.empty(NT, K, dtype=torch.int64, device=dev)
    if NT == 0:
        return weights, ids
    b = bias.float().contiguous() if bias is not None else torch.zeros(E, dtype=torch.float32, device=dev)
    h = hash_ids.long().contiguous() if hash_ids is not None else ids  # unused when not hashed
    kern = _kernel(E, K, scoring == "sqrtsoftplus", bias is not None, hash_ids is not None)
    kern(logits.float().contiguous(), b, h, weights, ids, float(scale))
    return weights, ids


def representative_kernels():
    """V4-Flash gates: 256 experts top-6, learned (bias) and hash-routed layers."""
    return [("moe_route_v4 E256 k6 learned", lambda: build_route_v4(256, 6, True, True, False)),
            ("moe_route_v4 E256 k6 hash", lambda: build_route_v4(256, 6, True, False, True))]
