"""Speculation never slower than plain decoding, measured, for a proposer that does not pace itself
(``Proposer.paces_itself`` False: DSpark has its own step-time curve).

Whether drafts pay depends on the batch size (a verify row is nearly free on a GPU at a few
requests, compute-bound on a CPU or at a large batch) and on how often they are accepted, which
changes with the text. So per batch size (running requests, in power-of-two buckets) the engine
keeps a running rate, emitted tokens per second of step, for speculative and for plain steps:

* at a new batch size it speculates first (``WARMUP`` steps), then tries ``TRIAL`` plain steps;
* from then on it runs the mode that measured faster, and now and then ``TRIAL`` steps of the other
  one, measured afresh, so that a change of text (or of load) is seen: the gap between trials doubles
  (from ``FIRST_GAP`` to ``MAX_GAP`` steps at that batch size) while they confirm the mode in use.

A step's time is the wall time of the engine's ``step()`` call that launched it, and its tokens are
those that call emitted. With async scheduling one call launches a step and completes the one
before, so the first call after a switch of mode mixes the two and is not counted. Steps with
prefill chunks are not counted either: their time is not a decode step's.
"""

from __future__ import annotations

import math

WARMUP = 24  # speculative steps measured at a batch size before plain ones are tried there
TRIAL = 8  # steps of the other mode per trial (its first, after the switch, not counted)
FIRST_GAP, MAX_GAP = 64, 4096  # steps between trials: doubled while trials confirm the mode in use
DECAY = 0.95  # per counted step: the memory of the running sums (about 20 steps)


class _Bucket:
    __slots__ = ("tokens", "seconds", "counted", "steps", "last", "trial_at", "gap", "trial_of")

    def __init__(self) -> None:
        self.tokens = {True: 0.0, False: 0.0}  # by mode (True: speculative)
        self.seconds = {True: 0.0, False: 0.0}
        self.counted = {True: 0, False: 0}
        self.steps = 0  # steps observed at this batch size
        self.last: bool | None = None  # the mode of its last counted step
        self.trial_at = -1  # the step its next (or current) trial starts at; -1: warming up
        self.gap = FIRST_GAP
        self.trial_of: bool | None = None  # the faster mode when the current trial started

    def rate(self, mode: bool) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] > 0 else 0.0

    def best(self) -> bool:
        return self.rate(True) >= self.rate(False)

    def in_trial(self) -> bool:
        return 0 <= self.trial_at <= self.steps < self.trial_at + TRIAL + 1


class SpecFloor:
    """The engine's measured choice between speculative and plain steps (module docstring)."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self._last: bool | None = None  # the mode of the last step observed
        self.switches = 0

    @staticmethod
    def key(requests: int) -> int:
        return max(requests, 1).bit_length()  # 1 | 2-3 | 4-7 | 8-15 ...

    def speculate(self, requests: int) -> bool:
        """Whether the coming step, at ``requests`` running requests, should be speculative."""
        b = self.buckets.setdefault(self.key(requests), _Bucket())
        if b.counted[True] < WARMUP:
            return True
        if b.counted[False] < TRIAL:
            return False
        return (not b.trial_of) if b.in_trial() else b.best()

    def observe(self, speculative: bool, requests: int, tokens: int, seconds: float, prefill: bool) -> None:
        """One ``step()`` call: its launched step's mode, the running requests, the tokens the call
        emitted and its wall time."""
        first = self._last is not None and self._last != speculative
        self.switches += first
        self._last = speculative
        b = self.buckets.setdefault(self.key(requests), _Bucket())
        b.steps += 1
        if b.trial_at < 0 and b.counted[False] >= TRIAL:  # warmed up: the first trial after a gap
            b.trial_at = b.steps + b.gap
        elif b.trial_at >= 0 and b.steps == b.trial_at:  # a trial starts: of the mode not in use
            b.trial_of = b.best()
        elif b.trial_at >= 0 and b.steps == b.trial_at + TRIAL + 1:  # it ended: confirmed, or not
            b.gap = min(2 * b.gap, MAX_GAP) if b.best() == b.trial_of else FIRST_GAP
            b.trial_at = b.steps + b.gap
        if first or prefill or not (0 < seconds < math.inf) or tokens < 0:  # (a bad clock reading: not counted)
            return
        if b.last != speculative:  # a run of the other mode at this batch size
            b.last = speculative
            if b.counted[speculative] and b.rate(speculative) < b.rate(not speculative):
                b.tokens[speculative] = b.seconds[speculative] = 0.0  # a trial: measured afresh
        b.tokens[speculative] = b.tokens[speculative] * DECAY + tokens
        b.seconds[speculative] = b.seconds[speculative] * DECAY + seconds
        b.counted[speculative] += 1

    def metrics(self) -> dict[str, float]:
        """Per bucket (named by its smallest request count) the measured tokens/s of each mode."""
        out = {}
        for k, b in sorted(self.buckets.items()):
            out[f"spec_floor_spec_tok_s_{1 << (k - 1)}"] = round(b.rate(True), 1)
            out[f"spec_floor_plain_tok_s_{1 << (k - 1)}"] = round(b.rate(False), 1)
        return out
