"""Speculative decoding as scheduled tokens (engine/speculative.py, proposer.py): proposers found
through the ``deepinfer.proposers`` entry point alone, greedy outputs identical to plain decoding,
no KV block leaked after roll-backs, preemption mid-speculation, and contract violations named."""

from __future__ import annotations

import pytest
from spec_helpers import proposer_package_on_path
from tiny_models import kv_bytes_per_block, rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.plugins import PluginError

BS = 4
PROPOSERS = '''
from deepinfer_core.proposer import Draft, Proposer

class PreviousToken(Proposer):
    """Proposes the request's last token, repeated."""
    name = "previous_token"
    core_api_version = "1.0"

    def propose(self, engine, requests, max_drafts, batch):
        return [Draft([r.token_ids[-1]] * m) for r, m in zip(requests, max_drafts)]


class Oracle(Proposer):
    """Proposes a known continuation (a plain run's outputs), its last draft wrong every 2nd call."""
    name = "oracle"
    core_api_version = "1.0"
    outputs = {}  # prompt tuple -> output tokens (set by the test)

    def __init__(self, section):
        self.corrupt = section.pop("corrupt", True)
        for prompt, output in section.pop("outputs", []):  # a config value reaches dp/ep worker processes
            Oracle.outputs[tuple(prompt)] = output
        super().__init__(section)
        self.calls = 0
        self.feedback = []

    def propose(self, engine, requests, max_drafts, batch):
        self.calls += 1
        out = []
        for r, m in zip(requests, max_drafts):
            want = self.outputs.get(tuple(r.prompt_token_ids), [])
            toks = want[r.num_output_tokens : r.num_output_tokens + m]
            if self.corrupt and toks and self.calls % 2 == 0:
                toks = toks[:-1] + [(toks[-1] + 1) % 64 + 4]
            out.append(Draft(toks) if toks else None)
        return out

    def verified(self, engine, requests, num_drafts, num_accepted):
        self.feedback.append((num_drafts, num_accepted))


class Sometimes(PreviousToken):
    """Speculates on every third step only; dormant (plain async steps) otherwise."""
    name = "sometimes"

    def __init__(self, section):
        super().__init__(section)
        self.asked = 0

    def active(self, engine):
        self.asked += 1
        return self.asked % 3 == 0


class TooLong(Proposer):
    name = "too_long"
    core_api_version = "1.0"

    def propose(self, engine, requests, max_drafts, batch):
        return [Draft([5] * (m + 1)) for m in max_drafts]


class Reserving(Proposer):
    """Writes draft KV (a draft model would): checks that the engine reserved the slots of the last
    token and every offered draft, and proposes one draft only (the rest must be given back)."""
    name = "reserving"
    core_api_version = "1.0"
    writes_draft_kv = True
    seen = []

    def propose(self, engine, requests, max_drafts, batch):
        for r, m in zip(requests, max_drafts):
            Reserving.seen.append((len(r.block_table) * engine.block_size >= r.num_tokens + m, m))
        return [Draft([r.token_ids[-1]]) if m else None for r, m in zip(requests, max_drafts)]


class Flaky(Proposer):
    """Raises on every 3rd call; returns a wrong-length list on every 3rd+1; else one valid draft and
    one out-of-vocabulary draft."""
    name = "flaky"
    core_api_version = "1.0"
    calls = 0

    def propose(self, engine, requests, max_drafts, batch):
        Flaky.calls += 1
        if Flaky.calls % 3 == 0:
            raise ValueError("draft model fell over")
        if Flaky.calls % 3 == 1:
            return []
        out = [Draft([r.token_ids[-1]]) for r in requests]
        out[0] = Draft([10**9])
        return out


class BadProbs(Proposer):
    """Drafts the last token with distributions that are wrong in turn: not finite, negative, 0 at the
    draft token, not summing to 1, integer."""
    name = "bad_probs"
    core_api_version = "1.0"
    calls = 0

    def propose(self, engine, requests, max_drafts, batch):
        import torch

        BadProbs.calls += 1
        V, mode = engine.model_config.vocab_size, BadProbs.calls % 5
        out = []
        for r, m in zip(requests, max_drafts):
            toks = [r.token_ids[-1]] * m
            q = torch.full((m, V), 1.0 / V)
            if mode == 0:
                q[0, 3] = float("nan")
            elif mode == 1:
                q[:, 0], q[:, 1] = -0.5, 0.5 + 1.0 / V
            elif mode == 2:
                q[torch.arange(m), torch.tensor(toks)] = 0.0
                q /= q.sum(-1, keepdim=True)
            elif mode == 3:
                q *= 1.5
            else:
                q = torch.ones(m, V, dtype=torch.long)
            out.append(Draft(toks, probs=q))
        return out


class Sleepy(PreviousToken):
    """Proposes the last token repeated, slowly: its speculative steps are slower than plain ones (by far more
    than a busy machine slows a tiny model's plain step: the test asserts a 2x gap)."""
    name = "sleepy"

    def propose(self, engine, requests, max_drafts, batch):
        import time

        time.sleep(0.06)
        return super().propose(engine, requests, max_drafts, batch)


class BadStart(PreviousToken):
    """Fails to construct (``fail = "init"``) or to start (``fail = "start"``)."""
    name = "bad_start"

    def __init__(self, section):
        self.fail = section.pop("fail")
        super().__init__(section)
        if self.fail == "init":
            raise FileNotFoundError("draft weights not found")

    def start(self, engine):
        raise OSError("cannot map the draft model")
'''


