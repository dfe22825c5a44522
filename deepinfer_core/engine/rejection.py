"""Speculative rejection sampling with the counter RNG: drafts are drawn and verified so that the
emitted tokens follow the target's (filtered) distribution exactly.

For request i with drafts d_1..d_m drawn from the draft distributions q_1..q_m and target rows
p_0..p_m (p_j is the target's distribution after d_1..d_j):

* d_j is accepted with probability min(1, p_{j-1}(d_j) / q_j(d_j)), in order, until one is rejected;
* on the first rejection at j, a token is drawn from norm(max(0, p_{j-1} - q_j));
* when all m are accepted, a bonus token is drawn from p_m.

Greedy requests (temperature 0) reduce to: accept while d_j == argmax p_{j-1}, then emit the
target's argmax, i.e. exactly the tokens of plain greedy decoding.

Point-mass drafts (a deterministic proposer's, ``q_j = delta(d_j)``) are verified by coupling instead:
at each position the target draws its own token x_j from p_j with the engine sampler's noise (the main
stream, keyed as plain decoding keys it), d_j is accepted while x_j == d_j, and the first x_j that
differs (or the bonus x_m) is emitted. That accepts d_j with probability p_j(d_j) = min(1, p/q) and, on a
rejection, emits a token of p_j without d_j: the rule above, exactly. And every emitted token is the
target's own draw, so a seeded request emits the very tokens of plain decoding with its seed,
speculation on or off.

Every random number comes from :func:`kernels_cpu.rng.uniform_from_counter` keyed by the request's
seed and the index of the token being decided, in separate streams (the seed is xor-ed with a
per-stream constant): the draft's draw, the accept test and the residual draw. The bonus token uses
the main stream with the same key as the engine's sampler, so the result never depends on what
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels_cpu.rng import uniform_from_counter

STREAM_DRAFT = 0x2D5A_11C3_0000_0000
STREAM_ACCEPT = 0x4A7C_15B9_0000_0000
STREAM_RESIDUAL = 0x1F3B_6E21_0000_0000


def stream(seeds: torch.Tensor, which: int) -> torch.Tensor:
    return seeds.long() ^ which


@dataclass
class SamplingRows:
    """Per-row sampling parameters as tensors (one row per distribution)."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] long (<= 0: off)
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32

    @classmethod
    def from_params(cls, params: list, device) -> SamplingRows:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))

    def index(self, rows: torch.Tensor) -> SamplingRows:
        return SamplingRows(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])


