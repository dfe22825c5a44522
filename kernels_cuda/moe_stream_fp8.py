"""``moe_stream`` over e4m3 experts: the FP8 fused MoE for decode batches (a few rows per expert).

``fused_moe_fp8``'s pipeline (``kernels_cuda.fp8_gemm``) puts the rows in the wgmma's M (64): at V2-Lite batch 64
each expert has about 6 rows, so 90 % of each tile is padding, and every CTA streams a 64-row activation tile
beside its weight tile. On the H200 that step ran at 37.5 % of the FP8 roofline, below the bf16 step on twice the
bytes (docs/h200/s15). Here the operands are swapped as in ``kernels_cuda.moe_stream``: the ``BW`` weight rows are
the mma's M, the block's ``BT`` token rows its N (m64nBTk32 e4m3 wgmma), so a CTA streams weights and a thin
activation tile.

The launches are the pipeline's, with the same buffers and the same arithmetic (``fused_moe_fp8``'s reference,
``kernels_cpu/fp8_ops.py``):

* ``moe_align`` (``kernels_cuda.moe``) lays the (token, slot) pairs out in blocks of ``BT`` rows per expert (16,
  32 or 64: ``moe_stream.block_rows``);
* ``moe_gather_quant`` (``kernels_cuda.fp8_gemm``) gathers the rows in expert order and quantises them per 128
  channels;
* ``gemm1``: acc[BW, BT] over 128-wide k blocks, each block one e4m3 wgmma chain into a fresh float32 fragment,
  scaled by the weight tile's scale (one a CTA: ``BW`` divides 128) and each row's activation scale, and added
  (DeepGEMM's promotion). The epilogue rounds gate and up to the activation dtype, applies SiLU(gate) * up in
  float32, and writes H[rows, BW columns] through shared memory;
* ``act_quant`` quantises H per 128 channels;
* ``gemm2``: acc[BW, BT] = W2 tiles x H rows with the same promotion, each row scattered to its (token, slot) row;
* ``moe_combine`` (``kernels_cuda.moe``) sums a token's slots in slot order, in float32.

Deterministic, and a row's bits do not depend on the other rows: every dot product reduces over K in a fixed
order, no atomics on data.
"""

import torch

from deepinfer_core.config import env_flag
from kernels_cuda import _tl, moe_stream

FP8 = "float8_e4m3fn"
GROUP = 128  # channels a scale covers (activations: per row; weights: 128 x 128 tiles)


