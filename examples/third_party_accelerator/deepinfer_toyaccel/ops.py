"""toyaccel's own op implementations (written differently from the reference on purpose)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    mean_square = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / xf.shape[-1]
    return (xf * torch.rsqrt(mean_square + eps) * w.float()).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)
