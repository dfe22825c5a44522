"""torch_npu-backed ops. Written against torch_npu's documented fused-op API; not runnable without
an Ascend NPU and CANN, so they are exercised only by the conformance kit on such a machine."""

from __future__ import annotations

import torch

from kernels_cpu import ops as reference


def _npu():
    import torch_npu

    return torch_npu


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _npu().npu_rms_norm(x, w, epsilon=eps)[0]


def add_rms_norm(x, residual, w, eps):
    residual = x + residual
    return rms_norm(residual, w, eps), residual


def paged_kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    # npu_scatter_pa_kv_cache expects separate K/V caches; the latent cache is a single K-only cache,
    # which index_copy_ handles as efficiently on the NPU.
    reference.paged_kv_write(cache, slot_mapping, kv)


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    npu = _npu()
    weights, ids, _ = npu.npu_moe_gating_top_k(
        logits.float(), k=top_k, bias=bias, k_group=topk_group, group_count=n_group,
        group_select_mode=1 if group_score == "top2sum" else 0, renorm=0,
        norm_type=1 if scoring == "sigmoid" else 0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20,
    )
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids.long()
