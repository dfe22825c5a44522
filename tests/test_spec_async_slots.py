"""Async speculative steps shaped by the proposer before they run (engine/spec_async.py): the draft
slots it takes (``Proposer.draft_slots``: a step offered none is a plain step), drafts no deeper than
the step's verify budget, and rows not re-laid where the proposer says re-laying does not pay
(``Proposer.relayout_pays``). Greedy outputs stay equal to plain decoding throughout."""

from __future__ import annotations

import pytest
from test_spec_async import PROMPTS, device_proposers, make, run, tokens  # noqa: F401  (fixtures)

from deepinfer_core import SamplingParams
from deepinfer_core.engine import transfer

K = 4


def greedy(n: int = 12) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _ in PROMPTS]


@pytest.fixture
def oracle(tiny_v3_path, device_proposers):  # noqa: F811
    """(reference outputs, a factory of async engines with the device oracle proposer)."""
    import device_proposers as dp

    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, greedy())
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    return ref, lambda **kw: make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": K, **kw})


class StepLog:
    """Per engine step: forward rows and the host-built tensors uploaded (Upload.send calls, elements)."""

    def __init__(self, llm, monkeypatch) -> None:
        self.rows, self.sends = [], []
        eng = llm.engine
        forward = eng.runner.forward

        def logged(batch):
            self.rows.append(int(batch.input_ids.shape[0]))
            return forward(batch)

        monkeypatch.setattr(eng.runner, "forward", logged)


def lockstep(engines: dict, monkeypatch) -> dict:
    """Step the engines in turn on the same requests; per engine and step: (forward rows, uploads)."""
    sent = [0, 0]
    send = transfer.Upload.send

    def counted(self):
        out = send(self)
        sent[0] += 1
        sent[1] += sum(t.numel() for t in out)
        return out

    monkeypatch.setattr(transfer.Upload, "send", counted)
    logs = {n: StepLog(llm, monkeypatch) for n, llm in engines.items()}
    for llm in engines.values():
        for p, sp in zip(PROMPTS, greedy()):
            llm.engine.add_request({"prompt_token_ids": p}, sp)
    while any(llm.engine.has_unfinished() for llm in engines.values()):
        for n, llm in engines.items():
            if llm.engine.has_unfinished():
                before = list(sent)
                llm.engine.step()
                logs[n].sends.append((sent[0] - before[0], sent[1] - before[1]))
    return logs


def test_a_step_offered_no_slots_costs_what_a_plain_step_does(tiny_v3_path, oracle, monkeypatch):
    """A proposer active on every step that takes no draft slots (``draft_slots`` all 0, as a dormant
    DSpark decides before scheduling) runs plain steps: every step's forward rows and its uploads
    (transfers and elements) equal a plain async engine's, nothing is proposed or verified."""
    ref, spec_engine = oracle
    llm = spec_engine()
    prop = llm.engine.spec.proposer
    monkeypatch.setattr(prop, "draft_slots", lambda engine, requests, slots: [0] * len(slots))
    logs = lockstep({"plain": make(tiny_v3_path), "spec": llm}, monkeypatch)
    assert logs["spec"].rows == logs["plain"].rows
    assert logs["spec"].sends == logs["plain"].sends
    m = llm.engine.metrics()
    assert prop.calls == 0 and m["spec_verified"] == 0 and m["spec_draft_slots"] == 0
    assert m["overlapped_steps"] >= m["steps"] - 2


def test_only_the_requests_given_slots_draft(oracle):
    """``draft_slots`` giving slots to some requests only (an exploratory step): the others decode as
    in a plain step beside them (no rows laid out for them), and outputs stay exact."""
    ref, spec_engine = oracle
    llm = spec_engine()
    prop = llm.engine.spec.proposer
    seen = []

    def some(engine, requests, slots):
        out = [m if len(r.prompt_token_ids) % 2 else 0 for r, m in zip(requests, slots)]
        seen.append(sum(1 for m in out if m))
        return out

    llm.engine.spec.proposer.draft_slots = some
    rows = []
    orig = prop.propose_on_device

    def propose(engine, requests, max_drafts, *a):
        rows.append([len(r.prompt_token_ids) % 2 for r in requests])
        return orig(engine, requests, max_drafts, *a)

    prop.propose_on_device = propose
    outs = run(llm, PROMPTS, greedy())
    assert tokens(outs) == tokens(ref)
    assert rows and all(all(odd for odd in r) for r in rows)  # only the requests given slots were offered
    m = llm.engine.metrics()
    assert m["spec_accepted"] > 0 and m["spec_draft_slots"] <= K * sum(seen)


def test_drafts_no_deeper_than_the_verify_budget(oracle):
    """With a verify budget of 2 rows per step, the proposer is asked for at most 2 drafts per
    request (no request can verify more), its slots unchanged; outputs exact."""
    ref, spec_engine = oracle
    llm = spec_engine(budget=2)
    prop = llm.engine.spec.proposer
    asked = []
    orig = prop.propose_on_device

    def propose(engine, requests, max_drafts, *a):
        asked.append(list(max_drafts))
        got = orig(engine, requests, max_drafts, *a)
        assert got.tokens.shape[1] == max(max_drafts)
        return got

    prop.propose_on_device = propose
    outs = run(llm, PROMPTS, greedy())
    assert tokens(outs) == tokens(ref)
    assert asked and max(max(a) for a in asked) == 2
    fb = prop.feedback
    assert fb and all(sum(nd) <= 2 for nd, _ in fb) and llm.engine.metrics()["spec_accepted"] > 0


@pytest.mark.parametrize("pays", [True, False])
def test_rows_not_relaid_where_relayout_does_not_pay(oracle, monkeypatch, pays):
    """Under a verify budget below the slots the rows are re-laid within it unless the proposer's
    ``relayout_pays`` says no: then every slot's row is computed (the forward as laid out by the
    host), the lengths still within the budget; outputs exact either way."""
    ref, spec_engine = oracle
    llm = spec_engine(budget=3)
    prop = llm.engine.spec.proposer
    monkeypatch.setattr(prop, "relayout_pays", lambda engine, requests, slots, budget: pays)
    relaid = []
    from deepinfer_core.engine import spec_async

    compact = spec_async.compact_rows

    def spy(*a, **kw):
        relaid.append(1)
        return compact(*a, **kw)

    monkeypatch.setattr(spec_async, "compact_rows", spy)
    outs = run(llm, PROMPTS, greedy())
    assert tokens(outs) == tokens(ref)
    m = llm.engine.metrics()
    assert all(sum(nd) <= 3 for nd, _ in prop.feedback) and m["spec_accepted"] > 0
    assert bool(relaid) == pays and (m["spec_relayouts_skipped"] > 0) == (not pays)


def test_a_proposer_failing_to_offer_slots_loses_only_its_drafts(oracle, caplog):
    ref, spec_engine = oracle
    llm = spec_engine()

    def broken(engine, requests, slots):
        raise RuntimeError("no slots today")

    llm.engine.spec.proposer.draft_slots = broken
    outs = run(llm, PROMPTS, greedy())
    assert tokens(outs) == tokens(ref)
    m = llm.engine.metrics()
    assert m["spec_proposer_errors"] > 0 and m["spec_verified"] == 0
    assert "draft_slots() raised RuntimeError" in caplog.text
