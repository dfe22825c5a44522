"""Plain-torch reference ops for DeepSeek-V4 (contracts in ``deepinfer_core.kernels.OP_SPECS``).

Shapes: T tokens, B sequences, H heads, D head dim, n mHC streams, C hidden size. Paged caches are
``[num_blocks, entries_per_block, dim]``; a sequence's entry ``e`` lives at row ``e % epb`` of block
``block_tables[b, e // epb]``. Rows read through a ``-1`` table entry or outside a sequence's range are
never used (and their contents may be garbage, NaN included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cpu.ops import grouped_experts, rope, silu_and_mul


def rope_inverse(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = cos_sin.shape[-1] // 2
    return rope(x, positions, torch.cat((cos_sin[:, :half], -cos_sin[:, half:]), dim=-1))


def _paged_rows(cache: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, entries: torch.Tensor,
                valid: torch.Tensor, with_mask: bool = False):
    """cache rows of entries[N, S] of sequences seq_idx[N]; zero where not ``valid`` or read through a
    -1 table entry (``with_mask``: also return that validity [N, S])."""
    epb = cache.shape[1]
    e = entries.clamp(min=0)
    col = (e // epb).clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.long()[seq_idx[:, None].expand_as(e), col]
    valid = valid & (blocks >= 0)
    slots = blocks.clamp(min=0) * epb + e % epb
    rows = cache.reshape(-1, cache.shape[-1])[slots]
    rows = torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype))
    return (rows, valid) if with_mask else rows


def v4_compress(state: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, close_pos: torch.Tensor,
                ape: torch.Tensor, norm_w: torch.Tensor, eps: float, cos_sin: torch.Tensor, col: int) -> torch.Tensor:
    """One compressed entry per closing token (position p, (p + 1) % m == 0) from the raw compressor
    inputs in the per-token state cache. Row layout from column ``col``: [kv | gate], each ``w`` wide,
    w = Dc (plain, HCA) or 2·Dc (overlapped, CSA: channels [:Dc] = Ca for the next window, [Dc:] = Cb).
    Plain: pool the m tokens p-m+1..p. Overlapped: pool 2m slots, Ca of p-2m+1..p-m then Cb of
    p-m+1..p (slots before position 0 absent). gate += ape[pos % m]; softmax over slots per channel;
    rms_norm(norm_w); rope the last R channels at the window's first position p-m+1."""
    pooled = v4_compress_pool(state, block_tables, seq_idx, close_pos, ape, norm_w.shape[0], col)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    return v4_compress_rope(normed, close_pos, ape.shape[0], cos_sin, rope)


def v4_compress_pool(state: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, close_pos: torch.Tensor,
                     ape: torch.Tensor, Dc: int, col: int) -> torch.Tensor:
    """v4_compress's gated pooling: [N, Dc] float32, before the norm and the rope."""
    m, w = ape.shape
    overlap = w == 2 * Dc
    S = 2 * m if overlap else m
    pos = close_pos[:, None] - S + 1 + torch.arange(S, device=close_pos.device)  # [N, S]
    valid = pos >= 0
    rows = _paged_rows(state, block_tables, seq_idx, pos, valid)[..., col: col + 2 * w].float()  # [N, S, 2w]
    kv, gate = rows[..., :w], rows[..., w:] + ape.float()[pos.clamp(min=0) % m]
    if overlap:  # first m slots: Ca channels; last m: Cb channels
        kv = torch.cat((kv[:, :m, :Dc], kv[:, m:, Dc:]), dim=1)
        gate = torch.cat((gate[:, :m, :Dc], gate[:, m:, Dc:]), dim=1)
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    return (kv * gate.softmax(dim=1)).sum(dim=1)  # [N, Dc]


def v4_compress_rope(normed: torch.Tensor, close_pos: torch.Tensor, m: int, cos_sin: torch.Tensor,
                     rope_fn) -> torch.Tensor:
    """v4_compress's last step: ``rope_fn`` (the rope op) on the last R channels at position p-m+1."""
    if normed.shape[0] == 0:
        return normed
    R = cos_sin.shape[-1]
    roped = rope_fn(normed[:, None, -R:], close_pos - m + 1, cos_sin)[:, 0]
    return torch.cat((normed[:, :-R], roped), dim=-1)


#: tokens per slice of the per-token gathers below (bounds their memory on long prefills)
TOKEN_CHUNK = 256


