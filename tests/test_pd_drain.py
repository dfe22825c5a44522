"""Drain with forwarding: a decode engine told to drain stops admission and, after its grace
period, hands every unfinished request off with its KV; another engine finishes them with the
tokens an undisturbed engine produces, computing one token per request (none starts over)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from test_pd_handoff import BS, PARAMS, kw, tokens, workload

from deepinfer_core import LLM
from deepinfer_core.config import ConfigError

LONG = dataclasses.replace(PARAMS, max_tokens=24)


@pytest.fixture(scope="module")
def setup(tiny_v3_path):
    prompts = workload(12)
    ref = tokens(LLM(**kw(tiny_v3_path)).generate(prompts, LONG, use_tqdm=False))
    section = {"backend": "shm", "namespace": f"drain-test-{uuid.uuid4().hex[:8]}"}
    return prompts, ref, section


def test_drain_forwards_unfinished_requests_with_their_kv(tiny_v3_path, setup):
    prompts, ref, section = setup
    d1 = LLM(kv_transfer=section, **kw(tiny_v3_path, max_num_seqs=8))
    d2 = LLM(kv_transfer=section, **kw(tiny_v3_path))
    e = d1.engine
    seqs = [e.add_request(p, LONG) for p in prompts]  # 8 run, 4 wait (max_num_seqs)
    for _ in range(6):
        e.step()
    e.start_drain(grace_s=3600)  # admission stops at once; requests keep running in the grace period
    with pytest.raises(ValueError, match="draining"):
        e.add_request(prompts[0], LONG)
    progress = [s.num_output_tokens for s in seqs]
    e.step()
    assert sum(s.num_output_tokens for s in seqs) > sum(progress)
    e.start_drain(grace_s=0)  # the grace period ends now
    done = e.step()
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in seqs)
    assert all(s.finish_reason == "forwarded" and s.kv_transfer_out for s in seqs)
    assert any(s.num_output_tokens == 0 for s in seqs) and any(s.num_output_tokens > 1 for s in seqs)
    e.blocks.check_no_leaks()
    assert not e.has_unfinished()
    m = e.metrics()
    assert m["drain_forwarded"] == len(seqs) and m["drain_forward_s"] > 0
    started = [s for s in seqs if s.num_output_tokens]
    params = [dataclasses.replace(LONG, kv_transfer_params=s.kv_transfer_out) for s in seqs]
    outs = d2.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == ref  # 0 lost, identical
    for s, o in zip(seqs, outs):  # the started ones resumed from the handed-off KV: nothing recomputed
        if s.num_output_tokens:
            assert o.metrics.num_cached_tokens_by_tier["handoff"] == s.num_tokens - 1
            assert o.metrics.num_computed_prompt_tokens == 0
    # D2 computed one token per started request, and at most the prompts of the waiting ones
    assert d2.metrics()["prefill_tokens"] <= len(started) + sum(
        len(p["prompt_token_ids"]) for p, s in zip(prompts, seqs) if not s.num_output_tokens)
    d2.engine.blocks.check_no_leaks()


def test_drain_needs_a_transport(tiny_v3_path):
    llm = LLM(**kw(tiny_v3_path))
    with pytest.raises(ConfigError, match="needs a \\[kv_transfer\\] transport"):
        llm.engine.start_drain(0)
    with pytest.raises(ConfigError, match="drain_grace_s"):
        LLM(drain_grace_s=-1.0, **kw(tiny_v3_path))


def test_n_samples_fork_the_hand_off_and_forward_one_by_one(tiny_v3_path, setup):
    """n = 3 from a prefill engine's hand-off: the decode engine receives child 0's state and forks
    the other two from its prompt blocks (no second prompt computed, no second hand-off read); a
    drain forwards each unfinished child with its own kv_transfer_params; each continued alone
    (n = 1, seed + i) gives the colocated n = 3 samples. A drain before child 0's first token (its
    siblings not yet queued) queues and forwards the siblings too instead of failing the engine."""
    _, _, section = setup
    from deepinfer_core.engine.sample_group import SampleGroup

    prompt = {"prompt_token_ids": workload(3)[2]["prompt_token_ids"] + [7, 8, 9]}
    n3 = dataclasses.replace(LONG, n=3, temperature=0.9, seed=17)
    ref = [c.token_ids for c in LLM(**kw(tiny_v3_path)).generate([prompt], n3, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in ref}) == 3  # three different samples
    p = LLM(kv_transfer=section, kv_role="prefill", **kw(tiny_v3_path))
    d1 = LLM(kv_transfer=section, **kw(tiny_v3_path))
    d2 = LLM(kv_transfer=section, **kw(tiny_v3_path))
    first = p.generate([prompt], dataclasses.replace(n3, n=1), use_tqdm=False)[0]
    assert first.kv_transfer_params is not None and first.outputs[0].token_ids == ref[0][:1]
    e = d1.engine
    group = SampleGroup(e, prompt, dataclasses.replace(n3, kv_transfer_params=first.kv_transfer_params))
    assert len(group.seqs) == 3 and group.seqs[0].num_output_tokens == 1  # siblings queued at once
    for _ in range(4):
        e.step()
    full = (len(prompt["prompt_token_ids"]) - 1) // BS * BS
    assert [s.metrics.num_cached_tokens_by_tier for s in group.seqs] == [
        {"handoff": len(prompt["prompt_token_ids"])}, {"device": full}, {"device": full}]
    assert e.handoff.counts["received"] == 1 and e.handoff.counts["recomputed"] == 0
    e.start_drain(grace_s=0)
    e.step()
    out = group.output(e.tokenizer)
    assert [c.finish_reason for c in out.outputs] == ["forwarded"] * 3
    assert len({c.kv_transfer_params["key"] for c in out.outputs}) == 3
    e.blocks.check_no_leaks()
    cont = d2.generate([prompt] * 3, [dataclasses.replace(n3, n=1, seed=17 + c.index, seq_seed=17 + c.index,
                                                          kv_transfer_params=c.kv_transfer_params)
                                      for c in out.outputs], use_tqdm=False)
    assert tokens(cont) == ref

    # a drain before child 0's first token: its siblings are queued anyway, then forwarded
    d3 = LLM(kv_transfer=section, **kw(tiny_v3_path))
    e = d3.engine
    group = SampleGroup(e, prompt, n3)
    assert len(group.seqs) == 1  # the siblings wait for child 0's prompt blocks
    e.start_drain(grace_s=0)
    e.step()
    assert group.release(e) and len(group.seqs) == 3
    e.step()
    out = group.output(e.tokenizer)
    assert [c.finish_reason for c in out.outputs] == ["forwarded"] * 3 and group.finished
    e.blocks.check_no_leaks()
    cont = d2.generate([prompt] * 3, [dataclasses.replace(n3, n=1, seed=17 + c.index, seq_seed=17 + c.index,
                                                          kv_transfer_params=c.kv_transfer_params)
                                      for c in out.outputs], use_tqdm=False)
    assert tokens(cont) == ref