@pytest.fixture(scope="module")
def proposer_package(tmp_path_factory):
    """A third-party package installed only as files on sys.path: its module and a dist-info whose
    entry_points.txt registers three proposers (what pip would write)."""
    yield from proposer_package_on_path(tmp_path_factory.mktemp("toy_proposers"), "toy_proposers", PROPOSERS, {
        "previous_token": "PreviousToken", "oracle": "Oracle", "too_long": "TooLong", "sometimes": "Sometimes",
        "flaky": "Flaky", "reserving": "Reserving", "bad_probs": "BadProbs", "bad_start": "BadStart",
        "sleepy": "Sleepy"})


def make(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=8, kv_cache_memory=2 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


PROMPTS = [rand_ids(6 + 5 * i, seed=70 + i) for i in range(5)]


def greedy(n=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run(llm: LLM, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert not llm.engine.has_unfinished()
    llm.engine.blocks.check_no_leaks()  # every rolled-back slot and draft block came back
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_v3_path):
    return make(tiny_v3_path)


@pytest.fixture(scope="module")
def reference(plain):
    ps = [greedy(logprobs=2) for _ in PROMPTS]
    return run(plain, ps)


@pytest.mark.parametrize("async_on", [False, True])
def test_third_party_proposer_through_the_entry_point_is_greedy_exact(tiny_v3_path, proposer_package,
                                                                     reference, async_on):
    llm = make(tiny_v3_path, async_scheduling=async_on, speculative={"proposer": "previous_token", "k": 3})
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    for o, r in zip(outs, reference):  # logprobs from the verify rows equal plain decoding's
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    m = llm.engine.metrics()
    assert m["spec_proposer"] == "previous_token" and m["spec_verified"] > 0 and m["spec_steps"] > 0


def test_accepted_drafts_emit_several_tokens_per_step(tiny_v3_path, proposer_package, reference):
    import toy_proposers

    toy_proposers.Oracle.outputs = {tuple(p): t for p, t in zip(PROMPTS, tokens(reference))}
    llm = make(tiny_v3_path, speculative={"proposer": "oracle", "k": 4})
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    m = llm.engine.metrics()
    assert m["spec_accepted"] > m["spec_verified"] // 2 and m["spec_accepted"] < m["spec_verified"]  # some rejected
    assert m["steps"] <= 6  # 12 tokens each: 1 prefill + 11 decode steps without speculation
    assert m["decode_tokens"] == sum(len(t) for t in tokens(reference))
    prop = llm.engine.spec.proposer
    assert prop.feedback and all(0 <= a <= d for nd, na in prop.feedback for d, a in zip(nd, na))


def test_stops_inside_accepted_drafts(tiny_v3_path, proposer_package, reference):
    import toy_proposers

    toy_proposers.Oracle.outputs = {tuple(p): t for p, t in zip(PROMPTS, tokens(reference))}
    stop_ps = [greedy(stop_token_ids=[t[5]]) for t in tokens(reference)]
    want = [t[: t.index(t[5]) + 1] for t in tokens(reference)]
    llm = make(tiny_v3_path, speculative={"proposer": "oracle", "k": 4, "corrupt": False})
    outs = run(llm, stop_ps)
    assert tokens(outs) == want and all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.metrics()["spec_accepted"] > 0


def test_sampled_requests_penalties_and_n2(tiny_v3_path, proposer_package):
    """Seeded sampling through rejection (exact in distribution, not token-equal), greedy with
    penalties (drafted too: token-equal to plain decoding) and n = 2, together."""
    ps = [SamplingParams(temperature=0.8, seq_seed=5 + i, max_tokens=10, ignore_eos=True) if i % 2 else
          SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3, n=2)
          for i in range(len(PROMPTS))]
    llm = make(tiny_v3_path, speculative={"proposer": "previous_token", "k": 2})
    outs = run(llm, ps)
    ref = run(make(tiny_v3_path), ps)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert all(len(c.token_ids) == 10 for c in o.outputs)
        if i % 2 == 0:
            assert len(o.outputs) == 2 and [c.token_ids for c in o.outputs] == [c.token_ids for c in r.outputs]


def test_preemption_mid_speculation_is_exact_and_leak_free(tiny_v3_path, proposer_package, reference):
    import toy_proposers

    toy_proposers.Oracle.outputs = {tuple(p): t for p, t in zip(PROMPTS, tokens(reference))}
    small = dict(kv_cache_memory=14 * kv_bytes_per_block(tiny_v3_path, BS), max_num_seqs=5)
    llm = make(tiny_v3_path, speculative={"proposer": "oracle", "k": 4}, **small)
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    m = llm.engine.metrics()
    assert m["preemptions"] > 0 and m["spec_accepted"] > 0


def test_a_proposer_writing_draft_kv_gets_its_slots_reserved_and_given_back(tiny_v3_path, proposer_package,
                                                                           reference):
    import toy_proposers

    llm = make(tiny_v3_path, speculative={"proposer": "reserving", "k": 4})
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])  # no leak: unused reserved slots came back
    assert tokens(outs) == tokens(reference)
    seen = toy_proposers.Reserving.seen
    assert seen and all(ok for ok, _ in seen)
    assert {m for _, m in seen} >= {0, 4}  # full room, and requests offered only to catch up


