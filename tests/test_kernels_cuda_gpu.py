"""GPU conformance of the TileLang backend (``kernels_cuda``) against the reference ops.

Skipped without a CUDA device. Two layers:

* the shared conformance kit (``deepinfer_core.testing``: small shapes, every edge case it knows),
  at block sizes 16 and 64;
* real-model shapes the kit does not reach: MLA decode with 576/512 latents at 16 and 128 heads,
  block sizes 16 and 64, long contexts (split-KV + combine), ragged multi-token queries; prefill
  192/128 with cached prefixes; fused MoE at V2-Lite widths with remote experts at small and large
  batch (both tile configurations); the V3 gate; a 102400-token vocabulary for sampling (bit-exact).

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU, the same calls only compile their kernels (no
comparison): ``examples/kernel_warm.py`` uses that to fill TileLang's cache ahead of a GPU run.
"""

import math
import os

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY, HAS_CUDA

from kernels_cpu import ops as ref

pytestmark = GPU_OR_DRY
DEV = "cuda" if HAS_CUDA else "cpu"
RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="runs kernels (DEEPINFER_TL_DRYRUN only compiles)")


def close(out: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """The kit's rule: |out - ref| <= rtol * (|ref| + rms(ref)), truth in float32 or better."""
    if DRY:
        return
    o, r = out.detach().double().cpu(), truth.detach().double().cpu()
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    rtol = RTOL[dtype]
    bound = rtol * (r.abs() + r.pow(2).mean().sqrt().clamp_min(1e-12))
    err = (o - r).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3e}, {worst:.2f}x the tolerance"


def up(*ts):
    return tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts)


up_ = up  # for tests whose parameter is named ``up``


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(g, *shape, dtype=torch.bfloat16, scale=1.0):
    if DRY:  # compile-only: the values are never looked at
        return torch.zeros(*shape, dtype=dtype, device=DEV)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


# ---- the conformance kit ------------------------------------------------------------------------
def _kit_cases():
    from deepinfer_core.testing.kernels import kernel_conformance_cases
    from kernels_cuda import CudaKernels

    return [(op, dt, bs) for op, dt in kernel_conformance_cases(CudaKernels) for bs in (16, 64)]


@pytest.mark.parametrize("op,dtype,block_size", _kit_cases())
def test_conformance_kit(op, dtype, block_size, monkeypatch):
    from deepinfer_core.testing import kernels as kit
    from kernels_cuda import CudaKernels

    if DRY:  # compile only: the outputs of kernels that did not run are not compared
        for name in ("_compare", "_check_moe_route", "_check_sample"):
            monkeypatch.setattr(kit, name, lambda *a, **k: None)
    kit.check_op(CudaKernels, op, dtype, DEV, block_size=block_size)


# ---- MLA decode ---------------------------------------------------------------------------------
def paged(g, seq_lens, bs, D, dtype=torch.bfloat16, extra_cols=3):
    per = [max(1, math.ceil(n / bs)) for n in seq_lens]
    nb = sum(per) + 5
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(len(seq_lens)))
    width = max(per) + extra_cols
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)  # junk past each sequence
    used = 0
    for b, n in enumerate(per):
        tables[b, :n] = order[used:used + n]
        used += n
    cache = randn(g, nb, bs, D, dtype=dtype)
    return cache, tables.to(DEV)


