"""``mla_decode_uv``: MLA's decode attention and W_UV in two launches instead of three.

The registry's meaning (``kernels_cpu/fused.py``) is ``head_linear(mla_decode(q, ...), w_uv)``. At small batches
``mla_decode`` splits the key axis (``mla_decode.choose_split``) and runs three kernels a layer: the attention
(fp32 partial outputs and their log-sum-exp per split), the combine (merges the live splits into the latent
output o[T, H, L] in the activation dtype) and ``head_linear``'s GEMV (o[t, h] times W_UV[h] [V, L]). Here the
attention kernel runs as it does there (same split count, same partials), and one kernel replaces the other two:

* CTA (v tile, head h, token t) of ``BV`` W_UV rows (V2-Lite at batch 1: 128 / 32 x 16 heads = 64 CTAs; V3:
  512) first issues the loads of its W_UV[h] rows into registers (16-byte vectors: a warp takes ``BV / 4``
  rows, its lanes the 512-wide K axis), so they are in flight while it merges;
* it merges head h's live splits as the combine does (``mla_decode.build_combine``: the split scores in one
  parallel pass, then the live prefix of partials summed split by split in order; a thread owns 4 of the 512
  columns and keeps 16 splits' loads in flight), or, where one live split wrote the output itself (a short
  context), reads that output row;
* the merged row is rounded to the activation dtype (as the combine's output is) into shared memory, then each
  lane multiplies its W vectors by it in float32 and the warp sums the lanes (a fixed butterfly): the rows of
  out[t, h, v tile], rounded once.

Every CTA of a head re-merges the head's partials (V / BV times: from L2, a few hundred KB at batch 1). The sums
run in a fixed order (deterministic); the host decides everything from shapes (the split count is the attention
kernel's, ``mla_decode._attend``), so the op can be captured in a CUDA graph.

Where the attention does not split (large batches), where ``head_linear`` would not run its GEMV (more rows than
``gemv_rows.faster_than_cublas`` gives it: the fused kernel reads W_UV once per token), at odd test shapes (latent
or rope widths the attention pads) and under ``DEEPINFER_UV_FUSION=0`` (a benchmark's before), the op is the
backend's ``mla_decode`` then ``head_linear``.
"""


import torch

from deepinfer_core.config import env_flag
from kernels_cuda import _tl
from kernels_cuda.mla_decode import MAX_SPLIT, split_weights_macro

VEC = 8  # 2-byte elements per 16-byte load
BV = 32  # W_UV rows (outputs) per CTA
THREADS = 128

#: ``DEEPINFER_UV_FUSION=0`` runs ``mla_decode`` (its combine) and ``head_linear`` as separate launches (a
#: benchmark's before)
ENV = "DEEPINFER_UV_FUSION"


def enabled() -> bool:
    return env_flag(ENV, True)


