"""Plain-torch reference ops. Each function's docstring is the op's contract (see
``deepinfer_core.kernels.OP_SPECS``). They are written to be vectorised enough to serve as the CPU
backend's fast path, too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cpu.kv_fp8 import dequantize_latent_rows, quantize_latent_rows
from kernels_cpu.rng import uniform_from_counter


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thk,hnk->thn", x, w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * xf).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, w, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x[T, N, D]: rotate interleaved pairs (x[2i], x[2i+1]) like DeepSeek's complex rotary."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [T, 1, D/2]
    xf = x.float().unflatten(-1, (half, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def paged_kv_write(cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """A uint8 cache of float ``kv`` holds FP8 latent rows: each row is quantised (``kernels_cpu.kv_fp8``)."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.uint8 and kv.is_floating_point():
        kv = quantize_latent_rows(kv, cache.shape[-1])
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat.index_copy_(0, slot_mapping, kv.to(cache.dtype))
    else:
        flat.index_copy_(0, slot_mapping[keep], kv[keep].to(cache.dtype))


def _context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_len: int):
    """Flat cache slot of each (sequence, position < max_len): [B, max_len], plus validity mask."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables.long().gather(1, (pos // block_size).expand(block_tables.shape[0], -1).clamp(
        max=block_tables.shape[1] - 1))
    slots = blocks * block_size + pos % block_size
    valid = pos[None, :] < seq_lens[:, None]
    return slots, valid


def paged_kv_gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    slots, valid = _context_slots(block_tables, seq_lens, cache.shape[1], max_len)
    return cache.view(-1, cache.shape[-1])[slots[valid]]


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dv: int,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache with ragged causal queries.

    q[T, H, D] with D = kv_lora + rope; keys are cache rows [.., D]; values their first dv entries.
    A uint8 cache holds FP8 latent rows (``kernels_cpu.kv_fp8``), dequantised per 128-value tile.
    """
    B = seq_lens.shape[0]
    T, H, D = q.shape
    if B == 0 or T == 0:  # no sequences (an idle rank's step): nothing to attend
        return q.new_zeros(T, H, dv)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    max_q = int(q_lens.max())
    max_len = int(seq_lens.max())
    slots, valid = _context_slots(block_tables, seq_lens, cache.shape[1], max_len)
    if cache.dtype == torch.uint8:
        kv = dequantize_latent_rows(cache.view(-1, cache.shape[-1])[slots], D, torch.float32)  # [B, L, D]
    else:
        kv = cache.view(-1, D)[slots]  # [B, L, D]
    # Place each sequence's queries in a [B, max_q] grid, aligned to the left.
    seq_of_tok = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=T)
    j_of_tok = torch.arange(T, device=q.device) - cu_q_lens[:-1].repeat_interleave(q_lens, output_size=T)
    if max_q == 1:
        qg = q.unsqueeze(1) if T == B else q.new_zeros(B, 1, H, D).index_put_((seq_of_tok, j_of_tok), q)
    else:
        qg = q.new_zeros(B, max_q, H, D).index_put_((seq_of_tok, j_of_tok), q)
    qpos = seq_lens[:, None] - q_lens[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, Q]
    kpos = torch.arange(max_len, device=q.device)
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]  # [B, Q, L]
    scores = torch.einsum("bqhd,bld->bqhl", qg.float(), kv.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bqhl,bld->bqhd", probs, kv[..., :dv].float())  # [B, Q, H, dv]
    return out[seq_of_tok, j_of_tok].to(q.dtype)


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q_lens: torch.Tensor,
    cu_k_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = cu_q_lens.tolist(), cu_k_lens.tolist()
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]]
        vs = v[ck[b] : ck[b + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        if nq == 0:
            continue
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[cq[b] : cq[b + 1]] = o.transpose(0, 1)
    return out


def select_experts(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """Top-k expert ids of ``choice`` [T, E], restricted to the best ``topk_group`` of ``n_group`` groups."""
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(T, n_group, E // n_group)
        if group_score == "max":
            gscore = grouped.amax(-1)
        elif group_score == "top2sum":
            top2 = grouped.topk(2, dim=-1).values
            gscore = top2[..., 0] + top2[..., 1]
        else:
            raise ValueError(f"moe_route: group_score must be 'max' or 'top2sum', got {group_score!r}")
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    return choice.topk(top_k, dim=-1).indices


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    n_group: int,
    topk_group: int,
    group_score: str,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if scoring == "softmax":
        scores = logits.softmax(-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"moe_route: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    ids = select_experts(scores if bias is None else scores + bias.float(), top_k, n_group, topk_group, group_score)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Grouped expert MLP: sort (token, slot) pairs by expert, one GEMM pair per expert, scatter-add."""
    return grouped_experts(x, w13, w2, weights, ids, silu_and_mul)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    act, project=None) -> torch.Tensor:
    """The expert loop of ``fused_moe`` with the activation ``act([n, 2I]) -> [n, I]`` as a parameter;
    ``project(a, e, which)`` (which 1: w13, 2: w2) replaces the plain ``F.linear(a, w[e])`` (FP8 experts)."""
    if project is None:
        def project(a, e, which):
            return F.linear(a, (w13 if which == 1 else w2)[e])

    T, C = x.shape
    E = w13.shape[0]
    out = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    local = (flat_ids >= 0) & (flat_ids < E)
    order = torch.argsort(torch.where(local, flat_ids, E), stable=True)
    counts = torch.bincount(flat_ids[local], minlength=E).tolist()
    tok = order // ids.shape[1]
    w = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = tok[start : start + n]
        h = act(project(x[t], e, 1))
        out.index_add_(0, t, project(h, e, 2).float() * w[start : start + n, None].float())
        start += n
    return out.to(x.dtype)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x, dim=-1)


def greedy_sample(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, logprobs, lse) of greedy rows: each row's first argmax, its log-probability, the normaliser."""
    return greedy_with_lse(x, logsumexp(x))


def greedy_with_lse(x: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`greedy_sample` given the rows' normaliser ``lse``."""
    tokens = x.argmax(-1)
    return tokens, x.gather(-1, tokens[..., None])[..., 0] - lse, lse


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Greedy rows where temperature == 0; otherwise an exponential-race draw (argmax p / E) from the
    filtered distribution, with E from a counter-based RNG so each row depends only on its own data."""
    logits = logits.float()
    greedy = temperature <= 0  # (no early exit for all-greedy rows: that would read a device value)
    B, V = logits.shape
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logits = logits / t[:, None]
    sorted_logits, sorted_idx = logits.sort(-1, descending=True)
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)  # top-p sees the top-k distribution
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    # min-p: drop tokens below min_p times the top probability
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)
    probs = filtered.softmax(-1)
    u = uniform_from_counter(seeds, offsets, V)  # [B, V] in (0, 1)
    race = probs / (-torch.log(u))
    sampled = race.argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)


def draft_lengths(conf: torch.Tensor, max_drafts: torch.Tensor, budget: int, min_conf: float) -> torch.Tensor:
    """Per-request draft lengths under a step's verify budget, from per-position draft confidences.

    ``c[b, j] = conf[b, 0] * ... * conf[b, j]`` (float32, multiplied left to right) estimates that
    request b's first j+1 drafts are all accepted. Positions ``j < max_drafts[b]`` with
    ``c[b, j] >= min_conf`` compete for ``budget`` verify slots: the ``budget`` largest win, ties
    broken by lower position, then lower request (so each request wins a prefix). Returns the
    number of slots each request won ([B] int64)."""
    conf = conf.float()
    B, K = conf.shape
    c = conf.clone()
    for j in range(1, K):  # a sequential product: the same float32 rounding as the device kernels
        c[:, j] = c[:, j - 1] * conf[:, j]
    valid = torch.arange(K, device=conf.device)[None, :] < max_drafts.to(conf.device)[:, None]
    ok = valid & (c >= min_conf)
    key = torch.where(valid, c, torch.full_like(c, float("-inf")))
    order = key.t().reshape(-1).sort(descending=True, stable=True).indices  # ties: position, then request
    n = min(max(int(budget), 0), int(ok.sum()))
    won = order[:n] % B  # the request of each winning slot (flat index j * B + b)
    return torch.bincount(won, minlength=B).to(torch.int64)
