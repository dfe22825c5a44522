"""DSpark's "budget" policy and per-depth calibration of its confidences.

Under a step's verify budget the drafts verified are the global top-k of the whole batch by
cumulative confidence (not a per-request cut), greedy output stays exact, and the draft loop's early
stop never changes that choice. The calibration maps are monotone, calibrate what a head
mis-estimates, round-trip through their JSON file, are applied by the engine, and a file with a bad
field is refused with an error naming it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from spec_helpers import PROMPTS, _cache_dir, greedy, make, reference, run, tiny_mtp_dir  # noqa: F401
from test_dspark_confidence import _random_head

from deepinfer_core.config import ConfigError
from kernels_cpu import ops
from plugins.dspark import calibration as calib_mod
from plugins.dspark import confidence as conf_mod
from plugins.dspark.calibration import Calibration, isotonic_fit
from plugins.dspark.policy import LiveCost, StepCost, budget_settled


def _feature(llm):
    return next(f for f in llm.engine.features if f.name == "dspark")


def _global_topk(conf: list[list[float]], budget: int) -> list[int]:
    """The reference choice: every (request, position) by P_ij = c_i1 ... c_ij, the ``budget``
    largest win (ties: lower position, then lower request)."""
    cands = []
    for i, cs in enumerate(conf):
        p = 1.0
        for j, c in enumerate(cs):
            p *= c
            cands.append((-p, j, i))
    lengths = [0] * len(conf)
    for _, _, i in sorted(cands)[: max(budget, 0)]:
        lengths[i] += 1
    return lengths


@pytest.fixture()
def mtp_with_head(tiny_mtp_dir, tiny_v3_path, tmp_path) -> str:  # noqa: F811
    """The tiny MTP layer with a random confidence head (confidences that vary across requests)."""
    out = tmp_path / "mtp_head"
    shutil.copytree(tiny_mtp_dir, out)
    C = json.loads((Path(tiny_v3_path) / "config.json").read_text())["hidden_size"]
    _random_head(C, 7, target=False).save(out / conf_mod.FILENAME)
    return str(out)


# ---- the budget policy -----------------------------------------------------------------------------------

def test_budget_policy_verifies_the_global_topk_by_cumulative_confidence(tiny_v3_path, mtp_with_head,
                                                                         reference):  # noqa: F811
    """Each step verifies ``verify_share`` of the offered draft slots, and which drafts are exactly
    the global top-k of the batch by cumulative confidence: the budget flows to the requests likeliest
    to accept, some requests get more drafts than others in the same step, and greedy output is
    unchanged."""
    llm = make(tiny_v3_path, dspark={"draft": mtp_with_head, "k": 4, "budget_policy": "budget",
                                     "verify_share": 0.5})
    feat = _feature(llm)
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)
    steps = []
    orig_choose, orig_lengths = feat._choose, feat._threshold_lengths

    def choose(engine, requests, max_drafts):
        steps.append({"max_drafts": list(max_drafts)})
        out = orig_choose(engine, requests, max_drafts)
        steps[-1]["verified"] = sum(len(d.tokens) for d in out if d is not None)
        return out

    def lengths(engine, conf, budget, min_conf=None):
        out = orig_lengths(engine, conf, budget, min_conf)
        steps[-1].update(conf=conf, budget=budget, lengths=out)
        return out

    feat._choose, feat._threshold_lengths = choose, lengths
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    planned = [s for s in steps if "conf" in s]
    assert len(planned) > 5 and llm.metrics()["dspark_verified"] > 0
    uneven = binding = 0
    for s in planned:
        assert s["budget"] <= feat.share_budget(sum(s["max_drafts"]))
        assert s["lengths"] == _global_topk(s["conf"], s["budget"])
        assert s["verified"] == sum(s["lengths"]) == min(s["budget"], sum(map(len, s["conf"])))
        binding += s["budget"] < sum(map(len, s["conf"]))
        uneven += len(set(s["lengths"])) > 1
    assert binding and uneven  # the budget cut, and unevenly across the batch
    assert feat.verify_budget(llm.engine, 4, 16) == 8  # async steps get the same budget from the host
    llm.engine.blocks.check_no_leaks()


def test_budget_draft_loop_stop_changes_nothing():
    """The draft loop stops once no deeper draft could win a verify slot (``budget_settled``): the
    ``draft_lengths`` op then picks the same lengths from the truncated drafts as from all k."""
    g = torch.Generator().manual_seed(0)
    stopped_early = 0
    for trial in range(300):
        R, K = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        conf = torch.rand(R, K, generator=g) ** float(torch.rand(1, generator=g) * 2)
        budget = int(torch.randint(0, R * K + 1, (1,), generator=g))
        cum, hist, depth = conf[:, 0].tolist(), [conf[:, 0].tolist()], 1
        while depth < K and not budget_settled(hist, list(range(R)), cum, budget):
            cum = [a * float(b) for a, b in zip(cum, conf[:, depth])]
            hist.append(cum)
            depth += 1
        stopped_early += depth < K
        full = ops.draft_lengths(conf, torch.full((R,), K), budget, 0.0)
        cut = ops.draft_lengths(conf[:, :depth].contiguous(), torch.full((R,), depth), budget, 0.0)
        assert cut.tolist() == full.tolist() == _global_topk(conf.tolist(), budget), (trial, depth)
    assert stopped_early > 50


def test_verify_share_out_of_range(tiny_v3_path):
    with pytest.raises(ConfigError, match="verify_share"):
        make(tiny_v3_path, dspark={"budget_policy": "budget", "verify_share": 1.5})
    with pytest.raises(ConfigError, match="budget_policy"):
        make(tiny_v3_path, dspark={"budget_policy": "topk"})


# ---- calibration -----------------------------------------------------------------------------------------

def _synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw confidence, outcome, depth) where the raw confidence overstates acceptance at depth 0
    (true rate c**2) and understates it at depth 1 (sqrt c)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, generator=g)
    depth = torch.randint(0, 2, (n,), generator=g)
    true = torch.where(depth == 0, c**2, c.sqrt())
    y = (torch.rand(n, generator=g) < true).float()
    return c, y, depth


def test_calibration_is_monotone_and_calibrates_each_depth(tmp_path):
    c, y, depth = _synthetic(20_000, 1)
    cal = Calibration.fit(c, y, depth, max_depth=3)
    grid = torch.linspace(0, 1, 201)
    for d in (1, 2, 3):
        out = cal.apply(grid, d)
        assert bool((out[1:] >= out[:-1] - 1e-7).all()) and bool(((out >= 0) & (out <= 1)).all())
    tc, ty, td = _synthetic(20_000, 2)  # fresh outcomes: the calibrated rates match, the raw ones do not
    for d, truth in ((0, tc**2), (1, tc.sqrt())):
        m = td == d
        got = cal.apply(tc[m], d + 1)
        assert float((got - truth[m]).abs().mean()) < 0.03
        assert float((tc[m] - truth[m]).abs().mean()) > 0.1
    torch.testing.assert_close(cal.apply(grid, 3), cal.apply(grid, 2))  # a depth past the fit: the last map
    cal.save(tmp_path / calib_mod.FILENAME)
    back = Calibration.load(tmp_path / calib_mod.FILENAME)
    torch.testing.assert_close(back.apply(grid, 1), cal.apply(grid, 1), atol=1e-5, rtol=0)
    assert back.meta["fitted_positions"] == 20_000
    x, fy = isotonic_fit(torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([1.0, 0.0, 1.0, 1.0]), prior=0.0)
    assert fy == sorted(fy) and x == sorted(set(x)) and fy[0] == 0.5  # the violating pair is pooled
    # a sparse end block with no acceptance is shrunk towards its confidence, not mapped to 0
    x, fy = isotonic_fit(torch.tensor([0.3, 0.31, 0.9, 0.95]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert 0.0 < fy[0] < 0.3 and 0.9 < fy[-1] < 1.0 and fy == sorted(fy)


GOOD = {"format": 1, "kind": "isotonic", "depths": [{"x": [0.1, 0.9], "y": [0.2, 0.8]}]}


@pytest.mark.parametrize("patch, message", [
    ({"format": 2}, "field 'format' must be 1"),
    ({"kind": "platt"}, "field 'kind' must be 'isotonic'"),
    ({"depths": []}, "field 'depths' must be a non-empty list"),
    ({"depths": [[0.1, 0.2]]}, r"depths\[0\] must be an object"),
    ({"depths": [{"x": [0.1, 0.9], "y": [0.2]}]}, r"depths\[0\]: 'x' has 2 knots and 'y' 1"),
    ({"depths": [{"x": [0.5, 0.4], "y": [0.2, 0.3]}]}, r"depths\[0\]\.x must be strictly increasing"),
    ({"depths": [{"x": [0.1, 0.9], "y": [0.8, 0.2]}]}, r"depths\[0\]\.y must be non-decreasing"),
    ({"depths": [{"x": [0.1, 0.9], "y": [0.2, 1.5]}]}, r"depths\[0\]\.y must be a non-empty list of numbers"),
    ({"depths": [GOOD["depths"][0], {"x": "0.1", "y": [0.2]}]}, r"depths\[1\]\.x must be a non-empty list"),
])
def test_calibration_file_with_a_bad_field_is_refused(tmp_path, patch, message):
    path = tmp_path / calib_mod.FILENAME
    path.write_text(json.dumps({**GOOD, **patch}))
    with pytest.raises(ValueError, match=message):
        Calibration.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON calibration file"):
        Calibration.load(path)
    path.write_text(json.dumps(GOOD))
    assert Calibration.load(path).depths == [([0.1, 0.9], [0.2, 0.8])]


def test_engine_applies_the_shipped_calibration(tiny_v3_path, mtp_with_head, reference):  # noqa: F811
    """A calibration file beside the head: the engine's confidences are the head's, mapped per depth
    (greedy output unchanged); by default only the policies that rank drafts under a budget read it;
    a bad file is refused at start-up (whichever the policy) with an error naming the field."""
    path = Path(mtp_with_head)
    cal = Calibration([([0.0, 1.0], [0.05, 0.35]), ([0.0, 1.0], [0.6, 0.9])])
    cal.save(path / calib_mod.FILENAME)
    for policy, mode, used in (("throughput", "auto", False), ("budget", "auto", True), ("threshold", "off", False)):
        other = make(tiny_v3_path, dspark={"draft": str(path), "k": 3, "budget_policy": policy, "calibration": mode})
        assert (_feature(other).calib is not None) == used, (policy, mode)
        other.shutdown()
    with pytest.raises(ConfigError, match="calibration must be"):
        make(tiny_v3_path, dspark={"draft": str(path), "calibration": "yes"})
    llm = make(tiny_v3_path, dspark={"draft": str(path), "k": 3, "budget_policy": "fixed", "calibration": "on"})
    feat = _feature(llm)
    assert feat.calib is not None
    seen = []
    orig = feat._choose

    def choose(engine, requests, max_drafts):
        for seq in requests:
            st = seq.feature_state.get("dspark")
            if st and st.drafts:
                seen.append(list(st.conf))
        return orig(engine, requests, max_drafts)

    feat._choose = choose
    outs = run(llm, PROMPTS, greedy(12))
    assert [o.outputs[0].token_ids for o in outs] == [r[:12] for r in reference]
    assert seen
    for conf in seen:  # depth 1 within [0.05, 0.35], depths 2 and 3 within [0.6, 0.9] (the last map)
        assert 0.05 - 1e-6 <= conf[0] <= 0.35 + 1e-6
        assert all(0.6 - 1e-6 <= c <= 0.9 + 1e-6 for c in conf[1:])
    assert len({round(c[0], 6) for c in seen}) > 1  # still the head's per-draft estimate, not a constant
    llm.engine.blocks.check_no_leaks()
    llm.shutdown()
    (path / calib_mod.FILENAME).write_text(json.dumps({**GOOD, "depths": [{"x": [0.1], "y": [2.0]}]}))
    with pytest.raises(ConfigError, match=r"calibration is unusable: .*depths\[0\]\.y"):
        make(tiny_v3_path, dspark={"draft": str(path), "k": 3})


def test_budget_share_rounds_to_whole_rows():
    from plugins.dspark.feature import DSpark

    feat = DSpark({"budget_policy": "budget", "verify_share": 0.75})
    assert [feat.share_budget(n) for n in (0, 1, 4, 5, 160)] == [0, 1, 3, 4, 120]
    assert math.isclose(feat.opts["verify_share"], 0.75)
