"""Batch-invariant ops: each token's result is bitwise independent of what else is in the batch.

Enabled by ``DEEPINFER_BATCH_INVARIANT=1`` (config ``batch_invariant = true``): the engine loads the
platform's ``batch_invariant_kernel_backend`` (this module's :class:`BatchInvariantKernels` by default)
and overrides its ops, and routes every sequence, prefill chunks included, through the absorbed
``mla_decode`` path, so a token gets the same logits alone, in any batch, at any position in the
batch and under any chunked-prefill split.

Where batch dependence comes from, and what is done about it here:

* **GEMMs** (``linear``, ``head_linear``, the expert GEMMs of ``fused_moe``, the two products inside
  attention). BLAS libraries pick kernels, blocking and thread partitions from the matrix shape: on
  x86 MKL a row computed in a call of 1-11 rows can differ in the last bit from the same row in a
  call of 16. Here every call has a row count that is a multiple of a fixed *row tile* (rows are
  zero-padded), at most a fixed *chunk* of rows per call, and the other two dimensions fixed by the
  weight. The plan (tile, chunk, or a fixed row count per call, or one row per call as a last resort)
  is chosen per (K, N, dtype, layout, threads) by a self-check that runs on first use: rows of random
  data must come out bitwise equal wherever they sit in calls of many sizes. So a library or device
  whose kernels behave differently is detected, not assumed.
* **Reductions outside GEMMs** (RMSNorm's mean of squares, softmax sums, the MoE weight
  normalisation) use a fixed pairwise tree over a zero-padded power-of-two width: elementwise adds in
  an order that depends only on the reduced length.
* **Attention** is computed per sequence with the keys in fixed splits of ``KV_SPLIT`` positions
  counted from position 0: scores per split (a tiled GEMM with N = KV_SPLIT), one exact max over the
  row, exponentials, per-split tree sums added split by split in order, and P·V per split added in
  order. A query row at position p gets the same result whether its sequence has 1 or 500 query
  rows this step (chunked prefill) and whatever the other sequences are: splits past p add exact
  zeros.
* **MoE**: expert GEMMs use the tiled linear whatever the number of tokens an expert receives;
  each token's expert outputs are summed in its top-k slot order.

* **Element-wise transcendentals**: torch's CPU kernels run the vectorised body and the scalar tail
  of a tensor with different formulas for some functions (``sigmoid`` and ``silu`` differ in the
  last bit), and which elements fall in the tail depends on the tensor's size and thread split. SiLU
  and the sigmoid router are written here as ``x / (1 + exp(-x))`` from ops that agree in both paths
  (``exp``, ``+``, ``/``).

Other element-wise ops (RoPE, penalties), copies (paged KV) and selection (top-k, argmax) are
batch-independent already and keep the reference implementations, as does ``sample``, whose
counter-based RNG makes each row's draw depend only on (seed, position).

Tunables (environment): ``DEEPINFER_BI_ROW_TILE`` (first row tile tried, default 16),
``DEEPINFER_BI_KV_SPLIT`` (attention split, default 256).

The same design carries to GPUs (fixed tiles, no split-K, per-sequence fixed KV splits); the
self-check then picks fixed-row-count calls if cuBLAS changes algorithms with M.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer_core.kernels import KernelBackend

logger = logging.getLogger("deepinfer.kernels.batch_invariant")

ROW_TILE = int(os.environ.get("DEEPINFER_BI_ROW_TILE", "16"))
KV_SPLIT = int(os.environ.get("DEEPINFER_BI_KV_SPLIT", "256"))
MAX_CHUNK = 256  # rows per GEMM call at most


# ---- fixed-order reductions -----------------------------------------------------------------
def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by pairwise halving of a zero-padded power-of-two width."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with the fixed-order sum."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / tree_sum(e)[..., None]


# ---- GEMM plans -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmPlan:
    """How rows are fed to the library GEMM.

    ``fixed``: every call has exactly ``chunk`` rows; otherwise a call has a multiple of ``tile`` rows,
    at most ``chunk``."""

    tile: int
    chunk: int
    fixed: bool = False

    def __str__(self) -> str:
        return f"{self.chunk} rows per call" if self.fixed else f"row tile {self.tile}, <= {self.chunk} rows"


def _candidate_plans() -> list[GemmPlan]:
    tiles = sorted({ROW_TILE, 32, 64})
    plans = [GemmPlan(t, max(MAX_CHUNK // t, 1) * t) for t in tiles]
    plans += [GemmPlan(t, t, fixed=True) for t in tiles]
    plans.append(GemmPlan(1, 1, fixed=True))  # one row per call: invariant by construction
    return plans


def _run(plan: GemmPlan, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[T, K] @ w[N, K].T under ``plan``."""
    T = x.shape[0]
    step = plan.chunk
    if not plan.fixed and T <= step and T % plan.tile == 0 and x.is_contiguous():
        return F.linear(x, w)
    unit = plan.chunk if plan.fixed else plan.tile
    padded = -(-T // unit) * unit
    if padded != T or not x.is_contiguous():
        buf = x.new_zeros(padded, x.shape[1])
        buf[:T] = x
        x = buf
    if padded <= step:
        return F.linear(x, w)[:T]
    out = torch.cat([F.linear(x[i : i + step], w) for i in range(0, padded, step)])
    return out[:T]


_plans: dict[tuple, GemmPlan] = {}
_plans_lock = threading.Lock()


def _plan_key(w: torch.Tensor) -> tuple:
    return (tuple(w.shape), w.stride(), w.dtype, w.device.type, torch.get_num_threads())


def _plan_ok(plan: GemmPlan, w: torch.Tensor) -> bool:
    K = w.shape[1]
    g = torch.Generator().manual_seed(0x5EED)
    n = plan.chunk + plan.tile + 9
    x = torch.randn(n, K, generator=g).to(device=w.device, dtype=w.dtype)
    probe = sorted({0, 1, 4, plan.tile - 1, plan.tile, plan.tile + 3, plan.chunk - 1, plan.chunk, n - 1})
    alone = {i: _run(plan, x[i : i + 1], w) for i in probe}
    windows = [(0, n), (0, 2), (1, plan.tile + 4), (3, min(n, 3 + plan.chunk)), (plan.tile - 1, n),
               (4, 4 + max(plan.tile - 1, 1))]
    for a, b in windows:
        y = _run(plan, x[a:b], w)
        for i in probe:
            if a <= i < b and not torch.equal(y[i - a : i - a + 1], alone[i]):
                return False
    return True


def gemm_plan(w: torch.Tensor) -> GemmPlan:
    """The verified plan for GEMMs against a weight of this shape, layout and dtype."""
    key = _plan_key(w)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            with torch.inference_mode():
                plan = next(p for p in _candidate_plans() if _plan_ok(p, w))
            if plan.tile != ROW_TILE or plan.fixed:
                logger.info("batch-invariant GEMM %s: %s", key[:3], plan)
            _plans[key] = plan
    return plan


# ---- ops ------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    y = _run(gemm_plan(w), x.reshape(-1, K), w)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[T, H, K], w[H, N, K] -> [T, H, N], one tiled GEMM per head."""
    T, H, _ = x.shape
    xh = x.transpose(0, 1).contiguous()  # [H, T, K]
    out = x.new_empty(T, H, w.shape[1])
    for h in range(H):
        out[:, h] = linear(xh[h], w[h])
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    ms = tree_sum(xf * xf) / xf.shape[-1]
    xf = xf * torch.rsqrt(ms + eps)[..., None]
    return (w.float() * xf).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    residual = x + residual
    return rms_norm(residual, w, eps), residual


def _split_sum(p: torch.Tensor, split: int) -> torch.Tensor:
    """Row sums of p[R, n*split]: a tree sum per split, then the splits added in order."""
    parts = tree_sum(p.view(p.shape[0], -1, split))  # [R, n]
    total = parts[:, 0]
    for s in range(1, parts.shape[1]):
        total = total + parts[:, s]
    return total


def _attend(rows: torch.Tensor, keys: torch.Tensor, values_t: torch.Tensor, qpos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Causal attention of rows[R, Dk] (float32) over keys[Lp, Dk] and values_t[Dv, Lp] whose length
    is a multiple of KV_SPLIT and whose rows past the context are zero; row r sees keys <= qpos[r]."""
    S = KV_SPLIT
    n = keys.shape[0] // S
    scores = torch.cat([linear(rows, keys[s * S : (s + 1) * S]) for s in range(n)], dim=1) * scale
    kpos = torch.arange(n * S, device=rows.device)
    scores.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    denom = _split_sum(p, S)
    o = linear(p[:, :S], values_t[:, :S])
    for s in range(1, n):
        o = o + linear(p[:, s * S : (s + 1) * S], values_t[:, s * S : (s + 1) * S])
    return o / denom[:, None]


def _padded_len(n: int) -> int:
    return max(-(-n // KV_SPLIT), 1) * KV_SPLIT


def mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    """Absorbed MLA per sequence with fixed KV splits (see the module docstring)."""
    T, H, D = q.shape
    bs = cache.shape[1]
    flat = cache.view(-1, D)
    out = q.new_empty(T, H, dv)
    tables = block_tables.long()
    cq, lens = cu_q_lens.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        q0, q1 = cq[b], cq[b + 1]
        Q = q1 - q0
        if Q == 0:
            continue
        Lp = _padded_len(L)
        pos = torch.arange(Lp, device=q.device)
        blocks = tables[b, (pos // bs).clamp(max=tables.shape[1] - 1)]
        kv = flat[blocks * bs + pos % bs].float()
        kv[L:] = 0
        rows = q[q0:q1].reshape(Q * H, D).float()
        qpos = torch.arange(L - Q, L, device=q.device).repeat_interleave(H)
        o = _attend(rows, kv, kv[:, :dv].t(), qpos, scale)
        out[q0:q1] = o.view(Q, H, dv).to(q.dtype)
    return out


def mla_prefill(q, k, v, cu_q_lens, cu_k_lens, scale):
    """Expanded causal attention, per sequence and head, with the same fixed KV splits."""
    T, H, _ = q.shape
    out = q.new_empty(T, H, v.shape[-1])
    cq, ck = cu_q_lens.tolist(), cu_k_lens.tolist()
    for b in range(len(cq) - 1):
        Q, L = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if Q == 0:
            continue
        Lp = _padded_len(L)
        qpos = torch.arange(L - Q, L, device=q.device)
        for h in range(H):
            keys = k.new_zeros(Lp, k.shape[-1], dtype=torch.float32)
            keys[:L] = k[ck[b] : ck[b + 1], h]
            vals = v.new_zeros(v.shape[-1], Lp, dtype=torch.float32)
            vals[:, :L] = v[ck[b] : ck[b + 1], h].t()
            out[cq[b] : cq[b + 1], h] = _attend(q[cq[b] : cq[b + 1], h].float(), keys, vals, qpos,
                                                scale).to(q.dtype)
    return out


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    logits = logits.float()
    if scoring == "softmax":
        scores = softmax(logits)
    elif scoring == "sigmoid":
        scores = sigmoid(logits)
    else:
        raise ValueError(f"moe_route: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    choice = scores if bias is None else scores + bias.float()
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
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(topk_group, dim=-1).indices,
                                                                   True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (tree_sum(weights)[:, None] + 1e-20)
    return weights * scale, ids


def fused_moe(x, w13, w2, weights, ids):
    """Expert MLPs with tiled GEMMs; each token's outputs summed in its top-k slot order."""
    T, C = x.shape
    E, k = w13.shape[0], ids.shape[1]
    flat_ids = ids.reshape(-1)
    local = (flat_ids >= 0) & (flat_ids < E)
    order = torch.argsort(torch.where(local, flat_ids, E), stable=True)
    counts = torch.bincount(flat_ids[local], minlength=E).tolist()
    contrib = torch.zeros(T * k, C, dtype=torch.float32, device=x.device)
    w = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        h = silu_and_mul(linear(x[slots // k], w13[e]))
        contrib[slots] = linear(h, w2[e]).float() * w[slots, None].float()
        start += n
    contrib = contrib.view(T, k, C)
    out = contrib[:, 0]
    for j in range(1, k):
        out = out + contrib[:, j]
    return out.to(x.dtype)


class BatchInvariantKernels(KernelBackend):
    """Ops whose per-token results do not depend on the batch (see the module docstring)."""

    name = "batch_invariant"
    core_api_version = "1.0"
    ops = {name: f"kernels_cpu.batch_invariant:{name}" for name in (
        "linear", "head_linear", "rms_norm", "add_rms_norm", "silu_and_mul", "mla_decode", "mla_prefill",
        "moe_route", "fused_moe",
    )}
