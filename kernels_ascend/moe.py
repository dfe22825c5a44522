"""MoE routing and the grouped expert MLP through torch_npu's MoE ops."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels_cpu import ops as reference


def _gating_fits(E: int, top_k: int, group_count: int, k_group: int) -> bool:
    """npu_moe_gating_top_k's documented limits: at most 2048 experts, groups of more than 2 experts
    whose 32-aligned size times the group count stays within 2048, and k within the kept groups."""
    per_group = E // group_count
    return (E <= 2048 and E % group_count == 0 and per_group > 2 and -(-per_group // 32) * 32 * group_count <= 2048
            and 1 <= top_k <= per_group * k_group)


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    grouped = n_group > 1 and topk_group < n_group
    group_count, k_group = (n_group, topk_group) if grouped else (1, 1)
    E = logits.shape[-1]
    if (scoring not in ("softmax", "sigmoid") or group_score not in ("max", "top2sum")
            or not _gating_fits(E, top_k, group_count, k_group)):
        return reference.moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale)
    import torch_npu

    x = logits.float()
    # The weights are gathered from norm_out (out_flag=True): the unbiased scores. The docs do not state
    # how y_out is renormalised, so y_out is not relied on.
    _, ids, scores = torch_npu.npu_moe_gating_top_k(
        x, top_k, bias=None if bias is None else bias.to(x.dtype), k_group=k_group, group_count=group_count,
        group_select_mode=1 if group_score == "top2sum" else 0, renorm=0,
        norm_type=1 if scoring == "sigmoid" else 0, out_flag=True, routed_scaling_factor=1.0, eps=1e-20,
    )
    ids = ids.long()
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return grouped_moe(x, w13, w2, weights, ids, lambda h: torch_npu.npu_swiglu(h, dim=-1))


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """init_routing_v2 (sort rows by expert) -> grouped_matmul -> ``act`` ([rows, 2I] -> [rows, I]) ->
    grouped_matmul -> finalize_routing (weighted combine). Experts outside [0, E) (other ranks') are routed to the extra
    expert id E, outside ``active_expert_range``, so they are neither computed nor combined.

    The weights are read as ``w13.transpose(1, 2)`` ([E, C, 2I]: grouped_matmul computes x @ w); the
    platform stores expert weights so that this view is contiguous (AscendPlatform.linear_weight_layout).
    """
    import torch_npu

    T, K = ids.shape
    E = w13.shape[0]
    local = (ids >= 0) & (ids < E)
    expert = torch.where(local, ids, E).to(torch.int32)
    rows, row_of_src, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x, expert, expert_num=E + 1, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, E], quant_mode=-1, row_idx_type=0,
    )
    gate_up = torch_npu.npu_grouped_matmul([rows], [w13.transpose(1, 2)], group_list=counts, split_item=2,
                                           group_type=0, group_list_type=1)[0]
    h = act(gate_up)
    down = torch_npu.npu_grouped_matmul([h], [w2.transpose(1, 2)], group_list=counts, split_item=2,
                                        group_type=0, group_list_type=1)[0]
    # rows past the routed ones belong to no group: their contents are undefined
    valid = torch.arange(T * K, device=x.device) < counts.sum()
    down = torch.where(valid[:, None], down, torch.zeros((), dtype=down.dtype, device=down.device))
    # finalize_routing reads the destination of (token i, choice k) at i + k * T; init_routing_v2's
    # row_idx_type=0 index is token-major (i * K + k) and -1 for rows outside active_expert_range
    src_to_dst = row_of_src.view(T, K).t().reshape(-1).clamp(min=0)
    scales = torch.where(local, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    return torch_npu.npu_moe_finalize_routing(down, None, None, None, scales.to(down.dtype), src_to_dst, None,
                                              drop_pad_mode=0, k=K)