def v4_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, block_tables: torch.Tensor,
                    seq_idx: torch.Tensor, positions: torch.Tensor, ratio: int, top_k: int,
                    scale: float) -> torch.Tensor:
    """Lightning indexer: for token t at position p, entries w < (p + 1) // ratio are visible;
    score[w] = sum_h weights[t, h] * relu(q[t, h] . keys[w]) * scale; the ids of the top_k visible
    entries, -1 padded."""
    T = q.shape[0]
    if T > TOKEN_CHUNK:
        return torch.cat([v4_indexer_topk(q[i: i + TOKEN_CHUNK], weights[i: i + TOKEN_CHUNK], keys, block_tables,
                                          seq_idx[i: i + TOKEN_CHUNK], positions[i: i + TOKEN_CHUNK], ratio, top_k,
                                          scale) for i in range(0, T, TOKEN_CHUNK)])
    out = torch.full((T, top_k), -1, dtype=torch.int64, device=q.device)
    visible = (positions + 1) // ratio  # [T]
    n_max = int(visible.max()) if T else 0
    if n_max == 0:
        return out
    ent = torch.arange(n_max, device=q.device).expand(T, n_max)
    vis = ent < visible[:, None]
    k = _paged_rows(keys, block_tables, seq_idx, ent, vis).float()  # [T, N, DI]
    scores = torch.einsum("thd,tnd->thn", q.float(), k).relu() * scale
    scores = (scores * weights.float()[:, :, None]).sum(1).masked_fill(~vis, float("-inf"))  # [T, N]
    kk = min(top_k, n_max)
    top = scores.topk(kk, dim=-1)
    out[:, :kk] = torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))
    return out


def v4_sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_tables: torch.Tensor,
                        comp_cache: torch.Tensor | None, comp_tables: torch.Tensor | None,
                        comp_ids: torch.Tensor | None, seq_idx: torch.Tensor, positions: torch.Tensor,
                        window: int, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Shared K=V attention of q[T, H, D] over the window keys p-window+1..p (>= 0) of the token's
    sequence (a key whose block-table entry is -1 is absent: bounded replay clips the window so) plus
    the compressed entries comp_ids[t] >= 0 (cache rows' first D channels), with a
    per-head sink logit in the softmax (its probability is dropped)."""
    T, H, D = q.shape
    if T > TOKEN_CHUNK:
        return torch.cat([v4_sparse_attention(
            q[i: i + TOKEN_CHUNK], swa_cache, swa_tables, comp_cache, comp_tables,
            None if comp_ids is None else comp_ids[i: i + TOKEN_CHUNK], seq_idx[i: i + TOKEN_CHUNK],
            positions[i: i + TOKEN_CHUNK], window, sinks, scale) for i in range(0, T, TOKEN_CHUNK)])
    pos = positions[:, None] - window + 1 + torch.arange(window, device=q.device)  # [T, W]
    keys, valid = _paged_rows(swa_cache, swa_tables, seq_idx, pos, pos >= 0, with_mask=True)
    keys = keys[..., :D]
    if comp_ids is not None and comp_ids.shape[1]:
        ck = _paged_rows(comp_cache, comp_tables, seq_idx, comp_ids, comp_ids >= 0)[..., :D]
        keys = torch.cat((keys, ck), dim=1)
        valid = torch.cat((valid, comp_ids >= 0), dim=1)
    keys = keys.float()  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(T, H, 1)
    probs = torch.cat((logits, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def _hc_mix(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = h.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.float())


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, n, C = h.shape
    mix = _hc_mix(h, fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, n: 2 * n] * scale[1] + base[n: 2 * n])
    comb = torch.softmax(mix[:, 2 * n:].view(T, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    x = (pre[:, :, None] * h).sum(dim=1).to(h.dtype)
    return x, post, comb


def mhc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    dt = h.dtype
    return post.to(dt)[:, :, None] * y[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), h)


def mhc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
             hc_eps: float) -> torch.Tensor:
    pre = torch.sigmoid(_hc_mix(h, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre[:, :, None] * h).sum(dim=1).to(h.dtype)


def moe_route_v4(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, top_k: int,
                 scoring: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if scoring == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"moe_route_v4: scoring must be 'sqrtsoftplus' or 'sigmoid', got {scoring!r}")
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        ids = (scores if bias is None else scores + bias.float()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def silu_and_mul_clamped(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is None:
        return silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_moe_clamped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    return grouped_experts(x, w13, w2, weights, ids, lambda h: silu_and_mul_clamped(h, limit))
