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
cost. The "budget" policy instead fixes the step's verify budget on the host (a share of the draft
slots offered) and verifies the global top-k drafts of the whole batch by cumulative confidence (the
``draft_lengths`` op), so the budget flows to the requests most likely to accept; its draft loop stops
once deeper drafts could not win a slot (``budget_settled``). The functions here take plain lists and
floats only, so a device-side implementation can replace them.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer_core.engine.cost_model import load_json, save_json

FORMAT = 2  # 2: the lean draft path (curves measured before it overstate draft steps)


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


def _suffix_min(ys: list[float]) -> list[float]:
    """``out[i] = min(ys[i:])``."""
    out = list(ys)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


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
        # a monotone curve keeps marginal costs non-negative under measurement noise: a point above a
        # larger size's is capped by it (one slow sample is not spread to every larger size)
        for ys in (self.verify_s, self.draft_s):
            for i in range(len(ys) - 2, -1, -1):
                ys[i] = min(ys[i], ys[i + 1])

    def verify(self, tokens: float) -> float:
        return _interp(self.verify_tokens, self.verify_s, tokens)

    def draft(self, rows: float) -> float:
        return _interp(self.draft_rows, self.draft_s, rows)

    def overhead(self, requests: int) -> float:
        return self.overhead_s + self.overhead_per_req_s * requests

    def save(self, path: Path) -> None:
        save_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> StepCost:
        """Read a cached curve; a malformed one (a shared cache directory is not trusted) raises
        ``ValueError`` naming the field, and the caller measures the curve again."""
        data = load_json(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a step-cost curve is a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown step-cost format {data.get('format')!r}")
        for sizes, times in (("verify_tokens", "verify_s"), ("draft_rows", "draft_s")):
            xs, ys = data.get(sizes), data.get(times)
            if not (isinstance(xs, list) and xs and all(type(x) is int and x > 0 for x in xs)
                    and all(a < b for a, b in zip(xs, xs[1:]))):
                raise ValueError(f"{path}: {sizes} must be increasing positive ints, got {xs!r}")
            if not (isinstance(ys, list) and len(ys) == len(xs) and all(_time(y) for y in ys)):
                raise ValueError(f"{path}: {times} must be {len(xs)} finite times >= 0, got {ys!r}")
        for key in ("overhead_s", "overhead_per_req_s"):
            if not _time(data.get(key, 0.0)):
                raise ValueError(f"{path}: {key} must be a finite time >= 0, got {data[key]!r}")
        return cls(**data)


def _time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


class LiveCost:
    """The measured curve, kept right while serving. The step-time curve is measured once at start-up
    (on a shared machine, under whatever load there was then), and it leaves out work outside the
    forwards: engine bookkeeping, rejection sampling, and the draft's catch-up forward over the
    tokens the target just accepted. Each decode step's real times correct it:

    - ``verify_scale`` and ``draft_scale``: running ratios of measured to predicted times of the
      target forward and of the autoregressive draft steps;
    - ``verify_seen``: the running time of each verify size seen so far; it replaces the scaled
      curve there (the curve's shape, measured in a few seconds, can be off on a loaded machine;
      the feature verifies one draft more than chosen every ``EXPLORE_VERIFY_EVERY`` steps, so
      sizes next to the chosen ones get measured too);
    - ``catchup_scale``: the catch-up (and the first draft token), in units of one draft step over
      as many rows as the catch-up forward has (``catch_rows`` per drafting request: one plus the
      accepted drafts, more after steps without drafts), so a scale learnt at batch 1 holds at 32;
    - ``extra_overhead_s``: the rest of the step cycle beyond the start-up estimate;
    - ``step_seen`` and ``step_scale``: async speculative steps timed whole (``observe_step``, one
      step late: the host never times their parts), per (decodes, verified rows), and the running
      ratio of those times to the decomposed curve; the async verify budget reads them (``step``).

    Samples are clipped to a factor of two of the current value, so one stall (another process, an
    idle gap between requests) moves an estimate little, while a lasting change is followed within
    tens of steps. Same interface as ``StepCost``, plus ``catchup``."""

    ALPHA = 0.05

    def __init__(self, base: StepCost, adapt: bool = True) -> None:
        self.base, self.adapt = base, adapt  # adapt=False: the curve as given (tests)
        self.verify_scale = self.draft_scale = self.catchup_scale = 1.0
        self.catch_rows = 1.0  # rows of the catch-up forward per drafting request (running mean)
        self.extra_overhead_s = 0.0
        self.cycles = 0
        self.verify_seen: dict[int, float] = {}
        self._cap: tuple[list[int], list[float]] | None = None  # sizes seen, least time seen at >= each
        # async speculative steps, timed whole: (decodes, verified rows) -> running seconds
        self.step_seen: dict[tuple[int, int], float] = {}
        self.step_scale = 1.0  # running ratio of measured to modelled (``step_model``) async steps
        self.async_steps = 0  # async steps observed

    def _raw_verify(self, tokens: float) -> float:
        seen = self.verify_seen.get(tokens) if isinstance(tokens, int) else None
        return seen if seen is not None else self.verify_scale * self.base.verify(tokens)

    def verify(self, tokens: float) -> float:
        """The running time of a size seen, else the scaled curve; at most the least time seen at any
        larger size (a forward over more tokens is not cheaper, so one slow sample of a size that is
        then rarely seen again, such as the batch without drafts while drafting always runs, does
        not make it look dearer than its neighbours)."""
        if self._cap is None:
            keys = sorted(self.verify_seen)
            self._cap = keys, _suffix_min([self.verify_seen[t] for t in keys])
        keys, mins = self._cap
        i = bisect.bisect_right(keys, tokens)
        est = self._raw_verify(tokens)
        return min(est, mins[i]) if i < len(keys) else est

    def _larger(self, tokens: int) -> float:
        """The least time seen at any size above ``tokens`` (inf: none)."""
        if self._cap is None:
            self.verify(tokens)
        keys, mins = self._cap
        i = bisect.bisect_right(keys, tokens)
        return mins[i] if i < len(keys) else math.inf

    def draft(self, rows: float) -> float:
        return self.draft_scale * self.base.draft(rows)

    def catchup(self, rows: float) -> float:
        """The catch-up forward and the first draft token of a step drafting ``rows`` requests."""
        return self.catchup_scale * self.draft(rows * self.catch_rows)

    def overhead(self, requests: int) -> float:
        return self.base.overhead(requests) + self.extra_overhead_s

    def drafting(self, rows: int, depth: int) -> float:
        """Draft time of a step that drafts ``depth`` tokens for ``rows`` requests."""
        return self.catchup(rows) + self.draft(rows) * (depth - 1) if rows and depth else 0.0

    @classmethod
    def _update(cls, old: float, sample: float) -> float:
        return old + cls.ALPHA * (min(max(sample, 0.5 * old), 2.0 * old) - old)

    def observe(self, tokens: int, verify_s: float, rows: int, steps: int, steps_s: float, catchup_s: float,
                requests: int, cycle_s: float | None, catchup_rows: int | None = None) -> None:
        """One decode step: the target verified ``tokens`` tokens in ``verify_s``; the draft caught up
        over ``catchup_rows`` rows (default: ``rows``) and proposed its first token for ``rows``
        requests in ``catchup_s`` (0 rows: it did not draft), then ran ``steps`` more draft steps in
        ``steps_s``; ``requests`` decode requests; ``cycle_s``: from this step's start to the next
        one's (None across an idle gap)."""
        if not self.adapt:
            return
        pv = self.base.verify(tokens)
        if pv > 0 and verify_s > 0:
            # a sample slower than a larger size's estimate is capped by it (in ``verify``), and it does
            # not move the scale: one slow sample of a size is not spread to the sizes above it
            spread = verify_s <= self._larger(tokens)
            prior = self.verify(tokens)
            self._cap = None
            if tokens in self.verify_seen:
                self.verify_seen[tokens] = self._update(prior, verify_s)
            else:  # the first sample of a size replaces the curve's guess (within a factor of two)
                self.verify_seen[tokens] = min(max(verify_s, 0.5 * prior), 2.0 * prior)
            if spread:
                self.verify_scale = self._update(self.verify_scale, verify_s / pv)
        pd = self.base.draft(rows) * steps
        if pd > 0 and steps_s > 0:
            self.draft_scale = self._update(self.draft_scale, steps_s / pd)
        if rows and catchup_s > 0:
            caught = catchup_rows or rows
            self.catch_rows += self.ALPHA * (caught / rows - self.catch_rows)
            self.catchup_scale = self._update(self.catchup_scale, catchup_s / max(self.draft(caught), 1e-9))
        if cycle_s is not None:
            other = max(cycle_s - verify_s - steps_s - catchup_s - self.base.overhead(requests), 0.0)
            if self.cycles == 0:  # the first sample sets it, capped at the forwards' time
                self.extra_overhead_s = min(other, verify_s + steps_s + catchup_s)
            else:
                floor = max(self.extra_overhead_s, 1e-5)
                self.extra_overhead_s += self.ALPHA * (min(other, 2.0 * floor) - self.extra_overhead_s)
            self.cycles += 1


    # ---- async speculative steps (measured whole, one step late) --------------------------------
    def step_model(self, requests: int, tokens: int, depth: int) -> float:
        """A whole step's time by the decomposed curve: overhead, drafting ``depth`` deep for
        ``requests`` requests, and a verify forward over ``tokens`` tokens."""
        return self.overhead(requests) + self.drafting(requests, depth) + self.verify(tokens)

    def step(self, requests: int, tokens: int, depth: int) -> float:
        """An async speculative step's whole time at ``requests`` decodes and ``tokens`` verified
        rows: the running time measured at that size (``step_seen``), else the decomposed curve
        scaled by the running ratio of measured to modelled async steps (``step_scale``); at most
        the estimate of any larger size seen at the same batch (one slow sample is capped by them)."""
        seen = self.step_seen.get((requests, tokens))
        est = seen if seen is not None else self.step_scale * self.step_model(requests, tokens, depth)
        larger = [v for (r, t), v in self.step_seen.items() if r == requests and t > tokens]
        return min([est, *larger])

    def step_curve(self, requests: int, tokens: list[int], depth: int) -> list[float]:
        """``[self.step(requests, t, depth) for t in tokens]`` (``tokens`` ascending), in one pass over
        the sizes seen at this batch size."""
        seen = sorted((t, v) for (r, t), v in self.step_seen.items() if r == requests)
        mins = _suffix_min([v for _, v in seen])
        keys = [t for t, _ in seen]
        out, i = [], 0
        for t in tokens:
            while i < len(keys) and keys[i] <= t:
                i += 1
            exact = seen[i - 1][1] if i and keys[i - 1] == t else None
            est = exact if exact is not None else self.step_scale * self.step_model(requests, t, depth)
            out.append(min(est, mins[i]) if i < len(keys) else est)
        return out

    def observe_step(self, requests: int, tokens: int, seconds: float, depth: int) -> None:
        """One async speculative step, timed whole (the pipeline's cycle: from the previous step's
        completion to this one's) at ``requests`` decodes and ``tokens`` verified rows, drafting
        ``depth`` deep. Samples are clipped to twice the current estimate, as ``observe``'s are."""
        if not self.adapt or seconds <= 0 or requests <= 0:
            return
        model = self.step_model(requests, tokens, depth)
        larger = [v for (r, t), v in self.step_seen.items() if r == requests and t > tokens]
        spread = seconds <= min(larger, default=math.inf)  # (as in ``observe``: a slower one moves no scale)
        prior = self.step(requests, tokens, depth)
        key = (requests, tokens)
        if key in self.step_seen:
            self.step_seen[key] = self._update(prior, seconds)
        else:
            self.step_seen[key] = min(max(seconds, 0.5 * prior), 2.0 * prior)
        if model > 0 and spread:
            self.step_scale = self._update(self.step_scale, seconds / model)
        self.async_steps += 1


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


def budget_settled(cum_hist: list[list[float]], live: list[int], cum: list[float], budget: int) -> bool:
    """The "budget" policy's stop for the draft loop: True when drafting deeper can no longer change
    the step's global top-``budget`` drafts by cumulative confidence. A row's deeper drafts have P at most
    its latest P_ij (``cum[i]``), so once ``budget`` drafts already proposed (``cum_hist[depth][row]``)
    beat every row that can still draft (``live``), no deeper draft would win a verify slot, and
    stopping changes nothing the ``draft_lengths`` op picks."""
    if not live or budget <= 0:
        return True
    bound = max(cum[i] for i in live)
    return sum(1 for ps in cum_hist for p in ps if p > bound) >= budget


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
                   expected_tokens: float, cost: StepCost, fixed_s: float, max_more: int,
                   start_s: float = 0.0, margin: float = 0.0) -> bool:
    """Whether drafting deeper pays for itself: the step's expected tokens per second if drafting
    stops now, against its best value after 1..``max_more`` more draft steps. Each row's future
    conditional confidences are forecast as its latest one, so P_{j+t} = P_j * c_j**t.

    ``cum_last``/``conf_last``: P_ij and c_ij of the rows that can still draft; ``rows``: rows in
    the draft batch (each draft step runs them all); ``tokens_so_far``: tokens the next verify would
    compute with the drafts so far; ``expected_tokens``: its expected tokens; ``fixed_s``: step time
    spent so far outside the verify forward (overhead and draft steps); ``start_s``: a one-off cost
    that only drafting deeper pays, not stopping now (before a step's first draft: the catch-up beyond
    one draft step, so a plain step is not charged for a catch-up it would not run); ``margin``: the
    relative gain drafting deeper must promise (hysteresis: resuming drafting asks for more than
    continuing it)."""
    if not cum_last or max_more <= 0:
        return False
    n = len(cum_last)
    best = expected_tokens / max(fixed_s + cost.verify(tokens_so_far), 1e-9)
    gain, powers = 0.0, list(cum_last)
    for d in range(1, max_more + 1):
        powers = [p * c for p, c in zip(powers, conf_last)]
        gain += sum(powers)
        value = (expected_tokens + gain) / max(fixed_s + start_s + d * cost.draft(rows)
                                               + cost.verify(tokens_so_far + d * n), 1e-9)
        if value > best * (1.0 + margin):
            return True
    return False