@pytest.mark.parametrize("proposer", ["too_long", "flaky"])
def test_a_proposer_breaking_its_contract_loses_its_drafts_not_the_requests(tiny_v3_path, proposer_package,
                                                                            reference, proposer, caplog):
    """Too many drafts, out-of-vocabulary ids, a wrong-length list, an exception: the drafts concerned
    are dropped for that step with an error naming the proposer; the requests decode on exactly."""
    llm = make(tiny_v3_path, speculative={"proposer": proposer, "k": 2})
    with caplog.at_level("ERROR", logger="deepinfer.speculative"):
        outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    m = llm.engine.metrics()
    assert m["spec_proposer_errors"] > 0
    errors = [r.getMessage() for r in caplog.records]
    if proposer == "too_long":
        assert m["spec_verified"] == 0
        assert any("proposer TooLong" in e and "at most 2 token ids" in e for e in errors)
    else:
        assert m["spec_verified"] > 0  # the valid drafts of the good calls were still verified
        for what in ("raised ValueError: draft model fell over", "must return a list of", "invalid draft"):
            assert any("proposer Flaky" in e and what in e for e in errors), (what, errors)


def test_draft_distributions_that_are_not_distributions_are_refused(tiny_v3_path, proposer_package, caplog):
    """Rejection sampling against a wrong q biases the samples without a sign (a q of 0 at the draft
    token accepted every draft): such drafts are dropped, named, and the sampled requests decode as
    without speculation, token for token."""
    ps = [SamplingParams(temperature=0.9, seq_seed=11 + i, max_tokens=8, ignore_eos=True) for i in range(len(PROMPTS))]
    want = tokens(run(make(tiny_v3_path), ps))
    llm = make(tiny_v3_path, speculative={"proposer": "bad_probs", "k": 3})
    with caplog.at_level("ERROR", logger="deepinfer.speculative"):
        outs = run(llm, ps)
    assert tokens(outs) == want
    m = llm.engine.metrics()
    assert m["spec_verified"] == 0 and m["spec_proposer_errors"] >= 5
    errors = [r.getMessage() for r in caplog.records]
    for what in ("not finite", "a negative value", "probability 0 at its own draft token", "whose sum is not 1",
                 "not floating point"):
        assert any("proposer BadProbs" in e and what in e for e in errors), (what, errors)


