# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""DSpark's draft-length policies: the throughput policy (``choose_lengths`` / ``worth_drafting`` on a
step-time curve) cuts unlikely drafts, respects the verify budget and decodes plainly where drafting
does not pay; the live cost follows the measured step times; the threshold policy (the
``draft_lengths`` kernel op) cuts by cumulative confidence and keeps greedy output exact."""

from __future__ import annotations

import math

import pytest
from spec_helpers import PROMPTS, _cache_dir, cheap_drafts, greedy, make, reference, run, tiny_draft  # noqa: F401

from deepinfer_core.config import ConfigError
from plugins.dspark import drafter as dspark_drafter
from plugins.dspark.policy import LiveCost, StepCost, choose_lengths, fixed_lengths, worth_drafting

# ---- the throughput policy ------------------------------------------------------------------------------

def test_no_drafting_when_it_does_not_pay(tiny_v3_path, tiny_draft, reference, monkeypatch):
    """With drafts whose confidence is too low to pay for their steps, the throughput policy decodes
    plainly (drafts accepted 9 times in 10 would pay on this curve, so it explores now and then)."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_draft})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 1.0], [1, 1024], [0.003, 0.2]), adapt=False)
    feat.explore_every = 3  # exploratory drafts every few skipped steps, each for a few requests only
    monkeypatch.setattr(dspark_drafter, "LARGE_EXPLORE_EVERY", 3)  # (also at 8 requests and more)
    rows = []
    loop = feat._draft_loop
    feat._draft_loop = lambda r, states, *a: (rows.append(len(states)), loop(r, states, *a))
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["dspark_steps_without_drafts"] > 0 and m["dspark_verified_per_step"] < 0.5
    assert rows and max(rows) <= dspark_drafter.EXPLORE_ROWS < len(PROMPTS)
    llm.engine.blocks.check_no_leaks()


def test_policy_cuts_unlikely_drafts_and_respects_budget():
    cost = StepCost([1, 8, 64, 256], [0.010, 0.011, 0.020, 0.060], [1, 64], [0.001, 0.004])
    cum = [[0.95, 0.9, 0.85, 0.8], [0.3, 0.05, 0.01, 0.001]] + [[0.5, 0.2]] * 30
    lengths = choose_lengths(cum, base_tokens=32, budget=1000, cost=cost, fixed_s=0.005)
    assert lengths[0] == 4 and lengths[1] <= 1
    assert choose_lengths(cum, 32, 3, cost, 0.005)[0] <= 3 and sum(choose_lengths(cum, 32, 3, cost, 0.005)) <= 3
    assert fixed_lengths([5, 5, 2], 8) == [3, 3, 2]
    # drafting deeper: worth it for a confident request, not for an unlikely one
    assert worth_drafting([0.9], [0.95], 1, 2, 1.9, cost, 0.003, 3)
    assert not worth_drafting([0.05], [0.2], 1, 2, 1.05, cost, 0.003, 3)


def test_live_cost_follows_measured_times():
    """The policy's costs follow the real step times: scales converge to measured/predicted, one
    stall moves them little, idle gaps (cycle None) are not counted as overhead."""
    base = StepCost([1, 8], [0.010, 0.017], [1, 8], [0.002, 0.004])
    live = LiveCost(base)
    for _ in range(200):  # the machine runs 1.5x slower than at start-up; 3 ms per step outside forwards
        live.observe(tokens=4, verify_s=1.5 * base.verify(4), rows=1, steps=2, steps_s=1.5 * 2 * 0.002,
                     catchup_s=0.004, requests=1, cycle_s=1.5 * base.verify(4) + 0.006 + 0.004 + 0.003)
    assert live.verify_scale == pytest.approx(1.5, rel=0.02) and live.draft_scale == pytest.approx(1.5, rel=0.02)
    assert live.verify(8) == pytest.approx(1.5 * 0.017, rel=0.02)  # not seen: the scaled curve
    assert live.verify(4) == pytest.approx(1.5 * base.verify(4), rel=0.02)  # seen: its own running time
    for _ in range(100):  # verifying 2 tokens costs as much as 4 here, unlike the start-up curve's shape
        live.observe(2, 1.5 * base.verify(4), 1, 0, 0.0, 0.0, 1, None)
    assert live.verify(2) == pytest.approx(live.verify(4), rel=0.02) and live.verify(1) < live.verify(2)
    guess = live.verify(3)
    live.observe(3, 0.8 * guess, 1, 0, 0.0, 0.0, 1, None)  # a size's first sample replaces the curve's guess
    assert live.verify(3) == pytest.approx(0.8 * guess)
    assert live.catchup(1) == pytest.approx(0.004, rel=0.02)
    assert live.overhead(1) == pytest.approx(0.003, rel=0.05)
    assert live.drafting(1, 3) == pytest.approx(0.004 + 2 * 0.003, rel=0.02)
    before = (live.verify_scale, live.extra_overhead_s)
    live.observe(4, 50 * base.verify(4), 1, 2, 0.006, 0.004, 1, cycle_s=None)  # a stall, then an idle gap
    assert live.verify_scale < 1.1 * before[0] and live.extra_overhead_s == before[1]
    frozen = LiveCost(base, adapt=False)
    frozen.observe(4, 1.0, 1, 2, 1.0, 1.0, 1, 1.0)
    assert frozen.verify(4) == base.verify(4) and frozen.overhead(1) == base.overhead(1)


