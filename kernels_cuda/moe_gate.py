"""``moe_gate`` in one launch for decode (at most 8 tokens): the router GEMV and the gate of ``moe_route``.

Grid (E, T): a CTA computes one float32 logit (gate row e against token t, K split over its threads,
16-byte loads) and writes it to a workspace; its thread 0 then counts the token's finished logits on a
device-scope counter (acq_rel). The CTA that brings the count to E holds the token's last logit and
routes the token (``moe_route``'s gate, reading the logits with acquire loads from L2), appends the
shared experts, and puts the counter back to 0 for the next launch (so a CUDA graph replays it as is).
Tokens are routed in parallel, each by its own last CTA. One launch instead of two (the GEMV and
``moe_route``), and no host sync.

The counters are one int32 tensor of 8 per device (``_tl.launch_counters``); each launch leaves them at 0.
"""

import torch

from kernels_cuda import _tl
from kernels_cuda.moe_route import route_macro

MAX_T = 8
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def build_gate_route(E: int, C: int, K: int, n_group: int, topk_group: int, softmax: bool, has_bias: bool,
                     top2sum: bool, renormalize: bool, S: int, w_dtype: str, x_dtype: str, g_dtype: str,
                     pdl: bool = False, norm: bool = False):
    """``pdl``: programmatic dependent launch (``_tl.PDL_ENV``): the gate rows are loaded before waiting for
    the kernel that wrote X (``_tl.pdl_gate``). ``norm``: ``add_rms_norm_moe_gate``, the post-attention
    residual add + RMSNorm in the prologue (``norm_gemv.norm_prologue``: every CTA normalises its token's row
    into shared memory while its gate row loads; CTA (0, t) writes the normed row and the new residual)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    NT = T.dynamic("NT")
    threads = max(128, (E + 31) // 32 * 32)
    VEC = 16 // _BYTES[g_dtype]
    iters = -(-C // (threads * VEC))
    KS = K + S
    route_token = route_macro(E, K, n_group, topk_group, softmax, has_bias, top2sum, renormalize, S, w_dtype,
                              atomic_logits=True)

    @T.macro
    def load_gate(Gate, g_loc, e, tx):
        for it in T.unroll(iters):
            k0 = (it * threads + tx) * VEC
            if k0 < C:
                for v in T.vectorized(VEC):
                    g_loc[it, v] = Gate[e, k0 + v]

    @T.macro
    def logit_and_route(Xs, r, g_loc, Bias, Logits, Count, Wt, Ids, scale, e, t, tx):
        """Logit (e, t) from row r of Xs; the CTA that completes token t's logits routes it."""
        x_loc = T.alloc_local((VEC,), x_dtype)
        acc = T.alloc_local((1,), "float32")
        part = T.alloc_shared((threads // 32,), "float32")
        last = T.alloc_shared((1,), "int32")
        acc[0] = 0.0
        for it in T.unroll(iters):
            k0 = (it * threads + tx) * VEC
            if k0 < C:
                for v in T.vectorized(VEC):
                    x_loc[v] = Xs[r, k0 + v]
                for v in T.unroll(VEC):
                    acc[0] += T.cast(x_loc[v], "float32") * T.cast(g_loc[it, v], "float32")
        acc[0] = T.warp_reduce_sum(acc[0])
        if tx % 32 == 0:
            part[tx // 32] = acc[0]
        T.sync_threads()
        if tx == 0:
            tot = T.alloc_var("float32", 0.0)
            for w in T.serial(threads // 32):
                tot += part[w]
            Logits[t, e] = tot
            last[0] = T.atomic_add(Count[t], 1, memory_order="acq_rel", return_prev=True)
        T.sync_threads()
        if last[0] == E - 1:  # every logit of token t is written: this CTA routes it
            route_token(Logits, Bias, Wt, Ids, t, tx, scale)
            if tx == 0:
                Count[t] = 0

    if not norm:
        @T.prim_func
        def moe_gate_kernel(X: T.Tensor((NT, C), x_dtype), Gate: T.Tensor((E, C), g_dtype),
                            Bias: T.Tensor((E,), "float32"), Logits: T.Tensor((NT, E), "float32"),
                            Count: T.Tensor((MAX_T,), "int32"), Wt: T.Tensor((NT, KS), w_dtype),
                            Ids: T.Tensor((NT, KS), "int64"), scale: T.float32):
            with T.Kernel(E, NT, threads=threads) as (e, t):
                tx = T.get_thread_binding()
                g_loc = T.alloc_local((iters, VEC), g_dtype)
                load_gate(Gate, g_loc, e, tx)
                if pdl:
                    gate()
                logit_and_route(X, t, g_loc, Bias, Logits, Count, Wt, Ids, scale, e, t, tx)

        return moe_gate_kernel

    from kernels_cuda.norm_gemv import norm_prologue

    prologue = norm_prologue(T, C, threads, True, x_dtype, write_normed=True)

    @T.prim_func
    def norm_gate_kernel(X: T.Tensor((NT, C), x_dtype), Res: T.Tensor((NT, C), x_dtype),
                         NW: T.Tensor((C,), x_dtype), Normed: T.Tensor((NT, C), x_dtype),
                         ResOut: T.Tensor((NT, C), x_dtype), Gate: T.Tensor((E, C), g_dtype),
                         Bias: T.Tensor((E,), "float32"), Logits: T.Tensor((NT, E), "float32"),
                         Count: T.Tensor((MAX_T,), "int32"), Wt: T.Tensor((NT, KS), w_dtype),
                         Ids: T.Tensor((NT, KS), "int64"), scale: T.float32, eps: T.float32):
        with T.Kernel(E, NT, threads=threads) as (e, t):
            tx = T.get_thread_binding()
            g_loc = T.alloc_local((iters, VEC), g_dtype)
            xs = T.alloc_shared((1, C), x_dtype)
            npart = T.alloc_shared((threads // 32,), "float32")
            load_gate(Gate, g_loc, e, tx)  # in flight while the row is normalised
            if pdl:
                gate()
            prologue(X, Res, NW, ResOut, Normed, xs, npart, t, tx, e == 0, eps)
            logit_and_route(xs, 0, g_loc, Bias, Logits, Count, Wt, Ids, scale, e, t, tx)

    return norm_gate_kernel


_kernel = _tl.kernel_cache(build_gate_route)


def applies(x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> bool:
    """At most 8 tokens of 2-byte activations, a float32 or same-dtype gate with rows of whole 16-byte vectors,
    contiguous and aligned, on a CUDA device."""
    if x.dtype not in (torch.bfloat16, torch.float16) or gate.dtype not in (x.dtype, torch.float32):
        return False
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() != 2 or gate.dim() != 2:
        return False
    C = gate.shape[1]
    if x.shape[1] != C or C % (16 // gate.element_size()) or not 1 <= x.shape[0] <= MAX_T:
        return False
    if not (x.is_contiguous() and gate.is_contiguous()) or x.data_ptr() % 16 or gate.data_ptr() % 16:
        return False
    return x.is_cuda or _tl.dry_run()


def gate_route(x, gate, bias, top_k, n_group, topk_group, softmax, top2sum, renormalize, scale, n_shared, dtype):
    """One launch of the kernel (``applies`` must hold); None when no counter can be had (first call inside a
    graph capture): the caller runs the two-launch path."""
    count = _tl.launch_counters("moe_gate", MAX_T, x.device)
    if count is None:
        return None
    NT, E = x.shape[0], gate.shape[0]
    dev = x.device
    logits = torch.empty(NT, E, dtype=torch.float32, device=dev)
    weights = torch.empty(NT, top_k + n_shared, dtype=dtype, device=dev)
    ids = torch.empty(NT, top_k + n_shared, dtype=torch.int64, device=dev)
    b = bias.float().contiguous() if bias is not None else logits[0]  # unread without a bias
    kern = _kernel(E, x.shape[1], int(top_k), n_group, topk_group, softmax, bias is not None, top2sum,
                   bool(renormalize), int(n_shared), _tl.tl_dtype(dtype), _tl.tl_dtype(x.dtype),
                   _tl.tl_dtype(gate.dtype), *_tl.pdl_arg(NT))
    kern(x, gate, b, logits, count, weights, ids, float(scale))
    return weights, ids


def add_rms_norm_moe_gate(x, residual, norm_w, eps, gate, bias, top_k, scoring, n_group, topk_group, group_score,
                          renormalize, scale, n_shared, dtype):
    """The registry's ``add_rms_norm_moe_gate``: one launch for at most 8 tokens (``build_gate_route(norm=True)``);
    the backend's ``add_rms_norm`` and ``moe_gate`` otherwise. Returns (normed, new_residual, weights, ids)."""
    from kernels_cuda import gemv_rows, moe_route, norm, norm_gemv

    C = x.shape[-1]
    fits = (applies(x, gate, dtype) and norm_gemv.enabled() and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
            and residual.data_ptr() % 16 == 0 and norm_w.shape == (C,) and C % 8 == 0 and C <= 16384)
    count = _tl.launch_counters("moe_gate", MAX_T, x.device) if fits else None
    if count is None:
        if (gate.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > MAX_T and (x.is_cuda or _tl.dry_run())
                and gemv_rows.no_cast_launches()):
            # past the GEMV's rows the router is the float32 GEMM: it reads the norm's float32 copy (the same
            # values linear_f32 would cast to, written by the norm launch instead of a cast launch of its own)
            normed, res, normed32 = norm.add_rms_norm_f32(x, residual, norm_w, eps)
        else:
            normed, res = norm.add_rms_norm(x, residual, norm_w, eps)
            normed32 = normed
        weights, ids = moe_route.moe_gate(normed32, gate, bias, top_k, scoring, n_group, topk_group, group_score,
                                          renormalize, scale, n_shared, dtype)
        return normed, res, weights, ids
    moe_route._check(scoring, group_score)
    grouped = n_group > 1 and topk_group < n_group
    ng, tg = (n_group, topk_group) if grouped else (1, 1)
    NT, E = x.shape[0], gate.shape[0]
    dev = x.device
    normed, res = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty(NT, E, dtype=torch.float32, device=dev)
    weights = torch.empty(NT, top_k + n_shared, dtype=dtype, device=dev)
    ids = torch.empty(NT, top_k + n_shared, dtype=torch.int64, device=dev)
    b = bias.float().contiguous() if bias is not None else logits[0]  # unread without a bias
    kern = _kernel(E, C, int(top_k), ng, tg, scoring == "softmax", bias is not None, group_score == "top2sum",
                   bool(renormalize), int(n_shared), _tl.tl_dtype(dtype), _tl.tl_dtype(x.dtype),
                   _tl.tl_dtype(gate.dtype), _tl.pdl(NT), True)
    kern(x, residual, norm_w.to(x.dtype).contiguous(), normed, res, gate, b, logits, count, weights, ids,
         float(scale), float(eps))
    return normed, res, weights, ids


def representative_kernels():
    return [
        ("moe_gate V2-Lite (64 experts x 2048, float32 gate, softmax, top-6, 2 shared)",
         lambda: build_gate_route(64, 2048, 6, 1, 1, True, False, False, False, 2, "bfloat16", "bfloat16",
                                  "float32")),
        ("add_rms_norm + moe_gate V2-Lite (the post-attention norm in the prologue)",
         lambda: build_gate_route(64, 2048, 6, 1, 1, True, False, False, False, 2, "bfloat16", "bfloat16",
                                  "float32", False, True)),
        ("moe_gate V3 (256 experts x 7168, float32 gate, sigmoid groups, top-8, 1 shared)",
         lambda: build_gate_route(256, 7168, 8, 8, 4, False, True, True, True, 1, "bfloat16", "bfloat16",
                                  "float32")),
    ]
