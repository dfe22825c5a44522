"""Sampling: top-p through torch_npu's fused top-k/top-p filter, the rest in plain torch on the NPU."""

from __future__ import annotations

import torch

from kernels_cpu.rng import uniform_from_counter


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference, without host synchronisation (capturable).

    top-k runs in torch: npu_top_k_top_p takes k only in [1, 1024], so a batch mixing "no top-k" rows
    with others cannot pass k for a real vocabulary. top-p runs in the fused op on the top-k-filtered
    logits, which is the reference's order (top-p sees the top-k distribution)."""
    import torch_npu

    logits = logits.float()
    B, V = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / t[:, None]
    k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    kth = scaled.sort(-1, descending=True).values.gather(1, (k - 1).long()[:, None])
    topk = scaled.masked_fill(scaled < kth, float("-inf"))
    filtered = torch_npu.npu_top_k_top_p(topk, p=top_p.to(topk.dtype), k=None)
    # min-p: drop tokens below min_p times the top probability of the top-k distribution
    probs = topk.softmax(-1)
    filtered = filtered.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    race = filtered.softmax(-1) / (-torch.log(uniform_from_counter(seeds, offsets, V)))
    return torch.where(greedy, logits.argmax(-1), race.argmax(-1))
