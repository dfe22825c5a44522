# ruff: noqa: F811  (pytest fixtures imported from spec_helpers are redefined as arguments)
"""DSpark under async scheduling: drafts proposed on the device (``plugins/dspark/device.py``) and
taken by the engine's async speculative path (``engine/spec_async.py``). Greedy outputs equal plain
decoding and synchronous DSpark, with a draft model and with an MTP layer, under preemption and beside
requests that force synchronous steps; a target drafting for itself is accepted as often as on the host
path (the catch-up reads the right tokens and hidden states); sampled requests are reproducible; no KV
block leaks. The device verify's distribution is checked in ``test_spec_async.py`` (chi-square)."""

from __future__ import annotations

import pytest
from spec_helpers import (  # noqa: F401
    PROMPTS,
    _cache_dir,
    _heldout_prompts,
    cheap_drafts,
    greedy,
    make,
    mtp_kv_and_teacher_forced,
    reference,
    run,
    tiny_draft,
    tiny_mtp,
    write_one_layer_draft,
)
from tiny_models import kv_bytes_per_block

from deepinfer_core import SamplingParams


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _async(path, **dspark):
    llm = make(path, dspark=dspark, async_scheduling=True)
    assert llm.engine.spec.on_device is not None, "DSpark should propose on the device with async scheduling"
    cheap_drafts(llm)
    return llm


@pytest.mark.parametrize("draft", ["self", "tiny_draft", "mtp"])
def test_async_dspark_greedy_identical_and_overlapped(tiny_v3_path, tiny_draft, tiny_mtp, reference, draft):
    if draft == "mtp":
        llm = _async(tiny_mtp, k=4)
    else:
        llm = _async(tiny_v3_path, draft=tiny_v3_path if draft == "self" else tiny_draft, k=4)
    outs = run(llm, PROMPTS, greedy(20, logprobs=0))
    assert _tokens(outs) == reference
    m = llm.metrics()
    assert m["spec_proposer_errors"] == 0 and m["spec_steps"] > 0 and m["dspark_verified"] > 0
    assert m["overlapped_steps"] >= m["spec_steps"] - 2  # speculative steps overlap the step in flight
    if draft == "self":  # the draft is the target: its catch-up must see exactly the target's tokens
        assert m["dspark_accept_rate"] > 0.95 and m["spec_accepted_per_step"] > 2
    for o in outs:
        assert all(o.outputs[0].logprobs[j][t].logprob <= 0 for j, t in enumerate(o.outputs[0].token_ids))
    llm.engine.blocks.check_no_leaks()


def test_async_dspark_accepts_as_often_as_sync(tiny_mtp, reference):
    """The same MTP drafts on the device as on the host: close accept counts (the device drafts
    greedily and cuts lengths on the device, so they need not be equal)."""
    rates = []
    for async_scheduling in (False, True):
        llm = make(tiny_mtp, dspark={"k": 4, "budget_policy": "fixed"}, async_scheduling=async_scheduling)
        assert _tokens(run(llm, PROMPTS, greedy(20))) == reference
        m = llm.metrics()
        rates.append(m["dspark_accepted"] / max(m["dspark_decode_steps"], 1))
    assert rates[1] == pytest.approx(rates[0], rel=0.35, abs=0.05), rates


def test_async_speculation_off_keeps_speculative_steps_synchronous(tiny_mtp, reference):
    """``async_speculation = false`` with async scheduling on: DSpark's speculative steps run on the
    host path (no device drafts), the dormant steps still overlap, and greedy outputs are unchanged."""
    llm = make(tiny_mtp, dspark={"k": 4, "budget_policy": "fixed"}, async_scheduling=True, async_speculation=False)
    assert llm.engine.async_scheduling and llm.engine.spec.on_device is None
    assert _tokens(run(llm, PROMPTS, greedy(20))) == reference
    m = llm.metrics()
    assert m["dspark_verified"] > 0 and m["spec_steps"] > 0
    with pytest.raises(Exception, match="async_speculation"):
        make(tiny_mtp, dspark={"k": 4}, async_scheduling=True, async_speculation="no")
    llm.engine.blocks.check_no_leaks()


