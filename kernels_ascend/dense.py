"""Norms, activation and rotary embedding through torch_npu's fused elementwise ops."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_rms_norm(x, w.to(x.dtype), epsilon=eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    # torch_npu.npu_add_rms_norm would fuse the add, but torch_npu 2.14.0 ships no documentation for
    # it (not in _op_plugin_docs.py), so its outputs' order and meaning are not a published contract.
    residual = x + residual
    return rms_norm(residual, w, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_swiglu(x, dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x[T, N, D] seen as BSND with B = 1; cos/sin repeated per interleaved pair, laid out 1S1D (the
    layout the docs require for rotary_mode='interleave')."""
    import torch_npu

    T, _, D = x.shape
    cs = cos_sin[positions]  # [T, D] = [cos | sin] per position
    cos = cs[:, : D // 2].repeat_interleave(2, dim=-1).to(x.dtype).view(1, T, 1, D)
    sin = cs[:, D // 2 :].repeat_interleave(2, dim=-1).to(x.dtype).view(1, T, 1, D)
    return torch_npu.npu_rotary_mul(x.unsqueeze(0), cos, sin, rotary_mode="interleave").squeeze(0)
