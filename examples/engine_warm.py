"""Compile, without a GPU, the TileLang kernels that the engine's bf16 forward uses for a model shape
(``DEEPINFER_TL_DRYRUN=1``: kernels are built into ``TILELANG_CACHE_DIR`` but not run).

    DEEPINFER_TL_DRYRUN=1 TILELANG_CACHE_DIR=.gpu/tlcache python examples/engine_warm.py --shapes v2-lite,v3-slice

Each op is called with empty CPU tensors of the shapes the model passes it (the ops pick their own
tile configurations from those shapes, as they do on the GPU), at token counts that cover every
configuration switch: every decode batch up to the largest captured graph (split-KV or not, and the
combine's tiles for small and mid-size split grids), every GEMV row count (decode batches, and prefill
chunks of up to ``gemv.MAX_M`` rows, kv_b_proj's included), the MoE token counts where ``fused_moe``'s
size rules change (``moe_token_counts``), prefill chunks up to 8192 tokens, and speculative verify steps
of up to ``--spec-k`` drafts a request (default 4, the engine's; 0: none): mla_decode's ragged kernel
(several query rows a request) at each split and combine configuration (``verify_token_counts``), and
the async launch's ``draft_lengths`` at k columns; with ``--mtp``, DSpark's MTP draft (``warm_mtp``); with ``--pdl``,
the ``DEEPINFER_PDL=1`` builds of the batch-1 chain and the FP8 batch-1 ops (``warm_pdl_b1``). The
weight-streaming MoE's down kernel is compiled in each of its variants (``moe_gemv.DOWNS``: ``warm_moe_downs``),
so a device run may pick one with ``DEEPINFER_MOE_DOWN`` from the packed cache.
``kernel_warm.py --engine-shapes`` runs this as part of the cache pack.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from random_checkpoint import SHAPES, shape_config  # noqa: E402

from deepinfer_core.models.config import ModelConfig  # noqa: E402
from deepinfer_core.models.deepseek import MoE  # noqa: E402

TOKENS = (1, 64, 256, 2048, 8192)  # MoE and norm token counts (the largest: the longest prefill chunk)
SPEC_K = 4  # the speculative draft length the engine defaults to (engine/speculative.py) and the device scripts run


def decode_batches() -> range:
    """Every decode batch up to the largest captured graph (``graph_runner.DEFAULT_BATCH_SIZES``): mla_decode's
    split count and combine tiles come from the batch and the SM count (``choose_split``), and both kinds of
    grid (split or not, a combine for small or for mid-size grids) recur at every size past it."""
    from deepinfer_core.engine.graph_runner import DEFAULT_BATCH_SIZES

    return range(1, max(DEFAULT_BATCH_SIZES) + 1)


def verify_token_counts(cfg: ModelConfig, k: int, block_size: int) -> list[int]:
    """The first token count of each ``mla_decode`` configuration a speculative verify step of draft length ``k``
    can take (none when ``k`` is 0). Such a step has up to the largest captured batch of requests
    (``decode_batches``) of up to ``k + 1`` query rows each (a verify graph's n x R rows, or an eager step's ragged
    rows), so mla_decode runs its ragged kernel; by the op's own size rules, its split count comes from the grid of
    head tiles x tokens (``choose_split``), and the combine's tiles from whether that grid is small."""
    from kernels_cuda import _tl
    from kernels_cuda import mla_decode as md

    H, L, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    c = md.config(md._round(H, 16), md._round(L, 64) + md._round(R, 16), md._round(L, 64), block_size)
    h_p, sms = md._round(H, c["BH"]), _tl.num_sms(0)
    seen, counts = set(), []
    for T in range(2, max(decode_batches()) * (k + 1) + 1) if k > 0 else ():
        split = md.choose_split(h_p // c["BH"] * T, sms) > 1
        key = (split, split and h_p * T <= 2 * sms)
        if key not in seen:
            seen.add(key)
            counts.append(T)
    return counts


def moe_token_counts(E: int, K: int, max_tokens: int = TOKENS[-1]) -> list[int]:
    """The first token count of each ``fused_moe`` configuration for ``E`` experts (routed + folded shared) and
    ``K`` slots a token, by its size rules: every count of the weight-streaming path (``moe_gemv``: row buckets,
    CUDA or tensor cores at one token), each block-row count of ``moe_stream`` (rows per expert: small expert
    counts reach all three at a few dozen tokens), each tile configuration of the pipeline (``moe``)."""
    from kernels_cuda import moe, moe_gemv, moe_stream

    seen, counts = set(), []
    for T in range(1, max_tokens + 1):
        NS = T * K
        if T <= moe_gemv.MAX_TOKENS and NS <= moe_gemv.THREADS:
            key = ("gemv", T)
        elif NS <= moe_stream.MAX_MEAN_ROWS * E:
            key = ("stream", moe_stream.block_rows(NS, E))
        else:
            key = ("pipeline", tuple(sorted(moe.choose_config(NS, E).items())))
        if key not in seen:
            seen.add(key)
            counts.append(T)
    return counts


def warm_moe_downs(x, w13, w2, weights, ids, limit: float | None = None) -> list[str]:
    """Each down kernel of the weight-streaming MoE (``moe_gemv.DOWNS``; ``fused_moe`` compiles only the one that
    ``CONFIG`` / ``DEEPINFER_MOE_DOWN`` picks) where ``fused_moe`` takes that path for these operands."""
    from kernels_cuda import moe_gemv

    if not moe_gemv.applies(x, w13, w2, weights, ids):
        return []
    for down in moe_gemv.DOWNS:
        moe_gemv.small_steps(x, w13, w2, weights, ids, None if limit is None else float(limit), down=down)[0][1][1]()
    return [f"moe_down {'/'.join(moe_gemv.DOWNS)} T={x.shape[0]}"]


def decode_query(cfg: ModelConfig, M: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MLA's query [M, H, N + R] laid out as ``MLA.forward`` has it (the ops compile per stride): with q_lora, the
    q_b projection's own output (contiguous); without, the first H * (N + R) columns of the fused q + kv_a
    projection's output (rows at its stride)."""
    H, NR = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        return torch.empty(M, H * NR, dtype=dtype).view(M, H, NR)
    xa = torch.empty(M, H * NR + cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype)
    return xa[:, : H * NR].view(M, H, NR)


def warm_shape(cfg: ModelConfig, block_size: int = 64, dtype: torch.dtype = torch.bfloat16,
               unfused: bool = False, spec_k: int = SPEC_K) -> list[str]:
    """Call every kernel op of the engine's forward for ``cfg`` once per configuration; returns their names.
    ``unfused``: also the ops of the ``set_decode_fusion(False)`` debug path (k_pe's rope on the projection's
    rows, the shared experts' own GEMVs and activation, the routed experts' ``fused_moe`` without them).
    ``spec_k``: also speculative verify steps of up to ``spec_k`` drafts a request (0: none): mla_decode over
    several query rows a request (``verify_token_counts``) and the async launch's ``draft_lengths``; their GEMVs
    and MoE run at token counts the size rules below already cover."""
    from kernels_cuda.draft_lengths import draft_lengths
    from kernels_cuda.elementwise import rope, silu_and_mul
    from kernels_cuda.gemv import MAX_M, linear, linear_f32
    from kernels_cuda.gemv_rows import head_linear, mla_q_absorb, mla_q_absorb_kv_write
    from kernels_cuda.kv_cache import paged_kv_write
    from kernels_cuda.mla_decode import mla_decode
    from kernels_cuda.mla_decode_uv import mla_decode_uv
    from kernels_cuda.mla_kv_write import mla_kv_write
    from kernels_cuda.mla_prefill import mla_prefill
    from kernels_cuda.moe import fused_moe
    from kernels_cuda.moe_gate import add_rms_norm_moe_gate
    from kernels_cuda.moe_route import moe_gate, moe_route
    from kernels_cuda.norm import add_rms_norm, rms_norm
    from kernels_cuda.norm_gemv import add_rms_norm_linear
    from kernels_cuda.sampling import greedy_sample, sample

    e = torch.empty
    C, H, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    done = []
    for rows in (1, 8):  # (one row: the decode chain's build, with programmatic dependent launch on sm_90+)
        for width in {C, L, cfg.q_lora_rank or L}:
            rms_norm(e(rows, width, dtype=dtype), e(width, dtype=dtype), 1e-6)
        add_rms_norm(e(rows, C, dtype=dtype), e(rows, C, dtype=dtype), e(C, dtype=dtype), 1e-6)
    done += [f"rms_norm C={width}" for width in {C, L, cfg.q_lora_rank or L}]
    cache = e(16, block_size, L + R, dtype=dtype)
    paged_kv_write(cache, torch.zeros(4, dtype=torch.long), e(4, L + R, dtype=dtype))
    done += [f"add_rms_norm C={C}", f"paged_kv_write bs={block_size}"]
    # the fused q(_a) + kv_a projection's output: kv_a is its last L + R columns (a strided slice)
    q_cols = cfg.q_lora_rank or H * (N + R)
    xa = e(4, q_cols + L + R, dtype=dtype)
    mla_kv_write(xa[:, q_cols:], e(L, dtype=dtype), 1e-6, torch.zeros(4, dtype=torch.long), e(16, R), cache,
                 torch.zeros(4, dtype=torch.long))
    done.append(f"mla_kv_write stride={q_cols + L + R}")
    for res in (None, e(1, C, dtype=dtype)):  # the first layer's input norm has no residual
        add_rms_norm_linear(e(1, C, dtype=dtype), res, e(C, dtype=dtype), 1e-6, e(q_cols + L + R, C, dtype=dtype))
    if cfg.first_k_dense_replace:  # a dense layer's post-attention norm + w13, and its activation
        add_rms_norm_linear(e(1, C, dtype=dtype), e(1, C, dtype=dtype), e(C, dtype=dtype), 1e-6,
                            e(2 * cfg.intermediate_size, C, dtype=dtype))
        silu_and_mul(e(8, 2 * cfg.intermediate_size, dtype=dtype))
        done.append(f"silu_and_mul I={cfg.intermediate_size}")
    done.append("add_rms_norm_linear (input norm + q + kv_a, dense norm + w13, at one row)")
    # small-M projections (decode batches up to MAX_M): every GEMM weight of the forward, and the router
    E_r = cfg.n_routed_experts
    weights = {(q_cols + L + R, C), (C, H * V), (2 * cfg.intermediate_size, C), (C, cfg.intermediate_size),
               (cfg.vocab_size, C)}
    if cfg.q_lora_rank:
        weights.add((H * (N + R), cfg.q_lora_rank))
    SI = (cfg.n_shared_experts or 0) * cfg.moe_intermediate_size
    if unfused and SI:  # the shared experts as their own MLP
        weights |= {(2 * SI, C), (C, SI)}
        silu_and_mul(e(8, 2 * SI, dtype=dtype))
        done.append(f"silu_and_mul I={SI}")
    if unfused:  # the cache entry's k_pe rotated on the projection's rows
        for M in (1, 8):
            rope(e(M, q_cols + L + R, dtype=dtype)[:, q_cols + L:][:, None], torch.zeros(M, dtype=torch.long),
                 e(16, R))
        done.append(f"rope k_pe stride={q_cols + L + R}")
    w_uk, w_uv = e(H, L, N, dtype=dtype), e(H, V, L, dtype=dtype)
    kv_b = e(H * (N + V), L, dtype=dtype)
    for M in range(1, MAX_M + 1):  # every GEMV row count (which kernel takes M rows depends on M, not its bucket)
        for n_out, k_in in sorted(weights):
            linear(e(M, k_in, dtype=dtype), e(n_out, k_in, dtype=dtype))
        # prefill: kv_b_proj over the latents of the chunk's context, a slice of its [latent | rope] cache entries
        linear(e(M, L + R, dtype=dtype)[:, :L], kv_b)
        if E_r:
            linear_f32(e(M, C, dtype=dtype), e(E_r, C))
        # MLA's decode query (q_b's output, or the fused projection's first columns) and W_UV
        q = decode_query(cfg, M, dtype)
        mla_q_absorb(q, w_uk, torch.zeros(M, dtype=torch.long), e(16, R))
        mla_q_absorb_kv_write(q, w_uk, torch.zeros(M, dtype=torch.long), e(16, R), e(M, q_cols + L + R, dtype=dtype)[
            :, q_cols:], e(L, dtype=dtype), 1e-6, cache, torch.zeros(M, dtype=torch.long))
        head_linear(q[..., :N], w_uk)
        head_linear(e(M, H, L, dtype=dtype), w_uv)
        done.append(f"gemv M={M} x {len(weights) + bool(E_r)} weights, kv_b_proj, mla_q_absorb, W_UV")
    for B in decode_batches():
        tables = torch.zeros(B, 4, dtype=torch.int32)
        # decode fusion's attention + W_UV (the merge of the key splits and W_UV in one kernel at small batches),
        # and mla_decode alone (its combine: larger batches, DEEPINFER_UV_FUSION=0, fusion off)
        for op in (mla_decode, lambda *a: mla_decode_uv(*a, w_uv)):
            op(e(B, H, L + R, dtype=dtype), cache, tables, torch.arange(B + 1), torch.full((B,), 64), 0.1, L)
    done.append(f"mla_decode, mla_decode_uv H={H} B=1..{B}")
    if spec_k:
        counts = verify_token_counts(cfg, spec_k, block_size)
        for T in counts:  # requests of k + 1 rows, the last one short
            B = -(-T // (spec_k + 1))
            cu = (torch.arange(B + 1) * (spec_k + 1)).clamp_(max=T)
            for op in (mla_decode, lambda *a: mla_decode_uv(*a, w_uv)):
                op(e(T, H, L + R, dtype=dtype), cache, torch.zeros(B, 4, dtype=torch.int32), cu, torch.full((B,), 64),
                   0.1, L)
        # the async launch pads the drafts' confidences to k columns (spec_async)
        draft_lengths(e(4, spec_k), torch.zeros(4, dtype=torch.long), 8, 0.0)
        done += [f"mla_decode(_uv) H={H} verify T={counts} (k={spec_k})", f"draft_lengths K={spec_k}"]
    S = 256
    for M in (1, S):  # prefill rows' q_pe (one row's view has a contiguous query's row stride)
        q = decode_query(cfg, M, dtype)
        rope(q[..., N:], torch.zeros(M, dtype=torch.long), e(16, R))
        done.append(f"rope q_pe H={H} stride={q.stride(0)}")
    cu = torch.tensor([0, S])
    mla_prefill(e(S, H, N + R, dtype=dtype), e(S, H, N + R, dtype=dtype), e(S, H, V, dtype=dtype), cu, cu, 0.1)
    done.append(f"mla_prefill H={H}")
    if cfg.n_routed_experts:
        with torch.device("meta"):
            moe = MoE(None, cfg, cfg.first_k_dense_replace)  # its routing constants (no memory)
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        S = cfg.n_shared_experts or 0  # folded in as always-selected experts E.. (MoE._fold_shared_experts)
        w13, w2 = e(E + S, 2 * I, C, dtype=dtype), e(E + S, C, I, dtype=dtype)
        bias = e(E) if moe.e_score_correction_bias is not None else None
        gate = e(E, C)
        for T in sorted(set(TOKENS) | set(moe_token_counts(E + S, k + S))):
            moe_route(e(T, E), bias, k, cfg.scoring_func, moe.n_group, cfg.topk_group, moe.group_score,
                      moe.renormalize, moe.scale)
            moe_gate(e(T, C, dtype=dtype), gate, bias, k, cfg.scoring_func, moe.n_group, cfg.topk_group,
                     moe.group_score, moe.renormalize, moe.scale, S, dtype)
            add_rms_norm_moe_gate(e(T, C, dtype=dtype), e(T, C, dtype=dtype), e(C, dtype=dtype), 1e-6, gate, bias, k,
                                  cfg.scoring_func, moe.n_group, cfg.topk_group, moe.group_score, moe.renormalize,
                                  moe.scale, S, dtype)
            moe_args = (e(T, C, dtype=dtype), w13, w2, e(T, k + S, dtype=dtype),
                        torch.zeros(T, k + S, dtype=torch.long))
            fused_moe(*moe_args)
            done.append(f"moe E={E}+{S} shared T={T}")
            done += warm_moe_downs(*moe_args)
        if unfused:  # the routed experts alone
            counts = sorted(set(TOKENS) | set(moe_token_counts(E, k)))
            for T in counts:
                fused_moe(e(T, C, dtype=dtype), w13[:E], w2[:E], e(T, k, dtype=dtype),
                          torch.zeros(T, k, dtype=torch.long))
            done.append(f"moe E={E} unfused T={counts}")
    B = 4
    sample(e(B, cfg.vocab_size), torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B), torch.zeros(B),
           torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
    done.append("sample")
    for B in (1, 4):  # greedy decoding's draw: the batch-1 build (programmatic dependent launch) and the others'
        greedy_sample(e(B, cfg.vocab_size))
    done.append("greedy_sample")
    return done


def warm_pdl_b1(cfg: ModelConfig, block_size: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The batch-1 decode chain's kernels as ``DEEPINFER_PDL=1`` builds them (programmatic dependent launch:
    ``kernels_cuda/_tl.py``; unset, the bf16 ones are already the default builds), so a device run can compare it
    from the packed cache."""
    from unittest import mock

    from kernels_cuda import _tl

    with mock.patch.dict(os.environ, {_tl.PDL_ENV: "1"}):
        return [f"pdl {name}" for name in warm_b1_chain(cfg, block_size, dtype)]


def b1_projections(cfg: ModelConfig) -> set[tuple[int, int]]:
    """(out, in) of the projections a batch-1 step runs as plain GEMVs in either weight dtype: o_proj, a dense
    layer's w2 and q_b (with q_lora)."""
    C, H, N, R = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    weights = {(C, H * cfg.v_head_dim)}
    if cfg.first_k_dense_replace:
        weights.add((C, cfg.intermediate_size))
    if cfg.q_lora_rank:
        weights.add((H * (N + R), cfg.q_lora_rank))
    return weights


def warm_b1_chain(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> list[str]:
    """One call of each op of a batch-1 decode step (its fused ops where they apply), and the attention ops of the
    suite's decode batches 64 and 256."""
    from kernels_cuda.gemv import linear
    from kernels_cuda.gemv_rows import mla_q_absorb_kv_write
    from kernels_cuda.mla_decode import mla_decode
    from kernels_cuda.mla_decode_uv import mla_decode_uv
    from kernels_cuda.moe import fused_moe
    from kernels_cuda.moe_gate import add_rms_norm_moe_gate
    from kernels_cuda.norm import add_rms_norm, rms_norm
    from kernels_cuda.norm_gemv import add_rms_norm_linear

    e = torch.empty
    C, H, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    q_cols = cfg.q_lora_rank or H * (N + R)
    cache = e(16, block_size, L + R, dtype=dtype)
    for res in (None, e(1, C, dtype=dtype)):
        add_rms_norm_linear(e(1, C, dtype=dtype), res, e(C, dtype=dtype), 1e-6, e(q_cols + L + R, C, dtype=dtype))
    weights = b1_projections(cfg) | {(cfg.vocab_size, C)}  # (bf16: the norm + q / kv_a and w13 GEMVs are fused)
    if cfg.first_k_dense_replace:
        add_rms_norm_linear(e(1, C, dtype=dtype), e(1, C, dtype=dtype), e(C, dtype=dtype), 1e-6,
                            e(2 * cfg.intermediate_size, C, dtype=dtype))
    for n_out, k_in in sorted(weights):
        linear(e(1, k_in, dtype=dtype), e(n_out, k_in, dtype=dtype))
    for width in {C, L, cfg.q_lora_rank or L}:  # (norm.py's kernels trigger the next launch: prefill's norms)
        rms_norm(e(1, width, dtype=dtype), e(width, dtype=dtype), 1e-6)
    add_rms_norm(e(1, C, dtype=dtype), e(1, C, dtype=dtype), e(C, dtype=dtype), 1e-6)
    q = decode_query(cfg, 1, dtype)
    mla_q_absorb_kv_write(q, e(H, L, N, dtype=dtype), torch.zeros(1, dtype=torch.long), e(16, R),
                          e(1, q_cols + L + R, dtype=dtype)[:, q_cols:], e(L, dtype=dtype), 1e-6, cache,
                          torch.zeros(1, dtype=torch.long))
    for B in (1, 64, 256):  # (and the attention of the suite's larger batches: its split and unsplit grids)
        for op in (mla_decode, lambda *a: mla_decode_uv(*a, e(H, V, L, dtype=dtype))):
            op(e(B, H, L + R, dtype=dtype), cache, torch.zeros(B, 4, dtype=torch.int32), torch.arange(B + 1),
               torch.full((B,), 64), 0.1, L)
        if B > 1:
            pos = torch.zeros(B, dtype=torch.long)
            mla_q_absorb_kv_write(decode_query(cfg, B, dtype), e(H, L, N, dtype=dtype), pos, e(16, R),
                                  e(B, q_cols + L + R, dtype=dtype)[:, q_cols:], e(L, dtype=dtype), 1e-6, cache, pos)
    done = ["add_rms_norm_linear", f"gemv x {len(weights)}", "(add_)rms_norm", "mla_q_absorb_kv_write",
            "mla_decode_uv"]
    if cfg.n_routed_experts:
        with torch.device("meta"):
            moe = MoE(None, cfg, cfg.first_k_dense_replace)
        E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        S = cfg.n_shared_experts or 0
        bias = e(E) if moe.e_score_correction_bias is not None else None
        add_rms_norm_moe_gate(e(1, C, dtype=dtype), e(1, C, dtype=dtype), e(C, dtype=dtype), 1e-6, e(E, C), bias, k,
                              cfg.scoring_func, moe.n_group, cfg.topk_group, moe.group_score, moe.renormalize,
                              moe.scale, S, dtype)
        fused_moe(e(1, C, dtype=dtype), e(E + S, 2 * I, C, dtype=dtype), e(E + S, C, I, dtype=dtype),
                  e(1, k + S, dtype=dtype), torch.zeros(1, k + S, dtype=torch.long))
        done += ["add_rms_norm_moe_gate", "moe"]
    return done + warm_b1_fp8(cfg, dtype)


def warm_b1_fp8(cfg: ModelConfig, dtype: torch.dtype, tokens: tuple[int, ...] = (1,)) -> list[str]:
    """The decode step's ops on FP8 weights (``weight_dtype = "fp8"``: e4m3 with 128 x 128 block scales) at each of
    ``tokens`` (the batch-1 step by default): the projections (GEMV, or activation quantisation + the blockwise
    GEMM) and the MoE (two launches, or the six of ``moe_stream_fp8`` / the pipeline)."""
    from kernels_cuda.fp8_gemm import fp8_linear, fused_moe_fp8

    e, f8 = torch.empty, torch.float8_e4m3fn
    C, H, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_cols = cfg.q_lora_rank or H * (cfg.qk_nope_head_dim + R)
    weights = b1_projections(cfg) | {(q_cols + L + R, C)}  # (FP8: q / kv_a and w13 are GEMVs of their own)
    if cfg.first_k_dense_replace:
        weights.add((2 * cfg.intermediate_size, C))
    done = []
    for T in tokens:
        for n_out, k_in in sorted(weights):
            fp8_linear(e(T, k_in, dtype=dtype), e(n_out, k_in, dtype=f8), e(-(-n_out // 128), -(-k_in // 128)))
        done.append(f"fp8_linear x {len(weights)} T={T}")
        if cfg.n_routed_experts:
            E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
            S = cfg.n_shared_experts or 0
            fused_moe_fp8(e(T, C, dtype=dtype), e(E + S, 2 * I, C, dtype=f8), e(E + S, 2 * I // 128, C // 128),
                          e(E + S, C, I, dtype=f8), e(E + S, C // 128, I // 128), e(T, k + S, dtype=dtype),
                          torch.zeros(T, k + S, dtype=torch.long))
            done.append(f"moe fp8 T={T}")
    return done


def warm_mtp(cfg: ModelConfig, block_size: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """DSpark's MTP draft (``plugins/dspark/draft.py``): its input projection ``eh_proj`` [C, 2C] and its layer's lean
    decode path (``plugins/dspark/lean.py``: the folded q / input / output GEMMs, the rope of the query's and the
    key's rope parts in one tensor) at every GEMV row count. The layer is built on the meta device (no memory) and
    run as the draft runs it, so the folded weights' shapes are the plugin's own; its norms, cache write, MoE and
    catch-up forward (a target-shaped decoder layer) are the target's configurations, warmed by ``warm_shape``."""
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.models.deepseek import DecoderLayer
    from deepinfer_core.models.loader import construct
    from kernels_cpu import ReferenceKernels
    from kernels_cuda import CudaKernels
    from kernels_cuda.gemv import MAX_M
    from plugins.dspark.lean import LeanDecoder, context_slot_table

    k, meta, C = Kernels(CudaKernels, ReferenceKernels), torch.device("meta"), cfg.hidden_size
    layer = construct(lambda: DecoderLayer(k, cfg, cfg.num_hidden_layers), dtype, meta)  # past the last layer
    layer.self_attn.post_load()
    if hasattr(layer.mlp, "post_load"):
        layer.mlp.post_load()
    lean = LeanDecoder(None, [layer], torch.empty(16, cfg.qk_rope_head_dim, device=meta), cfg.rms_norm_eps)
    eh_proj = torch.empty(C, 2 * C, dtype=dtype, device=meta)
    cache = torch.empty(16, block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=meta)
    with torch.inference_mode(), torch.device(meta):
        for T in range(1, MAX_M + 1):
            x = k.linear(torch.empty(T, 2 * C, dtype=dtype), eh_proj)
            ctx = context_slot_table(torch.zeros(T, 2, dtype=torch.int32), block_size)
            lean.run_layers(x, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), ctx, [cache])
    return [f"mtp eh_proj + lean decode M=1..{MAX_M}"]


def warm_v4(cfg, block_size: int = 256, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The DeepSeek-V4 ops of ``v4_suite.py``'s forward (``cfg`` a ``V4Config``), one call per configuration."""
    from deepinfer_core.models.deepseek_v4 import cache_layout
    from kernels_cuda.elementwise import rope
    from kernels_cuda.kv_cache import paged_kv_write
    from kernels_cuda.norm import rms_norm
    from kernels_cuda.sampling import greedy_sample, sample
    from kernels_cuda.v4_attention import v4_sparse_attention
    from kernels_cuda.v4_compress import v4_compress
    from kernels_cuda.v4_indexer import v4_indexer_topk
    from kernels_cuda.v4_mhc import mhc_post, mhc_pre
    from kernels_cuda.v4_moe import fused_moe_clamped, moe_route_v4

    e, f32, z = torch.empty, torch.float32, torch.zeros
    C, H, D, R, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.rope_dim, cfg.hc_mult
    HI, DI, m, m2, W = cfg.index_n_heads, cfg.index_head_dim, cfg.compress_csa, cfg.compress_hca, cfg.sliding_window
    done = []
    for width in {C, cfg.q_lora_rank, D}:
        rms_norm(e(8, width, dtype=dtype), e(width, dtype=dtype), 1e-6)
        done.append(f"rms_norm C={width}")
    for heads, dim in ((H, D), (1, D), (HI, DI)):
        rope(e(4, heads, dim, dtype=dtype)[..., -R:], z(4, dtype=torch.long), e(16, R, dtype=f32))
        done.append(f"rope {heads}x{dim}")
    caches = {}
    for g in cache_layout(cfg).groups:
        caches[g.name] = e(4, g.entries_per_block(block_size), g.entry_dim, dtype=g.dtype or dtype)
        paged_kv_write(caches[g.name], z(4, dtype=torch.long), e(4, g.entry_dim, dtype=f32))
        done.append(f"paged_kv_write {g.name}")
    tab, pos, seq = z(4, 8, dtype=torch.int32), z(4, dtype=torch.long), z(4, dtype=torch.long)
    sinks = e(H, dtype=f32)
    for splits in (1, 2):  # the one-pass kernel (large batches, prefill) and split-KV + combine (small batches)
        v4_sparse_attention(e(4, H, D, dtype=dtype), caches["swa"], tab, None, None, None, seq, pos, W, sinks,
                            D**-0.5, splits=splits)
        for group, ids in (("csa", z(4, cfg.index_topk, dtype=torch.long)), ("hca", z(4, 16, dtype=torch.long))):
            v4_sparse_attention(e(4, H, D, dtype=dtype), caches["swa"], tab, caches[group], tab, ids, seq, pos, W,
                                sinks, D**-0.5, splits=splits)
    done.append("v4_sparse_attention swa/csa/hca, unsplit and split-KV")
    cs = e(16, R, dtype=f32)
    v4_compress(caches["csa_state"], tab, seq, pos, e(m, 2 * D, dtype=f32), e(D, dtype=f32), 1e-6, cs, 0)
    v4_compress(caches["csa_state"], tab, seq, pos, e(m, 2 * DI, dtype=f32), e(DI, dtype=f32), 1e-6, cs, 4 * D)
    v4_compress(caches["hca_state"], tab, seq, pos, e(m2, D, dtype=f32), e(D, dtype=f32), 1e-6, cs, 0)
    v4_indexer_topk(e(4, HI, DI, dtype=dtype), e(4, HI, dtype=f32), caches["csa"][..., D:], tab, seq, pos, m,
                    cfg.index_topk, DI**-0.5)
    done += ["v4_compress csa/indexer/hca", "v4_indexer_topk"]
    h = e(4, n, C, dtype=dtype)
    x, post, comb = mhc_pre(h, e((2 + n) * n, n * C, dtype=f32), e((2 + n) * n, dtype=f32), e(3, dtype=f32),
                            cfg.hc_sinkhorn_iters, 1e-6, 1e-6)
    mhc_post(x, h, post, comb)
    done.append("mhc_pre/post")
    E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    w13, w2 = e(E, 2 * I, C, dtype=dtype), e(E, C, I, dtype=dtype)
    for T in (1, 8192 if E > 64 else 2048):  # both tile configurations of the fused MoE
        moe_route_v4(e(T, E, dtype=f32), e(E, dtype=f32), None, k, cfg.scoring_func, 1.5)
        moe_route_v4(e(T, E, dtype=f32), None, z(T, k, dtype=torch.long), k, cfg.scoring_func, 1.5)
        moe_args = (e(T, C, dtype=dtype), w13, w2, e(T, k, dtype=dtype), z(T, k, dtype=torch.long))
        fused_moe_clamped(*moe_args, cfg.swiglu_limit)
        done.append(f"moe_route_v4 + fused_moe_clamped T={T}")
        done += warm_moe_downs(*moe_args, cfg.swiglu_limit)
    B = 4
    sample(e(B, cfg.vocab_size), torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B), torch.zeros(B),
           torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long))
    done.append("sample")
    for B in (1, 4):  # greedy decoding's draw: the batch-1 build (programmatic dependent launch) and the others'
        greedy_sample(e(B, cfg.vocab_size))
    done.append("greedy_sample")
    return done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="v2-lite,v3-slice,v4-flash-slice,v4-graph-test",
                    help=f"comma-separated, of {sorted(SHAPES)}, v4-flash-slice and v4-graph-test")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--unfused", action="store_true",
                    help="also the set_decode_fusion(False) debug path's kernels (V2/V3 shapes)")
    ap.add_argument("--mtp", action="store_true",
                    help="also DSpark's MTP draft (its input projection and lean decode path; V2/V3 shapes)")
    ap.add_argument("--pdl", action="store_true",
                    help="also the batch-1 decode chain's DEEPINFER_PDL=1 kernels (V2/V3 shapes)")
    ap.add_argument("--fp8-tokens", default="",
                    help="also the FP8-weight step's ops at these decode batches, e.g. 64,256 (V2/V3 shapes)")
    ap.add_argument("--spec-k", type=int, default=SPEC_K,
                    help="also speculative verify steps of up to this many drafts a request (V2/V3 shapes; 0: none)")
    args = ap.parse_args(argv)
    if os.environ.get("DEEPINFER_TL_DRYRUN", "") in ("", "0"):
        raise SystemExit("engine_warm.py compiles only: set DEEPINFER_TL_DRYRUN=1 (and TILELANG_CACHE_DIR)")
    for shape in args.shapes.split(","):
        t0 = time.time()
        if shape in ("v4-flash-slice", "v4-graph-test"):  # DeepSeek-V4 (v4_suite.py: pages of 256 tokens)
            from v4_suite import GRAPH_TEST, suite_config

            from deepinfer_core.models.config_v4 import V4Config

            names = warm_v4(V4Config.from_dict(suite_config("full") if shape == "v4-flash-slice" else GRAPH_TEST))
        else:
            cfg = ModelConfig.from_dict(shape_config(shape))
            names = warm_shape(cfg, args.block_size, unfused=args.unfused, spec_k=args.spec_k)
            if args.mtp:
                names += warm_mtp(cfg, args.block_size)
            if args.pdl:
                names += warm_pdl_b1(cfg, args.block_size)
            if args.fp8_tokens:
                names += warm_b1_fp8(cfg, torch.bfloat16, tuple(int(t) for t in args.fp8_tokens.split(",")))
        print(f"{shape}: {len(names)} op calls compiled in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