def build_stream1_fp8(E: int, C: int, I: int, BT: int, BW: int, stages: int, threads: int, dtype: str, blocks: int = 2):
    """H = silu(gate) * up for a block of ``BT`` rows and ``BW`` hidden columns: gate and up rounded to ``dtype``
    first (the reference's ``fp8_linear`` outputs), SiLU and product in float32, H rounded once."""
    T = _tl.language()
    CAP, NBLK = T.dynamic("CAP"), T.dynamic("NBLK")
    CB = C // GROUP
    accum = "float32"
    assert I % BW == 0 and GROUP % BW == 0 and C % GROUP == 0 and I % GROUP == 0

    @T.prim_func
    def moe_sgemm1_fp8(Xq: T.Tensor((CAP, C), FP8), Sx: T.Tensor((CAP, CB), accum),
                       W13: T.Tensor((E, 2 * I, C), FP8), S13: T.Tensor((E, 2 * I // GROUP, CB), accum),
                       BlockExpert: T.Tensor((NBLK,), "int32"), Hs: T.Tensor((CAP, I), dtype)):
        with T.Kernel(I // BW, NBLK, threads=threads) as (bw, blk):
            T.annotate_min_blocks_per_sm(blocks)
            T.disable_warp_group_reg_alloc()
            X_s = T.alloc_shared((BT, GROUP), FP8)
            G_s = T.alloc_shared((BW, GROUP), FP8)
            U_s = T.alloc_shared((BW, GROUP), FP8)
            part_g = T.alloc_fragment((BW, BT), accum)
            part_u = T.alloc_fragment((BW, BT), accum)
            acc_g = T.alloc_fragment((BW, BT), accum)
            acc_u = T.alloc_fragment((BW, BT), accum)
            H_s = T.alloc_shared((BT, BW), dtype)
            e = BlockExpert[blk]
            ee = T.max(e, 0)
            n_iter = T.if_then_else(e >= 0, CB, 0)
            T.clear(acc_g)
            T.clear(acc_u)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(W13[ee, bw * BW:(bw + 1) * BW, k * GROUP:(k + 1) * GROUP], G_s)
                T.copy(W13[ee, I + bw * BW:I + (bw + 1) * BW, k * GROUP:(k + 1) * GROUP], U_s)
                T.copy(Xq[blk * BT:(blk + 1) * BT, k * GROUP:(k + 1) * GROUP], X_s)
                T.gemm(G_s, X_s, part_g, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(U_s, X_s, part_u, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                sg = S13[ee, (bw * BW) // GROUP, k]
                su = S13[ee, (I + bw * BW) // GROUP, k]
                for i, j in T.Parallel(BW, BT):
                    sa = Sx[blk * BT + j, k]
                    acc_g[i, j] += part_g[i, j] * sa * sg
                    acc_u[i, j] += part_u[i, j] * sa * su
            if e >= 0:
                for i, j in T.Parallel(BW, BT):
                    g = T.cast(T.cast(acc_g[i, j], dtype), accum)
                    u = T.cast(T.cast(acc_u[i, j], dtype), accum)
                    H_s[j, i] = T.cast(g / (1.0 + T.exp(-g)) * u, dtype)
                T.copy(H_s, Hs[blk * BT:(blk + 1) * BT, bw * BW:(bw + 1) * BW])

    return moe_sgemm1_fp8


def build_stream2_fp8(E: int, C: int, I: int, BT: int, BW: int, stages: int, threads: int, dtype: str, blocks: int = 2):
    """Y[slot] = quantised H rows x W2[e]^T with the tile scales, each row stored at its (token, slot) row."""
    T = _tl.language()
    CAP, NBLK, NS = T.dynamic("CAP"), T.dynamic("NBLK"), T.dynamic("NS")
    IB = I // GROUP
    accum = "float32"
    assert C % BW == 0 and GROUP % BW == 0 and I % GROUP == 0

    @T.prim_func
    def moe_sgemm2_fp8(Hq: T.Tensor((CAP, I), FP8), Sh: T.Tensor((CAP, IB), accum),
                       W2: T.Tensor((E, C, I), FP8), S2: T.Tensor((E, T.ceildiv(C, GROUP), IB), accum),
                       BlockExpert: T.Tensor((NBLK,), "int32"), RowSlot: T.Tensor((CAP,), "int32"),
                       Y: T.Tensor((NS, C), dtype)):
        with T.Kernel(C // BW, NBLK, threads=threads) as (bw, blk):
            T.annotate_min_blocks_per_sm(blocks)
            T.disable_warp_group_reg_alloc()
            H_s = T.alloc_shared((BT, GROUP), FP8)
            W_s = T.alloc_shared((BW, GROUP), FP8)
            part = T.alloc_fragment((BW, BT), accum)
            acc = T.alloc_fragment((BW, BT), accum)
            Y_s = T.alloc_shared((BT, BW), dtype)
            e = BlockExpert[blk]
            ee = T.max(e, 0)
            n_iter = T.if_then_else(e >= 0, IB, 0)
            T.clear(acc)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(W2[ee, bw * BW:(bw + 1) * BW, k * GROUP:(k + 1) * GROUP], W_s)
                T.copy(Hq[blk * BT:(blk + 1) * BT, k * GROUP:(k + 1) * GROUP], H_s)
                T.gemm(W_s, H_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                sw = S2[ee, (bw * BW) // GROUP, k]
                for i, j in T.Parallel(BW, BT):
                    acc[i, j] += part[i, j] * Sh[blk * BT + j, k] * sw
            if e >= 0:
                for i, j in T.Parallel(BW, BT):
                    Y_s[j, i] = acc[i, j]
                for j, i in T.Parallel(BT, BW):
                    slot = RowSlot[blk * BT + j]
                    if slot >= 0:
                        Y[slot, bw * BW + i] = Y_s[j, i]

    return moe_sgemm2_fp8


_gemm1 = _tl.kernel_cache(build_stream1_fp8)
_gemm2 = _tl.kernel_cache(build_stream2_fp8)

#: BW weight rows a CTA (gemm1: BW gate and BW up rows; a divisor of 128, so one weight scale a k block), pipeline
#: stages of one 128-wide k block each, and CTAs an SM (the register budget; shared memory must fit them too)
CONFIG = {"BW1": 64, "stages1": 4, "threads1": 128, "blocks1": 2,
          "BW2": 64, "stages2": 4, "threads2": 128, "blocks2": 3}

#: ``fused_moe_fp8`` takes this path up to this mean of rows per expert (as ``moe_stream``), above it the pipeline
MAX_MEAN_ROWS = moe_stream.MAX_MEAN_ROWS

#: ``DEEPINFER_FP8_MOE_STREAM=0`` keeps decode batches on the pipeline (a benchmark's before)
STREAM_ENV = "DEEPINFER_FP8_MOE_STREAM"


def enabled() -> bool:
    return env_flag(STREAM_ENV, True)


def applies(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
            ids: torch.Tensor, max_mean_rows: int = MAX_MEAN_ROWS) -> bool:
    """Whether ``fused_moe_fp8`` takes this path (after ``moe_gemv_fp8``): a mean of at most ``max_mean_rows`` rows
    per expert, 2-byte activations, e4m3 experts with one float32 scale per 128 x 128 tile, widths the 128-wide
    scale blocks and the tiles divide (V2-Lite's, V3's)."""
    if x.dim() != 2 or ids.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return False
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != torch.float8_e4m3fn or w2.dtype != w13.dtype:
        return False
    if NT == 0 or NT * ids.shape[1] > max_mean_rows * E:
        return False
    if C % GROUP or I % GROUP or w13.shape[2] != C or tuple(w2.shape) != (E, C, I):
        return False
    if tuple(w13_scale.shape) != (E, 2 * I // GROUP, C // GROUP) or tuple(w2_scale.shape) != (E, C // GROUP,
                                                                                               I // GROUP):
        return False
    c = CONFIG
    return I % c["BW1"] == 0 and C % c["BW2"] == 0


def stream_steps(x, w13, w13_scale, w2, w2_scale, weights, ids, buffers: dict | None = None, **overrides):
    """The launches as (name, thunk) pairs plus the output thunk; ``buffers``, when given, receives the
    intermediate tensors by name, as ``fp8_gemm.moe_fp8_steps``'s (``BM`` is the block rows), so
    ``tests/fp8_moe_stages.py`` checks each launch alike. ``overrides`` replace :data:`CONFIG` keys, and ``BT``."""
    from kernels_cuda import fp8_gemm

    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    BT = overrides.get("BT") or moe_stream.block_rows(NT * ids.shape[1], E)
    c = {**CONFIG, **overrides}
    dt = _tl.tl_dtype(x.dtype)
    k_gemm1 = _gemm1(E, C, I, BT, c["BW1"], c["stages1"], c["threads1"], dt, c["blocks1"])
    k_gemm2 = _gemm2(E, C, I, BT, c["BW2"], c["stages2"], c["threads2"], dt, c["blocks2"])
    return fp8_gemm.moe_fp8_launches(x, w13, w13_scale, w2, w2_scale, weights, ids, BT, k_gemm1, k_gemm2, buffers)


def representative_kernels():
    c = CONFIG
    g1 = (c["BW1"], c["stages1"], c["threads1"], "bfloat16", c["blocks1"])
    g2 = (c["BW2"], c["stages2"], c["threads2"], "bfloat16", c["blocks2"])
    return [
        ("moe_sgemm1_fp8 V2-Lite BT16", lambda: build_stream1_fp8(66, 2048, 1408, 16, *g1)),
        ("moe_sgemm2_fp8 V3 BT32", lambda: build_stream2_fp8(257, 7168, 2048, 32, *g2)),
    ]
