"""Async scheduling (the pipelined step loop, see ``deepinfer_core/engine/engine.py``) on the CPU:
``async_scheduling=True`` forces the pipelined code path, whose outputs must equal the synchronous
loop's token for token (and logprob for logprob) on mixed batches, with every stop condition, aborts,
preemption, prefix-cache hits and requests that force synchronous steps; no KV block may leak."""

from __future__ import annotations

import pytest
from tiny_models import kv_bytes_per_block, preemption_workload, rand_ids

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.llm import to_output
from deepinfer_core.scheduler import SchedulerOutput

BS = 4


def make_llm(path, async_on: bool, **kw) -> LLM:
    opts = dict(dtype="float32", block_size=BS, max_num_seqs=16, kv_cache_memory=2 << 20,
                async_scheduling=async_on)
    opts.update(kw)
    return LLM(str(path), **opts)


def gen(llm: LLM, prompts, params):
    ps = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(ps, params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    assert not llm.engine.has_unfinished() and llm.engine.pipeline.inflight is None
    llm.engine.blocks.check_no_leaks()
    return outs


def assert_identical(a, b) -> None:
    """Same tokens, text, finish/stop reasons, and bitwise-equal logprobs and prompt logprobs."""
    ca, cb = a.outputs[0], b.outputs[0]
    assert ca.token_ids == cb.token_ids
    assert all(t >= 0 for t in cb.token_ids)
    assert (ca.text, ca.finish_reason, ca.stop_reason) == (cb.text, cb.finish_reason, cb.stop_reason)
    if ca.logprobs is not None:
        assert len(ca.logprobs) == len(cb.logprobs) == len(ca.token_ids)
        for ea, eb in zip(ca.logprobs, cb.logprobs):
            assert {t: (lp.logprob, lp.rank) for t, lp in ea.items()} == {t: (lp.logprob, lp.rank)
                                                                         for t, lp in eb.items()}
    if a.prompt_logprobs is not None:
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert {t: lp.logprob for t, lp in ea.items()} == {t: lp.logprob for t, lp in eb.items()}


def mixed_batch() -> tuple[list, list[SamplingParams]]:
    """Prompt lengths 3..41, max_tokens 1..20, greedy and seeded sampling, logprobs, prompt logprobs."""
    prompts, params = [], []
    for i in range(12):
        prompts.append(rand_ids(3 + (i * 7) % 39, 200 + i))
        n = 1 + (i * 5) % 20
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seq_seed=1000 + i, max_tokens=n,
                                         ignore_eos=True, logprobs=0, prompt_logprobs=1 if i == 4 else None))
        else:
            params.append(SamplingParams(temperature=1.2, top_k=20, seq_seed=2000 + i, max_tokens=n,
                                         ignore_eos=True))
    return prompts, params


