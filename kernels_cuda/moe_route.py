"""DeepSeek MoE gate in one TileLang kernel: one CTA per token, one thread per expert.

softmax|sigmoid scores, group-limited selection on scores + bias (group score = max or sum of the
top two), top-k by rank (each thread counts the experts that beat it: ties go to the lower id, as a
stable sort would), weights from the unbiased scores, optional renormalisation, times the scale.
Replaces about fifteen small torch launches per MoE layer.

``moe_gate`` (decode fusion): for at most 8 tokens one launch (``kernels_cuda.moe_gate``: the GEMV's CTAs,
the last one per token routes it); above, the router GEMV and this kernel, which then also appends the
shared experts' ids and unit weights and writes the weights in the activation dtype. Either replaces
five launches (GEMV, route, two concatenations and a cast).
"""

import torch

from kernels_cuda import _tl


def route_macro(E: int, K: int, n_group: int, topk_group: int, softmax: bool, has_bias: bool, top2sum: bool,
                renormalize: bool, S: int, w_dtype: str, atomic_logits: bool = False):
    """The gate of one token as a TileLang macro ``route_token(Logits, Bias, Wt, Ids, t, tx, scale)`` run by a CTA
    of at least E threads (``tx`` the thread); ``atomic_logits``: the logits were written by other CTAs of the
    same launch (``moe_gate``'s single kernel)."""
    T = _tl.language()
    GS = E // n_group
    grouped = n_group > 1 and topk_group < n_group
    ninf = -T.infinity("float32")

    @T.macro
    def route_token(Logits, Bias, Wt, Ids, t, tx, scale):
        L_s = T.alloc_shared((E,), "float32")
        S_s = T.alloc_shared((E,), "float32")  # unbiased scores
        C_s = T.alloc_shared((E,), "float32")  # selection scores (biased, group-masked)
        G_s = T.alloc_shared((n_group,), "float32")
        Keep_s = T.alloc_shared((n_group,), "int32")
        Sel_s = T.alloc_shared((K,), "float32")
        if tx < E:
            if atomic_logits:  # written by other CTAs of this launch: read from L2, after their release
                L_s[tx] = T.atomic_load(Logits[t, tx], "acquire")
            else:
                L_s[tx] = Logits[t, tx]
        T.sync_threads()
        mx = T.alloc_var("float32", ninf)
        den = T.alloc_var("float32", 0.0)
        if softmax:
            for e in T.serial(E):
                mx = T.max(mx, L_s[e])
            for e in T.serial(E):
                den += T.exp(L_s[e] - mx)
        if tx < E:
            s = T.alloc_var("float32", 0.0)
            if softmax:
                s = T.exp(L_s[tx] - mx) / den
            else:
                s = 1.0 / (1.0 + T.exp(-L_s[tx]))
            S_s[tx] = s
            if has_bias:
                C_s[tx] = s + Bias[tx]
            else:
                C_s[tx] = s
        T.sync_threads()
        if grouped:
            if tx < n_group:
                best = T.alloc_var("float32", ninf)
                second = T.alloc_var("float32", ninf)
                for i in T.serial(GS):
                    v = C_s[tx * GS + i]
                    if v > best:
                        second = best
                        best = v
                    elif v > second:
                        second = v
                if top2sum:
                    G_s[tx] = best + second
                else:
                    G_s[tx] = best
            T.sync_threads()
            if tx < n_group:
                rank = T.alloc_var("int32", 0)
                for g in T.serial(n_group):
                    if (G_s[g] > G_s[tx]) | ((G_s[g] == G_s[tx]) & (g < tx)):
                        rank += 1
                Keep_s[tx] = T.if_then_else(rank < topk_group, 1, 0)
            T.sync_threads()
            if tx < E:
                if Keep_s[tx // GS] == 0:
                    C_s[tx] = ninf
            T.sync_threads()
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
            w = T.alloc_var("float32", Sel_s[tx])
            if renormalize:
                tot = T.alloc_var("float32", 0.0)
                for j in T.serial(K):
                    tot += Sel_s[j]
                w = w / (tot + 1e-20)
            Wt[t, tx] = T.cast(w * scale, w_dtype)
        if S > 0:
            if tx < S:
                Wt[t, K + tx] = T.cast(1.0, w_dtype)
                Ids[t, K + tx] = E + tx


    return route_token


def build_route(E: int, K: int, n_group: int, topk_group: int, softmax: bool, has_bias: bool,
                top2sum: bool, renormalize: bool, S: int = 0, w_dtype: str = "float32"):
    """``S`` > 0: columns K..K+S-1 of the outputs hold the always-selected experts E..E+S-1 with weight 1;
    the weights are written as ``w_dtype``."""
    T = _tl.language()
    NT = T.dynamic("NT")
    threads = max(32, (E + 31) // 32 * 32)
    KS = K + S
    route_token = route_macro(E, K, n_group, topk_group, softmax, has_bias, top2sum, renormalize, S, w_dtype)

    @T.prim_func
    def moe_route_kernel(Logits: T.Tensor((NT, E), "float32"), Bias: T.Tensor((E,), "float32"),
                         Wt: T.Tensor((NT, KS), w_dtype), Ids: T.Tensor((NT, KS), "int64"),
                         scale: T.float32):
        with T.Kernel(NT, threads=threads) as t:
            tx = T.get_thread_binding()
            route_token(Logits, Bias, Wt, Ids, t, tx, scale)

    return moe_route_kernel


_kernel = _tl.kernel_cache(build_route)


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    return _route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale, 0,
                  torch.float32)


def moe_gate(x, gate, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale, n_shared, dtype):
    """The registry's ``moe_gate``: one launch for at most 8 tokens (``kernels_cuda.moe_gate``); otherwise the
    router GEMV, then the route kernel writing the shared experts' slots and the weights in ``dtype``."""
    from kernels_cuda import moe_gate as single
    from kernels_cuda.gemv import linear_f32

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        from kernels_cpu import fused as ref

        return ref.moe_gate(x, gate, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale,
                            n_shared, dtype)
    _check(scoring, group_score)
    if single.applies(x, gate, dtype):
        grouped = n_group > 1 and topk_group < n_group
        out = single.gate_route(x, gate, bias, top_k, *((n_group, topk_group) if grouped else (1, 1)),
                                scoring == "softmax", group_score == "top2sum", renormalize, scale, n_shared, dtype)
        if out is not None:
            return out
    return _route(linear_f32(x, gate), bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale,
                  int(n_shared), dtype)


def _check(scoring: str, group_score: str) -> None:
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_route: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if group_score not in ("max", "top2sum"):
        raise ValueError(f"moe_route: group_score must be 'max' or 'top2sum', got {group_score!r}")


def _route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale, S, dtype):
    _check(scoring, group_score)
    NT, E = logits.shape
    grouped = n_group > 1 and topk_group < n_group
    ng, tg = (n_group, topk_group) if grouped else (1, 1)
    dev = logits.device
    weights = torch.empty(NT, top_k + S, dtype=dtype, device=dev)
    ids = torch.empty(NT, top_k + S, dtype=torch.int64, device=dev)
    if NT == 0:
        return weights, ids
    logits = logits.float().contiguous()
    # no bias: the kernel (has_bias False) never reads it, so a row of the logits stands in (no zeros launch)
    b = bias.float().contiguous() if bias is not None else logits[0]
    kern = _kernel(E, int(top_k), ng, tg, scoring == "softmax", bias is not None,
                   group_score == "top2sum", bool(renormalize), S, _tl.tl_dtype(dtype))
    kern(logits, b, weights, ids, float(scale))
    return weights, ids


def representative_kernels():
    return [("moe_route V3 (256 experts, 8 groups, top-8)",
             lambda: build_route(256, 8, 8, 4, False, True, True, True)),
            ("moe_gate's route V2-Lite (64 experts, top-6, 2 shared, bf16 weights)",
             lambda: build_route(64, 6, 1, 1, True, False, False, False, 2, "bfloat16"))]
