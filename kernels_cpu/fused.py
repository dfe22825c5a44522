"""Reference ops for the decode-fusion kernels: each is a composition of other ops, written once here
so that a backend may run it as one launch (``kernels_cuda.gemv``, ``kernels_cuda.kv_cache``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cpu.ops import add_rms_norm, head_linear, linear, mla_decode, moe_route, paged_kv_write, rms_norm, rope


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x.float() @ w.float().T``: float32 logits from activations and weights of any dtype (the router)."""
    return F.linear(x.float(), w.float())


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm and the projection after it: ``new_residual = x + residual`` (``x`` itself when
    ``residual`` is None), ``y = linear(rms_norm(new_residual, norm_w, eps), w)``; returns (y, new_residual)."""
    if residual is None:
        return linear(rms_norm(x, norm_w, eps), w, None), x
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    return linear(normed, w, None), residual


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


def mla_q_absorb(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed decode query from the projected query q[T, H, N + R] (N = w_uk's last dim):
    ``[head_linear(q[..., :N], w_uk) | rope(q[..., N:], positions, cos_sin)]``, [T, H, L + R]."""
    N = w_uk.shape[-1]
    return torch.cat((head_linear(q[..., :N], w_uk), rope(q[..., N:], positions, cos_sin)), -1)


def mla_q_absorb_kv_write(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """A decode step's MLA query and cache write together: ``mla_kv_write(kv_a, norm_w, eps, positions, cos_sin,
    cache, slot_mapping)`` (the entry is not returned: decode reads the cache), then ``mla_q_absorb(q, w_uk,
    positions, cos_sin)``, [T, H, L + R]."""
    mla_kv_write(kv_a, norm_w, eps, positions, cos_sin, cache, slot_mapping)
    return mla_q_absorb(q, w_uk, positions, cos_sin)


def mla_decode_uv(q: torch.Tensor, cache, block_tables: torch.Tensor, cu_q_lens: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, dv: int, w_uv: torch.Tensor) -> torch.Tensor:
    """MLA's decode attention and its value up-projection: ``head_linear(mla_decode(q, cache, block_tables, cu_q_lens,
    seq_lens, scale, dv), w_uv)`` with w_uv [H, V, dv], [T, H, V]. The latent output is rounded to q's dtype between
    the two (``mla_decode`` returns it so), and a backend's single launch keeps that rounding."""
    return head_linear(mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv), w_uv)


def moe_gate(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, n_group: int,
             topk_group: int, group_score: str, renormalize: bool, scale: float, n_shared: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router and the shared experts' slots for ``fused_moe``: ``moe_route(linear_f32(x, gate), ...)``, then
    ``n_shared`` always-selected experts E..E+n_shared-1 (E = gate's rows) of weight 1 appended to every token,
    the weights cast to ``dtype``: (weights[T, top_k + n_shared], ids[T, top_k + n_shared] int64)."""
    weights, ids = moe_route(linear_f32(x, gate), bias, top_k, scoring, n_group, topk_group, group_score,
                             renormalize, scale)
    if n_shared:
        T, E = ids.shape[0], gate.shape[0]
        shared = torch.arange(E, E + n_shared, dtype=ids.dtype, device=ids.device)
        ids = torch.cat((ids, shared.expand(T, n_shared)), 1)
        weights = torch.cat((weights, weights.new_ones(T, n_shared)), 1)
    return weights.to(dtype), ids


def add_rms_norm_moe_gate(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                          gate: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, n_group: int,
                          topk_group: int, group_score: str, renormalize: bool, scale: float, n_shared: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post-attention norm and the router: ``normed, new_residual = add_rms_norm(x, residual, norm_w, eps)``,
    then ``moe_gate(normed, gate, ...)``; returns (normed, new_residual, weights, ids)."""
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    weights, ids = moe_gate(normed, gate, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale,
                            n_shared, dtype)
    return normed, residual, weights, ids