@pytest.mark.parametrize("draft", ["tiny_draft", "mtp"])
def test_few_requests_speculate_on_the_host_where_the_forward_runs_inline(tiny_v3_path, tiny_draft, tiny_mtp,
                                                                         reference, draft):
    """The CPU runs the forward inline: with async scheduling, while fewer than ``host_steps_below``
    requests run, DSpark asks for synchronous steps (host draft loop and lengths), from that many on its
    steps overlap with device drafts. The requests finish at different times, so the steps switch both
    ways, and every switch keeps the output exact (a draft model's device catch-up after a host step
    re-reads the last token: the IndexError a zero-length span raised)."""
    path, opts = (tiny_mtp, {}) if draft == "mtp" else (tiny_v3_path, {"draft": tiny_draft})
    llm = make(path, dspark={"k": 4, "budget_policy": "fixed", "host_steps_below": 4, **opts},
               async_scheduling=True, max_num_seqs=8)
    assert llm.engine.spec.on_device is not None
    lens = [20 - 2 * (i % 7) for i in range(len(PROMPTS))]  # ragged: the running count falls through 4
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy(n) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(reference, lens)]
    m = llm.metrics()
    assert m["spec_proposer_errors"] == 0 and m["dspark_verified"] > 0
    # both kinds of speculative step ran: synchronous ones (each completes the one in flight) and overlapped ones
    assert 0 < m["overlapped_steps"] < m["steps"] - 2
    llm.engine.blocks.check_no_leaks()
    with pytest.raises(Exception, match="host_steps_below"):
        make(path, dspark={"host_steps_below": -1, **opts}, async_scheduling=True)


def test_a_step_that_only_prefills_counts_the_requests_it_admits(tiny_mtp):
    """With no request running yet a step only prefills, and DSpark counts it by the requests it admits.
    A wave of 8 (host_steps_below 4) takes the same steps as plain decoding from its first one: the
    synchronous prefill step that ``host_steps_below`` used to ask for left the DSpark engine one forward
    behind plain decoding's pipeline (the 1.6% that ``dspark_bench.py`` read as DSpark's cost at
    concurrency 32)."""
    def first_tokens(llm) -> tuple[int, int]:
        seqs = [llm.engine.add_request({"prompt_token_ids": p}, greedy(12)) for p in PROMPTS]
        steps = 0
        while any(s.num_output_tokens == 0 for s in seqs):
            llm.engine.step()
            steps += 1
        return steps, llm.engine.stats.overlapped_steps

    plain = make(tiny_mtp, features=False, async_scheduling=True, max_num_seqs=8)
    spec = make(tiny_mtp, dspark={"k": 3, "host_steps_below": 4}, async_scheduling=True, max_num_seqs=8)
    assert first_tokens(spec) == first_tokens(plain) == (2, 1)
    for llm in (plain, spec):
        while llm.engine.has_unfinished():
            llm.engine.step()
        llm.engine.blocks.check_no_leaks()


def test_a_request_alone_is_prefilled_on_the_host(tiny_mtp, reference):
    """Requests one at a time below ``host_steps_below``: every step runs on the host, the prefill too, so
    the MTP draft reads the prompt's hidden states and accepts exactly as often as synchronous DSpark. An
    asynchronous prefill step left the prompt out of the MTP's KV (the host path catches up only on the
    steps it runs): about a quarter fewer accepted drafts at concurrency 1 on the embedded model."""
    counts = []
    for async_scheduling in (False, True):
        llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed", "host_steps_below": 4},
                   async_scheduling=async_scheduling, max_num_seqs=1)
        assert _tokens(run(llm, PROMPTS, greedy(20))) == reference
        m = llm.metrics()
        counts.append((m["spec_verified"], m["spec_accepted"], m["overlapped_steps"]))
        llm.engine.blocks.check_no_leaks()
    assert counts[1] == counts[0] and counts[0][1] > 0, counts


