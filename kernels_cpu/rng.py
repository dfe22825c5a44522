"""A counter-based RNG in plain integer torch ops.

``uniform_from_counter(seeds, offsets, n)`` gives, for each row, n uniforms in (0, 1) that depend only
on (seed, offset, column). Any backend can reproduce it bit for bit, and a row's draw never depends
on what else is in the batch, which makes sampling deterministic across batch compositions.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 hash on values held in int64 (all intermediate products stay below 2**63)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_from_counter(seeds: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    seeds = seeds.long()
    s_lo, s_hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(_mix32(s_lo ^ 0x9E3779B9) ^ s_hi)
    key = _mix32(key ^ (offsets.long() & _M32))  # [B]
    col = torch.arange(n, device=seeds.device, dtype=torch.long)
    bits = _mix32(_mix32(key[:, None] ^ col[None, :]) + 0x632BE5AB)  # [B, n], 32 random bits
    # 24 high bits -> (0, 1) exactly representable in float32
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
