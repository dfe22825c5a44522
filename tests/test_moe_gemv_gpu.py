"""GPU conformance of the weight-streaming fused MoE at decode (``kernels_cuda.moe_gemv``: the up kernels on the CUDA
or tensor cores, the loop and slots down kernels) against the reference ops, at V2-Lite, V3 and V4 widths (moved out
of ``test_kernels_cuda_gpu.py``, whose helpers it shares). Skipped without a CUDA device; with
``DEEPINFER_TL_DRYRUN=1`` the calls only compile their kernels (``examples/kernel_warm.py``)."""

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY
from test_kernels_cuda_gpu import DEV, close, gen, randn, up_

from kernels_cpu import ops as ref

pytestmark = GPU_OR_DRY

V2L = dict(E=64, S=2, C=2048, I=1408, k=6)  # V2-Lite: 64 routed experts top-6, 2 shared experts folded in


def _decode_moe(T, E, S, C, I, k, seed=11, pool=None):
    """x, w13/w2 with S shared experts stacked behind E routed ones, ids = k routed (from ``pool``: repeats
    across tokens) + the S shared ids, bf16 weights (1.0 for the shared experts), as ``MoE.forward`` passes."""
    g = gen(seed)
    x = randn(g, T, C)
    w13 = randn(g, E + S, 2 * I, C, scale=C ** -0.5)
    w2 = randn(g, E + S, C, I, scale=I ** -0.5)
    pool = torch.arange(E) if pool is None else pool
    cg = torch.Generator().manual_seed(seed)
    routed = torch.stack([pool[torch.randperm(len(pool), generator=cg)[:k]] for _ in range(T)])
    ids = torch.cat((routed, torch.arange(E, E + S).expand(T, S)), 1).to(DEV)
    weights = torch.cat((torch.rand(T, k, generator=cg), torch.ones(T, S)), 1).to(DEV, torch.bfloat16)
    return x, w13, w2, weights, ids


UPS = ["fma", "mma"]  # moe_up on the CUDA cores / on the tensor cores
DOWNS = ["loop", "slots"]  # moe_down: a warp walks a column's K slots / K warps a CTA, one per slot


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("up", UPS)
@pytest.mark.parametrize("T", [1, 2, 8])
def test_fused_moe_decode_shapes(T, up, down):
    """V2-Lite on the weight-streaming path at 1-8 tokens (the backend sends it ``MAX_TOKENS``; both up kernels,
    both down kernels, the down kernel at a token per CTA and at the row bucket per CTA): experts 0-15 never
    picked, 16-27 shared by many tokens, the shared experts by every token."""
    from kernels_cuda import moe_gemv

    x, w13, w2, weights, ids = _decode_moe(T, **V2L, pool=torch.arange(16, 28))
    assert moe_gemv.applies(x, w13, w2, weights, ids, max_tokens=8)
    want = None if DRY else ref.fused_moe(*up_(x, w13, w2, weights), ids)
    for down_tokens in (1, 0) if T > 1 else (1,):
        out = moe_gemv.fused_moe_small(x, w13, w2, weights, ids, up=up, down=down, down_tokens=down_tokens)
        close(out, want, torch.bfloat16, f"fused_moe decode T={T} {up} {down} down_tokens={down_tokens}")


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("shape", ["V3 widths, 9 slots", "16 slots", "tiny widths"])
def test_fused_moe_decode_slot_counts(shape, down):
    """K = 9 at V3 widths (hidden 7168, expert 2048: 8 routed + 1 shared), K = 16 (14 routed + 2 shared) and tiny
    widths (hidden 64, expert 24: a lane's only vector past the width for most lanes), with other ranks' ids."""
    from kernels_cuda import moe_gemv

    dims = {"V3 widths, 9 slots": dict(E=16, S=1, C=7168, I=2048, k=8),
            "16 slots": dict(E=24, S=2, C=2048, I=1408, k=14),
            "tiny widths": dict(E=6, S=0, C=64, I=24, k=4)}[shape]
    for T in (1, 3):
        x, w13, w2, weights, ids = _decode_moe(T, **dims)
        ids[:, 1] = -1  # another rank's expert in every token
        ids[-1, 2] = w13.shape[0] + 3
        assert moe_gemv.applies(x, w13, w2, weights, ids, max_tokens=8)
        out = moe_gemv.fused_moe_small(x, w13, w2, weights, ids, up="fma", down=down)
        close(out, None if DRY else ref.fused_moe(*up_(x, w13, w2, weights), ids), torch.bfloat16,
              f"fused_moe decode {shape} T={T} {down}")