WS = {"kernel": "ws", "BH": 64, "BN": 64}
MLA_DECODE_CASES = [
    # label, heads, block size, q_lens, seq_lens, n_split (None: automatic), tile config (None: default)
    ("V3 heads, bs64, decode", 128, 64, [1] * 6, [1, 63, 64, 65, 1000, 3001], None, None),
    ("V2-Lite heads, bs16, decode", 16, 16, [1] * 6, [1, 15, 16, 17, 999, 2500], None, None),
    ("V3 heads, bs16, forced split", 128, 16, [1] * 3, [5, 700, 2000], 7, None),
    ("V2-Lite heads, bs64, ragged (MTP)", 16, 64, [1, 3, 2, 4], [9, 3, 300, 1200], None, None),
    ("V3 heads, bs64, ragged + split", 128, 64, [2, 1, 3], [2, 500, 1500], 5, None),
    ("32 heads, bs64, one long", 32, 64, [1], [8191], None, None),
    ("V2-Lite heads, bs16, warp-specialised (padded heads)", 16, 16, [1, 2, 1], [5, 300, 2000], None, WS),
    ("V3 heads, bs64, auto-pipelined tile kernel", 128, 64, [1, 1], [70, 900], None,
     {"BH": 64, "BN": 64, "stages": 2, "threads": 256}),
    ("V2-Lite heads, bs64, 8 consumer warps", 16, 64, [1, 2, 1], [64, 700, 3000], None,
     {"BH": 16, "BN": 64, "stages": 2, "threads": 256}),
    # batch 1 (one CTA: the split grid of 64, sized on the device to >= SPLIT_KEYS keys per split)
    ("V2-Lite heads, bs64, batch 1, 1 key", 16, 64, [1], [1], None, None),
    ("V2-Lite heads, bs64, batch 1, 63 keys", 16, 64, [1], [63], None, None),
    ("V2-Lite heads, bs64, batch 1, 64 keys", 16, 64, [1], [64], None, None),
    ("V2-Lite heads, bs64, batch 1, 65 keys", 16, 64, [1], [65], None, None),
    ("V2-Lite heads, bs64, batch 1, 2049 keys", 16, 64, [1], [2049], None, None),
    ("V2-Lite heads, bs16, batch 1, 4100 keys", 16, 16, [1], [4100], None, None),
    ("V2-Lite heads, bs64, batch 1, 40000 keys (64 splits)", 16, 64, [1], [40000], None, None),
    ("V3 heads, bs64, batch 1, 4097 keys", 128, 64, [1], [4097], None, None),
    ("V2-Lite heads, bs64, ragged batch 2 of 3 tokens", 16, 64, [2, 1], [65, 4096], None, None),
    ("V2-Lite heads, bs64, batch 130 (one wave: no split)", 16, 64, [1] * 130, [1 + 37 * i for i in range(130)],
     None, None),
]


@pytest.mark.parametrize("case", MLA_DECODE_CASES, ids=[c[0] for c in MLA_DECODE_CASES])
def test_mla_decode_real_shapes(case):
    from kernels_cuda.mla_decode import mla_decode

    _, H, bs, q_lens, seq_lens, n_split, cfg = case
    g = gen(1)
    L, R = 512, 64
    cache, tables = paged(g, seq_lens, bs, L + R)
    q = randn(g, sum(q_lens), H, L + R)
    cu = torch.tensor([0, *q_lens], device=DEV).cumsum(0)
    sl = torch.tensor(seq_lens, device=DEV)
    scale = 192 ** -0.5
    out = mla_decode(q, cache, tables, cu, sl, scale, L, n_split=n_split, cfg=cfg)
    if not DRY:
        truth = ref.mla_decode(*up(q, cache), tables.clamp_min(0), cu, sl, scale, L)
        close(out, truth, torch.bfloat16, f"mla_decode {case[0]}")


@pytest.mark.parametrize("split_keys", [64, 128, 512])
@pytest.mark.parametrize("seq_lens", [[1], [65], [3000], [63, 700, 5000]], ids=str)
def test_mla_decode_split_sizes(split_keys, seq_lens):
    """Every split size the policy may pick: splits past the context idle and the combine reads only the
    live ones (a prefix of the grid)."""
    from kernels_cuda.mla_decode import mla_decode

    g = gen(3)
    L, R = 512, 64
    cache, tables = paged(g, seq_lens, 64, L + R)
    q = randn(g, len(seq_lens), 16, L + R)
    cu = torch.arange(len(seq_lens) + 1, device=DEV)
    sl = torch.tensor(seq_lens, device=DEV)
    out = mla_decode(q, cache, tables, cu, sl, 0.1, L, split_keys=split_keys)
    if not DRY:
        close(out, ref.mla_decode(*up(q, cache), tables.clamp_min(0), cu, sl, 0.1, L), torch.bfloat16,
              f"mla_decode split_keys={split_keys} {seq_lens}")