def test_dormant_below_host_steps_hands_every_step_to_the_host_path(tiny_mtp):
    """Below ``host_steps_below`` (the forward runs inline, nothing overlaps) a dormant DSpark still asks
    for speculative steps, so that the host path's forecast decides every step, with each request's last
    first-draft confidence drifting back to the running mean while it does not draft. Before, dormant
    steps waited for the exploration gap: at concurrency 1 on the embedded model one unsure first draft
    kept a request from drafting for the rest of its 64 tokens (131 dormant steps in a round). From
    ``host_steps_below`` requests on, dormant steps stay plain overlapped steps until the gap."""
    llm = make(tiny_mtp, dspark={"k": 3, "host_steps_below": 8}, async_scheduling=True, max_num_seqs=16)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    seqs = [llm.engine.add_request({"prompt_token_ids": PROMPTS[3]}, greedy(40))]
    while seqs[0].num_output_tokens < 2:
        llm.engine.step()
    feat.skipped = 5
    assert feat.active(llm.engine) is True and feat.skipped == 5  # the host path counts the skipped steps
    seqs += [llm.engine.add_request({"prompt_token_ids": p}, greedy(40)) for p in PROMPTS[:8]]
    while any(s.num_output_tokens == 0 for s in seqs):
        llm.engine.step()
    assert llm.engine.load_stats()["running"] == 9
    feat.skipped = 5
    assert feat.active(llm.engine) is False and feat.skipped == 6
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.blocks.check_no_leaks()


def test_prompts_prefilled_overlapped_reach_the_host_drafts(tiny_mtp):
    """A wave of 4 under a token budget that admits about one prompt a step (``host_steps_below`` 4): the
    first step counts 4 coming requests and overlaps, the next two run below 4, on the host. The host draft
    catches up only on the steps it runs, so the overlapped step's hidden rows are kept when it is drained
    (``Proposer.step_drained``), and a host step that does not draft keeps its rows for the device path's
    catch-up: the MTP layer's KV of every prompt position then equals the entry from the target's teacher-forced
    hidden states. Without them the prompts stayed holes in the draft's KV (positions 28-30 of the last two
    prompts, before the device path read the kept rows)."""
    bs = 4
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed", "host_steps_below": 4}, async_scheduling=True,
               max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    seqs = [eng.add_request({"prompt_token_ids": PROMPTS[i]}, greedy(12)) for i in (5, 5, 5, 5)]
    overlapped = []
    while min(s.num_output_tokens for s in seqs) < 4:
        before = eng.stats.overlapped_steps
        eng.step()
        overlapped.append(eng.stats.overlapped_steps - before)
    eng.pipeline.drain()
    assert overlapped[:3] == [0, 0, 0] and feat.n["proposals"] > 0, overlapped  # an overlapped prefill, then host steps
    # every prompt: the two the overlapped step began, and the others, whose last chunks ran in a host step of 4
    # running requests (which does not draft: it keeps their rows, and the device path that takes over writes them)
    for seq in seqs:
        got, ref = mtp_kv_and_teacher_forced(eng, feat.source, seq, len(PROMPTS[5]), bs)  # the prompt's positions
        assert (got - ref).abs().max().item() < 1e-4, seq.request_id
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "control"])
def test_dormant_overlapped_steps_reach_the_mtp_kv(tiny_mtp, monkeypatch, keep):
    """DSpark on the device path goes dormant for several overlapped steps, then drafts again. At each plain
    launch the step in flight hands its hidden rows to the proposer (``Proposer.step_passed_dormant``), so the
    catch-up when drafting resumes writes the MTP KV of every position the dormant steps computed: each equals the
    entry from the target's teacher-forced hidden states. (The first dormant step, launched right after a
    speculative one, knows its positions only on the device and stays a one-step gap.) The control (the hook
    doing nothing) shows the hole: none of those positions is written."""
    bs = 4
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed"}, async_scheduling=True)
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    cheap_drafts(llm)
    dormant = iter([True] * 4 + [False] * 7)  # then True: drafting resumes
    monkeypatch.setattr(feat, "active", lambda engine: next(dormant, True))
    passed = []  # positions of the dormant steps handed over
    hook = feat.step_passed_dormant

    def spy(engine, batch):
        if batch.first_dev is None:  # (right after a speculative step the host knows only bounds: not kept)
            passed.extend(p for s, c0 in zip(batch.scheduled, batch.computed_before)
                          for p in range(c0, c0 + s.num_new_tokens))
        if keep:
            hook(engine, batch)

    monkeypatch.setattr(feat, "step_passed_dormant", spy)
    seq = eng.add_request({"prompt_token_ids": PROMPTS[5]}, greedy(60))
    for _ in range(4 + 7 + 3):  # drafting, dormant, drafting again (its catch-up writes the draft KV)
        eng.step()
    eng.pipeline.drain()
    m = llm.metrics()
    assert len(passed) >= 5 and m["spec_dormant_steps"] >= 7 and feat.n["proposals"] > 0, (passed, m)
    assert m["spec_proposer_errors"] == 0 and not seq.is_finished
    got, ref = mtp_kv_and_teacher_forced(eng, feat.source, seq, max(passed) + 1, bs)
    wrong = [p for p in passed if (got[p] - ref[p]).abs().max().item() > 1e-4]
    if keep:
        assert wrong == [], (wrong, passed)
    else:
        assert wrong == passed, (wrong, passed)  # none of them: the hole this hook closes
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()


