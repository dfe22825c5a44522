# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""DSpark's policy under async scheduling: async steps' measured times reach the live step-time curve
(``Proposer.step_timed``, ``engine/spec_timing.py``) and the throughput policy's verify budget is
chosen from it; the curve is monotone without spreading a slow sample upwards; the running accept
rate of device drafts is unbiased; and the MTP catch-up reads the hidden rows of the step in flight
that a synchronous step would (after plain steps, compacted rows and requests without drafts)."""

from __future__ import annotations

import random

import pytest
import torch
from spec_helpers import PROMPTS, _cache_dir, greedy, make, tiny_mtp  # noqa: F401

from plugins.dspark.feature import DSpark
from plugins.dspark.policy import LiveCost, StepCost

MS = 1e-3


def _feature(llm):
    return next(f for f in llm.engine.features if f.name == "dspark")


def _steep() -> StepCost:
    """A start-up curve on which every verified row costs 2 ms (drafting pays only for short drafts)."""
    return StepCost([1, 2, 4, 6], [4 * MS, 6 * MS, 10 * MS, 14 * MS], [1, 8], [0.5 * MS, 1 * MS])


# ---- 1. async step times feed the curve the policy reads ----------------------------------------------

def test_async_step_samples_change_the_chosen_budget():
    """The throughput policy's async verify budget comes from the curve of whole async steps: on the
    steep start-up curve it verifies few drafts; once async steps measured every size about as dear
    as the plain one (verify rows nearly free, as on a GPU), it verifies every slot."""
    feat = DSpark({"k": 5})
    feat.live, feat.mean_conf = LiveCost(_steep()), 0.7
    before = feat.device_budget(None, 1, 5)
    assert before <= 2
    for _ in range(30):
        for b in range(6):
            feat.step_timed(None, 1 + b, 1, (8.0 + 0.1 * b) * MS)
    assert feat.live.async_steps == 180 and set(feat.live.step_seen) == {(1, t) for t in range(1, 7)}
    assert feat.live.step(1, 3, 5) == pytest.approx(8.2 * MS, rel=0.02)
    assert feat.device_budget(None, 1, 5) == 5
    # and back: the rows turn dear, measured at every size: few drafts again
    for _ in range(200):
        for b in range(6):
            feat.step_timed(None, 1 + b, 1, (4.0 + 4.0 * b) * MS)
    assert feat.device_budget(None, 1, 5) <= 1


def test_async_engine_feeds_step_times_to_the_curve(tiny_mtp):
    """With async scheduling on, the engine times its overlapped speculative steps and DSpark's live
    curve receives them, keyed by the decodes and forward rows those steps ran."""
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed", "verify_budget": 5}, async_scheduling=True,
               max_num_seqs=4)
    feat = _feature(llm)
    shapes, got = [], []
    orig = feat.step_timed

    def record(engine, tokens, requests, seconds):
        got.append((tokens, requests, seconds))
        return orig(engine, tokens, requests, seconds)
    feat.step_timed = record
    eng = llm.engine
    seqs = [eng.add_request({"prompt_token_ids": p}, greedy(24)) for p in PROMPTS[:4]]
    while eng.has_unfinished():
        eng.step()
        fl = eng.pipeline.inflight.spec if eng.pipeline.inflight is not None else None
        if fl is not None and fl.shape is not None:
            shapes.append((fl.shape.tokens, fl.shape.requests))
    assert all(s.num_output_tokens == 24 for s in seqs)
    m = llm.metrics()
    assert m["overlapped_steps"] > 10 and m["spec_timed_steps"] == len(got) > 10
    assert feat.live.async_steps == len(got) and feat.live.step_seen
    for tokens, requests, seconds in got:  # each sample is a launched step's rows, timed > 0
        assert (tokens, requests) in shapes and seconds > 0 and tokens >= requests
    assert {(r, t) for t, r, _ in got} == set(feat.live.step_seen)
    eng.blocks.check_no_leaks()


# ---- 2. a monotone curve that caps, not spreads ----------------------------------------------------

def test_a_slow_sample_is_capped_by_larger_sizes_not_spread_to_them():
    """A step with fewer verified rows is never estimated slower than one with more measured: a slow
    sample (at start-up or while serving) is capped by the larger sizes' samples, and leaves every
    larger size's estimate, seen (its own time) or not (the curve's scale), where it was."""
    cost = StepCost([1, 2, 3, 4], [5 * MS, 9 * MS, 6 * MS, 7 * MS], [1], [1 * MS])
    assert cost.verify(2) == pytest.approx(6 * MS) and cost.verify(3) == pytest.approx(6 * MS)
    assert cost.verify(4) == pytest.approx(7 * MS)
    live = LiveCost(StepCost([1, 8], [4 * MS, 11 * MS], [1, 8], [1 * MS, 2 * MS]))
    for _ in range(50):
        for t in range(3, 7):
            live.observe(t, (3 + t) * MS, 1, 0, 0.0, 0.0, 1, None)
    before = {t: live.verify(t) for t in range(1, 10)}
    live.observe(2, 30 * MS, 1, 0, 0.0, 0.0, 1, None)  # one slow sample at 2 rows
    assert live.verify(2) <= live.verify(3)
    assert all(live.verify(t) == pytest.approx(before[t]) for t in range(3, 10))
    # the async steps' curve likewise
    for _ in range(50):
        for t in range(3, 7):
            live.observe_step(1, t, (6 + t) * MS, 5)
    steps = {t: live.step(1, t, 5) for t in range(3, 7)}
    live.observe_step(1, 2, 40 * MS, 5)
    assert live.step(1, 2, 5) <= live.step(1, 3, 5)
    assert all(live.step(1, t, 5) == pytest.approx(steps[t]) for t in range(3, 7))


# ---- 3. the running accept rate -----------------------------------------------------------------

def test_device_accept_rate_is_unbiased_at_few_requests():
    """One request at a time (below ``MEASURED_MIN_ROWS`` the forecast decides alone): drafts accepted
    with probability 0.6 each, 5 verified per step; the running rate the policy uses converges to 0.6
    (a mean of each step's a / (a + 1) gave 0.40), and a request's single outcome is not its forecast."""
    from plugins.dspark.state import _State

    feat = DSpark({"k": 5})
    rng = random.Random(3)
    st = _State(0)
    rates = []
    for i in range(4000):
        a = 0
        while a < 5 and rng.random() < 0.6:
            a += 1
        st.dev_pending = True
        feat.device_verified(st, 5, a)
        assert not st.dev_pending and st.recent_conf is None
        if i >= 1000:
            rates.append(feat.mean_conf)
    assert sum(rates) / len(rates) == pytest.approx(0.6, abs=0.02)


# ---- 4. the MTP catch-up's hidden rows ----------------------------------------------------------

def _teacher_hidden(eng, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states of a token sequence, computed in one prefill."""
    from deepinfer_core.models.metadata import AttentionMetadata, PrefillMeta

    bs, L = eng.block_size, len(ids)
    cache = [torch.zeros(-(-L // bs), bs, c.shape[-1]) for c in eng.kv_caches["latent"]]
    cu = torch.tensor([0, L])
    meta = AttentionMetadata(L, torch.arange(L), PrefillMeta(cu, cu, torch.tensor([L]),
                                                             torch.arange(-(-L // bs))[None].int(), False), None)
    with torch.inference_mode():
        return eng.model(torch.tensor(ids), torch.arange(L), meta, {"latent": cache})


@pytest.mark.parametrize("budget", [0, 5])
def test_mtp_catchup_reads_the_rows_a_synchronous_step_would(tiny_mtp, budget):
    """Every hidden row the MTP proposer is handed for a position it catches up on (p + 1 below the
    request's true length) is the target's hidden state at p, as a synchronous step would read it:
    with plain steps between speculative ones (the proposer dormant now and then: the plain step's
    positions were shifted back on the device by the rejected drafts before it), rows laid out anew
    under a verify budget, and requests near max_tokens that get no draft slots."""
    opts = {"k": 3, "budget_policy": "fixed"} | ({"verify_budget": budget} if budget else {})
    llm = make(tiny_mtp, dspark=opts, async_scheduling=True, max_num_seqs=4)
    eng, feat = llm.engine, _feature(llm)
    calls, orig_active, orig_propose = [0], feat.active, feat.propose_on_device

    def active(engine):  # dormant every third step (as the throughput policy may be)
        calls[0] += 1
        return False if calls[0] % 3 == 0 else orig_active(engine)

    seen, missing = [], []

    def propose(engine, requests, max_drafts, last_tokens, num_tokens, pending, hidden=None):
        if hidden is not None:
            rows, first, true_len = hidden.rows.tolist(), hidden.first.tolist(), num_tokens.tolist()
            for i, seq in enumerate(requests):
                if hidden.counts[i] and not first[i] <= true_len[i] - 2 < first[i] + hidden.counts[i]:
                    missing.append((seq.request_id, first[i], hidden.counts[i], true_len[i]))  # no proposing row
                for t in range(hidden.counts[i]):
                    if first[i] + t + 1 < true_len[i]:
                        seen.append((seq, first[i] + t, hidden.hidden[rows[i] + t].clone()))
        return orig_propose(engine, requests, max_drafts, last_tokens, num_tokens, pending, hidden=hidden)
    feat.active, feat.propose_on_device = active, propose
    seqs = [eng.add_request({"prompt_token_ids": PROMPTS[i]}, greedy(10 + 4 * j)) for j, i in enumerate((3, 4, 5, 6))]
    while eng.has_unfinished():
        eng.step()
    m = llm.metrics()
    assert m["overlapped_steps"] > 10 and m["dspark_verified"] > 0 and len(seen) > 20
    assert not missing, f"the rows handed over miss the proposing position: {missing[:8]}"
    assert m["spec_proposer_errors"] == 0
    if budget:
        assert m["spec_verify_budget"] < m["spec_draft_slots"]
    ref = {id(s): _teacher_hidden(eng, s.token_ids) for s in seqs}
    wrong = [(s.request_id, p) for s, p, h in seen if (h - ref[id(s)][p]).abs().max().item() > 1e-4]
    assert not wrong, f"{len(wrong)} of {len(seen)} hidden rows are not the target's at their positions: {wrong[:8]}"
    eng.blocks.check_no_leaks()