def test_mla_decode_graph_capture():
    """No host synchronisation inside: the op can be captured in a CUDA graph and replayed."""
    if DRY:
        pytest.skip("needs a GPU")
    from kernels_cuda.mla_decode import mla_decode

    g = gen(2)
    seq_lens = [100, 2000, 37]
    cache, tables = paged(g, seq_lens, 64, 576)
    q = randn(g, 3, 16, 576)
    cu = torch.arange(4, device=DEV)
    sl = torch.tensor(seq_lens, device=DEV)
    out = mla_decode(q, cache, tables, cu, sl, 0.1, 512)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = mla_decode(q, cache, tables, cu, sl, 0.1, 512)
    q.copy_(randn(g, 3, 16, 576))
    graph.replay()
    torch.cuda.synchronize()
    out = mla_decode(q, cache, tables, cu, sl, 0.1, 512)
    assert torch.equal(out, out_g)


# ---- MLA prefill --------------------------------------------------------------------------------
PREFILL_CASES = [
    ("no prefix", 16, [1, 100, 300, 7], [1, 100, 300, 7]),
    ("prefix hits and chunks", 16, [5, 129, 64, 200], [5, 700, 64 + 64, 1000]),
    ("V3 heads", 128, [257], [300]),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_mla_prefill_real_shapes(case):
    from kernels_cuda.mla_prefill import mla_prefill

    _, H, q_lens, k_lens = case
    g = gen(3)
    q = randn(g, sum(q_lens), H, 192)
    k = randn(g, sum(k_lens), H, 192)
    v = randn(g, sum(k_lens), H, 128)
    cq = torch.tensor([0, *q_lens], device=DEV).cumsum(0)
    ck = torch.tensor([0, *k_lens], device=DEV).cumsum(0)
    out = mla_prefill(q, k, v, cq, ck, 192 ** -0.5)
    if not DRY:
        close(out, ref.mla_prefill(*up(q, k, v), cq, ck, 192 ** -0.5), torch.bfloat16, f"mla_prefill {case[0]}")


# ---- MoE ----------------------------------------------------------------------------------------
MOE_CASES = [
    # label, T, E, C, I, k
    ("V2-Lite widths, 1 token", 1, 64, 2048, 1408, 6),
    ("V2-Lite widths, 37 tokens", 37, 64, 2048, 1408, 6),
    ("V2-Lite widths, 1500 tokens (large tiles)", 1500, 64, 2048, 1408, 6),
    ("V3 widths, 16 experts, 5 tokens", 5, 16, 7168, 2048, 8),
]


@pytest.mark.parametrize("case", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_fused_moe_real_shapes(case):
    from kernels_cuda.moe import fused_moe

    _, T, E, C, I, k = case
    g = gen(4)
    x = randn(g, T, C)
    w13 = randn(g, E, 2 * I, C, scale=C ** -0.5)
    w2 = randn(g, E, C, I, scale=I ** -0.5)
    ids = torch.stack([torch.randperm(E + 4, generator=torch.Generator().manual_seed(t))[:k] - 2
                       for t in range(T)]).to(DEV)  # some ids < 0 or >= E: other ranks' experts
    weights = torch.rand(T, k, generator=g, device=DEV).to(torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, ids)
    if not DRY:
        close(out, ref.fused_moe(*up(x, w13, w2, weights), ids), torch.bfloat16, f"fused_moe {case[0]}")


# ---- router, norms, cache write, sampling ---------------------------------------------------------
ROUTE_CASES = [
    ("V3 gate", 256, 8, "sigmoid", True, 8, 4, "top2sum", True, 2.5),
    ("V2-Lite gate", 64, 6, "softmax", False, 1, 1, "max", False, 1.0),
    ("V2 gate (groups)", 160, 6, "softmax", False, 8, 3, "max", False, 16.0),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_moe_route_real_shapes(case):
    from kernels_cuda.moe_route import moe_route

    _, E, k, scoring, has_bias, ng, tg, gs, renorm, scale = case
    g = gen(5)
    logits = randn(g, 300, E, dtype=torch.float32, scale=2.0)
    bias = randn(g, E, dtype=torch.float32, scale=0.05) if has_bias else None
    w, ids = moe_route(logits, bias, k, scoring, ng, tg, gs, renorm, scale)
    if DRY:
        return
    rw, rids = ref.moe_route(logits, bias, k, scoring, ng, tg, gs, renorm, scale)
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    # near-ties (|gap| < 1e-6) may legitimately pick another expert; random logits have few
    assert same.float().mean().item() > 0.99, f"{case[0]}: {int((~same).sum())} tokens routed differently"
    wo = w.gather(1, ids.sort(-1).indices)[same]
    wr = rw.gather(1, rids.sort(-1).indices)[same]
    close(wo, wr, torch.float32, f"moe_route {case[0]} weights")


GATE_CASES = [  # label, C, route case, shared experts
    ("V2-Lite", 2048, ROUTE_CASES[1], 2), ("V3", 7168, ROUTE_CASES[0], 1), ("V2 groups", 5120, ROUTE_CASES[2], 2)]


def _gate_inputs(case, T, seed):
    """x[T, C] bf16 whose routes have a clear margin (the kit's rule), the float32 gate, the bias."""
    from deepinfer_core.testing.kernel_cases import _route_margin

    _, C, (_, E, k, scoring, has_bias, ng, tg, gs, renorm, scale), S = case
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, C, generator=g) * 2.0 * C**-0.5
    bias = torch.randn(E, generator=g) * 0.05 if has_bias else None
    rows = []
    while len(rows) < T:
        cand = torch.randn(4 * T, C, generator=g).to(torch.bfloat16)
        rows.extend(cand[_route_margin(cand.float() @ gate.T, bias, k, scoring, ng, tg, gs) >= 1e-3])
    args = (k, scoring, ng, tg, gs, renorm, scale, S, torch.bfloat16)
    return torch.stack(rows[:T]).to(DEV), gate.to(DEV), None if bias is None else bias.to(DEV), args


def _check_gate(out, x, gate, bias, args, what):
    from kernels_cpu.fused import moe_gate as reference

    w, ids = out
    rw, rids = reference(x.cpu(), gate.cpu(), None if bias is None else bias.cpu(), *args)
    assert w.dtype == torch.bfloat16 and ids.dtype == torch.int64 and ids.shape == rids.shape, what
    assert torch.equal(ids.sort(-1).values.cpu(), rids.sort(-1).values), f"{what}: routed differently"
    close(w.gather(1, ids.sort(-1).indices).float(), rw.gather(1, rids.sort(-1).indices).float(), torch.bfloat16,
          f"{what} weights")


@pytest.mark.parametrize("T", [1, 3, 8, 20])  # 20: the two-launch path (GEMV + route)
@pytest.mark.parametrize("case", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_moe_gate_real_shapes(case, T):
    """The router from the activations with the shared experts appended: one launch up to 8 tokens (the last
    CTA of a token routes it), twice in a row (the counters must be back at 0)."""
    from kernels_cuda.moe_route import moe_gate

    x, gate, bias, args = _gate_inputs(case, T, T)
    for rep in range(2):
        out = moe_gate(x, gate, bias, *args)
        if not DRY:
            _check_gate(out, x, gate, bias, args, f"moe_gate {case[0]} T={T} call {rep}")


@needs_cuda
def test_moe_gate_graph_replays():
    """Captured once, replayed on new activations: each replay routes them (the counters reset themselves)."""
    from kernels_cuda.moe_route import moe_gate

    x, gate, bias, args = _gate_inputs(GATE_CASES[0], 4, 1)
    moe_gate(x, gate, bias, *args)  # counters made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gate(x, gate, bias, *args)
    for seed in (2, 3, 4):
        x2 = _gate_inputs(GATE_CASES[0], 4, seed)[0]
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        _check_gate(out, x, gate, bias, args, f"replay seed {seed}")


@pytest.mark.parametrize("C", [7168, 2048, 5120, 24, 40])  # 24: the tiny test model (a padded row)
def test_norms_real_shapes(C):
    from kernels_cuda.norm import add_rms_norm, rms_norm

    g = gen(6)
    x = randn(g, 257, C, scale=3.0)
    r = randn(g, 257, C, scale=3.0)
    w = (1 + randn(g, C, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    y = rms_norm(x, w, 1e-6)
    y2, r2 = add_rms_norm(x, r, w, 1e-6)
    if DRY:
        return
    close(y, ref.rms_norm(*up(x, w), 1e-6), torch.bfloat16, "rms_norm")
    assert torch.equal(r2, x + r), "add_rms_norm residual must equal the bf16 sum"
    close(y2, ref.rms_norm(r2.float(), w.float(), 1e-6), torch.bfloat16, "add_rms_norm")


@pytest.mark.parametrize("bs", [16, 64])
def test_paged_kv_write_real_shapes(bs):
    from kernels_cuda.kv_cache import paged_kv_write

    g = gen(7)
    cache = randn(g, 40, bs, 576)
    expect = cache.clone()
    slots = torch.randperm(40 * bs, generator=torch.Generator().manual_seed(0))[:300].to(DEV)
    slots[::7] = -1
    kv = randn(g, 300, 576)
    paged_kv_write(cache, slots, kv)
    if DRY:
        return
    keep = slots >= 0
    expect.view(-1, 576)[slots[keep]] = kv[keep]
    assert torch.equal(cache, expect)


def test_sample_large_vocab_bit_exact():
    from kernels_cuda.sampling import sample

    V = 102400
    rows = [  # temperature, top_k, top_p, min_p, seed, offset
        (0.0, 0, 1.0, 0.0, 1, 0), (1.0, 0, 1.0, 0.0, 2, 5), (0.7, 50, 1.0, 0.0, 3, 1),
        (1.0, 0, 0.9, 0.0, 4, 2), (0.8, 40, 0.95, 0.05, 5, 9), (1.2, 0, 1.0, 0.1, 6, 3),
        (1.0, 1, 1.0, 0.0, 7, 0), (1.0, 0, 0.5, 0.0, -123456789, 77), (1.0, 2000, 0.99, 0.0, 2**40 + 3, 2**33),
    ]
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(len(rows), V, generator=g) * 3
    t, k, p, m, s, o = (torch.tensor(c) for c in zip(*rows))
    args = (logits, t.float(), k, p.float(), m.float(), s, o)
    out = sample(*(a.to(DEV) for a in args))
    if DRY:
        return
    expect = ref.sample(*args)  # on the CPU, as the kit does
    assert torch.equal(out.cpu(), expect), f"rows differ: {(out.cpu() != expect).nonzero().flatten().tolist()}"


# ---- MXFP8 window KV snapshots ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_flash_snapshot_bit_exact(dtype):
    """A V4-Flash window snapshot (43 layers x 128 tokens x 512) at mixed magnitudes: bytes equal to the
    reference, 528 per row, and the dequantised rows equal the reference's."""
    from kernels_cpu import mxfp8 as ref_mx
    from kernels_cuda.mxfp8 import mxfp8_dequant, mxfp8_quant, ue8m0_scale

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(43 * 128, 512, generator=g) * torch.logspace(-4, 4, 43 * 128)[:, None]).to(dtype)
    x[5, 7], x[9, 100], x[17, 300] = float("inf"), -float("inf"), float("nan")
    packed = mxfp8_quant(x.to(DEV))
    back = mxfp8_dequant(packed, torch.bfloat16)
    amax = x.float().abs().nan_to_num(posinf=0.0, neginf=0.0).reshape(-1, 16, 32).amax(-1)
    scales = ue8m0_scale(amax.to(DEV))
    if DRY:
        return
    want = ref_mx.mxfp8_quant(x)
    assert packed.shape == (43 * 128, 528) and torch.equal(packed.cpu(), want)
    assert torch.equal(scales.cpu(), want[:, 512:])
    # the NaN input dequantises to NaN on both sides, which torch.equal never calls equal
    torch.testing.assert_close(back.cpu(), ref_mx.mxfp8_dequant(want, torch.bfloat16), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("B,K", [(1, 4), (64, 8), (300, 16)])
def test_draft_lengths_serving_shapes_exact(B, K):
    """Speculative draft lengths at serving batch sizes: the same lengths as the reference, with
    many tied products (certain drafts), every budget regime, and more requests than a CTA's threads."""
    from kernels_cuda.draft_lengths import draft_lengths

    g = torch.Generator().manual_seed(B + K)
    conf = torch.rand(B, K, generator=g).sqrt()
    conf[::7] = 1.0
    conf[1::5] = conf[2::5][: conf[1::5].shape[0]] if B > 2 else conf[1::5]
    maxd = torch.randint(0, K + 1, (B,), generator=g)
    for budget, thr in ((0, 0.0), (B, 0.0), (B * K // 3, 0.2), (B * K, 0.6), (10**6, 0.0)):
        out = draft_lengths(conf.to(DEV), maxd.to(DEV), budget, thr)
        if DRY:
            continue
        expect = ref.draft_lengths(conf, maxd, budget, thr)
        assert torch.equal(out.cpu(), expect), f"budget {budget} thr {thr}: rows " \
            f"{(out.cpu() != expect).nonzero().flatten().tolist()}"


# ---- decode fusion: small-M GEMV and the fused MLA cache write ---------------------------------
GEMV_SHAPES = [  # (N, K, weight dtype): V2-Lite q+kv_a, o, shared w13 / w2, LM head; V3 q_b, o; routers; odd N
    (3648, 2048, torch.bfloat16), (2048, 2048, torch.bfloat16), (5632, 2048, torch.bfloat16),
    (2048, 2816, torch.bfloat16), (102400, 2048, torch.bfloat16), (24576, 1536, torch.bfloat16),
    (7168, 16384, torch.bfloat16), (64, 2048, torch.float32), (256, 7168, torch.float32),
    (3650, 1416, torch.bfloat16)]


@pytest.mark.parametrize("N,K,w_dtype,M", [(*s, m) for s in GEMV_SHAPES for m in (1, 2, 8)]
                         + [(3648, 2048, torch.bfloat16, 3), (3650, 1416, torch.bfloat16, 5)])  # in the bucket of 4, 8
def test_gemv_real_shapes(N, K, w_dtype, M):
    """The GEMVs at 1 to 8 rows: ``gemv``'s kernel for one row and the float32 gate, ``gemv_rows`` for 2..8 rows
    of a bf16 weight (N = 3650: row groups past N; K = 1416: K vectors past K in the last step)."""
    from kernels_cuda.gemv import gemv

    g = gen(8)
    x = randn(g, M, K)
    w = randn(g, N, K, dtype=w_dtype, scale=K**-0.5)
    y = gemv(x, w, torch.float32 if w_dtype == torch.float32 else torch.bfloat16)
    if DRY:
        return
    assert y.dtype == (torch.float32 if w_dtype == torch.float32 else torch.bfloat16)
    close(y, x.double() @ w.double().T, torch.bfloat16, f"gemv N={N} K={K} M={M}")


@pytest.mark.parametrize("N,K,M", [(s[0], s[1], m) for s in GEMV_SHAPES if s[2] == torch.bfloat16 and s[0] <= 24576
                                   for m in (2, 5, 8)])
def test_gemv_mma_real_shapes(N, K, M):
    """The tensor-core GEMV (mma.m16n8k16, 16 weight rows x 8 activation rows) at 2..8 rows; N = 3650 has
    rows past N in its last tile; K = 1416 is not in 32-element steps per warp (not taken)."""
    from kernels_cuda.gemv_mma import applies, gemv_mma

    g = gen(13)
    x = randn(g, M, K)
    w = randn(g, N, K, scale=K**-0.5)
    if not applies(x, w):
        assert K % 32, f"gemv_mma should take N={N} K={K}"
        return
    y = gemv_mma(x, w)
    if DRY:
        return
    close(y, x.double() @ w.double().T, torch.bfloat16, f"gemv_mma N={N} K={K} M={M}")


HEAD_SHAPES = [(16, 512, 128), (16, 128, 512), (128, 512, 128), (128, 128, 512), (8, 1024, 4096)]


@pytest.mark.parametrize("H,N,K,T", [(*s, t) for s in HEAD_SHAPES for t in (1, 3, 8)])
def test_head_linear_real_shapes(H, N, K, T):
    """MLA's absorbed W_UK (K 128: half a warp per row group) and W_UV at V2-Lite / V3 heads, and V4's grouped
    output projection, from a strided query (q_nope is a column slice of the projection output)."""
    from kernels_cuda.gemv_rows import head_linear

    g = gen(10)
    x = randn(g, T, H, K + 64)[..., :K]
    w = randn(g, H, N, K, scale=K**-0.5)
    y = head_linear(x, w)
    if DRY:
        return
    assert y.shape == (T, H, N) and y.is_contiguous()
    close(y, ref.head_linear(x.double(), w.double()), torch.bfloat16, f"head_linear H={H} N={N} K={K} T={T}")


@pytest.mark.parametrize("H,T", [(16, 1), (16, 3), (16, 8), (16, 64), (128, 1), (128, 4), (128, 64)])  # V2-Lite, V3
def test_mla_q_absorb_real_shapes(H, T):
    """The decode query from the projection output's columns (q_a or q width + kv_a): W_UK GEMV and rope in
    one launch, against the reference composition."""
    from kernels_cpu.fused import mla_q_absorb as reference
    from kernels_cuda.gemv_rows import mla_q_absorb

    g = gen(12)
    N, R, L = 128, 64, 512
    xa = randn(g, T, H * (N + R) + L + R)
    q = xa[:, : H * (N + R)].view(T, H, N + R)
    w_uk = randn(g, H, L, N, scale=N**-0.5)
    pos = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(3)).to(DEV)
    cs = randn(g, 4096, R, dtype=torch.float32)
    out = mla_q_absorb(q, w_uk, pos, cs)
    if not DRY:
        want = reference(q.double(), w_uk.double(), pos, cs.double())
        close(out, want, torch.bfloat16, f"mla_q_absorb H={H} T={T}")
    if T > 8:  # past the fused rows: the rope written into the query's columns in place, the same bits
        from kernels_cuda import gemv_rows

        os.environ[gemv_rows.NO_CAST_ENV] = "1"
        try:
            again = mla_q_absorb(q, w_uk, pos, cs)
        finally:
            del os.environ[gemv_rows.NO_CAST_ENV]
        if not DRY:
            assert torch.equal(again, out)


def test_rope_writes_a_strided_out():
    """``rope(..., out=)``: q_pe rotated into the rope columns of the decode query [T, H, L + R] (the wide
    ``mla_q_absorb``), bit-equal to the kernel's contiguous output; the latent columns are left as they were."""
    from kernels_cuda.elementwise import rope

    g = gen(13)
    T, H, N, R, L = 64, 16, 128, 64, 512
    q = randn(g, T, H, N + R)
    pos = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(4)).to(DEV)
    cs = randn(g, 4096, R, dtype=torch.float32)
    wide = randn(g, T, H, L + R)
    before = wide.clone()
    rope(q[..., N:], pos, cs, out=wide[..., L:])
    if DRY:
        return
    assert torch.equal(wide[..., L:], rope(q[..., N:], pos, cs))
    assert torch.equal(wide[..., :L], before[..., :L])
    close(wide[..., L:], ref.rope(q[..., N:].double(), pos, cs.double()), torch.bfloat16, "rope into a slice")


def test_gemv_rows_writes_a_strided_out():
    """``gemv_rows(out=...)``: the decode query's latent columns [T, H, :L] of a [T, H, L + R] tensor; the rope
    columns are left as they were."""
    from kernels_cuda.gemv_rows import gemv_rows

    g = gen(11)
    x = randn(g, 2, 16, 192)[..., :128]
    w = randn(g, 16, 512, 128, scale=128**-0.5)
    q_abs = randn(g, 2, 16, 576)
    before = q_abs.clone()
    gemv_rows(x, w, out=q_abs[..., :512])
    if DRY:
        return
    close(q_abs[..., :512], ref.head_linear(x.double(), w.double()), torch.bfloat16, "strided out")
    assert torch.equal(q_abs[..., 512:], before[..., 512:])


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("T", [1, 37])
def test_mla_kv_write_real_shapes(T, bs):
    """V2-Lite (L 512, R 64) from the fused projection's output columns; the cache holds exactly the entry."""
    from kernels_cpu.fused import mla_kv_write as reference
    from kernels_cuda.mla_kv_write import mla_kv_write

    g = gen(9)
    width, L, R = 16 * 192 + 576, 512, 64
    xa = randn(g, T, width, scale=2.0)
    kv_a = xa[:, width - L - R:]
    w = (1 + randn(g, L, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(1)).to(DEV)
    cs = randn(g, 4096, R, dtype=torch.float32)
    cache = randn(g, 40, bs, L + R)
    before = cache.clone()
    slots = torch.randperm(40 * bs, generator=torch.Generator().manual_seed(2))[:T].to(DEV)
    if T > 1:
        slots[::5] = -1
    entry = mla_kv_write(kv_a, w, 1e-6, pos, cs, cache, slots)
    if DRY:
        return
    ref_cache = before.float()
    ref_entry = reference(kv_a.float(), w.float(), 1e-6, pos, cs, ref_cache, slots)
    close(entry, ref_entry, torch.bfloat16, "mla_kv_write entry")
    keep = slots >= 0
    flat, old = cache.view(-1, L + R), before.view(-1, L + R)
    assert torch.equal(flat[slots[keep]], entry[keep]), "the cache must hold the returned entry"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(flat[untouched], old[untouched]), "slots not written must keep their contents"
