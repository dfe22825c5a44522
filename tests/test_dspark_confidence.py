"""DSpark's confidence head with target features, its fit and calibration, and the length policy's
floor: no drafting where the step-time curve says drafting costs more than it yields.

Greedy output stays exact with a head that reads the target's features; the engine's per-step
confidences equal the head applied offline to the logged features; a fitted head survives
save/load and is calibrated, and so is the shipped draft's head on held-out text; the fast path
equals the head; with a curve on which drafting cannot pay the engine never drafts (not
even an exploratory step), with one on which it pays it drafts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from spec_helpers import (  # noqa: F401
    _cache_dir,
    _heldout_prompts,
    greedy,
    make,
    reference,
    run,
    tiny_mtp,
    tiny_mtp_dir,
)

from deepinfer_core import LLM, SamplingParams
from plugins.dspark import confidence as conf_mod
from plugins.dspark import drafter as dspark_drafter
from plugins.dspark import feature as dspark_feature
from plugins.dspark.confidence import EXTRA_FEATURES, LEGACY_FEATURES, TARGET_FEATURES, ConfidenceHead
from plugins.dspark.head_fit import (
    calibration,
    cut_trade,
    fit_head,
    fit_temperature,
    fold_temperature,
    outcomes,
    predict,
)
from plugins.dspark.policy import LiveCost, StepCost, choose_lengths, drafting_can_pay, worth_drafting

PROMPTS_N = 8


def _feature(llm):
    return next(f for f in llm.engine.features if f.name == "dspark")


def _random_head(C: int, seed: int, target: bool = True) -> ConfidenceHead:
    g = torch.Generator().manual_seed(seed)
    wt = torch.randn(len(TARGET_FEATURES), generator=g) if target else None
    return ConfidenceHead(torch.randn(C, generator=g) * 0.1, torch.randn(len(EXTRA_FEATURES), generator=g) * 0.5,
                          0.2, 1.0, wt)


@pytest.fixture()
def mtp_with_target_head(tiny_mtp_dir, tiny_v3_path, tmp_path) -> tuple[str, ConfidenceHead]:  # noqa: F811
    """The shipped-apart tiny MTP layer with a (random) confidence head reading target features."""
    out = tmp_path / "mtp_head"
    shutil.copytree(tiny_mtp_dir, out)
    C = json.loads((Path(tiny_v3_path) / "config.json").read_text())["hidden_size"]
    head = _random_head(C, 5)
    head.save(out / conf_mod.FILENAME)
    return str(out), head


# ---- the head in the engine ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["throughput", "threshold", "fixed"])
def test_target_features_keep_greedy_exact(tiny_v3_path, mtp_with_target_head, reference, policy):  # noqa: F811
    from spec_helpers import PROMPTS

    path, head = mtp_with_target_head
    llm = make(tiny_v3_path, dspark={"draft": path, "k": 4, "budget_policy": policy, "min_confidence": 0.05})
    feat = _feature(llm)
    assert feat.source.kind == "mtp" and feat.head.uses_target
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)  # drafting pays
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.metrics()["dspark_verified"] > 0
    llm.engine.blocks.check_no_leaks()


def test_engine_confidences_equal_offline_head(tiny_v3_path, mtp_with_target_head):
    """The engine's per-position confidences (fast path, target term folded per row) equal the head
    applied to the logged features offline; the logged target features vary across steps and the
    previous-acceptance feature is filled after a request's first verification."""
    from spec_helpers import PROMPTS

    path, head = mtp_with_target_head
    llm = make(tiny_v3_path, dspark={"draft": path, "k": 3, "budget_policy": "fixed"})
    feat = _feature(llm)
    feat.outcome_log = []
    params = [greedy(16) if i % 2 == 0 else torch_sampled(i) for i in range(len(PROMPTS))]
    run(llm, PROMPTS, params)
    o = outcomes(feat.outcome_log)
    assert o.target is not None and o.target.shape[1] == len(TARGET_FEATURES)
    assert bool((o.target[:, 5] == 1).any()) and bool((o.target[:, 5] == 0).any())  # no_prev, then a fraction
    assert float(o.target[:, 1].std()) > 0  # the target's top-1 probability differs across steps
    logged = torch.tensor([c for r in feat.outcome_log for c in r[4]])
    decided = torch.cat([torch.arange(len(r[7])) < len(r[4]) for r in feat.outcome_log])
    offline = predict(feat.head, o)[decided]
    torch.testing.assert_close(offline, logged, atol=1e-5, rtol=1e-4)
    llm.engine.blocks.check_no_leaks()


def torch_sampled(i: int):
    from deepinfer_core import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seq_seed=100 + i)