def drafting_can_pay(rows: int, cost: LiveCost, k: int, conf: float) -> bool:
    """Whether drafting could pay at all for a batch of ``rows`` decoding requests if every draft
    were accepted with probability ``conf`` (an optimistic bound): by the step-time curve, the
    expected tokens per second of drafting 1..k deep against a plain step. When even that bound
    loses, drafting is off at this batch size and not worth an exploratory step either."""
    if rows <= 0:
        return True
    return worth_drafting([1.0] * rows, [conf] * rows, rows, rows, rows, cost, cost.overhead(rows), k,
                          start_s=cost.catchup(rows) - cost.draft(rows))


def async_can_pay(rows: int, cost: LiveCost, k: int, conf: float, plain_rate: float | None) -> bool | None:
    """Whether an async speculative step at ``rows`` decoding requests, each request's j-th draft
    accepted with probability ``conf ** j``, yields more tokens per second than ``plain_rate`` (plain
    decoding's measured tokens per second there) at its best verify budget, by the async steps' own
    measured curve (``LiveCost.step``: whole steps, drafting included). None when no async step was
    measured at this batch size or plain decoding was not measured."""
    if plain_rate is None or rows <= 0 or not any(r == rows for r, _ in cost.step_seen):
        return None
    expected, best = float(rows), 0.0
    times = cost.step_curve(rows, list(range(rows + 1, rows + rows * k + 1)), k)
    for b in range(1, rows * k + 1):
        expected += conf ** ((b - 1) // rows + 1)  # the b-th best slot: level (b - 1) // rows + 1
        best = max(best, expected / max(times[b - 1], 1e-9))
    return best > plain_rate


class MeasuredRates:
    """Decode tokens per second as measured, while drafting and while not, per batch-size bucket
    (``rows.bit_length()``: 1, 2-3, 4-7, ...): the check on the step-time curve. The curve and the
    confidences forecast whether drafting pays; these say whether it did. Each rate is a running
    mean of tokens per step over a running mean of seconds per step (drafting, verification,
    bookkeeping, async overlap or its absence), seconds clipped to a factor of two of the current mean."""

    ALPHA = 0.2
    PROBE_AFTER = 16  # drafting steps at a bucket before its plain rate is measured (if unknown)
    REPROBE_AFTER = 512  # drafting steps before a close call (spec < CLOSE x plain) measures plain again
    CLOSE = 1.25

    def __init__(self) -> None:
        self.spec: dict[int, float] = {}  # tokens per second: running mean tokens over running mean seconds
        self.plain: dict[int, float] = {}
        self._means: dict[tuple[bool, int], list[float]] = {}  # (drafting, bucket) -> [tokens, seconds] per step
        self.spec_steps: dict[int, int] = {}  # drafting steps measured since plain decoding last was

    @staticmethod
    def bucket(rows: int) -> int:
        return max(int(rows), 1).bit_length()

    def observe(self, drafting: bool, rows: int, tokens: float, seconds: float) -> None:
        """One step cycle of ``seconds`` that emitted ``tokens`` for ``rows`` decoding requests."""
        if seconds <= 0 or tokens < 0 or rows <= 0:
            return
        b = self.bucket(rows)
        m = self._means.get((drafting, b))
        if m is None:
            m = self._means[drafting, b] = [float(tokens), seconds]
        else:  # a ratio of means: a mean of per-step rates would be biased by steps of few tokens
            m[0] += self.ALPHA * (tokens - m[0])
            m[1] += self.ALPHA * (min(max(seconds, 0.5 * m[1]), 2.0 * m[1]) - m[1])
        (self.spec if drafting else self.plain)[b] = m[0] / m[1]
        if drafting:
            self.spec_steps[b] = self.spec_steps.get(b, 0) + 1
        else:
            self.spec_steps[b] = 0

    def verdict(self, rows: int, margin: float = 0.0) -> bool | None:
        """Whether drafting measured faster than plain decoding by ``margin`` at this batch size;
        None while either is unmeasured."""
        b = self.bucket(rows)
        spec, plain = self.spec.get(b), self.plain.get(b)
        if spec is None or plain is None:
            return None
        return spec > plain * (1.0 + margin)

    def needs_plain_probe(self, rows: int) -> bool:
        """Drafting ran here a while and plain decoding never (or long ago, and the call is close, so
        the load may have moved it): a few plain steps should be measured."""
        b = self.bucket(rows)
        n = self.spec_steps.get(b, 0)
        if b not in self.plain:
            return n >= self.PROBE_AFTER
        return n >= self.REPROBE_AFTER and self.spec.get(b, 0.0) < self.CLOSE * self.plain[b]
