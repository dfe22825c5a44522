"""Applying token bitmasks to logits.

On CPU, xgrammar's ``apply_token_bitmask_inplace`` walks the bits one by one (about 130 us for a 32k
vocabulary here). Instead the mask worker turns each filled bitmask into a :class:`CpuMask` right
after filling it (both overlap the forward pass):

* when few bitmask words allow anything (structural positions of a JSON document, enums, numbers),
  the list of allowed token ids: applying it keeps those logits and sets the row to -inf (a fill and
  two small gathers);
* otherwise (inside strings, where most tokens are allowed) a row of 0 / -inf built by expanding each
  bitmask byte through a 256 x 8 table: applying it is one vectorised add (``x + 0 == x``,
  ``x - inf == -inf``).

Both give bitwise the logits xgrammar's kernel gives. Other devices use xgrammar's device kernel.
"""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

# _PENALTY[b, j] is 0.0 where bit j of byte b is set (token allowed), else -inf
_PENALTY = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, 0.0, -np.inf).astype(np.float32)
KEEP_FRACTION = 8  # allowed-id lists when at most 1/8 of the bitmask words allow a token


class CpuMask:
    """A filled bitmask ready to apply to one CPU float32 logits row: ``keep`` (allowed ids) or
    ``penalty`` (0 / -inf per token)."""

    __slots__ = ("keep", "penalty")

    def __init__(self, keep: np.ndarray | None = None, penalty: np.ndarray | None = None) -> None:
        self.keep, self.penalty = keep, penalty


def penalty_rows(bitmask: torch.Tensor | np.ndarray, vocab_size: int) -> np.ndarray:
    """[n, vocab_size] float32 of 0 (allowed) and -inf (masked) from an [n, ceil(V/32)] int32 bitmask."""
    words = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    packed = words.view(np.uint8)  # little-endian words: byte k holds tokens 8k..8k+7
    return _PENALTY.take(packed, axis=0).reshape(packed.shape[0], -1)[:, :vocab_size]


def prepare_cpu_mask(words: np.ndarray, vocab_size: int) -> CpuMask:
    """A :class:`CpuMask` from one bitmask row (``words``: [ceil(V/32)] int32, a numpy view)."""
    if np.count_nonzero(words) * KEEP_FRACTION <= words.size:
        nz = np.flatnonzero(words)
        pos = np.flatnonzero(np.unpackbits(words[nz].view(np.uint8), bitorder="little"))
        keep = nz[pos >> 5] * 32 + (pos & 31)
        return CpuMask(keep=keep if words.size * 32 <= vocab_size else keep[keep < vocab_size])
    return CpuMask(penalty=penalty_rows(words[None], vocab_size)[0])


def apply_cpu_masks(logits: torch.Tensor, rows: list[int], masks: list[CpuMask]) -> None:
    """Apply ``masks[i]`` to ``logits[rows[i]]`` in place (CPU float32 logits)."""
    values = logits.numpy()
    for r, m in zip(rows, masks):
        row = values[r]
        if m.keep is not None:
            kept = row[m.keep]
            row.fill(-np.inf)
            row[m.keep] = kept
        else:
            row += m.penalty


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is 0 (all rows if ``rows`` is
    None). ``bitmask`` is [n, ceil(V/32)] int32 on the CPU, as xgrammar fills it."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1], indices=rows)
        return
    words = bitmask.numpy()
    rows = list(range(words.shape[0])) if rows is None else rows
    apply_cpu_masks(logits, rows, [prepare_cpu_mask(w, logits.shape[-1]) for w in words])