@pytest.mark.parametrize("hostile", ["hook_raises", "abort_while_dormant"])
def test_dormant_keeping_survives_a_raising_hook_and_an_abort(tiny_mtp, monkeypatch, hostile):
    """Dormant stretches with the rows kept, hostile: the proposer's ``step_passed_dormant`` raises (logged and
    counted as a proposer error, the step goes on), or a request is aborted while its rows are kept. The others
    finish with plain decoding's greedy output, no KV block leaks, and the engine takes the next request."""
    plain = make(tiny_mtp, features=False)
    want = _tokens(run(plain, [PROMPTS[5], PROMPTS[6]], greedy(40)))
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed"}, async_scheduling=True)
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    cheap_drafts(llm)
    cycle = iter(([True] * 3 + [False] * 9) * 10)
    monkeypatch.setattr(feat, "active", lambda engine: next(cycle, True))
    if hostile == "hook_raises":
        def broken(engine, batch):
            raise ValueError("hostile hook")
        monkeypatch.setattr(feat, "step_passed_dormant", broken)
    seqs = [eng.add_request({"prompt_token_ids": p}, greedy(40)) for p in (PROMPTS[5], PROMPTS[6], PROMPTS[5])]
    for _ in range(8):
        eng.step()
    if hostile == "abort_while_dormant":
        assert seqs[1].feature_state["dspark"].kept_rows > 0  # it holds kept rows when aborted
        eng.abort(seqs[1].request_id)
    while eng.has_unfinished():
        eng.step()
    m = llm.metrics()
    assert m["spec_dormant_steps"] > 0 and feat.n["proposals"] > 0
    assert (m["spec_proposer_errors"] > 0) == (hostile == "hook_raises")
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [want[0], want[0]]
    if hostile == "abort_while_dormant":
        assert seqs[1].finish_reason == "abort"
    else:
        assert seqs[1].output_token_ids == want[1]
    eng.blocks.check_no_leaks()
    assert _tokens(run(llm, [PROMPTS[6]], greedy(40))) == [want[1]]


def test_dormant_keeping_holds_the_latest_positions_only():
    """``Drafter._keep_latest`` (dormant steps): contiguous rows chain; past the cap the oldest kept positions are
    given up (the draft KV's ``done`` moves past them, so the kept span still starts where it ends); a gap gives
    up what was kept; rows alone past the cap are not kept; positions the draft KV already covers are not."""
    import torch

    from plugins.dspark.drafter import Drafter
    from plugins.dspark.state import _State

    st = _State(0)
    st.done = 10

    def rows(n):
        return torch.zeros(n, 2)

    Drafter._keep_latest(st, 10, rows(3), 4, copy=False)
    Drafter._keep_latest(st, 13, rows(1), 4, copy=False)
    assert (st.done, st.kept_rows) == (10, 4)
    Drafter._keep_latest(st, 14, rows(2), 4, copy=False)  # the first 3 positions go
    assert (st.done, st.kept_rows, [t.shape[0] for t in st.kept_hidden]) == (13, 3, [1, 2])
    Drafter._keep_latest(st, 20, rows(1), 4, copy=False)  # a gap: restart at 20
    assert (st.done, st.kept_rows) == (20, 1)
    Drafter._keep_latest(st, 21, rows(5), 4, copy=False)  # alone past the cap
    assert (st.done, st.kept_rows, st.kept_hidden) == (26, 0, [])
    Drafter._keep_latest(st, 24, rows(1), 4, copy=False)  # already covered
    assert (st.done, st.kept_rows) == (26, 0)