class StepOrder:
    """A feature plugin that notes, whenever tokens are post-processed, how many steps were launched
    and completed by then (the engine's own counters)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    @hookimpl
    def tokens_sampled(self, engine, batch, token_ids) -> None:
        self.seen.append((engine.stats.launched_steps, engine.stats.completed_steps))


# ---- identical outputs -----------------------------------------------------------------------------

def test_mixed_batch_chunked_prefill_identical(tiny_v3_path):
    prompts, params = mixed_batch()
    ref_llm = make_llm(tiny_v3_path, False, max_num_batched_tokens=16)
    llm = make_llm(tiny_v3_path, True, max_num_batched_tokens=16)
    assert not ref_llm.engine.async_scheduling and llm.engine.async_scheduling
    order = StepOrder()
    llm.engine.pm.register(order)
    ref, outs = gen(ref_llm, prompts, params), gen(llm, prompts, params)
    for p, r, o in zip(params, ref, outs):
        assert_identical(r, o)
        assert len(o.outputs[0].token_ids) == p.max_tokens and o.outputs[0].finish_reason == "length"
    m, rm = llm.metrics(), ref_llm.metrics()
    assert m["decode_tokens"] == rm["decode_tokens"] == sum(p.max_tokens for p in params)
    assert m["prefill_tokens"] == rm["prefill_tokens"]
    # max_tokens stops are known when the last token is launched: nothing is computed past them
    assert m["discarded_tokens"] == 0
    # pipelining: every step but the first was launched before the previous one was post-processed
    assert m["overlapped_steps"] >= m["steps"] - 2 > 10 and rm["overlapped_steps"] == 0
    # ... so when tokens are post-processed, the next step is already launched
    assert order.seen and all(launched == completed + 2 for launched, completed in order.seen[:-1])
    assert order.seen[-1][0] == order.seen[-1][1] + 1  # the last step: drained with nothing behind it


def test_sync_mode_completes_each_step_before_the_next(tiny_v3_path):
    llm = make_llm(tiny_v3_path, False)
    order = StepOrder()
    llm.engine.pm.register(order)
    gen(llm, [rand_ids(9, 1), rand_ids(14, 2)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert order.seen and all(launched == completed + 1 for launched, completed in order.seen)
    assert llm.metrics()["overlapped_steps"] == 0


def test_stop_conditions_exact(tiny_v3_path):
    """eos, stop strings, stop_token_ids and max_model_len end at the same token as the synchronous
    loop; the extra token computed in the step launched meanwhile is never emitted."""
    sync, pipe = make_llm(tiny_v3_path, False), make_llm(tiny_v3_path, True)
    prompt = "the cat sat on the mat"
    (ref,) = gen(sync, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
    stop = text[8:10]
    t_stop, t_eos = ids[10], ids[6]
    for llm in (sync, pipe):
        llm.engine.tokenizer.eos_token_ids = [*llm.engine.tokenizer.eos_token_ids, t_eos]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["never-in-output\x00", stop]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[t_stop]),
        SamplingParams(temperature=0, max_tokens=24),  # eos
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]
    # each alone, and all together with a long-running request beside them
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for batch_prompts, batch_params in [([prompt], [c]) for c in cases] + [([prompt] * 5 + [rand_ids(7, 3)],
                                                                             cases + [long])]:
        r, o = gen(sync, batch_prompts, batch_params), gen(pipe, batch_prompts, batch_params)
        for a, b in zip(r, o):
            assert_identical(a, b)
    outs = gen(pipe, [prompt] * 5, cases)
    assert outs[0].outputs[0].token_ids == ids[: next(k for k in range(1, 25) if stop in
                                                       sync.tokenizer.decode(ids[:k]))]
    assert (outs[1].outputs[0].token_ids, outs[1].outputs[0].stop_reason) == (ids[: ids.index(t_stop) + 1], t_stop)
    assert (outs[2].outputs[0].token_ids, outs[2].outputs[0].finish_reason) == (ids[: ids.index(t_eos) + 1], "stop")
    assert outs[3].outputs[0].token_ids == ids[:5] and outs[4].outputs[0].token_ids == ids[:1]
    # stops found one step late: their extra tokens were computed and dropped
    assert pipe.metrics()["discarded_tokens"] > 0

    # max_model_len: the request ends when it reaches it, in both modes
    short_sync, short_pipe = (make_llm(tiny_v3_path, a, max_model_len=20) for a in (False, True))
    p = rand_ids(13, 4)
    (a,) = gen(short_sync, [p], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=1))
    (b,) = gen(short_pipe, [p], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=1))
    assert_identical(a, b)
    assert len(b.outputs[0].token_ids) == 7 and b.outputs[0].finish_reason == "length"


# ---- aborts, preemption, prefix cache ------------------------------------------------------------

def test_abort_mid_run(tiny_v3_path):
    prompts = [rand_ids(6 + 5 * i, 300 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, logprobs=1)
    ref = gen(make_llm(tiny_v3_path, False), prompts, params)
    llm = make_llm(tiny_v3_path, True)
    eng = llm.engine
    seqs = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
    for _ in range(5):
        eng.step()
    victim = seqs[1]
    assert victim.num_pending_tokens == 1 and victim.token_ids[-1] < 0  # a token in flight
    eng.abort(victim.request_id)
    assert victim.is_finished and victim.num_pending_tokens == 0 and min(victim.token_ids) >= 0
    n_at_abort = victim.num_output_tokens
    while eng.has_unfinished():
        eng.step()
    assert eng.pipeline.inflight is None
    eng.blocks.check_no_leaks()
    out = to_output(victim, eng.tokenizer)
    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == ref[1].outputs[0].token_ids[:n_at_abort] and 0 < n_at_abort < 15
    assert len(out.outputs[0].logprobs) == n_at_abort
    for i in (0, 2, 3):  # a different batch from the reference's after the abort: logprobs within rounding
        a, b = ref[i].outputs[0], to_output(seqs[i], eng.tokenizer).outputs[0]
        assert a.token_ids == b.token_ids and b.finish_reason == "length"
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(x[t].logprob - y[t].logprob) < 1e-4
    assert eng.stats.discarded_tokens == 1  # the victim's token in flight


def test_preemption_with_a_tiny_kv_cache(tiny_v3_path):
    prompts, params = preemption_workload()
    kv = 24 * kv_bytes_per_block(tiny_v3_path, BS)
    sync, pipe = make_llm(tiny_v3_path, False, kv_cache_memory=kv), make_llm(tiny_v3_path, True, kv_cache_memory=kv)
    ref, outs = gen(sync, prompts, params), gen(pipe, prompts, params)
    assert pipe.metrics()["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == pipe.metrics()["preemptions"]
    big = gen(make_llm(tiny_v3_path, True), prompts, params)  # no preemption at all
    for r, o, b in zip(ref, outs, big):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids == b.outputs[0].token_ids
        assert o.outputs[0].finish_reason == "length"
        for x, y in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert abs(x[next(iter(x))].logprob - y[next(iter(y))].logprob) < 1e-4
        if r.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(r.prompt_token_ids)
            for i in range(1, len(r.prompt_token_ids)):
                t = r.prompt_token_ids[i]
                assert abs(o.prompt_logprobs[i][t].logprob - r.prompt_logprobs[i][t].logprob) < 1e-4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_while_its_step_is_in_flight(tiny_v3_path, prefix_caching):
    """A request preempted (as the scheduler does when KV runs out) while a token or a prompt chunk
    of it is in flight is re-admitted at once: its recompute reads the placeholder from the device,
    and prompt logprobs scored twice are recorded once."""
    prompts = [rand_ids(9, 801), rand_ids(30, 800)]
    params = [SamplingParams(temperature=0.7, seq_seed=5, max_tokens=12, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1, logprobs=0)]
    kw = dict(max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    ref = gen(make_llm(tiny_v3_path, False, **kw), prompts, params)
    llm = make_llm(tiny_v3_path, True, **kw)
    eng = llm.engine
    seqs = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    eng.step()  # the short prompt and 7 tokens of the long one
    eng.step()  # the long prompt's next 15 tokens in flight, its first 7 post-processed
    long = seqs[1]
    assert long.num_computed_tokens == 22 and len(long.prompt_logprobs) == 1 + 7
    eng.scheduler._preempt(long, SchedulerOutput())
    eng.step()  # re-admitted: 15 tokens again, prompt logprobs of 7..14 scored a second time
    assert long.num_computed_tokens == 15 and len(long.prompt_logprobs) == 1 + 22
    while long.in_prefill:
        eng.step()
    short = seqs[0]
    assert short.num_pending_tokens == 1 and short.token_ids[-1] < 0 and not short.is_finished
    eng.scheduler._preempt(short, SchedulerOutput())  # a token in flight: the recompute reads it on the device
    eng.step()
    assert short.num_computed_tokens == short.num_tokens - 1 == 9 + short.num_output_tokens
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()
    for r, seq in zip(ref, seqs):
        o = to_output(seq, eng.tokenizer)
        assert seq.metrics.num_preemptions == 1
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for x, y, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(x[t].logprob - y[t].logprob) < 1e-4
        if r.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == 30
            for i in range(1, 30):
                t = r.prompt_token_ids[i]
                assert abs(o.prompt_logprobs[i][t].logprob - r.prompt_logprobs[i][t].logprob) < 1e-4


def test_prefix_cache_hits_same_as_sync(tiny_v3_path):
    shared = rand_ids(18, 400)
    prompts = [shared + rand_ids(3 + i, 401 + i) for i in range(4)] + [shared]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0)
    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_v3_path, mode)
        first = gen(llm, prompts[:1], params)
        second = gen(llm, prompts, params)  # hits the blocks of the first run and of each other
        results[mode] = (first + second, llm)
    (ref, ref_llm), (outs, llm) = results[False], results[True]
    for r, o in zip(ref, outs):
        assert_identical(r, o)
        assert o.metrics.num_cached_tokens == r.metrics.num_cached_tokens
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 4 * 16
    assert llm.engine.blocks.stats().hits == ref_llm.engine.blocks.stats().hits
    # only real tokens are hashed: every registered block's hash is reproducible from the outputs
    assert len(llm.engine.blocks.block_of) == len(ref_llm.engine.blocks.block_of)
    assert set(llm.engine.blocks.block_of) == set(ref_llm.engine.blocks.block_of)


# ---- requests and features that force synchronous steps --------------------------------------------

def test_penalty_request_runs_synchronously(tiny_v3_path):
    prompts = [rand_ids(8, 500), rand_ids(12, 501), rand_ids(5, 502)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.2, logprobs=0),
              SamplingParams(temperature=0.8, seq_seed=7, max_tokens=14, ignore_eos=True)]
    sync, pipe = make_llm(tiny_v3_path, False), make_llm(tiny_v3_path, True)
    ref, outs = gen(sync, prompts, params), gen(pipe, prompts, params)
    for r, o in zip(ref, outs):
        assert_identical(r, o)
    m = pipe.metrics()
    # synchronous while the penalty request runs (about 6 steps), pipelined after it
    assert 0 < m["overlapped_steps"] <= m["steps"] - 6
    # the penalty changes the output (the request did see its own tokens)
    (plain,) = gen(sync, prompts[1:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert plain.outputs[0].token_ids != outs[1].outputs[0].token_ids


class NeedsSync:
    """A feature that asks for synchronous steps: for requests with ``extra['sync']``, or for every
    step while ``every_step`` is set."""

    def __init__(self) -> None:
        self.every_step = False

    @hookimpl
    def request_needs_sync(self, engine, request):
        return True if request.params.extra.get("sync") else None

    @hookimpl
    def step_needs_sync(self, engine):
        return True if self.every_step else None


def test_feature_hooks_force_synchronous_steps(tiny_v3_path):
    prompts = [rand_ids(7, 600), rand_ids(10, 601)]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    flagged = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra={"sync": True})
    ref = gen(make_llm(tiny_v3_path, False), prompts, plain)

    llm = make_llm(tiny_v3_path, True)
    feature = NeedsSync()
    llm.engine.pm.register(feature)
    for params, every_step, overlaps in ((plain, False, True), (flagged, False, False), (plain, True, False)):
        feature.every_step = every_step
        before = llm.metrics()["overlapped_steps"]
        outs = gen(llm, prompts, params)
        assert (llm.metrics()["overlapped_steps"] > before) == overlaps
        for r, o in zip(ref, outs):
            assert r.outputs[0].token_ids == o.outputs[0].token_ids


# ---- idle measurement, config --------------------------------------------------------------------

@pytest.mark.parametrize("async_on", [False, True])
def test_device_idle_metrics(tiny_v3_path, async_on):
    llm = make_llm(tiny_v3_path, async_on, measure_device_idle=True)
    gen(llm, [rand_ids(9, 700), rand_ids(20, 701)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    m = llm.metrics()
    steps = m["steps"]
    assert m["device_idle_gaps"] == steps - 1  # one chain: every step after the first
    assert m["device_busy_ms"] > 0 and 0 <= m["device_idle_share"] < 1
    assert 0 <= m["device_idle_us_mean"] <= m["device_idle_us_max"]
    # a second generate starts a new chain: the time between the calls is not counted
    gen(llm, [rand_ids(5, 702)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    m2 = llm.metrics()
    assert m2["device_idle_gaps"] == m2["steps"] - 2
    off = make_llm(tiny_v3_path, async_on).metrics()
    assert "device_idle_share" not in off


def test_async_scheduling_default_follows_the_platform(tiny_v3_path):
    llm = LLM(str(tiny_v3_path), dtype="float32", block_size=BS, kv_cache_memory=1 << 20)
    assert llm.engine.platform.supports_async_overlap() is False
    assert llm.engine.async_scheduling is False and llm.metrics()["async_scheduling"] is False


# ---- the placeholders' resolution ------------------------------------------------------------------

def test_placeholders_take_the_previous_steps_tokens_by_row(tiny_v3_path):
    """``prepare(prev_tokens=...)``: a decode row holding placeholder ``-(i + 1)`` gets ``prev_tokens[i]``. In a
    pure decode step every row is one (a gather alone: a fresh tensor, not a view of ``prev_tokens``); beside a
    prefill chunk only the decode rows change. A placeholder past ``prev_tokens`` is an error naming both."""
    import torch

    llm = make_llm(tiny_v3_path, True)
    e = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seqs = [e.add_request({"prompt_token_ids": rand_ids(5 + i, 300 + i)}, params) for i in range(3)]
    e.step()  # the prompts' step is launched: each request now ends with a placeholder
    assert all(s.num_pending_tokens == 1 and s.token_ids[-1] < 0 for s in seqs)
    prev = torch.tensor([1001, 1002, 1003])

    def expected(out):
        want = []
        for s in out.prefills + out.decodes:
            c = s.seq.num_computed_tokens
            want += [int(prev[-t - 1]) if t < 0 else t for t in s.seq.token_ids[c: c + s.num_new_tokens]]
        return want

    out = e.scheduler.schedule()
    assert not out.prefills and len(out.decodes) == 3
    batch = e.runner.prepare(out, prev_tokens=prev)
    assert batch.input_ids.tolist() == expected(out) and sorted(batch.input_ids.tolist()) == [1001, 1002, 1003]
    assert batch.input_ids.untyped_storage().data_ptr() != prev.untyped_storage().data_ptr()
    batch.input_ids[0] = -5  # the step's ids may be edited in place (speculative layouts do)
    assert prev.tolist() == [1001, 1002, 1003]

    late = e.add_request({"prompt_token_ids": rand_ids(9, 400)}, params)
    mixed = e.scheduler.schedule()
    assert [s.seq for s in mixed.prefills] == [late] and mixed.decodes
    batch = e.runner.prepare(mixed, prev_tokens=prev)
    assert batch.input_ids.tolist() == expected(mixed)
    assert batch.input_ids[: late.num_prompt_tokens].tolist() == late.token_ids[: late.num_prompt_tokens]

    with pytest.raises(RuntimeError, match=r"placeholder -3 points past the previous step's 2 sampled tokens"):
        e.runner.prepare(mixed, prev_tokens=prev[:2])