def test_bad_speculative_config_is_named(tiny_v3_path, proposer_package):
    with pytest.raises(ConfigError, match="k must be an int in 1..16"):
        make(tiny_v3_path, speculative={"proposer": "previous_token", "k": 0})
    with pytest.raises(ConfigError, match="needs proposer"):
        make(tiny_v3_path, speculative={"k": 2})
    with pytest.raises(Exception, match="nope"):
        make(tiny_v3_path, speculative={"proposer": "nope"})
    with pytest.raises(ConfigError, match="takes no settings"):
        make(tiny_v3_path, speculative={"proposer": "previous_token", "depth": 3})
    with pytest.raises(PluginError, match="proposer 'bad_start' failed to construct: FileNotFoundError: draft weights"):
        make(tiny_v3_path, speculative={"proposer": "bad_start", "fail": "init"})
    with pytest.raises(PluginError, match="proposer 'bad_start' failed to start: OSError: cannot map"):
        make(tiny_v3_path, speculative={"proposer": "bad_start", "fail": "start"})


@pytest.mark.parametrize("coupled", [False, True])
def test_point_mass_drafts_keep_the_target_distribution(coupled):
    """A deterministic proposer's drafts (no probs) verified against sampled rows, by the rejection
    rule on one-hot rows or by coupling (the engine's way for them): the first emitted token still
    follows the target's filtered distribution (chi-square), the draft is kept with probability p(d),
    and coupled, every emitted token is the plain sampler's own draw at its position."""
    import torch

    from deepinfer_core.engine.rejection import SamplingRows, filtered_probs, verify
    from deepinfer_core.engine.speculative import SpecDecoder

    V, N = 8, 20000
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5)) * 1.5
    p = filtered_probs(logits, SamplingRows.from_params([SamplingParams(temperature=0.9)] * 2, "cpu"))
    seq = type("S", (), {"spec_probs": None})()
    draft = [int(p[0].argmax())]  # the likeliest token: accepted often, rejected sometimes
    q = SpecDecoder._draft_probs(seq, draft, V, "cpu")
    assert q.sum() == 1 and q[0, draft[0]] == 1
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 3
    tokens, accepted = verify(p.repeat(N, 1), q.repeat(N, 1), [draft] * N, seeds, [50] * N, [False] * N,
                              point_mass=[coupled] * N)
    counts = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).float()
    exp = p[0] * N
    stat = float(((counts - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((V - 1) / 2.0, dtype=torch.float64),
                                           torch.tensor(stat / 2.0, dtype=torch.float64)))
    assert pvalue > 1e-3
    assert sum(accepted) / N == pytest.approx(float(p[0, draft[0]]), abs=4 * (0.25 / N) ** 0.5)
    if coupled:  # the plain sampler at positions 50 (and 51 after an accepted draft) with the same seeds
        from kernels_cpu.ops import sample

        params = (torch.full((N,), 0.9), torch.zeros(N, dtype=torch.long), torch.ones(N), torch.zeros(N))
        first = sample(logits[:1].repeat(N, 1), *params, seeds, torch.full((N,), 50)).tolist()
        second = sample(logits[1:].repeat(N, 1), *params, seeds, torch.full((N,), 51)).tolist()
        assert [t[0] for t in tokens] == first
        assert all(t[1] == b for t, b in zip(tokens, second) if len(t) == 2)


def test_penalties_with_accepted_drafts_are_greedy_exact(tiny_v3_path, proposer_package):
    """Penalties apply per verified row, counting the drafts before it as output."""
    import toy_proposers

    ps = [greedy(n=14, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2) for _ in PROMPTS]
    ref = run(make(tiny_v3_path), ps)
    toy_proposers.Oracle.outputs = {tuple(p): t for p, t in zip(PROMPTS, tokens(ref))}
    llm = make(tiny_v3_path, speculative={"proposer": "oracle", "k": 4})
    outs = run(llm, ps)
    assert tokens(outs) == tokens(ref)
    m = llm.engine.metrics()
    assert m["spec_accepted"] > m["spec_verified"] // 2 and m["steps"] <= 8


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "ok": {"type": "boolean"}}, "required": ["id", "ok"]}