@pytest.mark.parametrize("max_kept", [512, 8])
def test_a_drained_step_survives_aborts_and_prompts_past_the_keep_limit(tiny_mtp, monkeypatch, max_kept):
    """The same wave, hostile: one request is aborted after the overlapped step (its drained rows are
    skipped), and with ``MAX_KEPT`` 8 the prompts are longer than what a request may keep (nothing is kept,
    the draft KV keeps its gap). The other requests finish with plain decoding's greedy output, no proposer
    error, no KV block leaked, and the engine takes the next request."""
    from plugins.dspark import drafter

    monkeypatch.setattr(drafter, "MAX_KEPT", max_kept)
    plain = make(tiny_mtp, features=False, max_num_seqs=4, max_num_batched_tokens=32)
    want = _tokens(run(plain, [PROMPTS[5], PROMPTS[6]], greedy(12)))
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed", "host_steps_below": 4}, async_scheduling=True,
               max_num_seqs=4, max_num_batched_tokens=32)
    eng = llm.engine
    seqs = [eng.add_request({"prompt_token_ids": PROMPTS[i]}, greedy(12)) for i in (5, 6, 5, 6)]
    eng.step()  # overlapped: the first prompt and a chunk of the second
    eng.abort(seqs[1].request_id)
    while eng.has_unfinished():
        eng.step()
    assert seqs[1].finish_reason == "abort"
    assert [s.output_token_ids for s in seqs[::2]] == [want[0], want[0]]
    assert seqs[3].output_token_ids == want[1]
    assert llm.metrics()["spec_proposer_errors"] == 0
    eng.blocks.check_no_leaks()
    assert _tokens(run(llm, [PROMPTS[6]], greedy(12))) == [want[1]]


@pytest.mark.parametrize("bad", [-1, True, 2.5, float("nan"), float("inf"), "8", None])
def test_host_steps_below_rejects_what_is_not_a_count(bad):
    """``host_steps_below`` takes an int >= 0: negatives, bools, floats (NaN, inf), strings and None are
    refused with an error that names the key, before any engine is built."""
    from deepinfer_core.config import ConfigError
    from plugins.dspark.feature import DSpark

    with pytest.raises(ConfigError, match="host_steps_below"):
        DSpark({"host_steps_below": bad})
    assert DSpark({"host_steps_below": 10**9}).opts["host_steps_below"] == 10**9  # huge: every step on the host


@pytest.mark.parametrize("bad", ["yes", 1, None, float("nan")])
def test_async_speculation_takes_a_bool(tiny_v3_path, bad):
    from deepinfer_core.config import ConfigError

    with pytest.raises(ConfigError, match="async_speculation"):
        make(tiny_v3_path, features=False, async_scheduling=True, async_speculation=bad)


def test_host_steps_draft_only_below_their_batch_size(tiny_mtp, reference):
    """A wave of 8 requests arrives at once: with 8 requests running the device path owns the steps, so the
    host path does not draft for them (the next step would verify the whole wave's drafts); it drafts again
    once fewer than 4 requests run."""
    llm = make(tiny_mtp, dspark={"k": 3, "budget_policy": "fixed", "host_steps_below": 4}, async_scheduling=True,
               max_num_seqs=8)
    feat = next(f for f in llm.engine.features if f.name == "dspark")
    rows, loop = [], feat._draft_loop
    feat._draft_loop = lambda r, states, *a: (rows.append(len(states)), loop(r, states, *a))
    lens = [20 - 2 * (i % 7) for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy(n) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(reference, lens)]
    assert rows and max(rows) < 4, rows  # the host drafted only for the tail
    assert llm.metrics()["spec_proposer_errors"] == 0
    llm.engine.blocks.check_no_leaks()


def test_async_dspark_under_preemption(tiny_v3_path, reference):
    llm = make(tiny_v3_path, dspark={"draft": tiny_v3_path, "k": 4, "budget_policy": "fixed"}, async_scheduling=True,
               kv_cache_memory=24 * 2 * kv_bytes_per_block(tiny_v3_path, 4))
    outs = run(llm, PROMPTS, greedy(20))
    m = llm.metrics()
    assert m["preemptions"] > 0 and m["dspark_accepted"] > 0 and m["overlapped_steps"] > 0
    assert _tokens(outs) == reference
    llm.engine.blocks.check_no_leaks()