def filtered_probs(logits: torch.Tensor, s: SamplingRows, needs_filter: bool | None = None,
                   any_greedy: bool | None = None) -> torch.Tensor:
    """The distribution the engine's ``sample`` op draws from: temperature, top-k, top-p (on the
    top-k distribution), min-p, the top token always kept. Rows with temperature 0 are one-hot.
    ``needs_filter`` / ``any_greedy``: known on the host (else read from ``s``, a device sync)."""
    logits = logits.float()
    N, V = logits.shape
    greedy = s.temperature <= 0
    t = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    scaled = logits / t[:, None]
    if needs_filter is None:
        needs_filter = bool(((s.top_k > 0) & (s.top_k < V)).any() | (s.top_p < 1).any() | (s.min_p > 0).any())
    if needs_filter:
        sorted_logits, sorted_idx = scaled.sort(-1, descending=True)
        ranks = torch.arange(V, device=logits.device)[None, :]
        k = torch.where((s.top_k <= 0) | (s.top_k > V), torch.full_like(s.top_k, V), s.top_k)
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= (probs.cumsum(-1) - probs) >= s.top_p[:, None]
        drop |= probs < (s.min_p[:, None] * probs[:, :1])
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, sorted_idx, sorted_logits)
    probs = scaled.softmax(-1)
    if any_greedy if any_greedy is not None else bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row from ``probs`` by an exponential race with counter-RNG noise."""
    u = uniform_from_counter(seeds, positions, probs.shape[-1])
    return (probs / (-torch.log(u))).argmax(-1)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return uniform_from_counter(seeds, positions, 1)[:, 0]


def verify(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: list[list[int]],
           seeds: torch.Tensor, first_pos: list[int], greedy: list[bool],
           target_argmax: list[int] | None = None, point_mass: list[bool] | None = None
           ) -> tuple[list[list[int]], list[int]]:
    """Verify the drafts of R requests.

    ``target_probs`` [sum(m_i + 1), V]: each request's rows p_0..p_m, concatenated in order (may be
    None-like for all-greedy batches when ``target_argmax`` is given). ``draft_probs`` [sum(m_i), V]:
    q_1..q_m for each request (rows of greedy requests, and of requests whose ``point_mass`` is True,
    are ignored). ``first_pos[i]`` is the token index of d_1. ``point_mass[i]``: request i's drafts
    are point masses, verified by coupling (module docstring). Returns (emitted tokens per request,
    accepted draft count per request).
    """
    R = len(draft_tokens)
    m = [len(d) for d in draft_tokens]
    t_start, d_start = [], []
    t = d = 0
    for i in range(R):
        t_start.append(t)
        d_start.append(d)
        t += m[i] + 1
        d += m[i]
    out: list[list[int]] = [[] for _ in range(R)]
    accepted = [0] * R
    sampled = [i for i in range(R) if not greedy[i]]
    if len(sampled) < R:
        if target_argmax is None:
            target_argmax = target_probs.argmax(-1).tolist()
        for i in range(R):
            if not greedy[i]:
                continue
            row = t_start[i]
            a = 0
            while a < m[i] and draft_tokens[i][a] == target_argmax[row + a]:
                a += 1
            accepted[i] = a
            out[i] = draft_tokens[i][:a] + [target_argmax[row + a]]
    if not sampled:
        return out, accepted

    dev = target_probs.device
    coupled = [i for i in sampled if point_mass is not None and point_mass[i]]
    if coupled:  # the target's own draw at every row: drafts accepted while they equal it
        rows = [t_start[i] + j for i in coupled for j in range(m[i] + 1)]
        req = torch.tensor([i for i in coupled for _ in range(m[i] + 1)], device=dev)
        pos = torch.tensor([first_pos[i] + j for i in coupled for j in range(m[i] + 1)], device=dev)
        x = draw(target_probs[torch.tensor(rows, device=dev)], seeds[req], pos).tolist()
        k = 0
        for i in coupled:
            a = 0
            while a < m[i] and draft_tokens[i][a] == x[k + a]:
                a += 1
            accepted[i], out[i] = a, x[k : k + a + 1]
            k += m[i] + 1
        sampled = [i for i in sampled if not point_mass[i]]
        if not sampled:
            return out, accepted
    # accept tests for every draft row of the sampled requests
    p_rows, q_rows, toks, seed_rows, pos_rows = [], [], [], [], []
    for i in sampled:
        for j in range(m[i]):
            p_rows.append(t_start[i] + j)
            q_rows.append(d_start[i] + j)
            toks.append(draft_tokens[i][j])
            seed_rows.append(i)
            pos_rows.append(first_pos[i] + j)
    acc_flags: list[bool] = []
    if p_rows:
        pr = torch.tensor(p_rows, device=dev)
        qr = torch.tensor(q_rows, device=dev)
        tk = torch.tensor(toks, device=dev)[:, None]
        p_tok = target_probs[pr].gather(1, tk)[:, 0]
        q_tok = draft_probs[qr].gather(1, tk)[:, 0]
        u = uniform(stream(seeds[torch.tensor(seed_rows, device=dev)], STREAM_ACCEPT),
                    torch.tensor(pos_rows, device=dev))
        # u < p/q  <=>  u * q < p (q > 0: the draft drew the token from q)
        acc_flags = (u * q_tok < p_tok).tolist()
    resid_req, resid_trow, resid_qrow, bonus_req, bonus_trow = [], [], [], [], []
    k = 0
    for i in sampled:
        a = 0
        while a < m[i] and acc_flags[k + a]:
            a += 1
        k += m[i]
        accepted[i] = a
        out[i] = list(draft_tokens[i][:a])
        if a < m[i]:
            resid_req.append(i)
            resid_trow.append(t_start[i] + a)
            resid_qrow.append(d_start[i] + a)
        else:
            bonus_req.append(i)
            bonus_trow.append(t_start[i] + a)
    if resid_req:
        p = target_probs[torch.tensor(resid_trow, device=dev)]
        q = draft_probs[torch.tensor(resid_qrow, device=dev)]
        res = (p - q).clamp_(min=0)
        mass = res.sum(-1, keepdim=True)
        res = torch.where(mass > 0, res / mass.clamp(min=1e-30), p)  # p == q: never rejected; be safe
        idx = torch.tensor(resid_req, device=dev)
        pos = torch.tensor([first_pos[i] + accepted[i] for i in resid_req], device=dev)
        for i, tok in zip(resid_req, draw(res, stream(seeds[idx], STREAM_RESIDUAL), pos).tolist()):
            out[i].append(tok)
    if bonus_req:
        p = target_probs[torch.tensor(bonus_trow, device=dev)]
        idx = torch.tensor(bonus_req, device=dev)
        pos = torch.tensor([first_pos[i] + accepted[i] for i in bonus_req], device=dev)
        for i, tok in zip(bonus_req, draw(p, seeds[idx], pos).tolist()):
            out[i].append(tok)
    return out, accepted


def verify_on_device(target: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, rows: SamplingRows | None,
                     seeds: torch.Tensor, first_pos: torch.Tensor, params: list | None = None,
                     sample: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for point-mass drafts on a fixed grid, without reading anything on the host
    (async speculative steps): the same coupled draws, bit for bit.

    ``target`` [R, K + 1, V]: each request's rows p_0..p_K (logits); ``drafts`` [R, K]; ``lengths``
    [R]: drafts of each request to verify (rows past them are ignored); ``rows``: each request's
    sampling parameters (None: every request is greedy), ``params`` their ``SamplingParams`` where
    known (the filters to apply are then decided on the host); ``first_pos`` [R]: the token index of d_1;
    ``sample``: the engine's ``sample`` op, so that the target's draws are plain decoding's bit for bit
    on any backend (None: the reference's draw, :func:`filtered_probs` and :func:`draw`).
    Returns (tokens [R, K + 1]: request i emits its first ``accepted[i] + 1``; accepted [R])."""
    R, K = drafts.shape
    dev = target.device
    j = torch.arange(K, device=dev)
    valid = j[None, :] < lengths[:, None]
    safe = drafts.clamp(min=0)
    if rows is None:
        argmax = target.argmax(-1)
        ok = safe == argmax[:, :K]
    else:
        V = target.shape[-1]
        per_row = rows.index(torch.arange(R, device=dev).repeat_interleave(K + 1))
        pos = (first_pos[:, None] + torch.arange(K + 1, device=dev)[None, :]).reshape(-1)
        row_seeds = seeds.long().repeat_interleave(K + 1)
        if sample is not None:  # the target's draws
            own = sample(target.reshape(R * (K + 1), V), per_row.temperature, per_row.top_k, per_row.top_p,
                         per_row.min_p, row_seeds, pos).view(R, K + 1)
        else:
            flags = {}
            if params is not None:
                flags = dict(needs_filter=any(0 < p.top_k < V or p.top_p < 1 or p.min_p > 0 for p in params),
                             any_greedy=any(p.temperature <= 0 for p in params))
            probs = filtered_probs(target.reshape(R * (K + 1), V), per_row, **flags)
            own = draw(probs, row_seeds, pos).view(R, K + 1)
        ok = safe == own[:, :K]
    accepted = (ok & valid).long().cumprod(1).sum(1)
    final = (argmax if rows is None else own).gather(1, accepted[:, None])[:, 0]
    tokens = torch.cat([safe, torch.zeros(R, 1, dtype=torch.long, device=dev)], 1)
    tokens.scatter_(1, accepted[:, None], final[:, None])
    return tokens, accepted