def test_fused_moe_decode_down_env(monkeypatch):
    """``DEEPINFER_MOE_DOWN=slots`` switches the backend's op (no override) to the slot-parallel down kernel."""
    from kernels_cuda import moe_gemv
    from kernels_cuda.moe import fused_moe

    x, w13, w2, weights, ids = _decode_moe(2, **V2L)
    monkeypatch.setenv(moe_gemv.DOWN_ENV, "slots")
    out = fused_moe(x, w13, w2, weights, ids)
    slots = moe_gemv.fused_moe_small(x, w13, w2, weights, ids, down="slots")
    if DRY:
        return
    assert torch.equal(out, slots)
    close(out, ref.fused_moe(*up_(x, w13, w2, weights), ids), torch.bfloat16, "fused_moe DEEPINFER_MOE_DOWN=slots")


@pytest.mark.parametrize("T", [1, 2, 8, 64])
def test_fused_moe_decode_dispatch(T):
    """Through the backend's op: 1-8 tokens on the streaming path (1 on the CUDA-core up kernel, 2-8 on the
    tensor-core one), 64 on the tensor-core pipeline."""
    from kernels_cuda import moe_gemv
    from kernels_cuda.moe import fused_moe

    x, w13, w2, weights, ids = _decode_moe(T, **V2L, pool=torch.arange(16, 28))
    assert moe_gemv.applies(x, w13, w2, weights, ids) == (T <= moe_gemv.MAX_TOKENS)
    out = fused_moe(x, w13, w2, weights, ids)
    if DRY:
        return
    close(out, ref.fused_moe(*up_(x, w13, w2, weights), ids), torch.bfloat16, f"fused_moe T={T}")


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("up", UPS)
def test_fused_moe_decode_remote_and_repeated_ids(up, down):
    """3 tokens: ids of other ranks (< 0, >= E), an expert twice in one token, a token with no local expert."""
    from kernels_cuda import moe_gemv

    x, w13, w2, weights, _ = _decode_moe(3, **V2L)
    E = w13.shape[0]
    ids = torch.tensor([[3, -1, 40, E, 3, 65, 64, 7], [-2, E + 5, -1, E, -1, -1, -1, E + 1],
                        [40, 41, 3, 0, 1, 2, 64, 65]], device=DEV)
    assert moe_gemv.applies(x, w13, w2, weights, ids, max_tokens=8)
    out = moe_gemv.fused_moe_small(x, w13, w2, weights, ids, up=up, down=down)
    if DRY:
        return
    close(out, ref.fused_moe(*up_(x, w13, w2, weights), ids), torch.bfloat16,
          f"fused_moe decode remote ids {up} {down}")
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a token with no local expert gets zeros"


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("up", UPS)
def test_fused_moe_decode_batch_invariant_and_deterministic(up, down):
    """With either up kernel and either down kernel a token's row is bitwise the same alone, in any batch of <= 8,
    at any place in it, and from call to call (no atomics on data; fixed reduction orders); the same with the
    down kernel's CTAs taking the row bucket of tokens (``down_tokens=0``)."""
    from kernels_cuda.moe_gemv import fused_moe_small

    x, w13, w2, weights, ids = _decode_moe(8, **V2L, pool=torch.arange(20))
    kw = dict(up=up, down=down)
    full = fused_moe_small(x, w13, w2, weights, ids, **kw)
    again = fused_moe_small(x, w13, w2, weights, ids, **kw)
    bucket = fused_moe_small(x, w13, w2, weights, ids, **kw, down_tokens=0)
    perm = torch.tensor([5, 2, 7, 0], device=DEV)
    part = fused_moe_small(x[perm], w13, w2, weights[perm], ids[perm], **kw)
    alone = [fused_moe_small(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], **kw) for t in range(8)]
    if DRY:
        return
    assert torch.equal(full, again), "two calls differ"
    assert torch.equal(part, full[perm]), "a token's row depends on the batch around it"
    assert torch.equal(torch.cat(alone), full), "a token alone differs from the same token in a batch of 8"
    if down == "slots":  # (its per-token arithmetic is the same code at any MB; not asserted of the loop kernel)
        assert torch.equal(bucket, full), "8 tokens a CTA differ from a token a CTA"


@pytest.mark.parametrize("down", DOWNS)
@pytest.mark.parametrize("up", UPS)
def test_fused_moe_clamped_decode(up, down):
    """V4-Flash widths (hidden 4096, expert 2048) with the SwiGLU clamp, one and four tokens."""
    from kernels_cpu.v4_ops import fused_moe_clamped as reference
    from kernels_cuda.moe import fused_moe_clamped
    from kernels_cuda.moe_gemv import fused_moe_small

    for T in (1, 4):
        x, w13, w2, weights, ids = _decode_moe(T, E=16, S=0, C=4096, I=2048, k=6)
        x = x * 8  # gates beyond the clamp
        out = fused_moe_small(x, w13, w2, weights, ids, 10.0, up=up, down=down)
        op = fused_moe_clamped(x, w13, w2, weights, ids, 10.0)  # the backend's op: streaming at 1 token
        if not DRY:
            want = reference(*up_(x, w13, w2, weights), ids, 10.0)
            close(out, want, torch.bfloat16, f"clamped T={T} {up} {down}")
            close(op, want, torch.bfloat16, f"clamped op T={T}")
