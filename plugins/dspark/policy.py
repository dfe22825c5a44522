"""Verify-length policy: how many draft tokens each request verifies, from the drafts' confidences
and this platform's measured step-time curve.

A request's draft prefix of length m is fully accepted with probability ``P_m = c_1 * ... * c_m``
(``c_j``: the confidence head's conditional acceptance probability of d_j), so it yields
``1 + P_1 + ... + P_m`` tokens in expectation (the +1 is the corrected or bonus token). The
throughput policy picks the lengths that maximise expected tokens per second of step time:

    (B + sum_i sum_{j <= m_i} P_ij) / (fixed + verify_time(T0 + sum_i m_i))

under ``sum_i m_i <= budget``. Since P_ij falls with j, taking candidates in descending order of
P_ij always gives valid prefixes; the objective is evaluated at every prefix of that order and the
best prefix wins. The same rule decides, while drafting, whether one more draft step is worth its
cost. The functions here take plain lists and floats only, so a device-side implementation can
replace them.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = 1


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points, extended linearly past the last two."""
    if not xs:
        return 0.0
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class StepCost:
    """Measured times on this platform: one target forward over T tokens of decode queries
    (``verify_tokens``/``verify_s``), one draft step over B rows (``draft_rows``/``draft_s``), and
    the engine's per-step work outside forwards per decode request (``overhead_per_req_s``)."""

    verify_tokens: list[int]
    verify_s: list[float]
    draft_rows: list[int]
    draft_s: list[float]
    overhead_s: float = 0.0
    overhead_per_req_s: float = 0.0
    platform: str = ""
    key: str = ""
    format: int = FORMAT

    def __post_init__(self) -> None:
        # a monotone curve keeps marginal costs non-negative under measurement noise
        for ys in (self.verify_s, self.draft_s):
            for i in range(1, len(ys)):
                ys[i] = max(ys[i], ys[i - 1])

    def verify(self, tokens: float) -> float:
        return _interp(self.verify_tokens, self.verify_s, tokens)

    def draft(self, rows: float) -> float:
        return _interp(self.draft_rows, self.draft_s, rows)

    def overhead(self, requests: int) -> float:
        return self.overhead_s + self.overhead_per_req_s * requests

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> StepCost:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown step-cost format {data.get('format')!r}")
        return cls(**data)


def choose_lengths(cum_conf: list[list[float]], base_tokens: int, budget: int, cost: StepCost,
                   fixed_s: float) -> list[int]:
    """Throughput-optimal verify lengths.

    ``cum_conf[i]``: P_i1 >= P_i2 >= ... for request i's drafts; ``base_tokens``: tokens the step
    computes anyway (prefill chunks plus one query token per decode); ``budget``: most draft tokens
    to verify in total; ``fixed_s``: step time that does not depend on the lengths (drafting,
    engine overhead)."""
    B = len(cum_conf)
    cands = sorted(((p, j, i) for i, ps in enumerate(cum_conf) for j, p in enumerate(ps)),
                   key=lambda c: (-c[0], c[1]))
    if budget < len(cands):
        cands = cands[: max(budget, 0)]
    best_n, gain = 0, float(B)
    best = gain / max(fixed_s + cost.verify(base_tokens), 1e-9)
    for n, (p, _, _) in enumerate(cands, start=1):
        gain += p
        value = gain / max(fixed_s + cost.verify(base_tokens + n), 1e-9)
        if value > best:
            best, best_n = value, n
    lengths = [0] * B
    for _, _, i in cands[:best_n]:
        lengths[i] += 1
    return lengths


def fixed_lengths(available: list[int], budget: int) -> list[int]:
    """Fixed-k policy: every request verifies all its drafts; over the budget, the longest are cut
    first (one token at a time, so requests stay as even as possible)."""
    lengths = list(available)
    excess = sum(lengths) - max(budget, 0)
    while excess > 0:
        i = max(range(len(lengths)), key=lambda r: lengths[r])
        lengths[i] -= 1
        excess -= 1
    return lengths


def worth_drafting(cum_last: list[float], conf_last: list[float], rows: int, tokens_so_far: float,
                   expected_tokens: float, cost: StepCost, fixed_s: float, max_more: int) -> bool:
    """Whether drafting deeper pays for itself: the step's expected tokens per second if drafting
    stops now, against its best value after 1..``max_more`` more draft steps. Each row's future
    conditional confidences are forecast as its latest one, so P_{j+t} = P_j * c_j**t.

    ``cum_last``/``conf_last``: P_ij and c_ij of the rows that can still draft; ``rows``: rows in
    the draft batch (each draft step runs them all); ``tokens_so_far``: tokens the next verify would
    compute with the drafts so far; ``expected_tokens``: its expected tokens; ``fixed_s``: step time
    spent so far outside the verify forward (overhead and draft steps)."""
    if not cum_last or max_more <= 0:
        return False
    n = len(cum_last)
    best = expected_tokens / max(fixed_s + cost.verify(tokens_so_far), 1e-9)
    gain, powers = 0.0, list(cum_last)
    for d in range(1, max_more + 1):
        powers = [p * c for p, c in zip(powers, conf_last)]
        gain += sum(powers)
        value = (expected_tokens + gain) / max(fixed_s + d * cost.draft(rows) + cost.verify(tokens_so_far + d * n),
                                               1e-9)
        if value > best:
            return True
    return False