def test_step_cycles_run_from_one_step_start_to_the_next(tiny_v3_path, tiny_draft):
    """The live curve's cycle of a speculative step (what it learns the engine's overhead from) runs from
    that step's start to the next step's, not into the next step's forward (which made the overhead a
    whole forward too large)."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_draft, "k": 3, "budget_policy": "fixed"})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    starts, cycles = [], []
    prepare, observe = llm.engine.runner.prepare, feat.live.observe

    def timed_prepare(*a, **kw):
        batch = prepare(*a, **kw)
        starts.append(batch.started)
        return batch

    def recorded(*a, cycle_s=None, **kw):
        cycles.append((len(starts), cycle_s))  # (the steps prepared so far, its cycle)
        return observe(*a, cycle_s=cycle_s, **kw)
    llm.engine.runner.prepare, feat.live.observe = timed_prepare, recorded
    run(llm, PROMPTS[:2], greedy(16))
    timed = [(n, c) for n, c in cycles if c is not None]
    assert len(timed) > 5
    for n, c in timed:  # observed at the propose after step n (1-based): step n - 1's cycle
        assert c == pytest.approx(starts[n - 1] - starts[n - 2], abs=1e-9)


def test_live_cost_batch32_converges_to_linear_step_times():
    """Concurrency 32: the start-up curve (few requests per point) is concave, 32 -> 64 verified rows
    costing 1.3x, while the real forward grows linearly with rows. The live cost follows the real times
    at the sizes seen, a stale slow sample of the undrafted batch (32 rows, no longer seen once
    drafting runs) is capped by the cheaper larger sizes, and a plain step is not charged the draft's
    catch-up: drafting at confidence 0.85 then does not pay, as in reality."""
    ms = 1e-3
    base = StepCost([1, 6, 24, 48, 96, 192], [x * ms for x in (3.9, 4.8, 6.9, 8.7, 12.8, 20.7)], [1, 8, 32, 64],
                    [x * ms for x in (1.1, 1.9, 4.6, 9.3)])

    def real(tokens: int) -> float:
        return (1.0 + 0.3 * tokens) * ms

    live = LiveCost(base)
    live.observe(32, 2 * real(32), 0, 0, 0.0, 0.0, 32, None)  # a slow undrafted step, then drafting only
    for i in range(400):  # depth 2: catch-up 8 ms, one draft step 4.6 ms
        t = 33 + i % 40
        live.observe(t, real(t), 32, 1, 4.6 * ms, 8 * ms, 32, real(t) + 4.6 * ms + 8 * ms + 1 * ms)
    for t in (33, 50, 72):
        assert live.verify(t) == pytest.approx(real(t), rel=0.02)
    assert live.verify_seen[32] > 1.3 * real(32) and live.verify(32) <= live.verify(33)
    assert live.catchup(32) == pytest.approx(8 * ms, rel=0.02) and live.draft(32) == pytest.approx(4.6 * ms, rel=0.02)
    assert live.overhead(32) == pytest.approx(1 * ms, rel=0.05)
    conf = [0.85] * 32
    start = live.catchup(32) - live.draft(32)
    assert not worth_drafting([1.0] * 32, conf, 32, 32, 32, live, live.overhead(32), 5, start_s=start)
    # charging the plain step the catch-up too (the old baseline) makes drafting look worth it
    assert worth_drafting([1.0] * 32, conf, 32, 32, 32, live, live.overhead(32) + start, 5)
    # at batch 1 a confident draft still pays with the same costs
    assert worth_drafting([1.0], [0.85], 1, 1, 1, live, live.overhead(1), 5, start_s=live.catchup(1) - live.draft(1))


def test_live_catchup_scales_with_the_rows_it_covers():
    """The catch-up forward covers one row per accepted token: its cost learnt at batch 1 (3 rows per
    request) carries over to batch 32 as a draft step over 96 rows, not over 32."""
    ms = 1e-3
    base = StepCost([1, 6], [4 * ms, 5 * ms], [1, 8, 32, 64, 128], [x * ms for x in (1.0, 1.5, 3.0, 5.0, 9.0)])
    live = LiveCost(base)
    for _ in range(300):  # batch 1: the catch-up over 3 rows costs what the curve says for 3 rows
        live.observe(4, 5 * ms, 1, 1, 1 * ms, base.draft(3), 1, None, catchup_rows=3)
    assert live.catch_rows == pytest.approx(3, rel=0.02) and live.catchup_scale == pytest.approx(1, rel=0.02)
    assert live.catchup(32) == pytest.approx(base.draft(96), rel=0.03) and live.catchup(32) > 1.5 * base.draft(32)


# ---- the threshold policy (the draft_lengths kernel op) -------------------------------------------

def test_threshold_policy_is_greedy_exact_and_cuts_by_cumulative_confidence(tiny_v3_path, reference):
    """``budget_policy = "threshold"``: the drafts offered are exactly those the ``draft_lengths``
    op keeps (cumulative confidence >= min_confidence, budget respected); greedy output unchanged."""
    llm = make(tiny_v3_path, dspark={"draft": tiny_v3_path, "k": 4, "budget_policy": "threshold",
                                     "min_confidence": 0.5, "verify_budget": 6})
    cheap_drafts(llm)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    seen = []
    orig = feat._threshold_lengths

    def spy(engine, conf, budget):
        out = orig(engine, conf, budget)
        seen.append((conf, budget, out))
        return out

    feat._threshold_lengths = spy
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert seen and llm.metrics()["dspark_verified"] > 0
    for conf, budget, lengths in seen:
        assert sum(lengths) <= budget
        for c, m in zip(conf, lengths):
            assert all(math.prod(c[: j + 1]) >= 0.5 - 1e-6 for j in range(m))
    assert any(m < len(c) for conf, _, lengths in seen for c, m in zip(conf, lengths))  # something was cut
    llm.engine.blocks.check_no_leaks()


def test_min_confidence_out_of_range(tiny_v3_path):
    with pytest.raises(ConfigError, match="min_confidence"):
        make(tiny_v3_path, dspark={"budget_policy": "threshold", "min_confidence": 1.5})


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(verify_tokens=[4, 2, 8]), "verify_tokens must be increasing positive ints"),
    (lambda d: d.update(draft_rows=[]), "draft_rows must be increasing positive ints"),
    (lambda d: d["verify_s"].__setitem__(1, float("nan")), "verify_s must be 3 finite times >= 0"),
    (lambda d: d.update(draft_s=[0.001]), "draft_s must be 2 finite times >= 0"),
    (lambda d: d.update(overhead_s=-1.0), "overhead_s must be a finite time >= 0"),
    (lambda d: d.update(format=1), "unknown step-cost format 1"),
])
def test_a_malformed_cached_step_time_curve_is_refused(tmp_path, edit, field):
    """A cached curve comes from a cache directory that may be shared or hand-edited: one that would
    divide by zero or steer the policy with NaN is refused naming the field (DSpark measures again)."""
    import json

    from deepinfer_core.engine.cost_model import save_json

    good = StepCost([1, 2, 4], [0.01, 0.012, 0.015], [1, 2], [0.002, 0.003], 0.001, 0.0001)
    path = tmp_path / "curve.json"
    save_json(path, good.__dict__)
    assert StepCost.load(path) == good
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        StepCost.load(path)
