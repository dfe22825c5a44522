# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""DSpark dormant under async scheduling: a step that does not draft is a plain step (decided before
scheduling, ``Proposer.draft_slots``: no slots laid out, nothing proposed or verified, the same
uploads), and exploratory drafts at high concurrency are rare: at least ``LARGE_EXPLORE_EVERY``
skipped steps apart, the gap doubling while they keep losing (also when drafting resumed after one
but stopped again soon), a few requests each; only where the measured async curve says a draft could
break even."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from spec_helpers import _cache_dir, make, tiny_mtp  # noqa: F401
from test_spec_async_slots import lockstep

from plugins.dspark import drafter as dspark_drafter
from plugins.dspark.feature import DSpark
from plugins.dspark.policy import LiveCost, StepCost

# drafts accepted 9 times in 10 would pay on this curve, 3 in 10 do not (as test_dspark's)
PAYS_AT_0_9 = ([1, 1024], [0.01, 1.0], [1, 1024], [0.003, 0.2])


def test_a_dormant_dspark_step_is_a_plain_step(tiny_mtp, monkeypatch):
    """Drafting never pays (and exploring is off): every step of the DSpark engine runs the forward
    rows and uploads of a plain async engine's step, and DSpark proposes nothing."""
    llm = make(tiny_mtp, dspark={"k": 3}, async_scheduling=True)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 1.0], [1, 1024], [0.05, 1.0]), adapt=False)
    feat.explore_every = 10**9
    logs = lockstep({"plain": make(tiny_mtp, features=False, async_scheduling=True), "dspark": llm}, monkeypatch)
    assert logs["dspark"].rows == logs["plain"].rows
    assert logs["dspark"].sends == logs["plain"].sends
    m = llm.metrics()
    assert feat.n["proposals"] == 0 and m["spec_verified"] == 0 and m["spec_draft_slots"] == 0
    assert m["dspark_steps_without_drafts"] > 0


class _Engine:
    def __init__(self, running: int) -> None:
        self.running = running

    def load_stats(self) -> dict:
        return {"running": self.running, "waiting": 0, "max_running": 64, "kv_usage": 0.0}


def _seqs(n: int) -> list:
    return [SimpleNamespace(request_id=str(i), is_finished=False, num_tokens=10, num_computed_tokens=9,
                            feature_state={}) for i in range(n)]


def _explorations(feat: DSpark, rows: int, steps: int, resume: int = 0) -> list[tuple[int, int]]:
    """(step, requests given slots) of the exploratory steps over ``steps`` steps at ``rows``
    requests; with ``resume``, each exploration makes drafting look worth it for that many steps
    (a resumed run that stops again)."""
    eng, seqs, out, left = _Engine(rows), _seqs(rows), [], 0
    for step in range(steps):
        feat.mean_conf = 0.95 if left > 0 else 0.3
        left -= 1
        if feat.active(eng):
            got = feat.draft_slots(eng, seqs, [feat.k] * rows)
            if any(got) and feat.exploring and left <= -1:
                out.append((step, sum(1 for m in got if m)))
                left = resume
    return out


@pytest.mark.parametrize("resume", [0, 5])
def test_explorations_back_off_at_high_concurrency(resume):
    """At 16 requests drafting loses (accept rate 0.3): exploratory steps come at least
    LARGE_EXPLORE_EVERY steps apart, each gap at least twice the one before (up to 4096), whether an
    exploration loses at once or drafting resumes for a few steps and stops (``resume``); each drafts
    a few requests only. At 2 requests they stay frequent (at most every SMALL_EXPLORE_EVERY steps)."""
    feat = DSpark({"k": 5})
    feat.live = LiveCost(StepCost(*PAYS_AT_0_9), adapt=False)
    got = _explorations(feat, 16, 8000, resume)
    steps = [s for s, _ in got]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert steps and steps[0] >= dspark_drafter.LARGE_EXPLORE_EVERY
    assert len(gaps) >= 2 and all(g >= dspark_drafter.LARGE_EXPLORE_EVERY for g in gaps)
    assert all(b >= min(2 * a, 4096) - resume - 2 for a, b in zip(gaps, gaps[1:])), gaps
    assert len(steps) <= 6
    if not resume:
        assert all(n <= dspark_drafter.EXPLORE_ROWS for _, n in got)
    small = DSpark({"k": 5})
    small.live = LiveCost(StepCost(*PAYS_AT_0_9), adapt=False)
    few = [s for s, _ in _explorations(small, 2, 2000)]
    assert len(few) >= 2000 // (dspark_drafter.SMALL_EXPLORE_EVERY + 2) - 1
    # the gap grown at 16 requests does not carry over to 2
    assert feat.explore_every == 4096
    assert len(_explorations(feat, 2, 1000)) >= 1000 // (dspark_drafter.SMALL_EXPLORE_EVERY + 2) - 1


