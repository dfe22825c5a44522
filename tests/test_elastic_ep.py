"""Elastic EP (``elastic_ep = true``): a SIGKILLed rank of a dp = ep = 4 group is dropped, the survivors
re-form the group, EPLB re-places the experts over them (reading the lost ones from the checkpoint)
and every unfinished request finishes with the greedy tokens of an undisturbed run; when too few
ranks are left to hold every expert, the engine fails with an error saying so."""

from __future__ import annotations

import os
import signal
import time

import pytest
from parallel_helpers import ep_checkpoint, make_llm, rand_ids, wait_gone

from deepinfer_core import SamplingParams
from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.parallel import WorkerFailure
from deepinfer_core.parallel.elastic import capacity_error, check_elastic
from deepinfer_core.parallel.expert_parallel import transfer_plan

SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
# a seeded sampled request: its tokens depend on (seed, position) only, so they survive re-routing too
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seq_seed=11, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return ep_checkpoint(tmp_path_factory.getbasetemp())


def prompts(n: int, seed: int) -> list[dict]:
    return [{"prompt_token_ids": rand_ids(6 + 2 * i, seed + i)} for i in range(n)]


def run_to_end(eng, limit_s: float = 60.0) -> None:
    t0 = time.monotonic()
    while eng.has_unfinished():
        eng.step()
        assert time.monotonic() - t0 < limit_s, "the driver hangs instead of re-forming or failing"


def kill_rank_mid_generate(eng, rank: int, seqs, steps: int = 3, sig=signal.SIGKILL) -> None:
    for _ in range(steps):
        eng.step()
    assert any(s.output_token_ids for s in seqs) and not any(s.is_finished for s in seqs)
    os.kill(eng.worker_pids()[rank], sig)


def test_transfer_plan_loads_experts_no_survivor_holds():
    # 2 survivors x 3 slots; the old placement over them lost expert 2 (-1: the dead rank's slot)
    old = [0, 1, 4, 3, 5, -1]
    new = [0, 1, 2, 3, 4, 5]
    plan = transfer_plan(old, new, 2, missing_ok=True)
    assert (-1, -1, 0, 2) in plan  # expert 2: read from the checkpoint on rank 0
    assert (0, 2, 1, 1) in plan  # expert 4 comes over from rank 0
    with pytest.raises(ValueError, match="logical expert 2 has no replica"):
        transfer_plan(old, new, 2)


def test_capacity_and_torchrun_errors():
    assert capacity_error(3, 6, 16) is None
    msg = capacity_error(3, 5, 16)
    assert "3 surviving rank(s) x 5 expert slots = 15 < the model's 16 routed experts" in msg
    assert "needs 6 slots" in msg and "redundant_experts_per_rank" in msg
    with pytest.raises(ConfigError, match="elastic_ep .* torchrun"):
        check_elastic(EngineConfig(elastic_ep=True, dp=2, ep=2), torchrun=True)


