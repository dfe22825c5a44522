"""Grouped MoE GEMMs for decode batches (a few rows per expert): the weights are the mma's M, the tokens its N.

Between ``moe_gemv`` (at most 8 tokens) and prefill, a decode batch gives each expert a handful of rows: at
V2-Lite batch 64, 64 x 6 routed pairs over 64 experts (about 6 rows each) plus 64 rows for each shared
expert, so nearly every expert's weights are read once per step and the layer is a bandwidth problem.
``kernels_cuda.moe``'s pipeline puts the rows in the wgmma's M (64) and the weight rows in N: 90 % of each
tile is padding and every CTA also streams a 64-row activation tile. Here the operands are swapped:

* ``moe_align`` (shared with ``kernels_cuda.moe``) lays the (token, slot) pairs out in blocks of ``BT``
  rows per expert (``BT`` = 16, 32 or 64 from the batch shape, a power of two);
* ``gemm1``: grid (I / BW weight rows, blocks). A CTA streams ``BW`` gate rows and ``BW`` up rows of its
  block's expert through a TMA pipeline (``BK`` columns a stage) and multiplies each stage by the block's
  ``BT`` activation rows: acc[BW, BT] = W[BW, BK] @ X[BT, BK]^T (wgmma m64nBTk16), the rows gathered into
  expert order first by ``kernels_cuda.moe``'s gather launch (read with TMA). The epilogue applies
  SiLU(gate) * up (V4's clamp optional), transposes through shared memory and writes H[rows, BW columns];
* ``gemm2``: grid (C / BW output columns, blocks), acc[BW, BT] = W2[BW, BK] @ H[BT, BK]^T, each of the block's
  rows scattered through shared memory to its (token, slot) row of Y (coalesced along the columns);
* ``moe_combine`` (shared) sums a token's slots in slot order, in float32.

Both GEMMs compile for 2-3 CTAs an SM (``blocks``: see ``build_gemm1``), so an SM streams several CTAs'
stages and one CTA's pipeline fill overlaps the others' loads.

Several blocks of one expert (the shared experts: a block per ``BT`` of their rows) read the same weight
rows; their CTAs run at about the same time (the grid walks the weight tiles of one block, then the next),
so the second read mostly hits L2. Deterministic, and a row's bits do not depend on the other rows: rows are
independent, every dot product reduces over K in a fixed order set by the static tiles, no atomics on data.
The size rules (this path against ``moe_gemv`` or the pipeline, and ``BT``) may change a row's rounding, as
between ``moe_gemv`` and the pipeline; the engine's batch-invariant mode replaces ``fused_moe`` altogether.
"""

import torch

from kernels_cuda import _tl, moe