def test_no_exploration_where_the_measured_async_curve_says_drafting_cannot_pay():
    """At 16 requests with the async steps measured there four times as dear as plain decoding's
    measured rate allows, even a hopeful accept rate cannot break even: no exploratory step (counted
    as blocked), though the start-up curve alone would explore."""
    feat = DSpark({"k": 5})
    feat.live = LiveCost(StepCost(*PAYS_AT_0_9), adapt=False)
    feat.live.adapt = True
    plain_step = 0.01
    for b in range(0, 81, 8):  # whole async steps at 16 requests: 4x a plain step, whatever the rows
        feat.live.observe_step(16, 16 + b, 4 * plain_step, 5)
    feat.live.adapt = False
    for _ in range(20):
        feat.rates.observe(False, 16, 16, plain_step)
    assert feat.async_verdict(16, 0.6) is False
    assert _explorations(feat, 16, 3000) == []
    assert feat.n["blocked_explorations"] > 0


def test_step_curve_equals_step_at_every_size():
    """``LiveCost.step_curve`` (one pass, read by the async budget and the async verdict) gives
    ``LiveCost.step`` at every size, measured or not, capped by larger sizes or not."""
    import random

    cost = LiveCost(StepCost([1, 64, 256], [0.01, 0.02, 0.05], [1, 64], [0.002, 0.004]))
    rng = random.Random(0)
    for _ in range(3000):
        r = rng.choice([1, 4, 32])
        cost.observe_step(r, r + rng.randrange(0, 5 * r + 1), rng.uniform(0.005, 0.08), 5)
    for r in (1, 4, 32, 7):
        sizes = list(range(r, 6 * r + 3))
        assert cost.step_curve(r, sizes, 5) == pytest.approx([cost.step(r, t, 5) for t in sizes], rel=1e-12)


@pytest.mark.parametrize(("conf", "spec_s", "trial"), [(0.3, 0.0105, False), (0.95, 0.0105, True),
                                                      (0.95, 0.02, False)])
def test_trials_only_where_the_forecast_says_drafting_pays(conf, spec_s, trial):
    """At 16 requests where drafting measured slower than plain decoding: a trial of real drafting
    (the whole batch) comes only where the forecast says drafting pays and the measured rates veto it
    by a little (the load may have moved: 5% slower); where the forecast says no as well, or drafting
    measured far slower (2x), exploring drafts a few requests and no step drafts for the whole batch."""
    feat = DSpark({"k": 5})
    feat.live = LiveCost(StepCost(*PAYS_AT_0_9), adapt=False)
    for _ in range(20):
        feat.rates.observe(True, 16, 16, spec_s)
        feat.rates.observe(False, 16, 16, 0.01)
    assert feat.rates.verdict(16) is False
    eng, seqs, full, explored = _Engine(16), _seqs(16), 0, 0
    for _ in range(3000):
        feat.mean_conf = conf
        if feat.active(eng):
            got = feat.draft_slots(eng, seqs, [feat.k] * 16)
            full += all(got)
            explored += 0 < sum(1 for g in got if g) < 16
    if trial:
        assert feat.n["trials"] > 0 and feat.n["measured_vetoes"] > 0 and full > 0
    else:
        assert feat.n["trials"] == 0 and full == 0 and explored > 0
