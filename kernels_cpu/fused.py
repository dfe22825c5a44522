"""Reference ops for the decode-fusion kernels: each is a composition of other ops, written once here
so that a backend may run it as one launch (``kernels_cuda.gemv``, ``kernels_cuda.kv_cache``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cpu.ops import paged_kv_write, rms_norm, rope


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x.float() @ w.float().T``: float32 logits from activations and weights of any dtype (the router)."""
    return F.linear(x.float(), w.float())


def mla_kv_write(kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
                 cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """MLA's cache entry from the kv_a projection, written into the paged latent cache and returned:
    entry = [rms_norm(kv_a[:, :L], norm_w, eps) | rope(kv_a[:, L:], positions, cos_sin)] with L = norm_w's
    width; ``cache.view(-1, L + R)[slot] = entry`` for every slot >= 0."""
    L = norm_w.shape[0]
    latent, k_pe = kv_a[:, :L], kv_a[:, L:]
    entry = torch.cat((rms_norm(latent, norm_w, eps), rope(k_pe[:, None], positions, cos_sin)[:, 0]), -1)
    paged_kv_write(cache, slot_mapping, entry)
    return entry