def build_gemm1(E: int, C: int, I: int, BT: int, BW: int, BK: int, stages: int, threads: int, dtype: str,
                limit: float | None = None, blocks: int = 2):
    """``limit``: V4's clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit). ``blocks``: CTAs an SM
    the registers must fit. TileLang's warp-specialised pipeline otherwise compiles for one (the consumer warp
    group raised to 240 registers with setmaxnreg), so an SM streams one CTA's stages and pays each CTA's
    pipeline fill alone; here the consumer needs few registers (a BW x BT accumulator)."""
    T = _tl.language()
    CAP, NBLK = T.dynamic("CAP"), T.dynamic("NBLK")
    accum = "float32"
    assert I % BW == 0 and C % BK == 0

    @T.prim_func
    def moe_sgemm1(Xs: T.Tensor((CAP, C), dtype), W13: T.Tensor((E, 2 * I, C), dtype),
                   BlockExpert: T.Tensor((NBLK,), "int32"), Hs: T.Tensor((CAP, I), dtype)):
        with T.Kernel(I // BW, NBLK, threads=threads) as (bw, blk):
            T.annotate_min_blocks_per_sm(blocks)
            T.disable_warp_group_reg_alloc()
            X_s = T.alloc_shared((BT, BK), dtype)
            G_s = T.alloc_shared((BW, BK), dtype)
            U_s = T.alloc_shared((BW, BK), dtype)
            acc_g = T.alloc_fragment((BW, BT), accum)
            acc_u = T.alloc_fragment((BW, BT), accum)
            H_s = T.alloc_shared((BT, BW), dtype)
            e = BlockExpert[blk]
            n_iter = T.if_then_else(e >= 0, C // BK, 0)
            T.clear(acc_g)
            T.clear(acc_u)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(W13[e, bw * BW:(bw + 1) * BW, k * BK:(k + 1) * BK], G_s)
                T.copy(W13[e, I + bw * BW:I + (bw + 1) * BW, k * BK:(k + 1) * BK], U_s)
                T.copy(Xs[blk * BT:(blk + 1) * BT, k * BK:(k + 1) * BK], X_s)
                T.gemm(G_s, X_s, acc_g, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(U_s, X_s, acc_u, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if e >= 0:
                if limit is not None:
                    for i, j in T.Parallel(BW, BT):
                        acc_g[i, j] = T.min(acc_g[i, j], limit)
                        acc_u[i, j] = T.max(T.min(acc_u[i, j], limit), -limit)
                for i, j in T.Parallel(BW, BT):
                    H_s[j, i] = acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j]
                T.copy(H_s, Hs[blk * BT:(blk + 1) * BT, bw * BW:(bw + 1) * BW])

    return moe_sgemm1


def build_gemm2(E: int, C: int, I: int, BT: int, BW: int, BK: int, stages: int, threads: int, dtype: str,
                blocks: int = 2):
    T = _tl.language()
    CAP, NBLK, NS = T.dynamic("CAP"), T.dynamic("NBLK"), T.dynamic("NS")
    accum = "float32"
    assert C % BW == 0 and I % BK == 0

    @T.prim_func
    def moe_sgemm2(Hs: T.Tensor((CAP, I), dtype), W2: T.Tensor((E, C, I), dtype),
                   BlockExpert: T.Tensor((NBLK,), "int32"), RowSlot: T.Tensor((CAP,), "int32"),
                   Y: T.Tensor((NS, C), dtype)):
        with T.Kernel(C // BW, NBLK, threads=threads) as (bw, blk):
            T.annotate_min_blocks_per_sm(blocks)
            T.disable_warp_group_reg_alloc()
            H_s = T.alloc_shared((BT, BK), dtype)
            W_s = T.alloc_shared((BW, BK), dtype)
            acc = T.alloc_fragment((BW, BT), accum)
            Y_s = T.alloc_shared((BT, BW), dtype)
            e = BlockExpert[blk]
            n_iter = T.if_then_else(e >= 0, I // BK, 0)
            T.clear(acc)
            for k in T.Pipelined(n_iter, num_stages=stages):
                T.copy(W2[e, bw * BW:(bw + 1) * BW, k * BK:(k + 1) * BK], W_s)
                T.copy(Hs[blk * BT:(blk + 1) * BT, k * BK:(k + 1) * BK], H_s)
                T.gemm(W_s, H_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if e >= 0:
                for i, j in T.Parallel(BW, BT):
                    Y_s[j, i] = acc[i, j]
                for j, i in T.Parallel(BT, BW):
                    slot = RowSlot[blk * BT + j]
                    if slot >= 0:
                        Y[slot, bw * BW + i] = Y_s[j, i]

    return moe_sgemm2


_gemm1 = _tl.kernel_cache(build_gemm1)
_gemm2 = _tl.kernel_cache(build_gemm2)

#: tiles (measured on the H200 at V2-Lite, examples/moe_small_bench.py): BW weight rows a CTA (gemm1: BW gate
#: and BW up rows), BK columns a pipeline stage; BT (rows a block) comes from the batch shape
#: and ``blocks`` CTAs an SM (the register budget; shared memory must fit them too)
CONFIG = {"BW1": 64, "BK1": 128, "stages1": 3, "threads1": 128, "blocks1": 2,
          "BW2": 64, "BK2": 128, "stages2": 3, "threads2": 128, "blocks2": 3}

#: rows a block, by the mean rows per expert (slots / experts)
BT_CHOICES = (16, 32, 64)

#: gemm1's k tile and stages from 32-row blocks on (V2-Lite b256 / b512 on the H200, docs/moe_stream.md round 2:
#: 208.4 / 223.5 us a layer against 214.2 / 231.0 with BK 128 x 3 stages; at 16-row blocks BK 64 cost 12 us more)
WIDE_BLOCKS = {"BK1": 64, "stages1": 4}


def tiles(BT: int, overrides: dict | None = None) -> dict:
    """:data:`CONFIG` for blocks of ``BT`` rows (:data:`WIDE_BLOCKS` from 32 rows), then ``overrides``."""
    return {**CONFIG, **(WIDE_BLOCKS if BT >= 32 else {}), **(overrides or {})}


def block_rows(n_slots: int, E: int) -> int:
    """BT: the mean rows per expert rounded up to 16, 32 or 64 (a size rule on shapes only)."""
    mean = -(-n_slots // E)
    return next((b for b in BT_CHOICES if mean <= b), BT_CHOICES[-1])


#: ``fused_moe`` takes this path up to this mean of rows per expert (slots / experts): decode batches; above it
#: prefill's matrix-bound tiles (``kernels_cuda.moe.LARGE``)
MAX_MEAN_ROWS = 64


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
            max_mean_rows: int = MAX_MEAN_ROWS) -> bool:
    """Whether ``fused_moe`` takes this path (after ``moe_gemv``): a mean of at most ``max_mean_rows`` rows per
    expert, 2-byte activations and weights of that dtype, widths the tiles divide (V2-Lite, V3 and V4's do)."""
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    if NT == 0 or NT * ids.shape[1] > max_mean_rows * E or ids.dim() != 2:
        return False
    c = CONFIG
    return I % c["BW1"] == 0 and C % c["BK1"] == 0 and C % c["BW2"] == 0 and I % c["BK2"] == 0


def stream_steps(x, w13, w2, weights, ids, limit: float | None = None, **overrides):
    """The launches as (name, thunk) pairs plus the output thunk (``overrides`` replace :data:`CONFIG` keys, and
    ``BT``; ``examples/moe_small_bench.py`` sweeps them)."""
    NT, C = x.shape
    E, two_i, _ = w13.shape
    I, K = two_i // 2, ids.shape[1]
    NS = NT * K
    BT = overrides.get("BT") or block_rows(NS, E)
    c = tiles(BT, overrides)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    dt = _tl.tl_dtype(x.dtype)
    dev = x.device
    nblk = (NS + BT - 1) // BT + min(E, NS)
    cap = nblk * BT
    ids2 = ids.to(torch.int64).contiguous()
    ids_flat = ids2.view(-1)
    wts = weights.to(torch.float32).contiguous()
    row_slot = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nblk, dtype=torch.int32, device=dev)
    hs = torch.empty(cap, I, dtype=x.dtype, device=dev)
    y = torch.empty(NS, C, dtype=x.dtype, device=dev)
    out = torch.empty(NT, C, dtype=x.dtype, device=dev)
    k_align = moe._align(E, BT)
    tiles1 = (BT, c["BW1"], c["BK1"], c["stages1"], c["threads1"], dt, limit, c["blocks1"])
    k_gemm2 = _gemm2(E, C, I, BT, c["BW2"], c["BK2"], c["stages2"], c["threads2"], dt, c["blocks2"])
    k_combine = moe._combine(C, K, E, dt)
    xs = torch.empty(cap, C, dtype=x.dtype, device=dev)
    k_gather, k_gemm1 = moe._gather(C, K, BT, dt), _gemm1(E, C, I, *tiles1)
    steps = [("align", lambda: k_align(ids_flat, row_slot, block_expert)),
             ("gather", lambda: k_gather(x, row_slot, block_expert, xs)),
             ("gemm1", lambda: k_gemm1(xs, w13, block_expert, hs))]
    steps.append(("gemm2", lambda: k_gemm2(hs, w2, block_expert, row_slot, y)))
    steps.append(("combine", lambda: k_combine(y, wts, ids2, out)))
    return steps, (lambda: out)


def fused_moe_stream(x, w13, w2, weights, ids, limit: float | None = None, **overrides) -> torch.Tensor:
    steps, finish = stream_steps(x, w13, w2, weights, ids, limit, **overrides)
    for _, step in steps:
        step()
    return finish()


def representative_kernels():
    c = CONFIG
    E, C, I = 66, 2048, 1408  # V2-Lite with the 2 shared experts folded in

    def g1(bt, e=E, cc=C, ii=I, limit=None):
        t = tiles(bt)
        return lambda: build_gemm1(e, cc, ii, bt, t["BW1"], t["BK1"], t["stages1"], t["threads1"], "bfloat16", limit,
                                   t["blocks1"])

    def g2(bt, e=E, cc=C, ii=I):
        return lambda: build_gemm2(e, cc, ii, bt, c["BW2"], c["BK2"], c["stages2"], c["threads2"], "bfloat16",
                                   c["blocks2"])

    # one shape each (V3's and V4's widths are the same code with other constants; the H200 tests run them)
    return [
        ("moe_sgemm1 V4 clamped BT16", g1(16, 256, 4096, 2048, 10.0)),
        ("moe_sgemm2 V2-Lite BT32", g2(32)),
        ("moe_sgemm1 V2-Lite BT32 (wide-block tiles)", g1(32)),
    ]