def test_rank_loss_reforms_the_group_and_no_request_is_lost(ckpt):
    """4 ranks, 4 redundant slots each (8 slots: 2 ranks can hold the 16 experts). SIGKILL a rank
    holding requests (-> 3 ranks), then SIGSTOP an idle one (hung: found by worker_timeout_s and the
    probe, then killed; -> 2 ranks), then SIGKILL one more (1 rank cannot hold 16 experts: a clear
    error)."""
    ref_llm = make_llm(ckpt)
    first, second = prompts(8, 100), prompts(1, 300)
    sps = [SP, SP, SP, SAMPLED] + [SP] * 5
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(first + second, sps, use_tqdm=False)]
    ref_llm.shutdown()

    llm = make_llm(ckpt, dp=4, ep=4, features=["eplb"], elastic_ep=True, worker_timeout_s=5.0,
                   eplb={"redundant_experts_per_rank": 4, "rebalance_every": 0})
    eng = llm.engine
    pids = eng.worker_pids()
    try:
        # 1. rank 0 (which also hosted the group's rendezvous store) holds 2 of the 6 running requests;
        #    2 more arrive just before it dies (not sent yet)
        seqs = [eng.add_request(p, sp) for p, sp in zip(first[:6], sps)]
        kill_rank_mid_generate(eng, 0, seqs)
        seqs += [eng.add_request(p, SP) for p in first[6:]]
        on_dead = [rid for rid, r in eng._owner.items() if r == 0]  # with the 2 new ones sent to rank 0
        kept = [sum(r == old for r in eng._owner.values()) for old in (1, 2, 3)]
        run_to_end(eng)
        assert [s.finish_reason for s in seqs] == ["length"] * 8, [s.error for s in seqs]
        assert [s.output_token_ids for s in seqs] == ref[:8]
        assert all(len(s.output_logprobs) == 16 for s in seqs)
        m = llm.metrics()
        (rf,) = m["elastic_reforms"]
        assert rf["lost_ranks"] == [0] and rf["old_ranks"] == [1, 2, 3] and rf["world_size"] == 3
        assert rf["requests_rerouted"] == len(on_dead) and rf["requests_kept"] == kept  # survivors kept theirs
        # rank 0 held experts 0-7 (0-3 and replicas of 4-7); ranks 1 and 3 hold them too: nothing to read
        assert rf["experts_loaded"] == 0
        assert len(m["ranks"]) == 3 and m["ep"] == m["dp"] == 3
        assert m["eplb_slots_per_rank"] == 8 and m["eplb_rebalances"] == 1

        # 2. serving continues; an idle rank hangs (the one request is on rank 0)
        (seq,) = [eng.add_request(p, SP) for p in second]
        hung = eng.worker_pids()[2]
        kill_rank_mid_generate(eng, 2, [seq], sig=signal.SIGSTOP)
        run_to_end(eng)
        assert wait_gone([hung]) == []
        assert seq.finish_reason == "length" and seq.output_token_ids == ref[8]
        rf = llm.metrics()["elastic_reforms"][-1]
        assert rf["lost_ranks"] == [2] and rf["old_ranks"] == [0, 1] and rf["world_size"] == 2
        assert rf["experts_loaded"] > 0  # the two survivors lacked some experts: read from the checkpoint

        # 3. one more loss: 1 rank x 8 slots cannot hold 16 experts
        seqs = [eng.add_request(p, SP) for p in first[:2]]
        kill_rank_mid_generate(eng, 1, seqs)
        run_to_end(eng)
        for s in seqs:
            assert s.finish_reason == "error" and isinstance(s.error, WorkerFailure)
            assert "1 surviving rank(s) x 8 expert slots = 8 < the model's 16 routed experts" in str(s.error)
        with pytest.raises(WorkerFailure, match="cannot re-form"):
            eng.add_request(first[0], SP)
        assert wait_gone(pids) == []
    finally:
        llm.shutdown()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("async_scheduling", [True])
def test_survivors_keep_their_requests_and_kv(ckpt, async_scheduling):
    """Kill one of 4 ranks once every request decodes: only its requests are recomputed (on their new
    owners, from prompt + emitted tokens); the survivors' requests continue from their KV (with
    async scheduling, less the step that was in flight). Counted: the prefill tokens each survivor
    computes after the re-form are exactly those of the requests re-routed to it."""
    reqs = prompts(8, 500)
    ref_llm = make_llm(ckpt)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(reqs, SP, use_tqdm=False)]
    ref_llm.shutdown()
    llm = make_llm(ckpt, dp=4, ep=4, features=["eplb"], elastic_ep=True, async_scheduling=async_scheduling,
                   eplb={"redundant_experts_per_rank": 4, "rebalance_every": 0})
    eng = llm.engine
    try:
        seqs = [eng.add_request(p, SP) for p in reqs]
        while not all(s.output_token_ids for s in seqs):
            eng.step()
        eng.step()
        owner = {s.request_id: eng._owner[s.request_id] for s in seqs}
        emitted = {s.request_id: len(s.output_token_ids) for s in seqs}
        os.kill(eng.worker_pids()[1], signal.SIGKILL)
        eng.step()  # the step the death breaks off: the group re-forms
        rf = llm.engine.reforms[0]
        moved = {rid: eng._owner[rid] for rid, r in owner.items() if r == 1}
        run_to_end(eng)
        assert [s.finish_reason for s in seqs] == ["length"] * 8
        assert [s.output_token_ids for s in seqs] == ref
        assert rf["lost_ranks"] == [1] and rf["requests_rerouted"] == len(moved) == 2
        assert rf["requests_kept"] == [2, 2, 2]
        m = llm.metrics()
        after = [r["prefill_tokens"] - before for r, before in zip(m["ranks"], rf["prefill_tokens_at_reform"])]
        by_id = {s.request_id: s for s in seqs}
        want = [sum(by_id[rid].num_prompt_tokens + emitted[rid] for rid, r in moved.items() if r == i)
                for i in range(3)]
        assert after == want and sum(want) > 0  # a survivor recomputing its own requests would add theirs
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