def test_async_dspark_beside_synchronous_requests(tiny_v3_path):
    """A request with penalties makes the steps synchronous while it runs (host-drafted DSpark), then
    they overlap (device-drafted): both paths share each request's draft state, outputs equal plain
    decoding."""
    params = [greedy(16) for _ in PROMPTS]
    params[3] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)
    plain = make(tiny_v3_path, features=False)
    ref = _tokens(run(plain, PROMPTS, params))
    llm = _async(tiny_v3_path, draft=tiny_v3_path, k=3)
    llm.generate([{"prompt_token_ids": PROMPTS[3]}], params[3], use_tqdm=False)  # synchronous steps first
    outs = run(llm, PROMPTS, params)
    assert _tokens(outs) == ref
    m = llm.metrics()
    assert m["overlapped_steps"] > 0 and m["dspark_accept_rate"] > 0.9
    llm.engine.blocks.check_no_leaks()


def test_async_dspark_sampled_reproducible(tiny_v3_path, tiny_draft):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seq_seed=10 + i, ignore_eos=True,
                             logprobs=1) for i in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = _async(tiny_v3_path, draft=tiny_draft, k=3, budget_policy="fixed")
        runs.append(_tokens(run(llm, PROMPTS, params)))
        assert llm.metrics()["dspark_verified"] > 0
        llm.engine.blocks.check_no_leaks()
    assert runs[0] == runs[1]
    assert all(len(t) == 16 for t in runs[0])


@pytest.mark.parametrize("draft", ["tiny_draft", "mtp"])
def test_device_drafting_reads_nothing_back_from_the_device(tiny_v3_path, tiny_draft, tiny_mtp, monkeypatch, draft):
    """DSpark's device proposal (catch-up, draft steps, confidences) never reads a tensor's values on
    the host: every ``tolist``/``item``/``bool``/``int``/``float`` of a tensor raises inside it (but
    in the CPU reference kernels, which stand in for the device's)."""
    import sys

    import torch

    from plugins.dspark.device import DeviceDrafter

    inside = [0]

    def guarded(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **kw):  # (the CPU reference kernels may: the device kernels do not)
            if inside[0] and "/kernels_cpu/" not in sys._getframe(1).f_code.co_filename:
                raise AssertionError(f"Tensor.{name} read a device value while DSpark drafted on the device")
            return orig(self, *a, **kw)
        return read

    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    orig = DeviceDrafter.propose_on_device

    def wrapped(self, *a, **kw):
        inside[0] += 1
        try:
            return orig(self, *a, **kw)
        finally:
            inside[0] -= 1
    monkeypatch.setattr(DeviceDrafter, "propose_on_device", wrapped)
    llm = _async(tiny_mtp, k=3) if draft == "mtp" else _async(tiny_v3_path, draft=tiny_draft, k=3)
    run(llm, PROMPTS, greedy(12))
    m = llm.metrics()
    assert m["spec_proposer_errors"] == 0 and m["dspark_proposals"] > 0 and m["overlapped_steps"] > 0


def test_dp_ep_2_with_async_dspark_equals_one_rank_without(tmp_path_factory, tmp_path):
    """dp = ep = 2, async scheduling on: every rank drafts on its device with its own (rank-local)
    draft, the target's verify forwards meet in the MoE all-to-alls (real gloo processes); greedy
    outputs and logprobs equal dp = ep = 1 without DSpark; both ranks overlapped verified steps."""
    from pathlib import Path

    from parallel_helpers import assert_same, ep_checkpoint, make_llm, workload

    ckpt = Path(ep_checkpoint(tmp_path_factory.getbasetemp()))
    draft = tmp_path / "ep_draft"
    write_one_layer_draft(ckpt, draft)  # layer 0 is dense
    ps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0) for _ in range(6)]
    prompts = workload(6)
    ref_llm = make_llm(ckpt)
    ref = ref_llm.generate(prompts, ps, use_tqdm=False)
    ref_llm.shutdown()
    llm = make_llm(ckpt, dp=2, ep=2, features=["dspark"], async_scheduling=True,
                   dspark={"draft": str(draft), "k": 3, "budget_policy": "fixed", "host_steps_below": 0})
    try:
        outs = llm.generate(prompts, ps, use_tqdm=False)
        assert_same(outs, ref)
        m = llm.metrics()
        assert all(r["spec_verified"] > 0 and r["overlapped_steps"] > 0 for r in m["ranks"]), m["ranks"]
    finally:
        llm.shutdown()


