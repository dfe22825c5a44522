"""DSpark's metrics across dp ranks (``plugins/dspark/metrics.py``): sums, rates from the sums, no
division by zero, ranks without DSpark ignored, and one rank's metrics merge to themselves."""

from __future__ import annotations

import math

import pytest

from plugins.dspark import metrics


def _rank(**over) -> dict:
    m = {f"dspark_{k}": 0 for k in metrics.SUMMED} | {f"dspark_{k}": 1.0 for k in metrics.AVERAGED}
    m |= {"dspark_draft": "mtp", "dspark_k": 5, "dspark_varlen": True}
    m |= {f"dspark_{k}": v for k, v in over.items()}
    return m | metrics._rates(m)


def test_merge_sums_counters_and_takes_rates_from_the_sums():
    a = _rank(decode_steps=10, verified=20, accepted=10, proposals=4, draft_depth_total=12, cost_verify_scale=1.0)
    b = _rank(decode_steps=30, verified=20, accepted=20, proposals=0, draft_depth_total=0, cost_verify_scale=3.0)
    out = metrics.merge([a, {"other_feature": 1}, b])  # a rank's dict without DSpark's keys is not a DSpark rank
    assert out["dspark_decode_steps"] == 40 and out["dspark_verified"] == 40 and out["dspark_accepted"] == 30
    assert out["dspark_accept_rate"] == pytest.approx(30 / 40)
    assert out["dspark_tokens_per_step"] == pytest.approx((30 + 40) / 40)
    assert out["dspark_mean_draft_depth"] == pytest.approx(12 / 4)
    assert out["dspark_cost_verify_scale"] == pytest.approx(2.0)
    assert "other_feature" not in out


def test_merge_of_nothing_and_of_idle_ranks():
    assert metrics.merge([]) is None
    assert metrics.merge([{"x": 1}]) is None
    out = metrics.merge([_rank(), _rank()])  # no step, no draft: zeros, not a division by zero
    assert out["dspark_accept_rate"] == 0.0 and out["dspark_mean_draft_depth"] == 0.0
    assert all(math.isfinite(v) for v in out.values() if isinstance(v, float))


def test_a_single_rank_merges_to_itself():
    a = _rank(decode_steps=7, verified=9, accepted=4, proposals=3, draft_depth_total=5, draft_time=0.25)
    assert metrics.merge([a]) == a