def test_target_head_needs_an_mtp_draft(tiny_v3_path, tmp_path):
    """A head reading target features beside a draft model (which is not fed them) is refused."""
    from spec_helpers import _copy_files

    from deepinfer_core.config import ConfigError

    out = tmp_path / "draft"
    _copy_files(Path(tiny_v3_path), out, skip=())
    C = json.loads((out / "config.json").read_text())["hidden_size"]
    _random_head(C, 1).save(out / conf_mod.FILENAME)
    with pytest.raises(ConfigError, match="target's features"):
        make(tiny_v3_path, dspark={"draft": str(out)})


# ---- fit, calibration, save/load ------------------------------------------------------------------------

def _synthetic_records(n_steps: int, C: int, seed: int, truth: ConfidenceHead) -> list:
    """Fixed-k verifications (k = 4) in ``DSpark.verified``'s record layout whose outcomes are drawn
    from ``truth`` (conditional acceptance, stop at the first rejection)."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for _ in range(n_steps):
        m = 4
        h = torch.randn(m, C, generator=g)
        lq = -torch.rand(m, generator=g) * 3
        lq2 = lq - torch.rand(m, generator=g) * 2 - 0.01
        ent = torch.rand(m, generator=g) * 2
        greedy = bool(torch.rand(1, generator=g) < 0.5)
        tf = conf_mod.target_features(torch.randn(1, 50, generator=g) * 3,
                                      torch.tensor([float("nan") if torch.rand(1, generator=g) < 0.2
                                                    else float(torch.rand(1, generator=g))]))[0]
        c = truth(h, lq, ent, torch.full((m,), greedy), lq2, truth.target_term(tf[None].expand(m, -1)))
        a = 0
        while a < m and float(torch.rand(1, generator=g)) < float(c[a]):
            a += 1
        n_log = min(a + 1, m)
        recs.append((h, lq, ent, greedy, c[:n_log].tolist(), [1.0] * min(a, n_log) + [0.0] * (n_log - min(a, n_log)),
                     [0] * (m + 1), torch.cumprod(c, 0).tolist(), a, lq2, tf))
    return recs


def test_calibration_round_trip(tmp_path):
    """Outcomes drawn from a known head: the fitted head (L2, temperature folded in) predicts them
    calibrated on fresh outcomes, survives save/load exactly (target weights and feature names
    included), and the offline cut replay accepts fewer drafts as it verifies fewer."""
    C = 8
    truth = _random_head(C, 11)
    fit_o = outcomes(_synthetic_records(3000, C, 1, truth))
    temp_o = outcomes(_synthetic_records(800, C, 2, truth))
    held_o = outcomes(_synthetic_records(1500, C, 3, truth))
    head = fit_head(fit_o, 1e-4, use_target=True)
    temp = fit_temperature(head, temp_o)
    assert 0.8 <= temp <= 1.25  # the fit is already calibrated: a temperature near 1
    head = fold_temperature(head, temp)
    cal = calibration(head, held_o)
    assert cal["max_decile_gap"] <= 0.08 and cal["ece"] <= 0.03, cal
    path = tmp_path / conf_mod.FILENAME
    head.save(path, fitted_temperature=str(temp))
    loaded = ConfidenceHead.load(path, C, 1.0)
    assert loaded.uses_target and loaded.names == EXTRA_FEATURES
    torch.testing.assert_close(predict(loaded, held_o), predict(head, held_o))
    assert calibration(loaded, held_o) == cal
    small, big = cut_trade(predict(head, held_o), held_o, 0.1), cut_trade(predict(head, held_o), held_o, 0.4)
    assert 0 <= small["accepted_drop"] < big["accepted_drop"] < 0.4  # a cut loses less than it verifies


def test_legacy_head_loads_and_bad_names_are_refused(tmp_path):
    from safetensors.torch import save_file

    C = 8
    legacy = ConfidenceHead(torch.ones(C), torch.ones(len(LEGACY_FEATURES)), 0.1, names=LEGACY_FEATURES)
    legacy.save(tmp_path / "legacy.safetensors")
    loaded = ConfidenceHead.load(tmp_path / "legacy.safetensors", C, 1.0)
    assert loaded.names == LEGACY_FEATURES and not loaded.uses_target
    h, lq, ent = torch.zeros(3, C), torch.tensor([-0.1, -1.0, -3.0]), torch.ones(3)
    g = torch.tensor([True, False, True])
    torch.testing.assert_close(loaded.fast(h, lq, ent, g, loaded.per_row(g)), loaded(h, lq, ent, g))
    save_file({"w_hidden": torch.ones(C), "w_extra": torch.ones(2), "bias": torch.zeros(1)},
              str(tmp_path / "bad.safetensors"), metadata={"extra_features": "a,b"})
    with pytest.raises(ValueError, match="confidence head features"):
        ConfidenceHead.load(tmp_path / "bad.safetensors", C, 1.0)


def test_fast_confidence_matches_head():
    from plugins.dspark.confidence import EXTRA_FEATURES, ConfidenceHead

    g = torch.Generator().manual_seed(0)
    head = ConfidenceHead(torch.randn(16, generator=g), torch.randn(len(EXTRA_FEATURES), generator=g), 0.3, 1.3)
    h, logq, ent = torch.randn(6, 16, generator=g), -torch.rand(6, generator=g) * 40, torch.rand(6, generator=g)
    logq2 = logq - torch.rand(6, generator=g)
    greedy_rows = torch.tensor([True, False, True, True, False, False])
    torch.testing.assert_close(head.fast(h, logq, ent, greedy_rows, head.per_row(greedy_rows), logq2),
                               head(h, logq, ent, greedy_rows, logq2))


def test_fast_confidence_with_target_term_matches_head():
    g = torch.Generator().manual_seed(0)
    head = _random_head(16, 3)
    head.temperature = 1.3
    h, logq = torch.randn(6, 16, generator=g), -torch.rand(6, generator=g) * 5
    logq2, ent = logq - torch.rand(6, generator=g), torch.rand(6, generator=g)
    rows = torch.tensor([True, False, True, True, False, False])
    tf = conf_mod.target_features(torch.randn(6, 30, generator=g), torch.tensor([0.5, float("nan"), 1, 0, 0.2, 1]))
    term = head.target_term(tf)
    torch.testing.assert_close(head.fast(h, logq, ent, rows, head.per_row(rows, term), logq2),
                               head(h, logq, ent, rows, logq2, term))


# ---- the policy's floor: no drafting where the curve says it costs more ----------------------------------

# a CPU-like curve: every verified token costs as much as a request's token, drafts cost 0.6 of it
LINEAR = StepCost(verify_tokens=[1, 2, 6, 32, 64, 192], verify_s=[1e-3, 2e-3, 6e-3, 32e-3, 64e-3, 192e-3],
                  draft_rows=[1, 8, 32, 64], draft_s=[0.6e-3, 4.8e-3, 19.2e-3, 38.4e-3], overhead_s=0.0)
# a GPU-like curve at small batch: verify rows nearly free (memory-bound), drafts cheap
FLAT = StepCost(verify_tokens=[1, 6, 32, 192], verify_s=[4e-3, 4.1e-3, 12e-3, 20e-3],
                draft_rows=[1, 64], draft_s=[0.2e-3, 0.4e-3], overhead_s=0.5e-3)


def test_policy_degrades_to_no_drafting_by_curve():
    """With verify rows as dear as requests' tokens, drafting cannot pay at 32 requests even if 9 in
    10 drafts were accepted: no lengths, no draft steps, no exploration. With nearly free verify
    rows it pays at one request and at 32."""
    lin, flat = LiveCost(LINEAR, adapt=False), LiveCost(FLAT, adapt=False)
    assert not drafting_can_pay(32, lin, 5, 0.9)
    assert not worth_drafting([1.0] * 32, [0.9] * 32, 32, 32, 32, lin, lin.overhead(32), 5)
    # drafts already made are sunk: verifying likely ones may still pay, unlikely ones not
    assert choose_lengths([[0.3, 0.09]] * 32, 32, 10_000, lin, lin.overhead(32) + lin.drafting(32, 2)) == [0] * 32
    assert drafting_can_pay(1, flat, 5, 0.9) and drafting_can_pay(32, flat, 5, 0.9)
    lengths = choose_lengths([[0.9, 0.81, 0.73]], 1, 10_000, flat, flat.overhead(1) + flat.drafting(1, 3))
    assert lengths == [3]
    # hysteresis: a gain of about 2% continues drafting but does not resume it (margin 3%)
    mid = StepCost([1, 2, 3], [1e-3, 1.6e-3, 2.2e-3], [1, 64], [1e-6, 1e-6])
    cost = LiveCost(mid, adapt=False)
    assert worth_drafting([1.0], [0.62], 1, 1, 1, cost, 0.0, 1)
    assert not worth_drafting([1.0], [0.62], 1, 1, 1, cost, 0.0, 1, margin=0.03)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_never_drafts_when_the_curve_says_it_costs_more(tiny_v3_path, tiny_mtp_dir, reference,  # noqa: F811
                                                              async_scheduling, monkeypatch):
    """The engine under the linear curve: no draft is verified (no exploratory step either, though one
    is due every 2 skipped steps), output equals plain decoding, nothing leaks."""
    from spec_helpers import PROMPTS

    llm = make(tiny_v3_path, dspark={"draft": tiny_mtp_dir, "k": 4}, async_scheduling=async_scheduling)
    feat = _feature(llm)
    feat.live = LiveCost(LINEAR, adapt=False)
    feat.explore_every = 2
    monkeypatch.setattr(dspark_drafter, "LARGE_EXPLORE_EVERY", 2)  # (also at 8 requests and more)
    outs = run(llm, PROMPTS, greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["dspark_verified"] == 0 and m["dspark_proposals"] == 0
    assert m["dspark_blocked_explorations"] > 0 and m["dspark_steps_without_drafts"] > 0
    llm.engine.blocks.check_no_leaks()


# ---- measured rates: the check on the curve --------------------------------------------------------------

def test_measured_rates_veto_and_probe():
    """Rates per batch-size bucket: no verdict until both are measured; a plain probe is asked after
    16 drafting steps; drafting measured slower vetoes; a close call measured long ago is probed again."""
    from plugins.dspark.policy import MeasuredRates

    r = MeasuredRates()
    assert r.bucket(1) != r.bucket(2) and r.bucket(32) == r.bucket(63) != r.bucket(64)
    for _ in range(15):
        r.observe(True, 32, 32 * 1.2, 0.05)  # 768 tok/s drafting at 32 requests
    assert r.verdict(32) is None and not r.needs_plain_probe(32)
    r.observe(True, 32, 32 * 1.2, 0.05)
    assert r.needs_plain_probe(32) and not r.needs_plain_probe(1)
    for _ in range(8):
        r.observe(False, 32, 32, 0.032)  # 1000 tok/s plain
    assert r.verdict(32) is False and not r.needs_plain_probe(32)
    assert r.verdict(40) is False and r.verdict(1) is None  # same bucket / another bucket
    assert r.plain[r.bucket(32)] == pytest.approx(1000.0) and r.spec[r.bucket(32)] == pytest.approx(768.0)
    for _ in range(40):  # drafting got faster (the load moved): the running mean follows within tens of steps
        r.observe(True, 32, 32 * 1.2, 0.032)
    assert r.verdict(32) is True and not r.verdict(32, margin=0.25)
    for _ in range(r.REPROBE_AFTER):
        r.observe(True, 32, 32 * 1.2, 0.032)
    assert r.needs_plain_probe(32)  # 1200 < 1.25 x 1000: a close call, measured long ago


def test_engine_goes_dormant_when_drafting_measured_slower(tiny_v3_path, tiny_mtp_dir, reference):  # noqa: F811
    """The curve says drafting pays, but the measured rates at this batch size say plain decoding was
    faster: the engine stops drafting (vetoes counted), output equals plain decoding."""
    from spec_helpers import PROMPTS

    from plugins.dspark.policy import MeasuredRates

    llm = make(tiny_v3_path, dspark={"draft": tiny_mtp_dir, "k": 4}, async_scheduling=True)
    feat = _feature(llm)
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)  # pays
    rates = MeasuredRates()
    for b in range(1, 6):  # every batch size up to 16: plain decoding measured 10x faster than drafting
        rates.spec[b], rates.plain[b] = 100.0, 1000.0
    rates.observe = lambda *a, **k: None  # keep them
    feat.rates = rates
    outs = run(llm, PROMPTS, greedy(20))
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.metrics()
    assert m["dspark_measured_vetoes"] > 0 and m["dspark_verified"] == 0
    llm.engine.blocks.check_no_leaks()


# ---- calibration of the shipped draft's confidence head --------------------------------------------------

@pytest.mark.parametrize("asset,kind", [(dspark_feature.DEFAULT_MTP, "mtp"), (dspark_feature.DEFAULT_DRAFT, "model")])
def test_shipped_draft_confidence_calibrated(asset, kind):
    if not (asset / "confidence_head.safetensors").is_file():
        pytest.skip(f"no shipped draft in {asset}")
    llm = LLM(features=["dspark"], dspark={"budget_policy": "fixed", "draft": str(asset)}, max_num_seqs=64)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    assert feat.source.kind == kind and feat.head.trained
    feat.outcome_log = []
    prompts = _heldout_prompts(llm.tokenizer, 96)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=64, seq_seed=i)
              for i in range(len(prompts))]
    run(llm, prompts, params)
    pred = torch.tensor([c for r in feat.outcome_log for c in r[4]])
    obs = torch.tensor([a for r in feat.outcome_log for a in r[5]])
    assert len(pred) >= 3000  # ~0.03 standard error per decile
    order = pred.argsort()
    gaps = [abs(float(pred[c].mean()) - float(obs[c].mean())) for c in order.chunk(10)]
    assert max(gaps) <= 0.1, [round(g, 3) for g in gaps]
    llm.engine.blocks.check_no_leaks()
