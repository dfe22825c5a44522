"""Applying token bitmasks to logits.

On CPU, xgrammar's ``apply_token_bitmask_inplace`` walks the bits one by one (about 130 us for a 32k
vocabulary here). Instead each bitmask byte is expanded through a 256 x 8 table of {0, -inf} into a
penalty row (about 10 us, done on the mask worker thread together with the fill), and applying it is
one vectorised add (``x + 0 == x``, ``x - inf == -inf``). Other devices use xgrammar's device kernel.
"""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

# _PENALTY[b, j] is 0.0 where bit j of byte b is set (token allowed), else -inf
_PENALTY = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 0.0, -np.inf).astype(np.float32)


def penalty_rows(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[n, vocab_size] float32 of 0 (allowed) and -inf (masked) from an [n, ceil(V/32)] int32 bitmask."""
    packed = bitmask.numpy().view(np.uint8)  # little-endian words: byte k holds tokens 8k..8k+7
    return _PENALTY.take(packed, axis=0).reshape(packed.shape[0], -1)[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: list[int], penalties: list[np.ndarray]) -> None:
    """``logits[rows[i]] += penalties[i]`` in place (CPU float32 logits)."""
    values = logits.numpy()
    for r, pen in zip(rows, penalties):
        values[r] += pen.reshape(-1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is 0 (all rows if ``rows`` is
    None). ``bitmask`` is [n, ceil(V/32)] int32 on the CPU, as xgrammar fills it."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1], indices=rows)
        return
    penalty = penalty_rows(bitmask, logits.shape[-1])
    values = logits.numpy()
    if rows is None:
        values += penalty
    else:
        values[rows] += penalty