@pytest.fixture(scope="module")
def so_reference():
    llm = LLM(features=["structured_output"], kv_cache_memory=64 << 20)
    ps = [SamplingParams(temperature=0.0, max_tokens=40, so_args={"schema_type": "json", "schema": SCHEMA}),
          SamplingParams(temperature=0.0, max_tokens=12, so_args={"schema_type": "regex", "schema": "[0-9]{2,5}"})]
    prompts = ["record = ", "n = "]
    outs = llm.generate(prompts, ps, use_tqdm=False)
    llm.shutdown()
    return prompts, ps, outs


@pytest.mark.parametrize("proposer", ["oracle", "previous_token", "dspark"])
def test_structured_output_with_drafts_is_valid_and_greedy_exact(proposer_package, so_reference, proposer,
                                                                  tmp_path, monkeypatch):
    """Grammar masks on every verified row (drafts the grammar rejects are masked out), the matcher
    advanced only by kept tokens: schema-valid and identical to decoding without drafts."""
    import json

    import jsonschema
    import toy_proposers

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    prompts, ps, ref = so_reference
    kw = dict(features=["structured_output"], kv_cache_memory=64 << 20)
    if proposer == "dspark":
        kw["features"] = ["structured_output", "dspark"]
    else:
        kw["speculative"] = {"proposer": proposer, "k": 4}
    llm = LLM(**kw)
    if proposer == "oracle":
        ids = [llm.engine.tokenizer.encode(p) for p in prompts]
        toy_proposers.Oracle.outputs = {tuple(i): o.outputs[0].token_ids for i, o in zip(ids, ref)}
    if proposer == "dspark":
        from plugins.dspark.policy import LiveCost, StepCost

        feat = next(f for f in llm.engine.features if f.name == "dspark")
        feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)
    outs = llm.generate(prompts, ps, use_tqdm=False)
    for o, r in zip(outs, ref):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    m = llm.engine.metrics()
    assert m["spec_verified"] > 0
    if proposer != "previous_token":
        assert m["spec_accepted"] > 0
    llm.engine.blocks.check_no_leaks()
    llm.shutdown()


def test_dp_ep_2_with_speculation_equals_one_rank_without(proposer_package, tmp_path_factory):
    """Every rank proposes and verifies its own requests (one target forward per rank per step):
    greedy outputs and logprobs equal dp = ep = 1 without speculation; the ranks' counts are summed."""
    from parallel_helpers import assert_same, ep_checkpoint, make_llm, workload

    ckpt = ep_checkpoint(tmp_path_factory.getbasetemp())
    ps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0) for _ in range(6)]
    prompts = workload(6)
    ref_llm = make_llm(ckpt)
    ref = ref_llm.generate(prompts, ps, use_tqdm=False)
    ref_llm.shutdown()
    outputs = [[p["prompt_token_ids"], o.outputs[0].token_ids] for p, o in zip(prompts, ref)]
    llm = make_llm(ckpt, dp=2, ep=2, speculative={"proposer": "oracle", "k": 3, "outputs": outputs})
    try:
        outs = llm.generate(prompts, ps, use_tqdm=False)
        assert_same(outs, ref)
        m = llm.metrics()
        assert m["spec_accepted"] > 0 and all(r["spec_accepted"] > 0 for r in m["ranks"])
        assert m["spec_accepted"] == sum(r["spec_accepted"] for r in m["ranks"])
    finally:
        llm.shutdown()


def test_a_dormant_proposer_lets_steps_overlap(tiny_v3_path, proposer_package, reference):
    """With async scheduling on, steps while the proposer is dormant are plain overlapped steps;
    speculative steps in between are synchronous; greedy outputs stay identical."""
    llm = make(tiny_v3_path, async_scheduling=True, speculative={"proposer": "sometimes", "k": 3},
               measure_device_idle=True)
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    m = llm.engine.metrics()
    assert m["spec_dormant_steps"] > 0 and m["spec_steps"] > 0 and m["overlapped_steps"] > 0
    assert 0.0 <= m["device_idle_share"] < 1.0 and m["device_idle_gaps"] > 0


def test_dspark_goes_dormant_when_drafting_does_not_pay(tiny_v3_path, reference, tmp_path, monkeypatch):
    from plugins.dspark.policy import LiveCost, StepCost

    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    llm = make(tiny_v3_path, async_scheduling=True, features=["dspark"],
               dspark={"draft": str(tiny_v3_path), "k": 3, "host_steps_below": 0})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    # a draft step costs a second: drafting never pays
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1.0, 1.0]), adapt=False)
    outs = run(llm, [greedy(logprobs=2) for _ in PROMPTS])
    assert tokens(outs) == tokens(reference)
    m = llm.engine.metrics()
    assert m["spec_dormant_steps"] > 0 and m["overlapped_steps"] >= m["spec_dormant_steps"] - 2
    assert m["dspark_verified"] == 0 and m["dspark_steps_without_drafts"] > 0


