"""Rotary tables: plain RoPE and YaRN (with DeepSeek's mscale), as one [max_pos, rope_dim] tensor
``[cos | sin]`` consumed by the ``rope`` kernel op."""

from __future__ import annotations

import math

import torch

from deepinfer_core.models.config import ModelConfig, yarn_mscale


def _yarn_inv_freq(dim: int, base: float, rope: dict) -> tuple[torch.Tensor, float]:
    factor = rope["factor"]
    original = rope.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolation = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def rope_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, qk_rope_head_dim] float32 table: cos in the first half, sin in the second."""
    dim = cfg.qk_rope_head_dim
    if cfg.rope_type == "default":
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        attention_factor = 1.0
    elif cfg.rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(dim, cfg.rope_theta, cfg.rope)
    else:
        raise ValueError(f"config.json: unsupported rope type {cfg.rope_type!r} (supported: default, yarn)")
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
