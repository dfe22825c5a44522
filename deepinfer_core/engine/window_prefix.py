"""Prefix hits for models with window cache groups (DeepSeek-V4's sliding window): the decision flow.

A hit is decided by the full-history (compressed) groups and then completed for the window groups
by ``swa_prefix_policy`` (EngineConfig):

1. The compressed groups' hit is ``L1`` tokens (block aligned), capped at
   ``L - (window + spec_lookback)`` for a prompt of ``L`` tokens (``spec_lookback`` defaults to the
   configured draft length + 1: 134 for window 128 and k = 5), so the last window and a speculative
   look-back are always computed.
2. Window KV for ``[L1 - unit, L1)`` present (device blocks or a host snapshot) -> the hit is ``L1``,
   exact. ``unit`` = the window rounded up to whole blocks (128 for V4-Flash).
3. Else ``retain`` takes the longest shorter hit whose window KV is present (exact, may be 0);
   ``bounded_replay`` keeps the compressed blocks up to ``L1``, restarts at ``s = L1 - unit`` and
   recomputes only the window state of ``[s, L1)`` with the window clipped at ``s`` (token ``i``
   attends keys ``max(s, i - window + 1) .. i``): cost ``unit`` tokens whatever the context,
   approximate; ``recompute`` restarts at ``s = L1 - layers * (window - 1)`` (floored to a block,
   >= 0) the same way: the clipped window's error moves ``window - 1`` tokens per layer, so the
   window state of ``[L1 - window + 1, L1)`` comes out exact, at ``layers * (window - 1)`` tokens.

Replayed tokens read the compressed entries from the cached blocks and never write them; their
window KV lives in the request's own blocks and never enters the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_core.config import SWA_PREFIX_POLICIES as POLICIES


@dataclass(frozen=True)
class PrefixPlan:
    """How a request with window groups starts. ``blocks``: compressed (full) blocks taken from the
    cache; ``start``: its first computed token; tokens in ``[start, replay_until)`` are a replay
    (window state only; the window is clipped at ``start``); ``retain``: the window groups' state
    for ``[.., blocks * block_size)`` comes from the cache (device blocks or a host snapshot)."""

    blocks: int
    start: int
    replay_until: int
    retain: bool

    @property
    def replay_tokens(self) -> int:
        return self.replay_until - self.start


NO_HIT = PrefixPlan(0, 0, 0, False)


def window_unit(window: int, block_size: int) -> int:
    """Tokens of window state a hit needs, in whole blocks: ceil((window - 1) / block) blocks."""
    return max(1, -(-(window - 1) // block_size)) * block_size


def hit_cap_blocks(num_tokens: int, window: int, spec_lookback: int, block_size: int) -> int:
    """Most blocks a hit may cover: ``(L - (window + spec_lookback)) // block_size``, >= 0."""
    return max(0, (num_tokens - window - spec_lookback) // block_size)


def plan_prefix(policy: str, full_hit: int, num_tokens: int, block_size: int, window: int, spec_lookback: int,
                num_layers: int, window_present: Callable[[int], bool]) -> PrefixPlan:
    """The decision flow (module docstring). ``full_hit``: leading blocks the compressed groups hold;
    ``window_present(n)``: whether the window state a hit of ``n`` blocks needs is cached."""
    if policy not in POLICIES:
        raise ValueError(f"swa_prefix_policy must be one of {POLICIES}, got {policy!r}")
    n = min(full_hit, hit_cap_blocks(num_tokens, window, spec_lookback, block_size))
    if n <= 0:
        return NO_HIT
    if window_present(n):
        return PrefixPlan(n, n * block_size, n * block_size, True)
    if policy == "retain":
        for m in range(n - 1, 0, -1):
            if window_present(m):
                return PrefixPlan(m, m * block_size, m * block_size, True)
        return NO_HIT
    end = n * block_size
    back = window_unit(window, block_size) if policy == "bounded_replay" else num_layers * (window - 1)
    start = max(0, (end - back) // block_size * block_size)
    return PrefixPlan(n, start, end, False)
