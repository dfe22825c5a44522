"""FP8 block-scaled GEMMs (DeepGEMM / DeepSeek-V3 semantics), in plain torch.

The exact meaning every backend must reproduce:

* **Weights** are e4m3 (``torch.float8_e4m3fn``) ``[N, K]`` with one float32 scale per 128 x 128 tile,
  ``w_scale[ceil(N/128), ceil(K/128)]`` (the checkpoint's ``weight_scale_inv``: the real weight is
  ``w * w_scale`` tile by tile). V4's ue8m0 scales are powers of two and load as float32 exactly.
* **Activations** are quantised on the fly per token and group of 128 channels
  (:func:`quantize_act_fp8`): ``s = max(amax(|x_group|), 1e-4) / 448`` in float32 (IEEE division),
  ``q = e4m3(x / s)``
  (round to nearest even, values clamped to +-448 first). With ``ue8m0=True`` the scale is rounded up
  to a power of two (``2^ceil(log2 s)``), as DeepSeek-V4 does.
* **Product**: ``y[t, n] = sum_kb (sum_{k in kb} q[t, k] w[n, k]) * s[t, kb] * w_scale[n // 128, kb]``
  accumulated in float32 and cast to ``x.dtype`` once. Backends may reorder the float32 sums (the
  conformance tolerance is float32-accumulation level on top of identical quantised operands).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cpu.ops import grouped_experts, silu_and_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
AMAX_FLOOR = 1e-4


def quantize_act_fp8(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x[T, K] -> (q[T, K] e4m3, scale[T, ceil(K/128)] float32), per token and group of 128 channels."""
    T, K = x.shape
    G = -(-K // GROUP)
    xf = F.pad(x.float(), (0, G * GROUP - K)).view(T, G, GROUP)
    amax = xf.abs().amax(-1).clamp(min=AMAX_FLOOR)
    # IEEE division on every device: a Python-scalar divisor makes CUDA torch multiply by its reciprocal
    # (1 ulp off in about half the groups, which moves exact e4m3 ties of bf16 inputs by a whole step)
    scale = amax / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, G * GROUP)[:, :K], scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q[..., N, K] (e4m3) times its scale per rows x cols tile, scale[..., ceil(N/rows), ceil(K/cols)]."""
    n, k = q.shape[-2:]
    s = scale.float().repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :n, :k]
    return q.float() * s


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x[..., K] @ (w[N, K] e4m3 scaled by w_scale per 128x128 tile).T -> [..., N] in x.dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    q, s = quantize_act_fp8(x.reshape(-1, K))
    a = dequantize_blocks(q, s, 1, GROUP)
    b = dequantize_blocks(w, w_scale, GROUP, GROUP)
    return (a @ b.t()).to(x.dtype).view(*lead, w.shape[0])


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe`` with FP8 experts: w13[E, 2I, C] / w2[E, C, I] e4m3 with per-expert 128x128 tile scales;
    each expert GEMM is :func:`fp8_linear`. The hidden: gate/up rounded to x.dtype (fp8_linear's output),
    silu(gate) * up in float32, rounded to x.dtype once, then quantised for the second GEMM."""
    def project(a: torch.Tensor, e: int, which: int) -> torch.Tensor:
        return fp8_linear(a, w13[e], w13_scale[e]) if which == 1 else fp8_linear(a, w2[e], w2_scale[e])

    def act(h: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(h.float()).to(h.dtype)

    return grouped_experts(x, w13, w2, weights, ids, act, project)
