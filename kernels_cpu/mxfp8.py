"""MXFP8 (OCP microscaling, e4m3 elements with one ue8m0 scale per 32 values): the reference.

Semantics (every backend must match these bytes exactly):

* Blocks: 32 consecutive values along the last dimension (``D % 32 == 0``).
* Scale rule (``ue8m0_scale``): ``amax`` = the largest finite ``|x|`` of the block, clamped below at
  1e-4 (as DeepGEMM's ``ceil_to_ue8m0``). The scale is ``2**e`` with ``e = ceil(log2(amax / 448))``,
  computed exactly from ``frexp`` (no float log), clamped to [-127, 127]; its byte is ``e + 127``
  (ue8m0: a biased exponent, no sign, no mantissa; 255 = NaN is never produced). Rounding the
  exponent *up* means ``amax / scale <= 448``: finite values never saturate.
* Elements: ``x / scale`` (exact: a power of two) rounded to the nearest float8 e4m3fn value, ties to
  even; e4m3 subnormals below 2**-6 keep 2**-9 steps. ``+-inf`` saturates to ``+-448`` (the largest
  e4m3fn magnitude); NaN becomes the e4m3fn NaN byte 0x7F whatever its sign; ``-0.0`` stays ``-0``.
* Packed row (``mxfp8_quant``'s output): ``D`` e4m3 bytes, then ``D / 32`` scale bytes: 528 bytes
  for a 512-wide row (V4-Flash's window KV entry).
* ``mxfp8_dequant``: ``e4m3 * 2**(byte - 127)`` in the requested dtype (exact in float32 and
  bfloat16 for normal results). Error bound of a round trip: ``|x - y| <= 2**-4 * |x| + 2**-9 * scale``
  (half an ulp of a 3-bit mantissa, or half the subnormal step), with ``scale <= amax / 224``.
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
NAN_BYTE = 0x7F


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte (uint8) of the power-of-two scale for blocks of largest magnitude ``amax``."""
    a = amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    mant, exp = torch.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(a)), exact
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


def _scale_of(byte: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte.to(torch.int32) - 127)


def mxfp8_quant(x: torch.Tensor) -> torch.Tensor:
    """x[N, D] (any float dtype) -> packed uint8 [N, D + D/32]: e4m3 bytes then ue8m0 scale bytes."""
    N, D = x.shape
    if D % BLOCK:
        raise ValueError(f"mxfp8_quant: the last dimension ({D}) must be a multiple of {BLOCK}")
    xf = x.float().reshape(N, D // BLOCK, BLOCK)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros((), dtype=xf.dtype)).amax(-1)  # [N, D/32]
    scale_byte = ue8m0_scale(amax)
    y = (xf / _scale_of(scale_byte)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # inf -> +-448; NaN stays NaN
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(torch.isnan(xf), torch.full((), NAN_BYTE, dtype=torch.uint8), q)
    return torch.cat((q.reshape(N, D), scale_byte), dim=-1)


def mxfp8_dequant(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [N, D + D/32] -> [N, D] of ``dtype``."""
    N, W = packed.shape
    D = W * BLOCK // (BLOCK + 1)
    if D + D // BLOCK != W or D % BLOCK:
        raise ValueError(f"mxfp8_dequant: a packed row of {W} bytes is not D + D/32 for a D multiple of {BLOCK}")
    q = packed[:, :D].contiguous().view(torch.float8_e4m3fn).float().reshape(N, D // BLOCK, BLOCK)
    scale = _scale_of(packed[:, D:])
    return (q * scale[..., None]).reshape(N, D).to(dtype)
