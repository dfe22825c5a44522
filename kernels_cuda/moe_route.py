"""DeepSeek MoE gate in one TileLang kernel: one CTA per token, one thread per expert.

softmax|sigmoid scores, group-limited selection on scores + bias (group score = max or sum of the
top two), top-k by rank (each thread counts the experts that beat it: ties go to the lower id, as a
stable sort would), weights from the unbiased scores, optional renormalisation, times the scale.
Replaces about fifteen small torch launches per MoE layer.
"""

import torch

from kernels_cuda import _tl


def build_route(E: int, K: int, n_group: int, topk_group: int, softmax: bool, has_bias: bool,
                top2sum: bool, renormalize: bool):
    T = _tl.language()
    NT = T.dynamic("NT")
    threads = max(32, (E + 31) // 32 * 32)
    GS = E // n_group
    grouped = n_group > 1 and topk_group < n_group
    ninf = -T.infinity("float32")

    @T.prim_func
    def moe_route_kernel(Logits: T.Tensor((NT, E), "float32"), Bias: T.Tensor((E,), "float32"),
                         Wt: T.Tensor((NT, K), "float32"), Ids: T.Tensor((NT, K), "int64"),
                         scale: T.float32):
        with T.Kernel(NT, threads=threads) as t:
            tx = T.get_thread_binding()
            L_s = T.alloc_shared((E,), "float32")
            S_s = T.alloc_shared((E,), "float32")  # unbiased scores
            C_s = T.alloc_shared((E,), "float32")  # selection scores (biased, group-masked)
            G_s = T.alloc_shared((n_group,), "float32")
            Keep_s = T.alloc_shared((n_group,), "int32")
            Sel_s = T.alloc_shared((K,), "float32")
            if tx < E:
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
                Wt[t, tx] = w * scale

    return moe_route_kernel


_kernel = _tl.kernel_cache(build_route)


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_route: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if group_score not in ("max", "top2sum"):
        raise ValueError(f"moe_route: group_score must be 'max' or 'top2sum', got {group_score!r}")
    NT, E = logits.shape
    grouped = n_group > 1 and topk_group < n_group
    ng, tg = (n_group, topk_group) if grouped else (1, 1)
    dev = logits.device
    weights = torch.empty(NT, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(NT, top_k, dtype=torch.int64, device=dev)
    if NT == 0:
        return weights, ids
    logits = logits.float().contiguous()
    # no bias: the kernel (has_bias False) never reads it, so a row of the logits stands in (no zeros launch)
    b = bias.float().contiguous() if bias is not None else logits[0]
    kern = _kernel(E, int(top_k), ng, tg, scoring == "softmax", bias is not None,
                   group_score == "top2sum", bool(renormalize))
    kern(logits, b, weights, ids, float(scale))
    return weights, ids


def representative_kernels():
    return [("moe_route V3 (256 experts, 8 groups, top-8)",
             lambda: build_route(256, 8, 8, 4, False, True, True, True))]
