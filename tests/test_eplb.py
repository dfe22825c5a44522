"""The ``eplb`` feature: the placement algorithm (pure functions), its configuration, and expert
weights moving between live ranks with outputs unchanged."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch
from parallel_helpers import BS, assert_same, children_of, ep_checkpoint, make_llm, params, wait_gone, workload
from tiny_models import kv_bytes_per_block

from deepinfer_core.config import ConfigError
from deepinfer_core.parallel.expert_parallel import transfer_plan
from plugins.eplb.algorithm import (
    balanced_packing,
    contiguous_placement,
    gpu_loads,
    initial_placement,
    load_trace,
    maps_from_phys_to_log,
    moe_lb,
    moe_lb_overall,
    pick_replicas,
    rebalance_experts,
    replicate_experts,
    save_trace,
    stabilize_placement,
    use_hierarchical,
)
from plugins.eplb.feature import EPLB
from plugins.eplb.synthetic import expected_loads, routing_trace, zipf_popularity


def zipf_loads(E: int, layers: int = 3, s: float = 1.0, tokens: int = 10_000, k: int = 8, seed: int = 0):
    return np.stack([expected_loads(zipf_popularity(E, s, seed + i), tokens, k) for i in range(layers)])


# ---- the algorithm -------------------------------------------------------------------------------

def test_replication_gives_each_extra_slot_to_the_largest_load_per_replica():
    slot_expert, counts = replicate_experts([10.0, 1.0, 5.0, 1.0], 7)
    # 10/1 -> e0 (2); 5/1 vs 10/2: tie, lowest id -> e0 (3); 5/1 -> e2 (2)
    assert counts.tolist() == [3, 1, 2, 1]
    assert slot_expert.tolist() == [0, 0, 0, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="cannot hold"):
        replicate_experts([1.0, 2.0, 3.0], 2)


def test_balanced_packing_heaviest_first_into_the_lightest_pack_with_room():
    pack, pos = balanced_packing([9, 8, 7, 1, 1, 1], 3)
    # 9->p0, 8->p1, 7->p2, then the 1s go to the lightest packs: p2, p1, p0
    assert pack.tolist() == [0, 1, 2, 2, 1, 0]
    assert pos.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="equal packs"):
        balanced_packing([1, 2, 3], 2)


@pytest.mark.parametrize("E,W,R,groups,nodes", [
    (16, 2, 1, 4, 1), (16, 4, 2, 4, 2), (64, 8, 1, 8, 2), (64, 8, 3, 8, 1), (256, 64, 1, 8, 8),
    (256, 128, 1, 8, 16), (32, 8, 0, 4, 1), (24, 6, 1, 4, 3),
])
def test_placement_invariants(E, W, R, groups, nodes):
    loads = zipf_loads(E, layers=2, seed=E + W)
    S = W * (E // W + R)
    p = rebalance_experts(loads, S, groups, nodes, W)
    assert p.phys_to_log.shape == (2, S) and p.replica_counts.shape == (2, E)
    for i in range(2):
        p2l = p.phys_to_log[i]
        assert p2l.min() >= 0 and p2l.max() < E
        assert (p.replica_counts[i] >= 1).all(), "every logical expert keeps a replica"
        assert p.replica_counts[i].sum() == S, "slot counts are exact"
        assert np.array_equal(np.bincount(p2l, minlength=E), p.replica_counts[i])
        assert len(p2l.reshape(W, -1)[0]) == S // W  # the same number of slots on every rank
        for e in range(E):
            slots = p.log_to_phys[i, e]
            real = slots[slots >= 0]
            assert len(real) == p.replica_counts[i, e] and (p2l[real] == e).all()
            assert (slots[len(real):] == -1).all()
    if R == 0:  # no redundancy: a permutation
        assert (p.replica_counts == 1).all()


def test_hierarchical_packs_whole_groups_onto_nodes():
    E, W, groups, nodes = 64, 8, 8, 2
    loads = zipf_loads(E, layers=1)
    p = rebalance_experts(loads, W * 9, groups, nodes, W)
    assert p.policy == "hierarchical" and use_hierarchical(E, groups, nodes, W)
    per_node = p.phys_to_log[0].reshape(nodes, -1)
    group_of = lambda e: e // (E // groups)  # noqa: E731
    node_groups = [{group_of(e) for e in row} for row in per_node]
    assert node_groups[0].isdisjoint(node_groups[1]) and all(len(g) == groups // nodes for g in node_groups)
    # groups that do not divide among the nodes: the global policy
    assert rebalance_experts(loads, W * 9, groups, 3, W).policy == "global"
    assert not use_hierarchical(E, 6, 4, W)


@pytest.mark.parametrize("E,W", [(64, 8), (256, 64), (256, 128)])
def test_loads_balance_on_zipf_traces(E, W):
    loads = zipf_loads(E, layers=4, seed=3)
    before = moe_lb_overall(gpu_loads(loads, contiguous_placement(E, W, 4).phys_to_log, W))
    p = rebalance_experts(loads, W * (E // W + 1), 8, 1, W)
    after = moe_lb_overall(gpu_loads(loads, p.phys_to_log, W))
    assert before >= 1.5
    assert after <= 1.10, (before, after)
    assert all(moe_lb(row) <= 1.15 for row in gpu_loads(loads, p.phys_to_log, W))


def test_replay_with_per_token_replica_choice_balances():
    """The route hook's replica choice on sampled routing (64 experts, ep 8, one redundant per rank)."""
    E, W, K = 64, 8, 8
    steps = list(routing_trace(12, 1, E, 128, W, K, s=1.0, seed=1))
    counts = sum(np.bincount(ids.reshape(-1), minlength=E) for step in steps[:6] for ids in step[0])
    p = rebalance_experts(counts, W * 9, 8, 1, W)
    l2p, cnt = p.log_to_phys[0], p.replica_counts[0]
    none, eplb = np.zeros(W), np.zeros(W)
    for step in steps[6:]:
        for r, ids in enumerate(step[0]):
            none += np.bincount(ids.reshape(-1) // (E // W), minlength=W)
            eplb += np.bincount(pick_replicas(ids, l2p, cnt, offset=r).reshape(-1) // 9, minlength=W)
    assert moe_lb(none) > 1.3 and moe_lb(eplb) <= 1.10, (moe_lb(none), moe_lb(eplb))


def test_pick_replicas_is_deterministic_and_uses_every_replica():
    p2l = np.array([0, 1, 2, 0, 3, 0, 1, 3])
    l2p, cnt = maps_from_phys_to_log(p2l, 4)
    ids = np.array([[0, 1], [0, 2], [0, 3], [0, 1]])
    a = pick_replicas(ids, l2p, cnt, offset=1)
    assert (p2l[a] == ids).all()
    assert sorted(a[:, 0].tolist()) == [0, 3, 5, 5] or set(a[:3, 0].tolist()) == {0, 3, 5}
    b = pick_replicas(torch.tensor(ids), torch.tensor(l2p), torch.tensor(cnt), offset=1)
    assert b.tolist() == a.tolist()


def test_initial_placement_moves_only_the_redundant_slots():
    E, W, R = 16, 4, 2
    p = initial_placement(E, W, R, num_layers=2)
    assert p.phys_to_log.shape == (2, W * (E // W + R)) and (p.replica_counts >= 1).all()
    assert p.replica_counts.sum(1).tolist() == [W * (E // W + R)] * 2
    plan = transfer_plan(list(range(E)), p.phys_to_log[0].tolist(), W)
    assert len(plan) == W * R and all(s != d for s, _, d, _ in plan)


def test_stabilize_keeps_resident_experts_in_their_slots():
    old = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    new = np.array([3, 0, 9, 1, 7, 5, 6, 0, 4, 2])  # 2 ranks x 5 slots (experts 8, 9 exist elsewhere)
    out = stabilize_placement(old, new, 2)
    for g in range(2):
        assert Counter(out.reshape(2, -1)[g].tolist()) == Counter(new.reshape(2, -1)[g].tolist())
    assert out.reshape(2, -1)[0, :2].tolist() == [0, 1] and out.reshape(2, -1)[0, 3] == 3
    assert out.reshape(2, -1)[1, :3].tolist() == [4, 5, 6]


def apply_plan(old: list[int], new: list[int], W: int) -> list:
    """Slot contents after executing transfer_plan(old, new) (slots not in the plan keep their expert)."""
    o_spr, n_spr = len(old) // W, len(new) // W
    held = {(p // o_spr, p % o_spr): e for p, e in enumerate(old)}
    result = {(d, j): held.get((d, j)) for d in range(W) for j in range(n_spr)}
    for s, sj, d, dj in transfer_plan(old, new, W):
        result[(d, dj)] = held[(s, sj)]
    return [result[(p // n_spr, p % n_spr)] for p in range(len(new))]


def test_transfer_plan_turns_the_old_placement_into_the_new_one():
    rng = np.random.default_rng(0)
    for W, E, R in ((2, 8, 1), (4, 16, 2), (8, 64, 1)):
        old = list(range(E))
        new = rebalance_experts(zipf_loads(E, 1, seed=W)[0], W * (E // W + R), 1, 1, W).phys_to_log[0]
        new = stabilize_placement(old, new, W).tolist()
        assert apply_plan(old, new, W) == new
        # between two replicated placements; only slots whose expert changes are in the plan
        newer = rebalance_experts(rng.random(E), len(new), 1, 1, W).phys_to_log[0]
        newer = stabilize_placement(new, newer, W).tolist()
        assert apply_plan(new, newer, W) == newer
        assert len(transfer_plan(new, newer, W)) == sum(a != b for a, b in zip(new, newer))


def test_trace_roundtrip_and_errors(tmp_path):
    loads = np.arange(32).reshape(2, 16)
    save_trace(tmp_path / "t.json", loads, [1, 2], steps=5)
    got, layers = load_trace(tmp_path / "t.json")
    assert layers == [1, 2] and np.array_equal(got, loads)
    per_step = {"format": "deepinfer-eplb-trace/1", "moe_layers": [3], "loads": [[[1, 2]], [[3, 4]]]}
    (tmp_path / "s.json").write_text(json.dumps(per_step))
    assert load_trace(tmp_path / "s.json")[0].tolist() == [[4.0, 6.0]]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a deepinfer-eplb-trace/1"):
        load_trace(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.json")


# ---- configuration -------------------------------------------------------------------------------

def test_feature_section_is_validated():
    assert EPLB({}).opts["window_steps"] == 1000 and EPLB({}).opts["rebalance_every"] == 10000
    assert EPLB({}).opts["redundant_experts_per_rank"] == 1
    with pytest.raises(ConfigError, match="unknown key"):
        EPLB({"window": 3})
    with pytest.raises(ConfigError, match="window_steps must be >= 1"):
        EPLB({"window_steps": 0})
    with pytest.raises(ConfigError, match="expects int"):
        EPLB({"rebalance_every": "often"})
    with pytest.raises(ConfigError, match="policy must be"):
        EPLB({"policy": "greedy"})


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> str:
    return ep_checkpoint(tmp_path_factory.getbasetemp())


def test_eplb_needs_expert_parallelism(ckpt):
    with pytest.raises(ConfigError, match="needs ep > 1"):
        make_llm(ckpt, features=["eplb"])


def test_bad_section_fails_before_workers_start(ckpt):
    before = children_of(os.getpid())
    with pytest.raises(ConfigError, match="unknown key"):
        make_llm(ckpt, dp=2, ep=2, features=["eplb"], eplb={"rebalance_evry": 3})
    assert children_of(os.getpid()) == before


# ---- live ranks ----------------------------------------------------------------------------------

def test_rebalancing_moves_experts_with_outputs_unchanged_then_replays_the_trace(ckpt, tmp_path):
    kv = 40 * kv_bytes_per_block(ckpt, BS)
    ref_llm = make_llm(ckpt, kv_cache_memory=kv)
    ref = ref_llm.generate(workload(), params(), use_tqdm=False)
    ref_llm.shutdown()
    trace = tmp_path / "trace.json"

    # 2 ranks, 2 redundant slots each, a rebalance every 3 steps over a 4-step window
    llm = make_llm(ckpt, dp=2, ep=2, kv_cache_memory=kv, features=["eplb"],
                   eplb={"window_steps": 4, "rebalance_every": 3, "redundant_experts_per_rank": 2,
                         "record_trace": str(trace)})
    pids = llm.engine.worker_pids()
    outs = llm.generate(workload(), params(), use_tqdm=False)
    m = llm.metrics()
    llm.shutdown()
    assert wait_gone(pids) == []
    assert_same(outs, ref)
    assert m["eplb_rebalances"] >= 5 and m["eplb_experts_moved"] > 0
    assert m["eplb_slots_per_rank"] == 16 // 2 + 2 and m["eplb_policy"] == "global"
    assert 1.0 <= m["moe_lb"] < 2.0 and set(m["moe_lb_per_layer"]) == {1, 2}
    assert m["eplb_moe_lb_before"] is not None
    loads, layers = load_trace(trace)
    assert layers == [1, 2] and loads.shape == (2, 16) and loads.sum() > 0

    # 4 ranks: the placement is computed once from the recorded trace (no live rebalancing)
    llm = make_llm(ckpt, dp=4, ep=4, kv_cache_memory=kv, features=["eplb"],
                   eplb={"trace_file": str(trace), "rebalance_every": 0})
    pids = llm.engine.worker_pids()
    try:
        outs = llm.generate(workload(), params(), use_tqdm=False)
        m = llm.metrics()
    finally:
        llm.shutdown()
    assert wait_gone(pids) == []
    assert_same(outs, ref)
    assert m["eplb_rebalances"] == 0 and m["eplb_experts_moved"] > 0  # experts moved once, at start-up
