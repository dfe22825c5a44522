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
  call of 16, and cuBLAS picks batched algorithms by the group count. Here every call has a row
  count that is a multiple of a fixed *row tile* (rows are zero-padded), at most a fixed *chunk* of
  rows per call, and the other dimensions fixed by the weight. The plan (tile and chunk, or a fixed
  row count per call, or one row per call as a last resort; for batched GEMMs also a fixed group
  count per call) is chosen per (K, N, dtype, layout, threads) by a self-check on first use: rows of
  random data must come out bitwise equal wherever they sit, in calls of many sizes and group
  counts. A library or device whose kernels behave differently is detected, not assumed.
* **Row reductions outside GEMMs** (RMSNorm's mean of squares, softmax sums, the MoE weight
  normalisation) use torch's own row sum where a self-check shows it batch-independent for that row
  length (on CPU it reduces a short row in an order set by its length), else a pairwise tree over a
  zero-padded power-of-two width (element-wise adds in an order set by the length alone).
* **Attention** (``mla_decode``; ``mla_prefill`` alike) runs sequences with equal query counts
  together, the keys in fixed splits of ``KV_SPLIT`` positions counted from position 0: scores per
  split (a batched GEMM with N = KV_SPLIT), a causal bias of 0 / -inf, one exact max over the row,
  exponentials, per-split sums added split by split in order, and P·V per split added in order. A
  query at position p gets the same result whether its sequence has 1 or 500 query rows this step
  (chunked prefill) and whatever the other sequences are: splits past p add exact zeros. The
  slots and bias of a step are computed once and shared by its layers.
* **MoE**: expert GEMMs use the tiled linear whatever the number of tokens an expert receives;
  each token's expert outputs are summed in its top-k slot order.
* **Element-wise transcendentals**: torch's CPU kernels run the vectorised body and the scalar tail
  of a tensor with different formulas for some functions (``sigmoid`` and ``silu`` differ in the
  last bit), and which elements fall in the tail depends on the tensor's size and thread split. SiLU
  and the sigmoid router are written here as ``x / (1 + exp(-x))`` from ops that agree in both paths
  (``exp``, ``+``, ``/``).

Other element-wise ops (RoPE, penalties), copies (paged KV) and selection (top-k, argmax) are
batch-independent already and keep the platform's implementations, as does ``sample``, whose
counter-based RNG makes each row's draw depend only on (seed, position).

Tunables (environment): ``DEEPINFER_BI_ROW_TILE`` (first row tile tried, default 4),
``DEEPINFER_BI_KV_SPLIT`` (attention split, default 64).

The ops are plain torch, so the same set runs on a GPU (``Platform.batch_invariant_kernel_backend``
lets a platform name a faster invariant set): the self-checks then choose the tilings cuBLAS needs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deepinfer_core.kernels import KernelBackend
from kernels_cpu import ops as reference
from kernels_cpu.kv_fp8 import dequantize_latent_rows

logger = logging.getLogger("deepinfer.kernels.batch_invariant")

ROW_TILE = int(os.environ.get("DEEPINFER_BI_ROW_TILE", "4"))
KV_SPLIT = int(os.environ.get("DEEPINFER_BI_KV_SPLIT", "64"))
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


_row_sum_ok: dict[tuple, bool] = {}


