"""GPU conformance of the decode FP8 kernels (``kernels_cuda.fp8_gemv``, ``kernels_cuda.moe_gemv_fp8``) at real
DeepSeek shapes and 1, 2, 5, 8 rows, against the reference ops (``kernels_cpu.fp8_ops``) on the same device:
the GEMV elementwise, the MoE launch by launch (the up kernel's hidden against the reference from x, the down
kernel against the reference from the kernel's own hidden) and end to end norm-wise (the hidden is
re-quantised to e4m3, docs/fp8.md), with other ranks' expert ids, every token on the same experts, and an
empty batch; ``fp8_linear`` / ``fused_moe_fp8`` dispatch to them; graph replay over a poisoned output."""

import pytest
import torch
import torch.nn.functional as F
from gpu_marks import DRY, GPU_OR_DRY, HAS_CUDA
from test_fp8_gemm_gpu import close, fp8_weight, randn

pytestmark = GPU_OR_DRY
DEV = "cuda" if HAS_CUDA else "cpu"

#: (name, N, K): V2-Lite's fused q+kv_a and o_proj, V3's projections and shared expert
GEMV_SHAPES = [("v2lite_q_kv_a", 3072 + 576, 2048), ("v2lite_o_proj", 2048, 2048), ("v3_q_a_kv_a", 1536 + 576, 7168),
               ("v3_q_b", 24576, 1536), ("v3_kv_a", 576, 7168), ("v3_o_proj", 7168, 16384),
               ("v3_shared_w13", 4096, 7168), ("v3_shared_w2", 7168, 2048)]
GEMV_CASES = [(f"{name} M={m}", m, n, k) for name, n, k in GEMV_SHAPES for m in (1, 2, 5, 8)]


@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_fp8_gemv_real_shapes(case):
    from kernels_cpu.fp8_ops import fp8_linear as ref
    from kernels_cuda import fp8_gemm, fp8_gemv

    _, M, N, K = case
    g = torch.Generator(device=DEV).manual_seed(M * 13 + N + K)
    x = randn(g, M, K)
    w, s = fp8_weight(g, N, K)
    assert fp8_gemv.applies(x, w, s)
    out = fp8_gemv.fp8_gemv(x, w, s)
    via = fp8_gemm.fp8_linear(x, w, s)  # the dispatch takes the GEMV where it measured faster
    if DRY:
        return
    close(out, ref(x, w, s), case[0])
    if fp8_gemv.faster_than_gemm(M, N, K):
        assert torch.equal(via, out), case[0]


@pytest.mark.skipif(DRY, reason="runs kernels")
def test_fp8_gemv_writes_every_row_and_replays_in_a_graph():
    from kernels_cuda.fp8_gemm import fp8_linear

    g = torch.Generator(device=DEV).manual_seed(2)
    x = randn(g, 5, 7168)
    w, s = fp8_weight(g, 2112, 7168)
    eager = fp8_linear(x, w, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, w, s)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.skipif(DRY, reason="runs kernels")
