"""A proposer's or a hook's failure during speculative decoding costs its drafts or its request, never
the step's other requests: a device proposer that raises or returns malformed drafts or confidences, a
proposer raising in any answer or notification, a ``process_logits`` hook raising for one request's
verify rows."""

from __future__ import annotations

import pytest
from test_spec_async import PROMPTS, make, mixed_params, run, tokens
from test_spec_async import device_proposers as device_proposers  # noqa: F401  (the toy proposers' package)

from deepinfer_core.hookspecs import hookimpl


@pytest.fixture(scope="module")
def plain_ref(tiny_v3_path):
    return run(make(tiny_v3_path, async_on=False), PROMPTS, mixed_params())


def test_a_failing_device_proposer_loses_only_its_drafts(tiny_v3_path, device_proposers, plain_ref, caplog):
    llm = make(tiny_v3_path, speculative={"proposer": "device_flaky", "k": 2})
    with caplog.at_level("ERROR", logger="deepinfer.speculative"):
        outs = run(llm, PROMPTS, mixed_params())
    assert tokens(outs) == tokens(plain_ref)
    m = llm.engine.metrics()
    assert m["spec_proposer_errors"] > 0 and m["spec_verified"] > 0
    errors = [r.getMessage() for r in caplog.records]
    for what in ("raised ValueError: draft kernel fell over", "must return a DeviceDraft with tokens of shape"):
        assert any("proposer DeviceFlaky" in e and what in e for e in errors), (what, errors)


def test_malformed_device_confidences_lose_only_their_drafts(tiny_v3_path, device_proposers, plain_ref, caplog):
    """Confidences of the wrong shape and a NaN cut are named (one of one dimension failed every
    request of the step before); NaN confidences draft nothing (the device cannot be asked)."""
    llm = make(tiny_v3_path, speculative={"proposer": "device_bad_conf", "k": 2})
    with caplog.at_level("ERROR", logger="deepinfer.speculative"):
        outs = run(llm, PROMPTS, mixed_params())
    assert tokens(outs) == tokens(plain_ref)
    assert llm.engine.metrics()["spec_proposer_errors"] > 0
    errors = [r.getMessage() for r in caplog.records]
    for what in ("DeviceDraft confidences must be a tensor of shape", "min_confidence must be a number in [0, 1]"):
        assert any("proposer DeviceBadConfidences" in e and what in e for e in errors), (what, errors)


@pytest.mark.parametrize("async_on", [True, False])
def test_a_proposer_raising_in_any_answer_costs_no_request(tiny_v3_path, device_proposers, plain_ref, caplog,
                                                            async_on):
    """``active``, ``draft_slots``, ``verify_budget`` (also NaN or not a number), ``relayout_pays``,
    ``step_timed``, ``verified``, ``request_finished``: each failure is named and a default stands in
    (each of them failed every request of the step before)."""
    llm = make(tiny_v3_path, async_on=async_on, speculative={"proposer": "device_raiser", "k": 2})
    with caplog.at_level("ERROR", logger="deepinfer.speculative"):
        outs = run(llm, PROMPTS, mixed_params())
    assert tokens(outs) == tokens(plain_ref)
    assert llm.engine.metrics()["spec_verified"] > 0
    errors = [r.getMessage() for r in caplog.records]
    whats = ["verified() raised RuntimeError: verified fell over", "request_finished() raised RuntimeError"]
    if async_on:
        whats += ["active() raised RuntimeError", "draft_slots() raised", "verify_budget() raised",
                  "verify_budget() must return a number of rows or None, got nan",
                  "verify_budget() must return a number of rows or None, got 'many'"]
    import device_proposers as dp

    if dp.DeviceRaiser.counts.get("step_timed"):  # (only steps timed whole are reported)
        whats.append("step_timed() raised")
    for what in whats:
        assert any("proposer DeviceRaiser" in e and what in e for e in errors), (what, errors)


class Bomb:
    """A feature whose ``process_logits`` raises whenever one request (by its prompt) is among the rows,
    from its third output token on."""

    def __init__(self, victim: list[int]) -> None:
        self.victim, self.fired = tuple(victim), 0

    @hookimpl
    def process_logits(self, engine, batch, logits):
        if any(tuple(s.prompt_token_ids) == self.victim and s.num_output_tokens >= 3 for s in batch.sample_seqs):
            self.fired += 1
            raise RuntimeError("bomb")


@pytest.mark.parametrize("mode", ["plain", "sync_spec", "async_spec"])
def test_a_request_whose_logits_hook_raises_fails_alone_in_a_verify_step(tiny_v3_path, device_proposers,
                                                                         plain_ref, mode):
    """``process_logits`` raising for one request's verify rows failed every request of the step; now
    that request fails alone (as in a plain step), the others decode exactly, and the next call works."""
    kw = {} if mode == "plain" else {"speculative": {"proposer": "device_previous", "k": 3}}
    llm = make(tiny_v3_path, async_on=mode == "async_spec", **kw)
    bomb = Bomb(PROMPTS[2])
    llm.engine.pm.register(bomb)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], mixed_params(), use_tqdm=False)
    assert bomb.fired and [o.error is not None for o in outs] == [i == 2 for i in range(len(PROMPTS))]
    assert "bomb" in str(outs[2].error)
    assert [t for i, t in enumerate(tokens(outs)) if i != 2] == [t for i, t in enumerate(tokens(plain_ref)) if i != 2]
    if mode != "plain":
        assert llm.engine.metrics()["spec_verified"] > 0
    llm.engine.blocks.check_no_leaks()
    llm.engine.pm.unregister(bomb)
    assert tokens(run(llm, PROMPTS, mixed_params())) == tokens(plain_ref)