def _library_row_sum_ok(n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's own ``sum(-1)`` gives each row the same result alone and among other rows
    (it reduces a row in an order set by its length, unless one long row is split over threads)."""
    key = (n, dtype, device.type, torch.get_num_threads())
    ok = _row_sum_ok.get(key)
    if ok is None:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(37, n, generator=g).to(device=device, dtype=dtype)
        full = x.sum(-1)
        ok = all(torch.equal(x[a:b].clone().sum(-1), full[a:b])
                 for a, b in ((0, 1), (5, 6), (36, 37), (3, 20), (1, 37)))
        _row_sum_ok[key] = ok
        if not ok:
            logger.info("batch-invariant row sums of length %d use the tree reduction", n)
    return ok


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, each row in a fixed order: torch's row reduction where a self-check
    shows it batch-independent for this length (short rows), else :func:`tree_sum`."""
    n = x.shape[-1]
    if n < 32768 and _library_row_sum_ok(n, x.dtype, x.device):
        return x.contiguous().sum(-1)
    return tree_sum(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with the fixed-order sum."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / row_sum(e)[..., None]


# ---- GEMM plans -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmPlan:
    """How rows (and, for batched GEMMs, groups) are fed to the library GEMM.

    ``fixed``: every call has exactly ``chunk`` rows; otherwise a call has a multiple of ``tile`` rows,
    at most ``chunk``. ``groups``: batched calls have exactly this many groups (zero-padded); 0 lets
    the group count vary (libraries such as cuBLAS pick batched algorithms by the group count)."""

    tile: int
    chunk: int
    fixed: bool = False
    groups: int = 0

    def __str__(self) -> str:
        rows = f"{self.chunk} rows per call" if self.fixed else f"row tile {self.tile}, <= {self.chunk} rows"
        return rows + (f", {self.groups} groups per call" if self.groups else "")


def _candidate_plans(batched: bool = False) -> list[GemmPlan]:
    tiles = sorted({ROW_TILE, 8, 16, 32, 64})
    plans = [GemmPlan(t, max(MAX_CHUNK // t, 1) * t) for t in tiles]
    plans += [GemmPlan(t, t, fixed=True) for t in tiles]
    plans.append(GemmPlan(1, 1, fixed=True))  # one row per call: invariant by construction
    if batched:
        plans += [replace(p, groups=g) for g in (16, 1) for p in plans]
    return plans


def _pad_rows(x: torch.Tensor, unit: int) -> torch.Tensor:
    """x[..., T, K] with T zero-padded to a multiple of ``unit``, contiguous."""
    T = x.shape[-2]
    padded = -(-T // unit) * unit
    if padded == T and x.is_contiguous():
        return x
    buf = x.new_zeros(*x.shape[:-2], padded, x.shape[-1])
    buf[..., :T, :] = x
    return buf


def _run(plan: GemmPlan, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[T, K] @ w[N, K].T under ``plan``."""
    T = x.shape[0]
    x = _pad_rows(x, plan.chunk if plan.fixed else plan.tile)
    if x.shape[0] <= plan.chunk:
        y = F.linear(x, w)
    else:
        y = x.new_empty(x.shape[0], w.shape[0])
        for i in range(0, x.shape[0], plan.chunk):
            y[i : i + plan.chunk] = F.linear(x[i : i + plan.chunk], w)
    return y if y.shape[0] == T else y[:T]


def _run_bmm(plan: GemmPlan, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[G, T, K] @ b[G, K, N] under ``plan`` (rows of every group padded alike)."""
    if plan.groups:
        G, step = a.shape[0], plan.groups
        out = []
        for g in range(0, G, step):
            ag, bg = a[g : g + step], b[g : g + step]
            n = ag.shape[0]
            if n < step:  # pad with zero groups, keeping b's layout
                bp = torch.empty_strided((step, *bg.shape[1:]), bg.stride(), dtype=bg.dtype, device=bg.device)
                bp.zero_()
                bp[:n] = bg
                ag = torch.cat((ag, ag.new_zeros(step - n, *ag.shape[1:])))
                bg = bp
            out.append(_run_bmm(replace(plan, groups=0), ag, bg)[:n])
        return out[0] if len(out) == 1 else torch.cat(out)
    T = a.shape[1]
    a = _pad_rows(a, plan.chunk if plan.fixed else plan.tile)
    if a.shape[1] <= plan.chunk:
        y = torch.bmm(a, b)
    else:
        y = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
        for i in range(0, a.shape[1], plan.chunk):
            y[:, i : i + plan.chunk] = torch.bmm(a[:, i : i + plan.chunk], b)
    return y if y.shape[1] == T else y[:, :T]


_plans: dict[tuple, GemmPlan] = {}
_plans_lock = threading.Lock()


def _probe_rows(plan: GemmPlan) -> tuple[int, list[int], list[tuple[int, int]]]:
    """Rows of the check, the rows whose results are compared, and the row windows run."""
    n = plan.chunk + plan.tile + 9
    probe = sorted({0, 1, 2, 4, plan.tile - 1, plan.tile, plan.tile + 3, plan.chunk - 1, plan.chunk, n - 1})
    windows = [(0, n), (0, 2), (1, plan.tile + 4), (3, min(n, 3 + plan.chunk)), (plan.tile - 1, n),
               (4, 4 + max(plan.tile - 1, 1))]
    # every call size up to 16 tiles, each with the probe rows at a different place
    windows += [(k % 3, k % 3 + k * plan.tile) for k in range(1, min(16, plan.chunk // plan.tile) + 1)]
    return n, probe, windows


def _linear_plan_ok(plan: GemmPlan, w: torch.Tensor) -> bool:
    g = torch.Generator().manual_seed(0x5EED)
    n, probe, windows = _probe_rows(plan)
    x = torch.randn(n, w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
    alone = {i: _run(plan, x[i : i + 1], w) for i in probe}
    for a, b in windows:
        y = _run(plan, x[a:b], w)
        if any(a <= i < b and not torch.equal(y[i - a : i - a + 1], alone[i]) for i in probe):
            return False
    return True


def _bmm_plan_ok(plan: GemmPlan, b: torch.Tensor) -> bool:
    """Rows must not depend on the row window, the number of groups or the group's position."""
    g = torch.Generator().manual_seed(0x5EED)
    n, probe, windows = _probe_rows(plan)
    G, K, N = 5, b.shape[1], b.shape[2]
    bt = torch.empty_strided((G, K, N), b.stride(), dtype=b.dtype, device=b.device)
    bt.copy_(torch.randn(G, K, N, generator=g).to(b.dtype))
    a = torch.randn(G, n, K, generator=g).to(device=b.device, dtype=b.dtype)
    alone = {(j, i): _run_bmm(plan, a[j : j + 1, i : i + 1], bt[j : j + 1]) for j in (0, 3) for i in probe}
    for g0, g1 in ((0, G), (0, 1), (3, 4), (2, G)):
        for r0, r1 in windows:
            y = _run_bmm(plan, a[g0:g1, r0:r1], bt[g0:g1])
            for (j, i), want in alone.items():
                if g0 <= j < g1 and r0 <= i < r1 and not torch.equal(y[j - g0, i - r0], want[0, 0]):
                    return False
    return True


def _plan_for(key: tuple, ok, batched: bool = False) -> GemmPlan:
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            with torch.inference_mode():
                plan = next((p for p in _candidate_plans(batched) if ok(p)), None)
                if plan is None:
                    raise RuntimeError(f"batch-invariant mode: no GEMM plan gives batch-independent results "
                                       f"for {key[:4]} on this device")
            if plan.tile != ROW_TILE or plan.fixed:
                logger.info("batch-invariant GEMM %s: %s", key[:4], plan)
            _plans[key] = plan
    return plan


def gemm_plan(w: torch.Tensor) -> GemmPlan:
    """The verified plan for ``linear`` against a weight w[N, K] of this shape, layout and dtype."""
    key = ("linear", tuple(w.shape), w.stride(), w.dtype, w.device.type, torch.get_num_threads())
    return _plan_for(key, lambda p: _linear_plan_ok(p, w))


def bmm_plan(b: torch.Tensor) -> GemmPlan:
    """The verified plan for batched GEMMs against b[G, K, N] of this layout (any G)."""
    key = ("bmm", tuple(b.shape[1:]), b.stride(), b.dtype, b.device.type, torch.get_num_threads())
    return _plan_for(key, lambda p: _bmm_plan_ok(p, b), batched=True)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[G, T, K] @ b[G, K, N]; each (group, row) result independent of G, T and its position."""
    return _run_bmm(bmm_plan(b), a, b)


# ---- ops ------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    y = _run(gemm_plan(w), x.reshape(-1, K), w)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w.shape[0])


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear(x.float(), w.float())


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                        w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels_cpu.fused.add_rms_norm_linear`` with this module's row-wise norms and fixed-tile ``linear``."""
    if residual is None:
        return linear(rms_norm(x, norm_w, eps), w), x
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    return linear(normed, w), residual


def add_rms_norm_moe_gate(x, residual, norm_w, eps, gate, bias, top_k, scoring, n_group, topk_group, group_score,
                          renormalize, scale, n_shared, dtype):
    """``kernels_cpu.fused.add_rms_norm_moe_gate`` with this module's row-wise norm and ``moe_gate``."""
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    weights, ids = moe_gate(normed, gate, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale,
                            n_shared, dtype)
    return normed, residual, weights, ids


def mla_kv_write(kv_a: torch.Tensor, norm_w: torch.Tensor, eps: float, positions: torch.Tensor,
                 cos_sin: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """``kernels_cpu.fused.mla_kv_write`` with this module's row-wise ``rms_norm`` (rope and the write are
    per token already)."""
    L = norm_w.shape[0]
    entry = torch.cat((rms_norm(kv_a[:, :L], norm_w, eps),
                       reference.rope(kv_a[:, None, L:], positions, cos_sin)[:, 0]), -1)
    reference.paged_kv_write(cache, slot_mapping, entry)
    return entry


def head_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x[T, H, K], w[H, N, K] -> [T, H, N] as one batched GEMM over heads."""
    return bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def mla_q_absorb(q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """``kernels_cpu.fused.mla_q_absorb`` with this module's ``head_linear`` (rope is per token already)."""
    N = w_uk.shape[-1]
    return torch.cat((head_linear(q[..., :N], w_uk), reference.rope(q[..., N:], positions, cos_sin)), -1)


def mla_q_absorb_kv_write(q, w_uk, positions, cos_sin, kv_a, norm_w, eps, cache, slot_mapping):
    """``kernels_cpu.fused.mla_q_absorb_kv_write`` with this module's ``mla_kv_write`` and ``mla_q_absorb``."""
    mla_kv_write(kv_a, norm_w, eps, positions, cos_sin, cache, slot_mapping)
    return mla_q_absorb(q, w_uk, positions, cos_sin)


def mla_decode_uv(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv, w_uv):
    """``kernels_cpu.fused.mla_decode_uv`` with this module's ``mla_decode`` and ``head_linear``."""
    return head_linear(mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv), w_uv)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    ms = row_sum(xf * xf) / xf.shape[-1]
    xf = xf * torch.rsqrt(ms + eps)[..., None]
    return (w.float() * xf).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    residual = x + residual
    return rms_norm(residual, w, eps), residual


def _causal_bias(qpos: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, Q, 1, KV_SPLIT] of 0 (visible) / -inf (masked) for query positions qpos[B, Q]."""
    S = KV_SPLIT
    kpos = torch.arange(n * S, device=qpos.device).view(1, n, 1, 1, S)
    hidden = kpos > qpos[:, None, :, None, None]
    return torch.zeros(hidden.shape, dtype=torch.float32, device=qpos.device).masked_fill_(hidden, float("-inf"))


def _attend(rows: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, bias: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention for B items at once: rows[B, R, Dk] over keys[B, Lp, Dk] and vals[B, Lp, Dv] (float32,
    Lp a multiple of KV_SPLIT). ``bias`` [B or 1, n, Q, 1, KV_SPLIT] (0 / -inf, from
    :func:`_causal_bias`) masks keys per query; the R rows are Q queries of R / Q rows each. Keys a row
    cannot see may hold any finite values. Returns [B, R, Dv].

    Splits of KV_SPLIT keys are batched GEMM groups; the row max is exact, each split's sum has a
    fixed order, and splits are added in order, so splits past a row's position add exact zeros."""
    B, R, Dk = rows.shape
    S, Dv = KV_SPLIT, vals.shape[-1]
    n, Q = keys.shape[1] // S, bias.shape[2]
    G = B * n
    qg = rows.unsqueeze(1).expand(B, n, R, Dk).reshape(G, R, Dk)
    scores = bmm(qg, keys.reshape(G, S, Dk).transpose(1, 2)).view(B, n, Q, R // Q, S) * scale + bias
    scores = scores.view(B, n, R, S)
    p = torch.exp(scores - scores.amax(dim=(1, 3), keepdim=True))
    sums = row_sum(p)  # [B, n, R]
    o = bmm(p.view(G, R, S), vals.reshape(G, S, Dv)).view(B, n, R, Dv)
    denom, acc = sums[:, 0], o[:, 0]
    for s in range(1, n):
        denom = denom + sums[:, s]
        acc = acc + o[:, s]
    return acc / denom[..., None]


def _padded_len(n: int) -> int:
    return max(-(-n // KV_SPLIT), 1) * KV_SPLIT


_decode_plan_cache: list = [None, None]  # (key, plan) of the last step: its layers share one plan


def _decode_plan(block_tables, cu_q_lens, seq_lens, bs: int) -> list[tuple]:
    """Per group of sequences with one query length: token rows, cache slots of their padded
    contexts and the causal bias. The same for every layer of a step, so the last one is kept."""
    cq, lens = cu_q_lens.tolist(), seq_lens.tolist()
    key = (tuple(cq), tuple(lens), bs, tuple(block_tables.shape), block_tables.cpu().numpy().tobytes())
    if _decode_plan_cache[0] == key:
        return _decode_plan_cache[1]
    dev = block_tables.device
    buckets: dict[int, list[int]] = {}
    for b in range(len(lens)):
        if cq[b + 1] > cq[b]:
            buckets.setdefault(cq[b + 1] - cq[b], []).append(b)
    plan = []
    for Q, members in buckets.items():
        idx = torch.tensor(members, device=dev)
        ctx = seq_lens[idx]
        Lp = _padded_len(max(lens[b] for b in members))
        tok = (cu_q_lens[idx][:, None] + torch.arange(Q, device=dev)).flatten()  # [nb * Q]
        pos = torch.arange(Lp, device=dev)
        tables = block_tables[idx].long()
        slots = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1).expand(len(members), -1)) * bs + pos % bs
        qpos = ctx[:, None] - Q + torch.arange(Q, device=dev)  # [nb, Q]
        plan.append((tok, slots, _causal_bias(qpos, Lp // KV_SPLIT), len(members), Q))
    _decode_plan_cache[:] = [key, plan]
    return plan


def mla_decode(q, cache, block_tables, cu_q_lens, seq_lens, scale, dv):
    """Absorbed MLA with fixed KV splits; sequences with the same query length run together. A uint8
    cache holds FP8 latent rows (kernels_cpu/kv_fp8.py)."""
    T, H, D = q.shape
    flat = cache.view(-1, cache.shape[-1])
    out = q.new_empty(T, H, dv)
    for tok, slots, bias, nb, Q in _decode_plan(block_tables, cu_q_lens, seq_lens, cache.shape[1]):
        rows = q[tok].reshape(nb, Q * H, D).float()
        kv = flat[slots]  # [nb, Lp, D]; past a context: other blocks' (finite) entries, masked
        kv = dequantize_latent_rows(kv, D, torch.float32) if cache.dtype == torch.uint8 else kv.float()
        o = _attend(rows, kv, kv[..., :dv], bias, scale)
        out[tok] = o.view(-1, H, dv).to(q.dtype)
    return out


def mla_prefill(q, k, v, cu_q_lens, cu_k_lens, scale):
    """Expanded causal attention with the same fixed KV splits, the heads of a sequence together."""
    T, H, _ = q.shape
    out = q.new_empty(T, H, v.shape[-1])
    cq, ck = cu_q_lens.tolist(), cu_k_lens.tolist()
    for b in range(len(cq) - 1):
        Q, L = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if Q == 0:
            continue
        Lp = _padded_len(L)
        keys = k.new_zeros(H, Lp, k.shape[-1], dtype=torch.float32)
        keys[:, :L] = k[ck[b] : ck[b + 1]].transpose(0, 1)
        vals = v.new_zeros(H, Lp, v.shape[-1], dtype=torch.float32)
        vals[:, :L] = v[ck[b] : ck[b + 1]].transpose(0, 1)
        bias = _causal_bias(torch.arange(L - Q, L, device=q.device)[None], Lp // KV_SPLIT)
        o = _attend(q[cq[b] : cq[b + 1]].transpose(0, 1).float(), keys, vals, bias, scale)  # [H, Q, Dv]
        out[cq[b] : cq[b + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Per-row log-sum-exp with the row sum of :func:`row_sum` (CUDA's own reduction changes with the
    number of rows)."""
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.log(row_sum(torch.exp(x - m))) + m[..., 0]


def greedy_sample(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's greedy draw (``argmax`` is batch-independent) with :func:`logsumexp` above."""
    return reference.greedy_with_lse(x, logsumexp(x))


def moe_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    logits = logits.float()
    if scoring == "softmax":
        scores = softmax(logits)
    elif scoring == "sigmoid":
        scores = sigmoid(logits)
    else:
        raise ValueError(f"moe_route: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    ids = reference.select_experts(scores if bias is None else scores + bias.float(), top_k, n_group, topk_group,
                                   group_score)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (row_sum(weights)[:, None] + 1e-20)
    return weights * scale, ids


def moe_gate(x, gate, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale, n_shared, dtype):
    """``kernels_cpu.fused.moe_gate`` with this module's ``linear_f32`` and ``moe_route``."""
    weights, ids = moe_route(linear_f32(x, gate), bias, top_k, scoring, n_group, topk_group, group_score,
                             renormalize, scale)
    if n_shared:
        T, E = ids.shape[0], gate.shape[0]
        shared = torch.arange(E, E + n_shared, dtype=ids.dtype, device=ids.device)
        ids = torch.cat((ids, shared.expand(T, n_shared)), 1)
        weights = torch.cat((weights, weights.new_ones(T, n_shared)), 1)
    return weights.to(dtype), ids


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
        "linear", "linear_f32", "add_rms_norm_linear", "mla_kv_write", "mla_q_absorb", "mla_q_absorb_kv_write",
        "head_linear", "rms_norm",
        "add_rms_norm", "silu_and_mul",
        "mla_decode", "mla_decode_uv", "mla_prefill",
        "moe_route", "moe_gate", "add_rms_norm_moe_gate", "fused_moe", "logsumexp",
        "greedy_sample",
    )}
