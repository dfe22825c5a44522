"""Speculative decoding under async scheduling (engine/spec_async.py): drafts proposed on the device
(``Proposer.propose_on_device``), verified on the device, the host learning the kept tokens one
step late. Greedy outputs equal synchronous speculation and plain decoding over mixed batches (stop
strings, penalties and ``so_args`` forcing synchronous steps, n > 1, preemption); the device verify
equals the host's bit for bit and keeps the target distribution; no KV block leaks; a proposer that
fails loses only its drafts."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import proposer_package_on_path
from tiny_models import kv_bytes_per_block, rand_ids

from deepinfer_core import LLM, SamplingParams

BS = 4
PROPOSERS = '''
import torch

from deepinfer_core.proposer import DeviceDraft, Draft, Proposer


class DevicePrevious(Proposer):
    """Proposes the request's last token, repeated, on the device (and on the host when asked)."""
    name = "device_previous"
    core_api_version = "1.0"
    proposes_on_device = True
    calls = 0

    def propose(self, engine, requests, max_drafts, batch):
        return [Draft([r.token_ids[-1]] * m) for r, m in zip(requests, max_drafts)]

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending):
        DevicePrevious.calls += 1
        return DeviceDraft(last_tokens[:, None].expand(-1, max(max_drafts)).clone())


class DeviceOracle(Proposer):
    """Proposes a known continuation (gathered on the device at each request's true length), its
    last draft wrong every 2nd call; with ``confidences`` the third draft's confidence is low, so the
    draft_lengths op cuts every request to 2 drafts."""
    name = "device_oracle"
    core_api_version = "1.0"
    proposes_on_device = True
    outputs = {}  # prompt tuple -> output tokens (set by the test)

    def __init__(self, section):
        self.conf = section.pop("confidences", False)
        self.sparse = section.pop("sparse", False)  # requests with an even prompt length get no drafts
        self.budget = section.pop("budget", None)  # verify rows per step (Proposer.verify_budget)
        super().__init__(section)
        self.calls = 0
        self.feedback = []

    def _table(self, requests, width, device):
        rows = [list(r.prompt_token_ids) + self.outputs.get(tuple(r.prompt_token_ids), []) for r in requests]
        n = max(len(x) for x in rows) + width
        return torch.tensor([x + [-1] * (n - len(x)) for x in rows], device=device)

    def propose(self, engine, requests, max_drafts, batch):
        out = []
        for r, m in zip(requests, max_drafts):
            want = self.outputs.get(tuple(r.prompt_token_ids), [])
            toks = want[r.num_output_tokens : r.num_output_tokens + m]
            out.append(Draft(toks) if toks else None)
        return out

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending):
        self.calls += 1
        K = max(max_drafts)
        table = self._table(requests, K, last_tokens.device)
        cols = num_tokens[:, None] + torch.arange(K, device=last_tokens.device)[None, :]
        toks = table.gather(1, cols)
        if self.calls % 2 == 0:
            toks[:, -1] = (toks[:, -1] + 1) % 60 + 4
        if self.sparse:
            even = torch.tensor([len(r.prompt_token_ids) % 2 == 0 for r in requests], device=toks.device)
            toks[even] = -1
        if not self.conf:
            return DeviceDraft(toks)
        conf = torch.full(toks.shape, 0.95, device=toks.device)
        if K >= 3:
            conf[:, 2] = 0.3
        return DeviceDraft(toks, conf, min_confidence=0.5)

    def verify_budget(self, engine, num_requests, num_slots):
        return self.budget

    def verified(self, engine, requests, num_drafts, num_accepted):
        self.feedback.append((num_drafts, num_accepted))


class DeviceSometimes(DevicePrevious):
    """Speculates on every third step only (dormant otherwise: plain steps right after speculative ones)."""
    name = "device_sometimes"

    def __init__(self, section):
        super().__init__(section)
        self.asked = 0

    def active(self, engine):
        self.asked += 1
        return self.asked % 3 == 0