def test_spec_floor_runs_the_mode_that_measured_faster_per_batch_size():
    """engine/spec_floor.py on given times: speculation first, a plain trial, then the faster mode,
    with trials of the other now and then, further apart while they confirm it (a change of text is
    seen); batch sizes apart; the first step after a switch and prefill steps not counted."""
    from deepinfer_core.engine import spec_floor
    from deepinfer_core.engine.spec_floor import SpecFloor

    f = SpecFloor()
    rates = {(1, True): 300.0, (1, False): 100.0, (32, True): 1000.0, (32, False): 2000.0}  # tokens/s

    def run(requests, steps):
        modes = []
        for _ in range(steps):
            m = f.speculate(requests)
            modes.append(m)
            f.observe(m, requests, 10, 10 / rates[requests, m], prefill=False)
        return modes

    one, many = run(1, 600), run(32, 600)
    W, T = spec_floor.WARMUP, spec_floor.TRIAL
    # the warm-up, a trial of plain steps (its first not counted), then the faster mode
    assert one[: W + T + 2] == [True] * W + [False] * (T + 1) + [True]
    assert sum(one) >= 600 - 4 * (T + 1)  # speculation wins at one request: plain only in 4 trials
    assert sum(many) <= W + 3 * (T + 1)  # plain wins at 32: speculation only in warm-up and 3 trials
    assert f.metrics()["spec_floor_spec_tok_s_1"] == 300.0 and f.metrics()["spec_floor_plain_tok_s_32"] == 2000.0
    assert f.buckets[f.key(32)].gap > spec_floor.FIRST_GAP  # the trials confirmed plain: they grew apart
    rates[32, True] = 5000.0  # the text became predictable: a trial sees it, speculation takes over
    later = run(32, 1200)
    switch = later.index(True)  # at the next trial (the gap had grown to 512 steps)
    assert switch <= 512 + T and sum(later[switch:]) >= len(later) - switch - 3 * (T + 1)
    before = dict(f.buckets[f.key(32)].counted)
    f.observe(False, 32, 10, 1.0, prefill=False)  # the first step after a switch: mixed, not counted
    f.observe(False, 32, 10, 1.0, prefill=True)  # a prefill step: not a decode step's time
    for seconds, toks in ((float("nan"), 10), (float("inf"), 10), (0.0, 10), (-1.0, 10), (1.0, -3)):
        f.observe(False, 32, toks, seconds, prefill=False)  # a bad clock reading or count: not counted
    assert f.buckets[f.key(32)].counted == before


@pytest.mark.parametrize("async_on", [False, True])
def test_a_proposer_slower_than_plain_decoding_is_held_to_plain_steps(tiny_v3_path, proposer_package, async_on):
    """A proposer whose steps cost more than they give: after its warm-up and a plain trial the
    engine runs plain steps (greedy outputs unchanged); ``floor = false`` keeps it speculating."""
    ps = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = tokens(run(make(tiny_v3_path, async_scheduling=async_on), [ps] * len(PROMPTS)))
    llm = make(tiny_v3_path, async_scheduling=async_on, speculative={"proposer": "sleepy", "k": 3})
    assert tokens(run(llm, [ps] * len(PROMPTS))) == want
    m = llm.engine.metrics()
    assert m["spec_floor_plain_tok_s_4"] > 2 * m["spec_floor_spec_tok_s_4"], m
    spec_steps = m["spec_steps"]
    assert spec_steps < 24 + 8 + 6, m  # warm-up and a switch's steps, then plain ones
    off = make(tiny_v3_path, async_scheduling=async_on, speculative={"proposer": "sleepy", "k": 3, "floor": False})
    assert tokens(run(off, [ps] * len(PROMPTS))) == want
    assert off.engine.metrics()["spec_steps"] > spec_steps + 5
    with pytest.raises(ConfigError, match="floor must be true or false"):
        make(tiny_v3_path, speculative={"proposer": "sleepy", "floor": "yes"})