def test_fp8_gemv_exact_ties_quantise_as_the_reference():
    """A group whose amax is 21/16 has the exact scale 3 * 2^-10 and 0.890625 / it = 304 is the e4m3 288/320 tie:
    a 1-ulp scale or a reciprocal multiply would round it the other way (a weight of ones on that column
    reads q * s back)."""
    from kernels_cuda.fp8_gemv import fp8_gemv

    K = 2048
    x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEV)
    x[0, :128] = 1.3125
    x[0, 1] = 0.890625
    w = torch.zeros(128, K, device=DEV)
    w[0, 1] = 1.0
    y = fp8_gemv(x, w.to(torch.float8_e4m3fn), torch.ones(1, K // 128, device=DEV))
    assert y[0, 0].item() == 320.0 * 1.3125 / 448.0


#: (name, T, E, C, I, k): V2-Lite folds its 2 shared experts into 66 (top-6 + 2 slots); V3 257 (top-8 + 1)
MOE_CASES = [("V2-Lite T=1", 1, 66, 2048, 1408, 8), ("V2-Lite T=2", 2, 66, 2048, 1408, 8),
             ("V2-Lite T=5", 5, 66, 2048, 1408, 8), ("V2-Lite T=8", 8, 66, 2048, 1408, 8),
             ("V3 T=1", 1, 257, 7168, 2048, 9), ("V3 T=8", 8, 257, 7168, 2048, 9)]
ROUTINGS = ["distinct", "remote", "same"]
#: the up kernels: CUDA cores (``build_up_fp8``) and e4m3 tensor cores (``build_up_fp8_mma``)
UPS = ["fma", "mma"]


def _routing(kind: str, T: int, E: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(T * 31 + E + k)
    if kind == "same":  # every token on the same experts: one CTA serves T rows per expert
        return torch.randperm(E, generator=gen)[:k].expand(T, k).contiguous().to(DEV)
    span = E + 6 if kind == "remote" else E  # remote: ids < 0 or >= E (other ranks' experts)
    return torch.stack([torch.randperm(span, generator=gen)[:k] - (3 if kind == "remote" else 0)
                        for _ in range(T)]).to(DEV)


@pytest.mark.parametrize("up", UPS)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("case", MOE_CASES, ids=[c[0] for c in MOE_CASES])
def test_fused_moe_fp8_small_real_shapes(case, routing, up):
    from kernels_cpu.fp8_ops import fp8_linear, fused_moe_fp8
    from kernels_cuda import fp8_gemm, moe_gemv_fp8

    name, T, E, C, I, k = case
    if E > 100 and routing != "remote" and T > 1:
        pytest.skip("V3 at 8 tokens: the remote-id routing only (device time)")
    g = torch.Generator(device=DEV).manual_seed(T + E)
    x = randn(g, T, C)
    w13, s13 = fp8_weight(g, E, 2 * I, C)
    w2, s2 = fp8_weight(g, E, C, I)
    ids = _routing(routing, T, E, k)
    weights = torch.rand(T, k, device=DEV).to(torch.bfloat16)
    assert moe_gemv_fp8.applies(x, w13, s13, w2, s2, weights, ids, max_tokens=8)
    steps, finish, h = moe_gemv_fp8.moe_fp8_small_steps(x, w13, s13, w2, s2, weights, ids, up=up)
    for _, step in steps:
        step()
    out = finish()
    via = fp8_gemm.fused_moe_fp8(x, w13, s13, w2, s2, weights, ids)
    if DRY:
        return
    what = f"{name} {routing} {up}"
    if T <= moe_gemv_fp8.MAX_TOKENS and moe_gemv_fp8.up_kind(C) == up:  # the dispatch takes the two launches
        assert torch.equal(via, out), what
    ok = (ids >= 0) & (ids < E)
    h_ref = torch.zeros_like(h)
    y_ref = torch.zeros(T, C, dtype=torch.float32, device=DEV)
    for t in range(T):
        for j in range(k):
            if ok[t, j]:
                e = int(ids[t, j])
                gu = fp8_linear(x[t:t + 1], w13[e], s13[e])
                h_ref[t * k + j] = (F.silu(gu[:, :I].float()) * gu[:, I:].float()).to(x.dtype)[0]
                # the down reference from the kernel's own hidden row
                y = fp8_linear(h[t * k + j:t * k + j + 1], w2[e], s2[e])
                y_ref[t] += y[0].float() * weights[t, j].float()
    rows = ok.reshape(-1)
    close(h[rows], h_ref[rows], f"{what}: up (hidden)")
    close(out, y_ref.to(x.dtype), f"{what}: down")
    truth = fused_moe_fp8(x, w13, s13, w2, s2, weights, ids).double()
    rel = ((out.double() - truth).norm() / truth.norm().clamp_min(1e-30)).item()
    assert rel <= 2e-2, f"{what}: relative error norm {rel:.3e}"


@pytest.mark.skipif(DRY, reason="runs kernels")
@pytest.mark.parametrize("up", UPS)
def test_fused_moe_fp8_small_all_remote_and_empty(up, monkeypatch):
    """Every slot another rank's: zeros; an empty batch: the reference's empty output (either up kernel, picked by
    ``DEEPINFER_FP8_MOE_UP`` through the backend's op)."""
    from kernels_cuda import moe_gemv_fp8
    from kernels_cuda.fp8_gemm import fused_moe_fp8

    monkeypatch.setenv(moe_gemv_fp8.UP_ENV, up)

    g = torch.Generator(device=DEV).manual_seed(5)
    E, C, I = 66, 2048, 1408
    w13, s13 = fp8_weight(g, E, 2 * I, C)
    w2, s2 = fp8_weight(g, E, C, I)
    x = randn(g, 2, C)
    ids = torch.tensor([[-1, E, E + 5, -7]] * 2, device=DEV)
    weights = torch.rand(2, 4, device=DEV).to(torch.bfloat16)
    assert bool((fused_moe_fp8(x, w13, s13, w2, s2, weights, ids) == 0).all())
    empty = fused_moe_fp8(x[:0], w13, s13, w2, s2, weights[:0], ids[:0])
    assert empty.shape == (0, C)


@pytest.mark.skipif(DRY, reason="runs kernels")
@pytest.mark.parametrize("up", UPS)
def test_fused_moe_fp8_small_replays_in_a_graph(up):
    from kernels_cuda.moe_gemv_fp8 import fused_moe_fp8_small

    g = torch.Generator(device=DEV).manual_seed(6)
    E, C, I, k = 66, 2048, 1408, 8
    w13, s13 = fp8_weight(g, E, 2 * I, C)
    w2, s2 = fp8_weight(g, E, C, I)
    x = randn(g, 2, C)
    ids = _routing("distinct", 2, E, k)
    weights = torch.rand(2, k, device=DEV).to(torch.bfloat16)
    eager = fused_moe_fp8_small(x, w13, s13, w2, s2, weights, ids, up=up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_fp8_small(x, w13, s13, w2, s2, weights, ids, up=up)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
