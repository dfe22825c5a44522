"""Context parallelism (``cp = N``) for the MLA prefill of one long prompt.

The prompt's T tokens are split over N ranks in a zigzag: 2N equal chunks, rank r takes chunks r
and 2N-1-r, so every rank has the same causal attention work (a contiguous split would give the
last rank N times the first's), and rank 0 holds the prompt's last token. Each rank runs every
layer on its own tokens only (projections, MLP/MoE, norms); attention needs every earlier token's
key and value, so per layer the ranks **all-gather the MLA latent KV entries** (normalised latent +
rope key, ``kv_lora_rank + qk_rope_head_dim`` values per token: 576 in V3) and each rank expands
them with ``kv_b_proj`` itself.

Why all-gather of the latent and not a ring of K/V blocks: MLA's cache entry is what a token's
keys and values are computed from, and it is ~70x smaller than the expanded per-head K/V (V3:
576 values against 128 heads x (192 + 128)), so gathering it costs T x 576 values per layer,
less than one ring pass of expanded K/V; every rank ends with the whole latent KV, which is what
the decode rank must hold anyway; and attention is then one exact softmax over the full context
(no online-softmax merging of partial results). The price is that each rank expands K/V for the
whole context (``kv_b_proj`` over T tokens), computing what a ring would spread; where that
dominates (very long T, few heads), a ring over latent blocks would be the next step.

After the prefill, rank 0 has the last token's logits and every layer's entries for all T
tokens: it writes them into its own engine's KV cache and decode continues there, alone.
"""

from __future__ import annotations

import torch

from deepinfer_core.communicator import Communicator


def zigzag(T: int, world: int) -> list[list[tuple[int, int]]]:
    """Per rank, its (start, end) token segments: chunks r and 2N-1-r of 2N near-equal chunks."""
    bounds = [T * i // (2 * world) for i in range(2 * world + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(2 * world)]
    return [[chunks[r], chunks[2 * world - 1 - r]] for r in range(world)]


def _gather_entries(entry: torch.Tensor, segments: list[list[tuple[int, int]]], comm: Communicator | None,
                    rank: int, T: int) -> torch.Tensor:
    """Every rank's entries of its tokens -> all T entries in prompt order."""
    if comm is None or comm.world_size == 1:
        return entry
    counts = [sum(e - s for s, e in segs) for segs in segments]
    width = max(counts)
    padded = entry.new_zeros(width, entry.shape[1])
    padded[: entry.shape[0]] = entry
    gathered = comm.all_gather(padded).view(len(segments), width, entry.shape[1])
    full = entry.new_empty(T, entry.shape[1])
    for r, segs in enumerate(segments):
        at = 0
        for s, e in segs:
            full[s:e] = gathered[r, at : at + e - s]
            at += e - s
    return full


def _attention(attn, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, mine: list[tuple[int, int]],
               segments, comm, rank: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA over this rank's tokens against the whole (gathered) context; returns (output, all entries)."""
    k, n = attn.k, x.shape[0]
    if attn.cfg.q_lora_rank is None:
        q = k.linear(x, attn.q_proj)
    else:
        q = k.linear(attn.q_a_layernorm(k.linear(x, attn.q_a_proj)), attn.q_b_proj)
    q = q.view(n, attn.H, attn.N + attn.R)
    q_nope, q_pe = q.split([attn.N, attn.R], dim=-1)
    q_pe = k.rope(q_pe, positions, cos_sin)
    latent, k_pe = k.linear(x, attn.kv_a_proj_with_mqa).split([attn.L, attn.R], dim=-1)
    entry = torch.cat((attn.kv_a_layernorm(latent), k.rope(k_pe[:, None], positions, cos_sin)[:, 0]), -1)
    full = _gather_entries(entry, segments, comm, rank, T)
    end = max(e for _, e in mine)
    kv = k.linear(full[:end, : attn.L], attn.kv_b_proj).view(end, attn.H, attn.N + attn.V)
    k_nope, v = kv.split([attn.N, attn.V], dim=-1)
    key = torch.cat((k_nope, full[:end, None, attn.L :].expand(end, attn.H, attn.R)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)
    # one "sequence" per segment: its queries are the last tokens of the keys up to its end
    keys = torch.cat([key[:e] for _, e in mine])
    values = torch.cat([v[:e] for _, e in mine]).contiguous()
    cu_q = torch.tensor([0] + list(torch.tensor([e - s for s, e in mine]).cumsum(0).tolist()), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor([e for _, e in mine]).cumsum(0).tolist()), dtype=torch.int32)
    out = k.mla_prefill(query, keys, values, cu_q.to(x.device), cu_k.to(x.device), attn.scale)
    return k.linear(out.reshape(n, attn.H * attn.V), attn.o_proj), full


@torch.inference_mode()
def cp_prefill(model, token_ids: list[int], comm: Communicator | None) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                                list[tuple[int, int]]]:
    """Prefill ``token_ids`` split over ``comm``'s ranks (None: one rank). Returns this rank's
    logits (float32, one row per token of its segments, in segment order), every layer's entries
    for all tokens (``[T, kv_lora_rank + qk_rope_head_dim]``) and its segments. The model is a
    DeepSeek V2/V3 ``DeepseekForCausalLM`` (layers of MLA + MLP/MoE) holding all its experts."""
    world = 1 if comm is None else comm.world_size
    rank = 0 if comm is None else comm.rank
    T = len(token_ids)
    if T < 2 * world:
        raise ValueError(f"context parallelism over {world} ranks needs a prompt of at least {2 * world} tokens, "
                         f"got {T}")
    segments = zigzag(T, world)
    mine = [(s, e) for s, e in segments[rank] if e > s]
    device = model.embed_tokens.device
    idx = torch.cat([torch.arange(s, e) for s, e in mine]).to(device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)[idx]
    k, cfg = model.k, model.cfg
    x = model.embed_tokens[ids]
    residual = None
    entries = []
    for layer in model.layers:
        if residual is None:
            residual, x = x, k.rms_norm(x, layer.input_layernorm, layer.eps)
        else:
            x, residual = k.add_rms_norm(x, residual, layer.input_layernorm, layer.eps)
        x, full = _attention(layer.self_attn, x, idx, model.cos_sin, mine, segments, comm, rank, T)
        entries.append(full)
        x, residual = k.add_rms_norm(x, residual, layer.post_attention_layernorm, layer.eps)
        x = layer.mlp(x)
    x, _ = k.add_rms_norm(x, residual, model.norm, cfg.rms_norm_eps)
    return model.logits(x), entries, mine


def prefilled_state(engine, token_ids: list[int], entries: list[torch.Tensor]):
    """A ``RequestState`` for ``engine`` holding the KV of all prompt positions but the last (the
    engine computes that one itself and samples the first token with its own sampler and seed)."""
    from deepinfer_core.engine.handoff_format import RequestState

    (group,) = [g for g in engine.cache_layout.groups]  # DeepSeek V2/V3: the one "latent" group
    bs, n = engine.block_size, len(token_ids) - 1
    nb = -(-n // bs)
    rows = []
    for e in entries:  # written by the model's own op, so encoded rows (kv_cache_dtype "fp8") are encoded
        padded = e.new_zeros(nb, bs, group.entry_dim, dtype=group.dtype or e.dtype)
        engine.kernels.paged_kv_write(padded, torch.arange(n, device=e.device), e[:n])
        rows.append(padded)
    blocks = {engine.blocks.pool_of[group.name]: list(range(nb))}
    return RequestState(list(token_ids), len(token_ids), n, [], [], blocks, {group.name: rows})
