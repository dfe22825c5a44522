"""One request can never poison the engine (issue 14, item 1): an error attributable to one request
fails it alone (``finish_reason == "error"``, ``.error`` naming the cause); an error no request
explains fails the step's requests; either way no KV block leaks, nothing is left unfinished and the
next ``generate()`` gives the same outputs as a fresh engine."""

from __future__ import annotations

import pytest
from tiny_models import VOCAB, rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.sampler import Sampler
from plugins.dspark.policy import LiveCost, StepCost

BS = 4
PROMPTS = [rand_ids(5 + 4 * i, 70 + i) for i in range(5)]


def make(path, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=8, kv_cache_memory=1 << 20)
    opts.update(kw)
    return LLM(str(path), **opts)


def params(i: int, **kw) -> SamplingParams:
    """Mixed greedy and seeded sampling, logprobs on some."""
    base = dict(max_tokens=6 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seq_seed=30 + i,
                logprobs=2 if i % 3 == 0 else None)
    base.update(kw)
    return SamplingParams(**base)


def gen(llm: LLM, prompts=PROMPTS, ps=None):
    ps = ps if ps is not None else [params(i) for i in range(len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.pipeline.inflight is None
    eng.blocks.check_no_leaks()


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    llm = make(tiny_v3_path)
    outs = gen(llm)
    assert all(o.error is None for o in outs)
    return tokens(outs)


# ---- the two reported requests ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 2**200])
def test_any_int_seq_seed_is_accepted_and_taken_modulo_2_64(tiny_v3_path, reference, seed):
    llm = make(tiny_v3_path)
    ps = [params(i) for i in range(len(PROMPTS))] + [params(0, seq_seed=seed), params(0, seq_seed=seed % 2**64)]
    outs = gen(llm, PROMPTS + [PROMPTS[0], PROMPTS[0]], ps)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert tokens(outs[:-2]) == reference
    assert outs[-2].outputs[0].token_ids == outs[-1].outputs[0].token_ids  # same seed modulo 2**64
    assert_clean(llm)
    assert tokens(gen(llm)) == reference


def test_prompt_logprobs_above_the_vocabulary_are_clamped(tiny_v3_path, reference):
    llm = make(tiny_v3_path)
    ps = [params(i) for i in range(len(PROMPTS))]
    ps[1] = params(1, prompt_logprobs=5000)
    outs = gen(llm, ps=ps)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert tokens(outs) == reference
    plp = outs[1].prompt_logprobs
    assert plp[0] is None and len(plp) == len(PROMPTS[1])
    assert all(len(entry) == VOCAB for entry in plp[1:])  # every token, ranked
    assert_clean(llm)


# ---- the class: injected faults -------------------------------------------------------------------
def _poison_sampling(monkeypatch, victim_len: int) -> None:
    """Sampling raises for any batch holding the request whose prompt has ``victim_len`` tokens."""
    real = Sampler.sample

    def sample(self, logits, seqs, positions):
        if any(s.num_prompt_tokens == victim_len for s in seqs):
            raise RuntimeError("injected sampling fault")
        return real(self, logits, seqs, positions)

    monkeypatch.setattr(Sampler, "sample", sample)


@pytest.mark.parametrize("async_on", [False, True])
def test_fault_in_one_requests_sampling_fails_it_alone(tiny_v3_path, reference, monkeypatch, async_on):
    llm = make(tiny_v3_path, async_scheduling=async_on)
    _poison_sampling(monkeypatch, len(PROMPTS[2]))
    outs = gen(llm)
    bad = outs[2]
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "sampling failed" in str(bad.error) and "injected sampling fault" in str(bad.error)
    others = [o for i, o in enumerate(outs) if i != 2]
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in others)
    assert tokens(others) == [t for i, t in enumerate(reference) if i != 2]
    assert_clean(llm)
    monkeypatch.undo()
    assert tokens(gen(llm)) == reference  # the engine is not poisoned
    assert_clean(llm)


@pytest.mark.parametrize("async_on", [False, True])
def test_fault_in_one_requests_prompt_logprobs_fails_it_alone(tiny_v3_path, reference, monkeypatch, async_on):
    llm = make(tiny_v3_path, async_scheduling=async_on)
    eng = llm.engine
    real = eng.pipeline.prompt_logprob_tensors

    def poisoned(seq, first, count, logits):
        if seq.num_prompt_tokens == len(PROMPTS[3]):
            raise IndexError("injected prompt-logprob fault")
        return real(seq, first, count, logits)

    monkeypatch.setattr(eng.pipeline, "prompt_logprob_tensors", poisoned)
    ps = [params(i, prompt_logprobs=1) for i in range(len(PROMPTS))]
    outs = gen(llm, ps=ps)
    assert outs[3].outputs[0].finish_reason == "error" and "injected prompt-logprob fault" in str(outs[3].error)
    others = [o for i, o in enumerate(outs) if i != 3]
    assert all(o.error is None for o in others)
    assert tokens(others) == [t for i, t in enumerate(reference) if i != 3]
    assert_clean(llm)


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("where", ["forward", "schedule", "complete"])
def test_unattributable_step_failure_fails_the_step_and_recovers(tiny_v3_path, reference, monkeypatch,
                                                                 async_on, where):
    llm = make(tiny_v3_path, async_scheduling=async_on)
    eng = llm.engine
    obj, name = {"forward": (eng.runner, "forward"), "schedule": (eng.scheduler, "schedule"),
                 "complete": (eng.pipeline, "complete")}[where]
    real, calls = getattr(obj, name), []

    def once(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # mid-generation: some requests decoding, some tokens in flight
            raise RuntimeError(f"injected {where} fault")
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, once)
    outs = gen(llm)
    failed = [o for o in outs if o.error is not None]
    assert failed, "the fault was not hit"
    for o in failed:
        assert o.outputs[0].finish_reason == "error"
        assert "engine step failed" in str(o.error) and f"injected {where} fault" in str(o.error)
        assert "plugin" not in str(o.error)  # no hook implementation raised it
    for o, want in zip(outs, reference):
        if o.error is None:
            assert o.outputs[0].token_ids == want
    assert_clean(llm)
    monkeypatch.undo()
    assert tokens(gen(llm)) == reference
    assert_clean(llm)


@pytest.mark.parametrize("async_on", [False, True])
def test_a_raising_hook_is_named_and_the_engine_recovers(tiny_v3_path, reference, async_on):
    """A plugin whose ``tokens_sampled`` raises mid-generation: the step's requests fail with an error naming the
    plugin and the hook (not the engine's own code), the others finish as before, nothing leaks; unregistered,
    the engine generates what a fresh one does."""
    import pluggy

    hookimpl = pluggy.HookimplMarker("deepinfer")

    class Flaky:
        calls = 0

        @hookimpl
        def tokens_sampled(self, engine, batch, token_ids):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise ZeroDivisionError("flaky plugin's bug")

    llm = make(tiny_v3_path, async_scheduling=async_on)
    plugin = Flaky()
    llm.engine.pm.register(plugin, name="flaky")
    outs = gen(llm)
    failed = [o for o in outs if o.error is not None]
    assert failed, "the hook's fault was not hit"
    for o in failed:
        assert o.outputs[0].finish_reason == "error"
        assert str(o.error) == ("engine step failed in plugin 'flaky' (hook tokens_sampled): "
                                "ZeroDivisionError: flaky plugin's bug"), o.error
    for o, want in zip(outs, reference):
        if o.error is None:
            assert o.outputs[0].token_ids == want
    assert_clean(llm)
    llm.engine.pm.unregister(plugin)
    assert tokens(gen(llm)) == reference
    assert_clean(llm)


def test_dspark_step_fault_recovers(tiny_v3_path, reference, monkeypatch, tmp_path):
    """The speculative path (engine/speculative.py with the DSpark proposer)."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    greedy = [params(i, temperature=0.0, logprobs=None) for i in range(len(PROMPTS))]
    want = tokens(gen(make(tiny_v3_path), ps=greedy))
    llm = make(tiny_v3_path, features=["dspark"], dspark={"draft": str(tiny_v3_path), "k": 2})
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    feat.live = LiveCost(StepCost([1, 1024], [0.01, 0.0101], [1, 1024], [1e-6, 1e-5]), adapt=False)  # always draft
    _poison_sampling(monkeypatch, len(PROMPTS[4]))  # rows without drafts: the normal sampler
    spec = llm.engine.spec
    real, calls = spec._verify, []

    def verify(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected verify fault")
        return real(*a, **kw)

    monkeypatch.setattr(spec, "_verify", verify)
    outs = gen(llm, ps=greedy)
    assert "injected sampling fault" in str(outs[4].error)
    assert calls, "no drafts were verified"
    assert any("injected verify fault" in str(o.error) for o in outs)
    for o, w in zip(outs, want):
        if o.error is None:
            assert o.outputs[0].token_ids == w
    assert_clean(llm)
    monkeypatch.undo()
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    assert tokens(gen(llm, ps=greedy)) == want
    assert_clean(llm)
