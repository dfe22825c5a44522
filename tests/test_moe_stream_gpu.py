"""H200 conformance of ``kernels_cuda.moe_stream`` (decode-batch MoE GEMMs with the tokens as the mma's N)
against the reference ``fused_moe`` / ``fused_moe_clamped`` (``kernels_cpu``), at V2-Lite widths with the
shared experts folded in, through the path and through the op's dispatch. Compile-only with
``DEEPINFER_TL_DRYRUN=1`` and no GPU."""

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY
from test_kernels_cuda_gpu import close as close_kit

from kernels_cpu import ops as ref

pytestmark = GPU_OR_DRY
DEV = "cpu" if DRY else "cuda"
V2L = dict(E=64, S=2, C=2048, I=1408, k=6)  # 64 routed experts top-6 + 2 shared experts


def close(out, truth, what):
    """The kit's rule for bf16 (``test_kernels_cuda_gpu.close``), truth in float32."""
    close_kit(out, truth, torch.bfloat16, what)


def batch(T, E, S, C, I, k, seed=5, remote=False):
    """x, w13/w2 (S shared experts behind E routed), ids = k routed + the S shared, bf16 weights (1.0 shared).
    ``remote``: some routed ids fall outside [0, E + S) (other ranks' experts)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        if DRY:
            return torch.zeros(*shape, dtype=torch.bfloat16)
        return (torch.randn(*shape, generator=g) * scale).to(DEV, torch.bfloat16)

    x = rnd(T, C)
    w13 = rnd(E + S, 2 * I, C, scale=C ** -0.5)
    w2 = rnd(E + S, C, I, scale=I ** -0.5)
    lo = -3 if remote else 0
    routed = torch.stack([torch.randperm(E - lo + (3 if remote else 0), generator=g)[:k] + lo for _ in range(T)])
    routed = torch.where(routed >= E, routed + S, routed)  # remote ids above: past the shared experts too
    ids = torch.cat((routed, torch.arange(E, E + S).expand(T, S)), 1).to(DEV)
    weights = torch.cat((torch.rand(T, k, generator=g), torch.ones(T, S)), 1).to(DEV, torch.bfloat16)
    return x, w13, w2, weights, ids


def truth(x, w13, w2, weights, ids):
    return ref.fused_moe(x.float(), w13.float(), w2.float(), weights.float(), ids)


@pytest.mark.parametrize("T", [9, 37, 64, 256])
def test_moe_stream_v2_lite(T):
    """Block rows 16 (9-64 tokens) and 32 (256), shared experts in several blocks."""
    from kernels_cuda import moe_stream

    args = batch(T, **V2L)
    assert moe_stream.applies(args[0], args[1], args[2], args[4])
    out = moe_stream.fused_moe_stream(*args)
    close(out, truth(*args), f"moe_stream T={T}")


def test_moe_stream_dispatch():
    """``fused_moe`` sends 9..528 tokens (a mean of <= 64 rows per expert) here, 1-8 to ``moe_gemv``,
    prefill-sized batches to the pipeline; the op's result matches the reference."""
    from kernels_cuda import moe_gemv, moe_stream
    from kernels_cuda.moe import fused_moe

    x, w13, w2, weights, ids = batch(64, **V2L)
    assert not moe_gemv.applies(x, w13, w2, weights, ids)
    assert moe_stream.applies(x, w13, w2, ids)
    big = torch.zeros(529, 2048, dtype=torch.bfloat16, device=DEV)
    assert not moe_stream.applies(big, w13, w2, torch.zeros(529, 8, dtype=torch.int64, device=DEV))
    assert moe_stream.block_rows(64 * 8, 66) == 16 and moe_stream.block_rows(256 * 8, 66) == 32
    close(fused_moe(x, w13, w2, weights, ids), truth(x, w13, w2, weights, ids), "fused_moe T=64")


def test_moe_stream_remote_ids():
    """Ids outside [0, E) (other ranks' experts) contribute nothing."""
    from kernels_cuda import moe_stream

    args = batch(40, **V2L, remote=True)
    if not DRY:
        assert ((args[4] < 0) | (args[4] >= 66)).any()
    close(moe_stream.fused_moe_stream(*args), truth(*args), "moe_stream remote ids")


def test_moe_stream_deterministic_and_row_invariant():
    """Bitwise: two runs agree, and a token's row does not depend on the others' order (same block rows)."""
    from kernels_cuda.moe_stream import fused_moe_stream

    x, w13, w2, weights, ids = batch(48, **V2L)
    full = fused_moe_stream(x, w13, w2, weights, ids)
    again = fused_moe_stream(x, w13, w2, weights, ids)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1)).to(DEV)
    part = fused_moe_stream(x[perm], w13, w2, weights[perm], ids[perm])
    if not DRY:
        assert torch.equal(full, again)
        assert torch.equal(full[perm], part)


def test_moe_stream_clamped():
    """V4's SwiGLU clamp (through ``fused_moe_clamped``'s dispatch) against ``kernels_cpu.v4_ops``."""
    from kernels_cpu.v4_ops import fused_moe_clamped as reference
    from kernels_cuda.moe import fused_moe_clamped

    x, w13, w2, weights, ids = batch(32, **V2L)
    if not DRY:
        x = x * 8  # pre-activations past the clamp
    out = fused_moe_clamped(x, w13, w2, weights, ids, 1.5)
    close(out, reference(x.float(), w13.float(), w2.float(), weights.float(), ids, 1.5), "clamped")
