"""The CUDA ``greedy_sample`` (``kernels_cuda/sampling.py``: one launch over the vocabulary's chunks, the row's last
CTA merging) past the conformance kit's cases (``test_kernels_cuda_gpu.py::test_conformance_kit``): non-finite
rows, serving batch sizes under graph replay, rows past the launch counters, and two threads sampling at once.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU, the calls only compile the kernels (``examples/kernel_warm.py``)."""

import threading

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY, HAS_CUDA
from test_kernels_cuda_gpu import close

from kernels_cpu import ops as ref

pytestmark = GPU_OR_DRY
DEV = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="runs kernels (DEEPINFER_TL_DRYRUN only compiles)")


def _greedy_rows(V: int, seed: int) -> torch.Tensor:
    """Rows for greedy_sample past the kit: NaN, +inf and all -inf rows (as torch orders them), ties in
    different chunks, a vocabulary of one token's chunk plus one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, V, generator=g) * 4
    x[0, [7, 70000]] = float("nan")  # the first NaN is the token; the normaliser is NaN
    x[1, 90000] = float("inf")  # the token; lse inf, the logprob NaN
    x[2] = float("-inf")  # token 0; lse -inf; logprob NaN
    x[3, [2048, 4096, 99999]] = 25.0  # ties on chunk boundaries
    x[4, :100000] = float("-inf")  # only the last, partial chunk is live
    x[5, 100] = float("nan")
    x[5, 101] = float("inf")  # NaN beats inf
    x[6, 0] = 1e30  # one huge logit: logprob 0
    return x


def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN at {a.isnan().nonzero().flatten().tolist()}, " \
        f"reference {b.isnan().nonzero().flatten().tolist()}"
    ok = ~a.isnan()
    assert torch.allclose(a[ok], b[ok], rtol=1e-5, atol=1e-5), f"{what}: {a[ok].tolist()} vs {b[ok].tolist()}"


@pytest.mark.parametrize("V", [102400, 129280, 2049])
def test_greedy_sample_non_finite_rows(V):
    """NaN, inf and masked rows give torch.argmax's token and torch.logsumexp's normaliser (the kit compares
    finite outputs only)."""
    from kernels_cuda.sampling import greedy_sample

    x = _greedy_rows(V, 3) if V > 100001 else torch.randn(3, V)
    tok, lp, lse = greedy_sample(x.to(DEV))
    if DRY:
        return
    r_tok, r_lp, r_lse = ref.greedy_sample(x)
    assert torch.equal(tok.cpu(), r_tok), f"tokens {tok.tolist()}, reference {r_tok.tolist()}"
    _same_or_both_nan(lse.cpu(), r_lse, "lse")
    _same_or_both_nan(lp.cpu(), r_lp, "logprob")


@needs_cuda
@pytest.mark.parametrize("R", [1, 64, 256, 4097])  # 4097: past the counters, the reference's reductions
def test_greedy_sample_batches_and_graph_replays(R):
    """Each row's token and logprob as sampled alone, at serving batch sizes; captured once and replayed on new
    logits (the counters reset themselves)."""
    from kernels_cuda.sampling import greedy_sample

    V = 102400 if R <= 256 else 3000
    x = torch.randn(R, V, device=DEV) * 3
    out = greedy_sample(x)  # counters made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_sample(x)
    for seed in (5, 6):
        x.copy_(torch.randn(R, V, generator=torch.Generator().manual_seed(seed)).to(DEV) * 3)
        graph.replay()
        torch.cuda.synchronize()
        r_tok, r_lp, r_lse = ref.greedy_sample(x.cpu())
        assert torch.equal(out[0].cpu(), r_tok), f"replay {seed}: rows {(out[0].cpu() != r_tok).nonzero().tolist()}"
        close(out[1], r_lp, torch.float32, f"replay {seed} logprobs")
        close(out[2], r_lse, torch.float32, f"replay {seed} lse")
    for r in {0, R // 2, R - 1}:
        alone = greedy_sample(x[r : r + 1].clone())
        assert int(alone[0]) == int(out[0][r]) and float(alone[1]) == float(out[1][r]), f"row {r} alone"



@needs_cuda
def test_greedy_sample_from_two_threads():
    """Two threads sampling different logits at once (one stream: the launches, and so their counters, are
    serialised) each get the reference's tokens; the next call works."""
    from kernels_cuda.sampling import greedy_sample

    xs = [torch.randn(3, 102400, generator=torch.Generator().manual_seed(s)) * 3 for s in (1, 2)]
    greedy_sample(xs[0].to(DEV))  # the counters, made once
    got: dict[int, list] = {}

    def run(i):
        x = xs[i].to(DEV)
        got[i] = [greedy_sample(x)[0].cpu() for _ in range(20)]

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        want = ref.greedy_sample(xs[i])[0]
        assert all(torch.equal(tok, want) for tok in got[i]), f"thread {i}"
    assert torch.equal(greedy_sample(xs[1].to(DEV))[0].cpu(), ref.greedy_sample(xs[1])[0])
