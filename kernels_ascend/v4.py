"""DeepSeek-V4 ops through torch_npu where a documented fused op computes them (docs/ascend.md lists
which do not, and why): rope by the negative angle (npu_rotary_mul), the clamped SwiGLU
(npu_clipped_swiglu), the clamped expert MLP (the MoE chain of kernels_ascend.moe with the clamped
SwiGLU), sigmoid routing (npu_moe_gating_top_k) and the compressor's norm and rope (npu_rms_norm,
npu_rotary_mul) after its gated pooling in plain torch."""

from __future__ import annotations

import torch

from kernels_ascend.dense import rms_norm, rope
from kernels_ascend.moe import grouped_moe, moe_route
from kernels_cpu import v4_ops as reference


def rope_inverse(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """rope with sin negated: npu_rotary_mul's interleave mode (through kernels_ascend.dense.rope)."""
    half = cos_sin.shape[-1] // 2
    return rope(x, positions, torch.cat((cos_sin[:, :half], -cos_sin[:, half:]), dim=-1))


def silu_and_mul_clamped(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """npu_clipped_swiglu with alpha 1 and bias 0 on the halves [gate | up] (interleaved=False) is
    silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) (docs: npu_clipped_swiglu, 计算公式 (3)-(4))."""
    import torch_npu

    if limit is None:
        return torch_npu.npu_swiglu(x, dim=-1)
    return torch_npu.npu_clipped_swiglu(x.contiguous(), dim=-1, alpha=1.0, limit=float(limit), bias=0.0,
                                        interleaved=False)


def fused_moe_clamped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    return grouped_moe(x, w13, w2, weights, ids, lambda h: silu_and_mul_clamped(h, limit))


def moe_route_v4(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, top_k: int,
                 scoring: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scoring without hash routing is moe_route's ungrouped, renormalised sigmoid gate
    (npu_moe_gating_top_k). npu_moe_gating_top_k has no sqrt-softplus norm (norm_type: softmax or
    sigmoid) and no given ids, so those run the reference (plain torch on the NPU)."""
    if scoring == "sigmoid" and hash_ids is None:
        return moe_route(logits, bias, top_k, "sigmoid", 1, 1, "max", True, scale)
    return reference.moe_route_v4(logits, bias, hash_ids, top_k, scoring, scale)


def v4_compress(state: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, close_pos: torch.Tensor,
                ape: torch.Tensor, norm_w: torch.Tensor, eps: float, cos_sin: torch.Tensor, col: int) -> torch.Tensor:
    """The gated pooling over the paged state in plain torch (a gather and a per-channel softmax: no
    fused op), then npu_rms_norm and npu_rotary_mul in float32 (both document float32 inputs)."""
    pooled = reference.v4_compress_pool(state, block_tables, seq_idx, close_pos, ape, norm_w.shape[0], col)
    normed = rms_norm(pooled, norm_w.float(), eps)
    return reference.v4_compress_rope(normed, close_pos, ape.shape[0], cos_sin.float(), rope)
