"""Which decode graphs exist and how a step is padded into one (host-side logic only, no device work).

A graph is keyed by ``(n, R)``: ``n`` sequences of ``R`` query rows each. ``R = 1`` is a plain decode
step; ``R > 1`` a speculative verify step (the query token plus up to ``R - 1`` drafts). A verify step
whose requests carry ``q_i <= R`` rows is laid out request-major, ``R`` rows per request: request i's
real rows are rows ``i*R .. i*R + q_i - 1`` and its other rows are padding. Its context length becomes
``seq_len_i + R - q_i``, so that the attention of real row j (query j of R sees the first
``seq_len - R + j + 1`` keys) still sees exactly the keys it sees eagerly; padding rows see a few keys
past the request's context, write no KV, and are dropped.
"""

from __future__ import annotations

import bisect

#: Largest ``n * R`` (token rows) captured for verify steps when ``verify_graph_tokens`` is unset.
DEFAULT_VERIFY_TOKENS = 256


def verify_buckets(sizes: list[int], max_rows: int, max_tokens: int) -> dict[int, list[int]]:
    """Rows per request ``R`` in ``2..max_rows`` -> the batch sizes captured with R rows: every
    decode size ``n`` with ``n * R <= max_tokens`` (the bound on capture time and static memory).
    Empty when ``max_rows < 2`` (no speculation) or ``max_tokens < 2``."""
    out = {}
    for R in range(2, max_rows + 1):
        ns = [n for n in sorted(set(sizes)) if n * R <= max_tokens]
        if ns:
            out[R] = ns
    return out


def pick_key(sizes: list[int], buckets: dict[int, list[int]], B: int, max_q: int) -> tuple[int, int] | None:
    """The graph ``(n, R)`` a decode step of ``B`` sequences with at most ``max_q`` rows each replays:
    the fewest rows ``R >= max_q`` captured, then the smallest ``n >= B`` captured with them; None
    when there is none (the step runs eagerly). ``sizes``: the plain (``R = 1``) sizes, sorted."""
    if B < 1 or max_q < 1:
        return None
    if max_q == 1:
        i = bisect.bisect_left(sizes, B)
        return (sizes[i], 1) if i < len(sizes) else None
    for R in sorted(buckets):
        if R < max_q:
            continue
        ns = buckets[R]
        i = bisect.bisect_left(ns, B)
        if i < len(ns):
            return ns[i], R
    return None


def padded_layout(q_lens: list[int], seq_lens: list[int], n: int, R: int) -> tuple[list[int], list[int]]:
    """(row of each real token in the padded layout, every padded sequence's context length) for a
    verify step of ``len(q_lens)`` requests padded to ``n`` sequences of ``R`` rows. Padding
    requests get context length ``R``: each of their rows attends over at least one key."""
    B = len(q_lens)
    if B > n or len(seq_lens) != B or any(not 1 <= q <= R for q in q_lens):
        raise ValueError(f"padded_layout: {B} requests with rows {q_lens} do not fit {n} x {R}")
    dst = [i * R + j for i, q in enumerate(q_lens) for j in range(q)]
    lens = [s + R - q for s, q in zip(seq_lens, q_lens)] + [R] * (n - B)
    return dst, lens