def build_combine_uv(H: int, HP: int, DV: int, V: int, dtype: str = "bfloat16", pdl: bool = False,
                     unroll: int = 16):
    """The kernel: Y[t, h, v] = sum_k W[h, v, k] * round(o[t, h, k]) for h < H, with o the merge of the split
    partials OPart / LsePart (``build_combine``'s) or, where one split is live, Out's row. ``HP``: the attention's
    (padded) head count, the extent of its buffers. ``unroll``: live splits whose partial loads a thread has in
    flight at once (each thread owns DV / 128 columns of the row: one 16-byte load a split at DV = 512). ``pdl``
    (``_tl.PDL_ENV``): launched early, it loads its W_UV rows, then waits for the attention (``_tl.pdl_gate``)."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    NT, n_split = T.dynamic("NT"), T.dynamic("NSPLIT")
    accum = "float32"
    S = MAX_SPLIT
    U = unroll
    split_weights = split_weights_macro(T, S)
    warps = THREADS // 32
    RW = BV // warps  # W_UV rows per warp
    NKV = DV // VEC  # 16-byte vectors per row
    KI = -(-NKV // 32)  # of them per lane
    PER = DV // THREADS  # merged columns per thread
    assert V % BV == 0 and BV % warps == 0 and DV % VEC == 0 and DV % THREADS == 0 and H <= HP

    @T.prim_func
    def mla_decode_combine_uv(
        OPart: T.Tensor((NT, HP, n_split, DV), accum),
        LsePart: T.Tensor((NT, HP, n_split), accum),
        Out: T.Tensor((NT, HP, DV), dtype),
        W: T.Tensor((H, V, DV), dtype),
        Y: T.Tensor((NT, H, V), dtype),
    ):
        with T.Kernel(V // BV, H, NT, threads=THREADS) as (vb, h, t):
            tid = T.get_thread_binding(0)
            lane = tid % 32
            warp = tid // 32
            w_loc = T.alloc_local((RW, KI, VEC), dtype)
            xb = T.alloc_local((VEC,), dtype)
            acc = T.alloc_local((RW,), accum)
            ob = T.alloc_local((U, PER), accum)
            o = T.alloc_local((PER,), accum)
            ro = T.alloc_local((PER,), dtype)
            lse = T.alloc_fragment((1, S), accum)
            wts = T.alloc_fragment((1, S), accum)
            live = T.alloc_fragment((1, S), accum)
            mx = T.alloc_fragment((1,), accum)
            total = T.alloc_fragment((1,), accum)
            n_live = T.alloc_fragment((1,), accum)
            w_s = T.alloc_shared((S,), accum)
            n_s = T.alloc_shared((1,), "int32")
            row_s = T.alloc_shared((DV,), dtype)

            # this CTA's W_UV rows: independent 16-byte loads, in flight during the merge
            for r in T.unroll(RW):
                for i in T.unroll(KI):
                    if i * 32 + lane < NKV:
                        for v in T.vectorized(VEC):
                            w_loc[r, i, v] = W[h, vb * BV + warp * RW + r, (i * 32 + lane) * VEC + v]

            if pdl:
                gate()
            # the combine's split weights: the live splits are a prefix
            split_weights(LsePart, t, h, lse, wts, live, mx, total, n_live, w_s, n_s)
            T.sync_threads()
            n = T.alloc_var("int32")
            n = n_s[0]
            if n != 1:
                # the combine's sum, split by split in order; a thread's columns of U splits in flight at once
                for d in T.unroll(PER):
                    o[d] = 0.0
                for c in T.serial(T.ceildiv(n, U)):
                    for j in T.unroll(U):
                        if c * U + j < n:
                            for d in T.vectorized(PER):
                                ob[j, d] = OPart[t, h, c * U + j, tid * PER + d]
                    for j in T.unroll(U):
                        for d in T.unroll(PER):
                            o[d] += T.if_then_else(c * U + j < n, w_s[T.min(c * U + j, S - 1)] * ob[j, d], 0.0)
                for d in T.unroll(PER):  # the combine's output rounding
                    ro[d] = T.cast(o[d], dtype)
            else:  # the one live split wrote the output row itself
                for d in T.vectorized(PER):
                    ro[d] = Out[t, h, tid * PER + d]
            for d in T.vectorized(PER):
                row_s[tid * PER + d] = ro[d]
            T.sync_threads()

            # W_UV: per lane its K vectors of its warp's rows, then the warp's lanes summed (a fixed butterfly)
            for r in T.unroll(RW):
                acc[r] = 0.0
            for i in T.unroll(KI):
                if i * 32 + lane < NKV:
                    for v in T.vectorized(VEC):
                        xb[v] = row_s[(i * 32 + lane) * VEC + v]
                    for r in T.unroll(RW):
                        for v in T.unroll(VEC):
                            acc[r] += T.cast(w_loc[r, i, v], accum) * T.cast(xb[v], accum)
            for r in T.unroll(RW):
                acc[r] = T.warp_reduce_sum(acc[r])
            if lane == 0:
                for r in T.unroll(RW):
                    Y[t, h, vb * BV + warp * RW + r] = T.cast(acc[r], dtype)

    return mla_decode_combine_uv


_kernel = _tl.kernel_cache(build_combine_uv)


def _fused_applies(q: torch.Tensor, dv: int, w_uv: torch.Tensor, fp8: bool) -> bool:
    from kernels_cuda.gemv_rows import faster_than_cublas

    T_, H, D = q.shape
    R = D - dv
    if not enabled() or q.dtype not in (torch.bfloat16, torch.float16) or T_ == 0:
        return False
    if w_uv.dim() != 3 or w_uv.dtype != q.dtype or w_uv.shape[0] != H or w_uv.shape[2] != dv:
        return False
    if w_uv.shape[1] % BV or dv % VEC or dv % THREADS or not (fp8 or (dv % 64 == 0 and R % 16 == 0)):
        return False  # latent or rope widths the attention pads: odd test shapes
    return faster_than_cublas(T_, w_uv.numel() * w_uv.element_size())


def mla_decode_uv(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, w_uv):
    """The registry's ``mla_decode_uv``: q[T, H, dv + rope] over the latent cache, then W_UV [H, V, dv] ->
    [T, H, V] (module docstring)."""
    from kernels_cuda import mla_decode as md
    from kernels_cuda.gemv_rows import head_linear

    fp8 = cache.dtype == torch.uint8
    kernel_cache = fp8 or cache.dtype == q.dtype
    if not (kernel_cache and _fused_applies(q, dv, w_uv, fp8)):
        return head_linear(md.mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv), w_uv)
    T_, H, _ = q.shape
    out, split = md._attend(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv)
    if split is None:  # no key split: the attention wrote the final output
        return head_linear(out if out.shape[1] == H else out[:, :H].contiguous(), w_uv)
    o_part, lse_part = split
    V = w_uv.shape[1]
    y = torch.empty(T_, H, V, dtype=q.dtype, device=q.device)
    kernel = _kernel(H, out.shape[1], dv, V, _tl.tl_dtype(q.dtype), *_tl.pdl_arg(T_))
    kernel(o_part, lse_part, out, w_uv.contiguous(), y)
    return y


def representative_kernels():
    """The fused merge + W_UV kernel at V2-Lite's shape (16 heads, latent 512, V 128: 64 CTAs at batch 1) and V3's
    (128 heads: 512 CTAs a token)."""
    return [
        ("mla_decode_uv H16 L512 V128 (V2-Lite merge + W_UV)",
         lambda: build_combine_uv(16, 16, 512, 128, "bfloat16")),
        ("mla_decode_uv H128 L512 V128 (V3 merge + W_UV)",
         lambda: build_combine_uv(128, 128, 512, 128, "bfloat16")),
    ]
