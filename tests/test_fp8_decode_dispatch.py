"""``fp8_linear`` and ``fused_moe_fp8`` of the CUDA backend take the weight-streaming decode kernels where they
measured faster (``kernels_cuda.fp8_gemv``: one row, two on a small weight; ``kernels_cuda.moe_gemv_fp8``: up to two
tokens) and the GEMM paths otherwise, or with
``DEEPINFER_FP8_GEMV=0`` (CPU, dry run: kernels are traced, not compiled or run; ``_tl.dry_launch_hook``
names each launch)."""

import pytest
import torch

pytest.importorskip("tilelang")

FP8 = torch.float8_e4m3fn


@pytest.fixture
def dry(monkeypatch):
    from kernels_cuda import _tl

    monkeypatch.setenv(_tl.DRYRUN_ENV, "1")
    monkeypatch.setattr(_tl, "compile_kernel", lambda *a, **k: None)
    launched: list[str] = []
    monkeypatch.setattr(_tl, "dry_launch_hook", launched.append)
    yield launched


def _dense(M: int, N: int = 256, K: int = 1024):
    x = torch.randn(M, K).to(torch.bfloat16)
    return x, torch.randn(N, K).to(FP8), torch.rand(-(-N // 128), K // 128)


@pytest.mark.parametrize("M", [1, 2, 3, 8, 9])
def test_fp8_linear_rows_rule(dry, M):
    from kernels_cuda.fp8_gemm import fp8_linear

    x, w, s = _dense(M)
    assert fp8_linear(x, w, s).shape == (M, 256)
    assert dry == (["build_fp8_gemv"] if M <= 2 else ["build_act_quant"]), dry


@pytest.mark.parametrize("M", [1, 2])
def test_fp8_linear_rows_rule_large_weight(dry, M):
    """Above 8 MB of weight only one row takes the GEMV."""
    from kernels_cuda.fp8_gemm import fp8_linear

    fp8_linear(*_dense(M, N=8192 + 128))
    assert dry == (["build_fp8_gemv"] if M == 1 else ["build_act_quant"]), dry


def test_fp8_linear_gemv_switch(dry, monkeypatch):
    from kernels_cuda.fp8_gemm import GEMV_ENV, fp8_linear

    monkeypatch.setenv(GEMV_ENV, "0")
    fp8_linear(*_dense(1))
    assert dry == ["build_act_quant"], dry


def test_fp8_gemv_applies(dry):
    from kernels_cuda.fp8_gemv import applies

    x, w, s = _dense(2)
    assert applies(x, w, s)
    assert not applies(x.float(), w, s)  # float32 activations: the reference
    assert not applies(x[:, :1000], w[:, :1000], s)  # K not a multiple of 128
    assert not applies(torch.cat((x, x)).view(2, 2, -1)[:, 0], w, s)  # strided rows
    assert not applies(x, w.to(torch.bfloat16), s)
    assert not applies(torch.randn(9, 1024).to(torch.bfloat16), w, s)  # (the kernel's buckets end at 8 rows)


def _moe(T: int, E: int = 6, C: int = 512, I: int = 256, k: int = 3, ids=None):
    x = torch.randn(T, C).to(torch.bfloat16)
    w13, s13 = torch.randn(E, 2 * I, C).to(FP8), torch.rand(E, 2 * I // 128, C // 128)
    w2, s2 = torch.randn(E, C, I).to(FP8), torch.rand(E, C // 128, I // 128)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if ids is None else ids
    return x, w13, s13, w2, s2, torch.rand(T, k).to(torch.bfloat16), ids


STREAM = ["build_align", "build_gather_quant", "build_stream1_fp8", "build_act_quant", "build_stream2_fp8",
          "build_combine"]
PIPELINE = ["build_align", "build_gather_quant", "build_gemm1_fp8", "build_act_quant", "build_gemm2_fp8",
            "build_combine"]


@pytest.fixture
def stream(monkeypatch):
    """``DEEPINFER_FP8_MOE_STREAM=1`` (the default, set explicitly)."""
    from kernels_cuda import moe_stream_fp8

    monkeypatch.setenv(moe_stream_fp8.STREAM_ENV, "1")


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 128, 129])
def test_fused_moe_fp8_tokens_rule(dry, stream, T):
    """Up to ``MAX_TOKENS`` (4) tokens the two weight-streaming launches (the tensor-core up kernel by default);
    above them, up to a mean of 64 rows per expert (6 experts x 64 / 3 slots: 128 tokens), the six launches with
    the weights as the wgmma's M (``moe_stream_fp8``); above that the six-launch pipeline."""
    from kernels_cuda.fp8_gemm import fused_moe_fp8

    assert fused_moe_fp8(*_moe(T)).shape == (T, 512)
    if T <= 4:
        assert dry == ["build_up_fp8_mma", "build_down_fp8"], dry
    else:
        assert dry == (STREAM if T <= 128 else PIPELINE), dry


def test_fused_moe_fp8_stream_block_rows(dry, stream):
    """The stream path's block rows follow the mean rows per expert (16, 32, 64) as ``moe_stream``'s do; an
    explicit pipeline tile configuration keeps the pipeline."""
    from kernels_cuda.fp8_gemm import MOE_SMALL, moe_fp8_steps

    for T, BT in ((5, 16), (32, 16), (33, 32), (64, 32), (65, 64), (128, 64)):  # 3 slots over 6 experts
        bufs: dict = {}
        moe_fp8_steps(*_moe(T), buffers=bufs)
        assert bufs["BM"] == BT, (T, bufs["BM"])
    steps, _ = moe_fp8_steps(*_moe(8), cfg=MOE_SMALL)
    for _, step in steps:
        step()
    assert dry == PIPELINE, dry


@pytest.mark.parametrize("value", [None, "1", "0"])
def test_fused_moe_fp8_stream_switch(dry, monkeypatch, value):
    """Unset or ``1``: decode batches take the stream path; ``0``: the pipeline (a benchmark's before)."""
    from kernels_cuda import moe_stream_fp8
    from kernels_cuda.fp8_gemm import fused_moe_fp8

    if value is None:
        monkeypatch.delenv(moe_stream_fp8.STREAM_ENV, raising=False)
    else:
        monkeypatch.setenv(moe_stream_fp8.STREAM_ENV, value)
    fused_moe_fp8(*_moe(8))
    assert dry == (PIPELINE if value == "0" else STREAM), dry


def test_moe_stream_fp8_applies():
    from kernels_cuda.moe_stream_fp8 import applies

    x, w13, s13, w2, s2, _, ids = _moe(8)
    assert applies(x, w13, s13, w2, s2, ids)
    assert not applies(x.float(), w13, s13, w2, s2, ids)  # float32 activations: the reference
    assert not applies(x, w13.to(torch.bfloat16), s13, w2, s2, ids)  # not e4m3
    assert not applies(x, w13, s13[:, :1], w2, s2, ids)  # scales that are not one per 128 x 128 tile
    assert not applies(x, w13, s13, w2[:, :, :128], s2, ids)  # w2's shape does not match w13's
    assert not applies(x[:0], w13, s13, w2, s2, ids[:0])  # no tokens
    x6, w13_6, s13_6, w2_6, s2_6, _, ids6 = _moe(8, C=576)  # C not a multiple of 128
    assert not applies(x6, w13_6, s13_6, w2_6, s2_6, ids6)


@pytest.mark.parametrize("T", [1, 2])
def test_fused_moe_fp8_up_kernel_switch(dry, monkeypatch, T):
    """``DEEPINFER_FP8_MOE_UP=mma`` (and the default) puts the engine's dispatch on the e4m3 tensor-core up kernel,
    "fma" on the CUDA-core one; an explicit ``up`` wins; another value is refused."""
    from kernels_cuda import moe_gemv_fp8
    from kernels_cuda.fp8_gemm import fused_moe_fp8

    monkeypatch.setenv(moe_gemv_fp8.UP_ENV, "mma")
    fused_moe_fp8(*_moe(T))
    assert dry == ["build_up_fp8_mma", "build_down_fp8"], dry
    dry.clear()
    moe_gemv_fp8.fused_moe_fp8_small(*_moe(T), up="fma")
    assert dry == ["build_up_fp8", "build_down_fp8"], dry
    dry.clear()
    monkeypatch.setenv(moe_gemv_fp8.UP_ENV, "fma")
    fused_moe_fp8(*_moe(T))
    assert dry == ["build_up_fp8", "build_down_fp8"], dry
    monkeypatch.setenv(moe_gemv_fp8.UP_ENV, "tensor")
    with pytest.raises(ValueError):
        fused_moe_fp8(*_moe(T))


def test_fused_moe_fp8_small_takes_other_ranks_ids(dry):
    """ids < 0 or >= E stay on the two-launch path (their slots are skipped in the kernels)."""
    from kernels_cuda.fp8_gemm import fused_moe_fp8

    fused_moe_fp8(*_moe(2, ids=torch.tensor([[-1, 0, 6], [7, 2, 2]])))
    assert dry == ["build_up_fp8_mma", "build_down_fp8"], dry


def test_moe_gemv_fp8_applies(dry):
    from kernels_cuda.moe_gemv_fp8 import applies

    args = _moe(2)
    assert applies(*args)
    x, w13, s13, w2, s2, wt, ids = _moe(2, C=384)  # a column's 16-byte vectors do not tile 384
    assert not applies(x, w13, s13, w2, s2, wt, ids)
    x, w13, s13, w2, s2, wt, ids = args
    assert not applies(x, w13.to(torch.bfloat16), s13, w2, s2, wt, ids)
    assert not applies(x, w13, s13[:, :1], w2, s2, wt, ids)