def test_shipped_mtp_on_the_device_accepts_like_the_host_path_under_a_verify_budget():
    """The embedded model's shipped MTP layer (a trained draft) with a verify budget below the draft
    slots, so the engine lays the rows out anew on the device and the next catch-up reads the hidden
    states at their new rows (``StepHidden``): greedy output equals plain decoding and the accepted
    drafts per step come close to the host path's under the same budget."""
    from deepinfer_core import LLM

    kw = dict(max_num_seqs=4, enable_prefix_caching=False)
    plain = LLM(async_scheduling=True, **kw)
    prompts = _heldout_prompts(plain.tokenizer, 4)
    ref = _tokens(run(plain, prompts, greedy(24)))
    per_step = []
    for async_scheduling in (False, True):
        llm = LLM(features=["dspark"], dspark={"k": 4, "budget_policy": "fixed", "verify_budget": 6,
                                                "host_steps_below": 0}, async_scheduling=async_scheduling, **kw)
        assert _tokens(run(llm, prompts, greedy(24))) == ref
        m = llm.metrics()
        if async_scheduling:
            assert m["spec_verify_budget"] < m["spec_draft_slots"] and m["overlapped_steps"] > 0
        per_step.append(m["dspark_accepted"] / max(m["dspark_decode_steps"], 1))
        llm.engine.blocks.check_no_leaks()
    assert per_step[0] > 0.3 and per_step[1] == pytest.approx(per_step[0], rel=0.3), per_step


def test_mtp_cache_on_the_device_matches_teacher_forced(tiny_mtp):
    """MTP drafting on the device with a verify budget below the slots (rows laid out anew on the
    device, so each catch-up must find the hidden states at their new rows and the positions the
    device shifted back): the MTP layer's KV of every position caught up on equals the entry computed
    from the target's teacher-forced hidden states."""
    k, bs = 3, 4
    llm = make(tiny_mtp, dspark={"k": k, "budget_policy": "fixed", "verify_budget": 5}, async_scheduling=True,
               max_num_seqs=4)
    eng = llm.engine
    feat = next(f for f in eng.features if f.name == "dspark")
    seqs = [eng.add_request({"prompt_token_ids": PROMPTS[i]}, greedy(40)) for i in (3, 4, 5, 6)]
    while min(s.num_output_tokens for s in seqs) < 20:
        eng.step()
    eng.pipeline.drain()  # every token on the host
    m = llm.metrics()
    assert m["spec_verify_budget"] < m["spec_draft_slots"] and m["overlapped_steps"] > 10
    for seq in seqs:
        n = len(seq.token_ids) - k - 2  # positions surely caught up on (the last catch-up reached its true length - 2)
        got, ref = mtp_kv_and_teacher_forced(eng, feat.source, seq, n, bs)
        assert (got - ref).abs().max().item() < 1e-4, seq.request_id
    while eng.has_unfinished():
        eng.step()
    eng.blocks.check_no_leaks()


def test_async_dspark_budget_policy_verifies_its_share(tiny_v3_path, reference):
    """The "budget" policy on the device: every step drafts, the host fixes the verify budget at
    ``verify_share`` of the offered slots and the draft_lengths op picks the batch's best drafts
    within it; greedy output equals plain decoding."""
    llm = _async(tiny_v3_path, draft=tiny_v3_path, k=4, budget_policy="budget", verify_share=0.5)
    assert _tokens(run(llm, PROMPTS, greedy(20))) == reference
    m = llm.metrics()
    assert m["spec_proposer_errors"] == 0 and m["overlapped_steps"] > 0 and m["dspark_accept_rate"] > 0.9
    assert m["spec_verify_budget"] <= 0.5 * m["spec_draft_slots"] + m["spec_steps"]  # rounding per step
    assert m["dspark_verified"] <= m["spec_verify_budget"]
    llm.engine.blocks.check_no_leaks()