class DeviceFlaky(DevicePrevious):
    """Raises on every 3rd call, returns a malformed result on every 3rd + 1."""
    name = "device_flaky"

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending):
        DeviceFlaky.calls += 1
        if DeviceFlaky.calls % 3 == 0:
            raise ValueError("draft kernel fell over")
        if DeviceFlaky.calls % 3 == 1:
            return DeviceDraft(last_tokens[:, None])  # one column: too few
        return super().propose_on_device(engine, requests, max_drafts, last_tokens, num_tokens, pending)


class DeviceRaiser(DevicePrevious):
    """Every answer and notification raises on its odd calls; the verify budget is NaN or a string on
    its even ones."""
    name = "device_raiser"
    counts = {}

    def _odd(self, what):
        n = DeviceRaiser.counts[what] = DeviceRaiser.counts.get(what, 0) + 1
        if n % 2:
            raise RuntimeError(f"{what} fell over")

    def active(self, engine):
        self._odd("active")
        return True

    def draft_slots(self, engine, requests, slots):
        self._odd("draft_slots")
        return slots

    def verify_budget(self, engine, num_requests, num_slots):
        self._odd("verify_budget")  # then NaN, "many", -inf (no rows) and inf (every slot) in turn
        return (float("nan"), "many", float("-inf"), float("inf"))[(DeviceRaiser.counts["verify_budget"] // 2 - 1) % 4]

    def relayout_pays(self, engine, num_requests, num_slots, budget):
        self._odd("relayout_pays")
        return True

    def step_timed(self, engine, tokens, requests, seconds):
        self._odd("step_timed")

    def verified(self, engine, requests, num_drafts, num_accepted):
        self._odd("verified")

    def request_finished(self, engine, request):
        self._odd("request_finished")


class DeviceBadConfidences(DevicePrevious):
    """Confidences of one dimension, too few columns, a NaN ``min_confidence``, all NaN, in turn."""
    name = "device_bad_conf"

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending):
        DeviceBadConfidences.calls += 1
        R, K = len(requests), max(max_drafts)
        toks = last_tokens[:, None].expand(-1, K).clone()
        mode = DeviceBadConfidences.calls % 4
        if mode == 0:
            return DeviceDraft(toks, torch.full((R,), 0.9))
        if mode == 1:
            return DeviceDraft(toks, torch.full((R, max(K - 1, 0)), 0.9))
        if mode == 2:
            return DeviceDraft(toks, torch.full((R, K), 0.9), min_confidence=float("nan"))
        return DeviceDraft(toks, torch.full((R, K), float("nan")))
'''


@pytest.fixture(scope="module")
def device_proposers(tmp_path_factory):
    """A third-party package registering device proposers through entry_points.txt alone."""
    yield from proposer_package_on_path(tmp_path_factory.mktemp("device_proposers"), "device_proposers", PROPOSERS, {
        "device_previous": "DevicePrevious", "device_oracle": "DeviceOracle", "device_flaky": "DeviceFlaky",
        "device_sometimes": "DeviceSometimes", "device_bad_conf": "DeviceBadConfidences",
        "device_raiser": "DeviceRaiser"})


def make(path, async_on=True, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=8, kv_cache_memory=2 << 20, async_scheduling=async_on)
    opts.update(kw)
    return LLM(str(path), **opts)


def run(llm: LLM, prompts, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert not llm.engine.has_unfinished() and llm.engine.pipeline.inflight is None
    llm.engine.blocks.check_no_leaks()  # every rolled-back slot came back
    return outs


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def same_logprobs(a, b) -> None:
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa.outputs, ob.outputs):
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for x, y in zip(ca.logprobs or [], cb.logprobs or []):
                assert x.keys() == y.keys()
                assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)


PROMPTS = [rand_ids(3 + 7 * i, seed=90 + i) for i in range(6)]  # 3..38 tokens


def mixed_params() -> list[SamplingParams]:
    """Mixed output lengths, logprobs, n = 2 and a penalty (which forces synchronous steps while it runs)."""
    return [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2 if i % 2 else None,
                           n=2 if i == 3 else 1, repetition_penalty=1.3 if i == 0 else 1.0)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def plain_ref(tiny_v3_path):
    return run(make(tiny_v3_path, async_on=False), PROMPTS, mixed_params())


def test_async_speculation_overlaps_and_is_greedy_exact(tiny_v3_path, device_proposers, plain_ref):
    """Identical to plain decoding and to synchronous speculation; steps overlap although every
    step speculates; drafts were verified and some accepted (the previous token often repeats)."""
    spec = {"proposer": "device_previous", "k": 3}
    sync = run(make(tiny_v3_path, async_on=False, speculative=spec), PROMPTS, mixed_params())
    llm = make(tiny_v3_path, speculative=spec)
    assert llm.engine.spec.on_device is not None
    outs = run(llm, PROMPTS, mixed_params())
    assert tokens(outs) == tokens(plain_ref) == tokens(sync)
    same_logprobs(outs, plain_ref)
    m = llm.engine.metrics()
    assert m["spec_verified"] > 0 and m["overlapped_steps"] > m["steps"] // 2
    assert m["decode_tokens"] == sum(len(t) for o in tokens(plain_ref) for t in o)


def test_accepted_drafts_several_tokens_per_overlapped_step(tiny_v3_path, device_proposers, plain_ref):
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1) for _ in PROMPTS]
    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4})
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    same_logprobs(outs, ref)
    m = llm.engine.metrics()
    assert m["spec_accepted"] > m["spec_verified"] // 2 and m["spec_accepted"] < m["spec_verified"]
    assert m["steps"] <= 8 and m["overlapped_steps"] >= m["steps"] - 2  # 14 tokens: 1 prefill + 13 plain steps
    fb = llm.engine.spec.proposer.feedback
    assert fb and all(0 <= a <= d for nd, na in fb for d, a in zip(nd, na))


def test_device_draft_lengths_cut_by_confidence(tiny_v3_path, device_proposers):
    """Confidences go through the draft_lengths op on the device: the third draft's low confidence
    ends every request's drafts at 2; outputs stay exact."""
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4, "confidences": True})
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    fb = llm.engine.spec.proposer.feedback
    assert fb and max(d for nd, _ in fb for d in nd) == 2
    assert llm.engine.metrics()["spec_accepted"] > 0


def test_unfilled_slots_cost_no_verify_rows(tiny_v3_path, device_proposers):
    """Half the requests get no drafts: the host's verify budget follows the filled share, and the
    device lays the decode rows out anew (each request its query and kept drafts, then padding);
    outputs and logprobs stay exact, no block leaks."""
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2) for _ in PROMPTS]
    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4, "sparse": True})
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    same_logprobs(outs, ref)
    m = llm.engine.metrics()
    assert m["spec_verify_budget"] < 0.8 * m["spec_draft_slots"] and m["spec_accepted"] > 0
    assert m["overlapped_steps"] >= m["steps"] - 2


def test_chunked_prefills_beside_relaid_drafted_decodes(tiny_v3_path, device_proposers):
    """Steps mixing prefill chunks (token budget 16, prompts up to 38 tokens, prompt logprobs) with
    drafted decodes whose rows are laid out anew on the device: greedy-identical to the synchronous
    loop without speculation, logprobs and prompt logprobs included."""
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1,
                             prompt_logprobs=1 if i == 4 else None) for i in range(len(PROMPTS))]
    ref = run(make(tiny_v3_path, async_on=False, max_num_batched_tokens=16), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    llm = make(tiny_v3_path, max_num_batched_tokens=16,
               speculative={"proposer": "device_oracle", "k": 3, "sparse": True})
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    same_logprobs(outs, ref)
    for a, b in zip(outs[4].prompt_logprobs[1:], ref[4].prompt_logprobs[1:]):
        assert {t: round(lp.logprob, 4) for t, lp in a.items()} == {t: round(lp.logprob, 4) for t, lp in b.items()}
    m = llm.engine.metrics()
    assert m["spec_accepted"] > 0 and m["spec_verify_budget"] < m["spec_draft_slots"]


def test_a_proposers_verify_budget_bounds_each_step(tiny_v3_path, device_proposers):
    """``Proposer.verify_budget`` fixes the step's draft rows on the host (3 here, over 6 requests
    offered 4 slots each); the device shares them out: never more verified, output exact."""
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4, "budget": 3})
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    fb = llm.engine.spec.proposer.feedback
    assert fb and all(sum(nd) <= 3 for nd, _ in fb) and max(sum(nd) for nd, _ in fb) == 3
    assert llm.engine.metrics()["spec_accepted"] > 0


def test_stops_and_stop_strings_inside_accepted_drafts(tiny_v3_path, device_proposers):
    import device_proposers as dp

    base = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for _ in PROMPTS]
    sync = make(tiny_v3_path, async_on=False)
    ref = run(sync, PROMPTS, base)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    texts = [o.outputs[0].text for o in ref]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                             stop_token_ids=[o.outputs[0].token_ids[6]]) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[t[6:9]] if len(t) > 9 else None)
              for i, (o, t) in enumerate(zip(ref, texts))]
    want = run(sync, PROMPTS, params)
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4})
    outs = run(llm, PROMPTS, params)
    for a, b in zip(outs, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
            (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.metrics()["spec_accepted"] > 0


def test_sampled_requests_run_exactly_their_lengths(tiny_v3_path, device_proposers):
    """Seeded sampling verified on the device (exact in distribution, see the verify tests below):
    every request gets its max_tokens, n = 2 choices differ, nothing leaks."""
    ps = [SamplingParams(temperature=0.9, top_p=0.95, seq_seed=7 + i, max_tokens=9, ignore_eos=True, logprobs=1,
                         n=2 if i == 0 else 1) for i in range(len(PROMPTS))]
    llm = make(tiny_v3_path, speculative={"proposer": "device_previous", "k": 3})
    outs = run(llm, PROMPTS, ps)
    assert all(len(c.token_ids) == 9 and len(c.logprobs) == 9 for o in outs for c in o.outputs)
    assert llm.engine.metrics()["spec_verified"] > 0 and llm.engine.metrics()["overlapped_steps"] > 0


def test_seeded_sampling_emits_plain_decodings_tokens(tiny_v3_path, device_proposers):
    """Point-mass drafts are verified by coupling (engine/rejection.py): a seeded request emits the
    tokens plain decoding with its seed emits, its drafts accepted or not, async and sync."""
    import device_proposers as dp

    ps = [SamplingParams(temperature=0.9, top_p=0.95, seq_seed=7 + i, max_tokens=9, ignore_eos=True,
                         n=2 if i == 0 else 1, repetition_penalty=1.2 if i == 1 else 1.0) for i in range(len(PROMPTS))]
    want = tokens(run(make(tiny_v3_path, async_on=False), PROMPTS, ps))
    dp.DeviceOracle.outputs = {tuple(p): w[0] for p, w in zip(PROMPTS, want)}
    for async_on in (True, False):
        for name in ("device_previous", "device_oracle"):
            llm = make(tiny_v3_path, async_on=async_on, speculative={"proposer": name, "k": 3})
            got = tokens(run(llm, PROMPTS, ps))
            assert got == want, (async_on, name, [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w])
            m = llm.engine.metrics()
            assert m["spec_verified"] > 0
            if name == "device_oracle":
                assert m["spec_accepted"] > m["spec_verified"] // 3, m


def test_preemption_mid_async_speculation(tiny_v3_path, device_proposers):
    import device_proposers as dp

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1) for _ in PROMPTS]
    ref = run(make(tiny_v3_path, async_on=False), PROMPTS, params)
    dp.DeviceOracle.outputs = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, ref)}
    small = dict(kv_cache_memory=22 * kv_bytes_per_block(tiny_v3_path, BS), max_num_seqs=6)
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4}, **small)
    outs = run(llm, PROMPTS, params)
    assert tokens(outs) == tokens(ref)
    m = llm.engine.metrics()
    assert m["preemptions"] > 0 and m["spec_accepted"] > 0


def test_a_dormant_device_proposer_between_speculative_steps(tiny_v3_path, device_proposers, plain_ref):
    """Plain steps launched right after speculative ones (their inputs corrected from the accepted
    counts in flight) and speculative steps after plain ones, all overlapped: exact."""
    llm = make(tiny_v3_path, speculative={"proposer": "device_sometimes", "k": 3})
    outs = run(llm, PROMPTS, mixed_params())
    assert tokens(outs) == tokens(plain_ref)
    same_logprobs(outs, plain_ref)
    m = llm.engine.metrics()
    assert m["spec_dormant_steps"] > 0 and m["spec_steps"] > 0 and m["overlapped_steps"] > m["steps"] // 2


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["id"]}


def test_structured_output_beside_async_speculation(device_proposers):
    """A grammar request makes steps synchronous while it runs (its drafts verified on the host
    path), the others speculate asynchronously before and after: all greedy-identical to plain."""
    import json

    import jsonschema

    ps = [SamplingParams(temperature=0.0, max_tokens=30, so_args={"schema_type": "json", "schema": SCHEMA}),
          SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    prompts = ["record = ", "the cat sat"]
    ref_llm = LLM(features=["structured_output"], kv_cache_memory=64 << 20, async_scheduling=False)
    ref = ref_llm.generate(prompts, ps, use_tqdm=False)
    ref_llm.shutdown()
    llm = LLM(features=["structured_output"], kv_cache_memory=64 << 20, async_scheduling=True,
              speculative={"proposer": "device_previous", "k": 3})
    outs = llm.generate(prompts, ps, use_tqdm=False)
    for o, r in zip(outs, ref):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    m = llm.engine.metrics()
    assert m["spec_verified"] > 0 and m["overlapped_steps"] > 0
    llm.engine.blocks.check_no_leaks()
    llm.shutdown()




def test_launching_a_speculative_step_reads_nothing_back_from_the_device(tiny_v3_path, device_proposers, monkeypatch):
    """The engine's part of an overlapped speculative launch (accepted counts -> last tokens and
    rejections, proposing, the input correction and re-layout, the verify) never reads a tensor's
    values on the host: every ``tolist``/``item``/``bool``/``int``/``float`` of a tensor raises
    inside it (the ``draft_lengths`` op excepted: its torch reference counts on the host, the device
    kernels do not)."""
    import device_proposers as dp

    from deepinfer_core.engine.spec_async import AsyncSpec

    inside = [0]

    def guarded(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **kw):
            if inside[0]:
                raise AssertionError(f"Tensor.{name} read a device value during an async speculative launch")
            return orig(self, *a, **kw)
        return read

    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    from deepinfer_core.engine import spec_async

    for owner, name in ((AsyncSpec, "_resolve"), (AsyncSpec, "_draft"), (spec_async, "patch_rows"),
                        (spec_async, "compact_rows"), (AsyncSpec, "_verify")):
        orig = getattr(owner, name)

        def wrapped(*a, _orig=orig, **kw):
            inside[0] += 1
            try:
                return _orig(*a, **kw)
            finally:
                inside[0] -= 1
        monkeypatch.setattr(owner, name, wrapped)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seq_seed=i, max_tokens=8, ignore_eos=True, logprobs=1)
              for i in range(len(PROMPTS))]
    llm = make(tiny_v3_path, speculative={"proposer": "device_previous", "k": 3})
    run(llm, PROMPTS, params)
    m = llm.engine.metrics()
    assert m["spec_verified"] > 0 and m["overlapped_steps"] > 0
    # rows laid out anew (half the requests draft nothing)
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    dp.DeviceOracle.outputs = {tuple(p): t[0] for p, t in zip(PROMPTS, tokens(run(make(tiny_v3_path), PROMPTS,
                                                                                     greedy)))}
    llm = make(tiny_v3_path, speculative={"proposer": "device_oracle", "k": 4, "sparse": True})
    kernel = llm.engine.kernels.draft_lengths

    def unguarded(*a, **kw):
        saved, inside[0] = inside[0], 0
        try:
            return kernel(*a, **kw)
        finally:
            inside[0] = saved
    monkeypatch.setattr(llm.engine.kernels, "draft_lengths", unguarded)
    run(llm, PROMPTS, greedy)
    m = llm.engine.metrics()
    assert m["spec_accepted"] > 0 and m["spec_verify_budget"] < m["spec_draft_slots"]


def test_dp_ep_2_with_async_speculation_equals_one_rank_without(tmp_path_factory):
    """Every rank drafts on the device, verifies and settles its own requests one step late, its
    steps overlapping: greedy outputs and logprobs equal dp = ep = 1 without speculation."""
    from parallel_helpers import assert_same, ep_checkpoint, make_llm, workload

    ckpt = ep_checkpoint(tmp_path_factory.getbasetemp())
    ps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0) for _ in range(6)]
    prompts = workload(6)
    ref_llm = make_llm(ckpt)
    ref = ref_llm.generate(prompts, ps, use_tqdm=False)
    ref_llm.shutdown()
    llm = make_llm(ckpt, dp=2, ep=2, async_scheduling=True, speculative={"proposer": "ngram", "k": 3, "device": "on"})
    try:
        outs = llm.generate(prompts, ps, use_tqdm=False)
        assert_same(outs, ref)
        m = llm.metrics()
        assert all(r["spec_verified"] > 0 and r["overlapped_steps"] > 0 for r in m["ranks"])
        assert m["spec_draft_slots"] == sum(r["spec_draft_slots"] for r in m["ranks"])
    finally:
        llm.shutdown()


def test_upload_and_host_copy_pack_their_parts():
    """``Upload`` sends parts of several dtypes and shapes as views of one buffer, each with its own
    values; ``HostCopy`` brings tensors back one copy per dtype, each with its shape and values."""
    from deepinfer_core.engine.transfer import HostCopy, Upload
    from deepinfer_core.selection import select_platform

    up = Upload(torch.device("cpu"), False)
    parts = [([3, 1, 2], torch.long), ([[1, 2], [3, 4], [5, 6]], torch.int32), ([], torch.long),
             ([0.5, -1.5], torch.float32), ([True, False, True], torch.bool), ([7], torch.long)]
    handles = [up.add(d, dt) for d, dt in parts]
    sent = up.send()
    for h, (d, dt) in zip(handles, parts):
        assert sent[h].dtype == dt and sent[h].tolist() == d
    sent[handles[0]][0] = 9  # parts never overlap
    assert sent[handles[5]].tolist() == [7] and sent[handles[2]].numel() == 0
    platform = select_platform("cpu")
    tensors = [torch.arange(6).view(2, 3), torch.tensor([0.25, 0.5]), None, torch.tensor(4),
               torch.arange(4).view(2, 2).t(), torch.empty(0, 3, dtype=torch.float32)]
    host = HostCopy(tensors, platform, False, copy_cpu=True).wait()
    assert host[2] is None
    for a, b in zip(tensors, host):
        if a is not None:
            assert b is not a and b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    assert host[0].untyped_storage().data_ptr() == host[3].untyped_storage().data_ptr()  # one int64 copy
