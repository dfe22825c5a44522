"""MXFP8 reference ops (kernels_cpu/mxfp8.py): the scale rule, rounding, saturation, special values,
the round-trip error bound, the 528-byte row of a 512-wide entry, and the conformance kit catching a
backend that rounds differently."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.kernels import KernelBackend
from deepinfer_core.testing import check_op
from kernels_cpu import ReferenceKernels
from kernels_cpu.mxfp8 import E4M3_MAX, mxfp8_dequant, mxfp8_quant, ue8m0_scale


def _scale(byte: int) -> float:
    return 2.0 ** (byte - 127)


def test_ue8m0_scale_rounds_the_exponent_up_and_never_saturates():
    amax = torch.tensor([448.0, 449.0, 896.0, 1.0, 0.0, 1e-5, 3e38])
    got = ue8m0_scale(amax).tolist()
    assert got[0] == 127  # 448 / 448 = 2**0 exactly
    assert got[1] == 128 and got[2] == 128  # 449 needs 2**1; 896 is exactly 448 * 2
    assert got[3] == 127 - 8  # 1/448 -> 2**-8 (ceil of log2 0.00223 = -8.8)
    assert got[4] == got[5] == ue8m0_scale(torch.tensor([1e-4])).item()  # floored at 1e-4
    assert got[6] == 127 + 120  # 3e38 / 448 = 6.7e35, just above 2**119
    x = torch.randn(1000) * torch.logspace(-3, 6, 1000)
    scale = torch.tensor([_scale(b) for b in ue8m0_scale(x.abs()).tolist()])
    assert bool(((x.abs() / scale) <= E4M3_MAX).all())
    above = x.abs() >= 1e-4  # the smallest power of two that fits (above the floor)
    assert bool(((x.abs() / scale)[above] > E4M3_MAX / 2).all())


def test_quant_rounding_ties_to_even_and_special_values():
    x = torch.zeros(1, 64)
    x[0, :6] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, float("inf"), float("nan")])
    x[0, 32:34] = torch.tensor([-float("inf"), -0.0])
    packed = mxfp8_quant(x)
    assert packed.shape == (1, 66) and packed.dtype == torch.uint8
    assert packed[0, 64].item() == 127 and packed[0, 65] == ue8m0_scale(torch.tensor([0.0])).item()
    y = mxfp8_dequant(packed, torch.float32)[0]
    # 1.0625 lies halfway between 1.0 and 1.125: to the even mantissa (1.0); 1.1875 -> 1.25
    assert y[:5].tolist() == [448.0, 1.0, 1.25, -1.0, 448.0]  # inf saturates to the block max 448 * scale
    assert packed[0, 5].item() == 0x7F  # NaN
    block2_scale = _scale(packed[0, 65].item())
    assert y[32].item() == -E4M3_MAX * block2_scale  # -inf in a zero block: saturates at its scale
    assert packed[0, 33].item() == 0x80  # -0.0 keeps its sign


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 37.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_format_bound(scale, dtype):
    g = torch.Generator().manual_seed(int(scale * 1000) % 997)
    x = (torch.randn(64, 512, generator=g) * scale).to(dtype)
    y = mxfp8_dequant(mxfp8_quant(x), torch.float32)
    xf = x.float().reshape(64, 16, 32)
    s = torch.tensor([_scale(b) for b in mxfp8_quant(x)[:, 512:].flatten().tolist()]).reshape(64, 16, 1)
    bound = 2.0 ** -4 * xf.abs() + 2.0 ** -9 * s  # half an ulp of 3 mantissa bits, or of the subnormal step
    err = (y.reshape(64, 16, 32) - xf).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    assert bool((s <= amax / 224).all())


def test_flash_window_row_is_528_bytes():
    packed = mxfp8_quant(torch.randn(128, 512, dtype=torch.bfloat16))
    assert packed.shape == (128, 528) and packed.numel() * packed.element_size() == 528 * 128


def test_bad_width_is_rejected():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quant(torch.randn(2, 48))
    with pytest.raises(ValueError, match="D \\+ D/32"):
        mxfp8_dequant(torch.zeros(2, 50, dtype=torch.uint8), torch.float32)


def _truncating_quant(x):  # rounds toward zero instead of to nearest even
    packed = mxfp8_quant(x)
    N, W = packed.shape
    D = W * 32 // 33
    q = packed[:, :D].view(torch.float8_e4m3fn).float()
    s = torch.ldexp(torch.ones(N, D // 32), packed[:, D:].to(torch.int32) - 127).repeat_interleave(32, -1)
    exact = (x.float() / s).clamp(-448, 448)
    down = torch.where((q.abs() > exact.abs()) & torch.isfinite(exact), q - q.sign() * 2.0 ** -9, q)
    return torch.cat((down.to(torch.float8_e4m3fn).view(torch.uint8), packed[:, D:]), -1)


class _Truncating(KernelBackend):
    name = "truncating"
    core_api_version = "1.0"
    ops = {"mxfp8_quant": f"{__name__}:_truncating_quant"}


def test_the_kit_catches_wrong_rounding():
    for op in ("ue8m0_scale", "mxfp8_quant", "mxfp8_dequant"):
        check_op(ReferenceKernels, op, torch.float32 if op != "mxfp8_dequant" else torch.bfloat16)
    with pytest.raises(AssertionError, match="mxfp8_quant.*not bit-exact"):
        check_op(_Truncating, "mxfp8_quant", torch.float32)
