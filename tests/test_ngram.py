"""The shipped ``ngram`` proposer (plugins/ngram): greedy-exact on the host and on the device, drafting
on the host where the forward runs inline, and a cost per step that does not grow with the context
(its device table and host index equal a search of the whole history)."""

from __future__ import annotations

import pytest
import torch
from test_spec_async import PROMPTS, make, mixed_params, run, same_logprobs, tokens


@pytest.fixture(scope="module")
def plain_ref(tiny_v3_path):
    return run(make(tiny_v3_path, async_on=False), PROMPTS, mixed_params())


def test_ngram_proposer_sync_and_async_are_greedy_exact(tiny_v3_path, plain_ref):
    """The shipped prompt-lookup proposer (entry point ``ngram``) drafts on the host (synchronous
    steps) and on the device (overlapped steps): both identical to plain decoding."""
    for async_on in (False, True):
        llm = make(tiny_v3_path, async_on=async_on, speculative={"proposer": "ngram", "k": 3, "device": "on"})
        assert (llm.engine.spec.on_device is not None) == async_on
        outs = run(llm, PROMPTS, mixed_params())
        assert tokens(outs) == tokens(plain_ref)
        same_logprobs(outs, plain_ref)
        assert llm.engine.metrics()["spec_verified"] > 0



def test_ngram_drafts_on_the_host_where_the_forward_runs_inline(tiny_v3_path):
    """``device = "auto"``: on the CPU (no overlap to win) its speculative steps draft on the host."""
    from deepinfer_core.config import ConfigError

    llm = make(tiny_v3_path, speculative={"proposer": "ngram", "k": 3})
    assert llm.engine.spec.on_device is None and llm.engine.async_scheduling
    with pytest.raises(ConfigError, match="device must be 'auto', 'on' or 'off', got 'gpu'"):
        make(tiny_v3_path, speculative={"proposer": "ngram", "device": "gpu"})



def test_ngram_device_history_equals_a_search_of_the_whole_history():
    """The ngram proposer's device table (each request's known tokens appended as they become known,
    rows reused after a request finishes) and its host index draft what a search of the request's
    whole history (on the device with the tokens in flight after it) drafts: many steps, a growing
    table, finished and new requests. Neither re-reads a request's history each step (a step at 64
    requests of 32k tokens built 1.4 s of upload lists before)."""
    import random
    from types import SimpleNamespace

    from plugins.ngram.proposer import NgramProposer

    rng = random.Random(3)
    prop = NgramProposer({})
    engine = SimpleNamespace(platform=SimpleNamespace(supports_pinned_memory=lambda: False))

    class Req:
        def __init__(self, n):
            self.token_ids = [rng.randrange(6) for _ in range(n)]
            self.num_known_tokens = n

    live = [Req(rng.randrange(2, 40)) for _ in range(5)]
    for _ in range(60):
        P, K = rng.randrange(1, 4), rng.randrange(1, 5)
        pend = [[rng.randrange(6) for _ in range(rng.randrange(0, P + 1))] for _ in live]
        drafts = prop.propose_on_device(
            engine, live, [K] * len(live), torch.tensor([(r.token_ids + p)[-1] for r, p in zip(live, pend)]),
            torch.tensor([len(r.token_ids) + len(p) for r, p in zip(live, pend)]),
            torch.tensor([p + [-1] * (P - len(p)) for p in pend]).reshape(len(live), P)).tokens
        for r, p, got in zip(live, pend, drafts.tolist()):
            h = r.token_ids + p
            at = max((i for i in range(len(h) - 1) if h[i] == h[-1]), default=-1)
            want = h[at + 1 : at + 1 + K] if at >= 0 else []
            assert got == want + [-1] * (K - len(want)), (h, got, want)
        host = prop.propose(engine, live, [K] * len(live), None)  # the host index, on the known tokens
        for r, d in zip(live, host):
            h = r.token_ids
            at = max((i for i in range(len(h) - 1) if h[i] == h[-1]), default=-1)
            assert (d.tokens if d else []) == (h[at + 1 : at + 1 + K] if at >= 0 else [])
        for r, p in zip(live, pend):  # the tokens in flight become known, and one more
            r.token_ids += p + [rng.randrange(6)]
            r.num_known_tokens = len(r.token_ids)
        if rng.random() < 0.3:  # a request finishes, another arrives (its row is reused)
            prop.request_finished(engine, live.pop(rng.randrange(len(live))))
            live.append(Req(rng.randrange(2, 70)))
    assert len(prop._table.owner) <= 6  # rows were reused


def test_ngram_device_table_gives_memory_back():
    """The device table follows the load: after a long request finishes it is cut back to what the live rows
    need, and once no request holds a row it is dropped; the drafts stay those of a search of the history."""
    from types import SimpleNamespace

    from plugins.ngram.proposer import NgramProposer

    prop = NgramProposer({})
    engine = SimpleNamespace(platform=SimpleNamespace(supports_pinned_memory=lambda: False))

    class Req:
        def __init__(self, toks):
            self.token_ids, self.num_known_tokens = list(toks), len(toks)

    def step(live, K=3):
        last = torch.tensor([r.token_ids[-1] for r in live])
        n = torch.tensor([len(r.token_ids) for r in live])
        got = prop.propose_on_device(engine, live, [K] * len(live), last, n,
                                     torch.full((len(live), 1), -1)).tokens.tolist()
        for r, d in zip(live, got):
            h = r.token_ids
            at = max((i for i in range(len(h) - 1) if h[i] == h[-1]), default=-1)
            want = h[at + 1 : at + 1 + K] if at >= 0 else []
            assert d == want + [-1] * (K - len(want))

    long, short = Req([1, 2, 3] * 3000), Req([4, 5, 4, 6, 4])
    step([long, short])
    assert prop._table.t.shape[1] >= 9000
    prop.request_finished(engine, long)
    short.token_ids += [5, 4]
    short.num_known_tokens = len(short.token_ids)
    step([short])
    assert prop._table.t.shape[1] == 64  # the live row needs 7 (+ the step's) columns: cut back to the floor
    assert prop._table.t[prop._table.row(short), :7].tolist() == short.token_ids
    prop.request_finished(engine, short)
    assert prop._table.t is None and prop._table.owner == []
    step([Req([7, 8, 7])])  # and it grows again
