"""Expert-parallel load balancing (EPLB) as pure functions over numpy arrays.

Input: per-layer, per-logical-expert loads (tokens routed to the expert in a window).
Output (:class:`Placement`): for every MoE layer a physical→logical map (which logical expert each
physical slot holds; slots ``[g * S_g, (g + 1) * S_g)`` live on rank/GPU ``g``), a logical→physical
map (the slots of each expert's replicas, padded with -1) and the replica count of every expert.

Steps, per layer:
  1. replication: every expert gets one slot; each extra slot goes to the expert with the largest
     load per replica (``argmax load / replicas``; ties to the lowest expert id);
  2. balanced packing of the replicas (weight = load / replicas) onto GPUs: sort descending, put
     each item in the lightest pack that still has room (ties to the lowest pack);
  3. hierarchical policy, used when the expert groups divide evenly among the nodes: first pack the
     groups onto nodes by load (balanced packing), then do 1 and 2 inside every node; otherwise the
     global policy does 1 and 2 over all experts and GPUs.

Everything here is deterministic: every rank that runs it on the same loads gets the same placement.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_FORMAT = "deepinfer-eplb-trace/1"


@dataclass
class Placement:
    phys_to_log: np.ndarray  # [L, S] int64: logical expert held by each physical slot
    log_to_phys: np.ndarray  # [L, E, max_replicas] int64: slots of each expert's replicas, -1 padded
    replica_counts: np.ndarray  # [L, E] int64, every entry >= 1
    policy: str  # "hierarchical" | "global"

    @property
    def num_slots(self) -> int:
        return self.phys_to_log.shape[1]


def replicate_experts(loads, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Give ``num_slots >= E`` slots to E experts: one each, then each extra slot to the expert with
    the largest load per replica. Returns (slot_expert [num_slots], sorted by expert; counts [E])."""
    loads = np.asarray(loads, dtype=np.float64)
    E = loads.shape[0]
    if num_slots < E:
        raise ValueError(f"replicate_experts: {num_slots} slots cannot hold {E} experts")
    counts = np.ones(E, dtype=np.int64)
    for _ in range(num_slots - E):
        counts[int(np.argmax(loads / counts))] += 1
    return np.repeat(np.arange(E, dtype=np.int64), counts), counts


def balanced_packing(weights, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Put n items (n divisible by ``num_packs``) into packs of n / num_packs items each: heaviest
    first, each into the lightest pack with room. Returns (pack of each item, its index in the pack)."""
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[0]
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items do not divide into {num_packs} equal packs")
    cap = n // num_packs
    pack_load = np.zeros(num_packs, dtype=np.float64)
    pack_size = np.zeros(num_packs, dtype=np.int64)
    pack_of = np.empty(n, dtype=np.int64)
    index_in_pack = np.empty(n, dtype=np.int64)
    for i in np.argsort(-w, kind="stable"):
        open_packs = np.flatnonzero(pack_size < cap)
        p = int(open_packs[np.argmin(pack_load[open_packs])])
        pack_of[i], index_in_pack[i] = p, pack_size[p]
        pack_size[p] += 1
        pack_load[p] += w[i]
    return pack_of, index_in_pack


def use_hierarchical(num_experts: int, num_groups: int, num_nodes: int, num_gpus: int) -> bool:
    """The hierarchical policy applies when the expert groups divide evenly among several nodes."""
    return (num_nodes > 1 and num_groups >= 1 and num_experts % num_groups == 0
            and num_groups % num_nodes == 0 and num_gpus % num_nodes == 0)


def rebalance_layer(loads, num_slots: int, num_groups: int = 1, num_nodes: int = 1,
                    num_gpus: int = 1) -> tuple[np.ndarray, str]:
    """Physical→logical map [num_slots] of one layer, and the policy used."""
    loads = np.asarray(loads, dtype=np.float64)
    E = loads.shape[0]
    if num_gpus < 1 or num_slots % num_gpus:
        raise ValueError(f"EPLB: {num_slots} slots do not divide among {num_gpus} GPUs")
    if num_slots < E:
        raise ValueError(f"EPLB: {num_slots} slots cannot hold {E} experts")
    if np.any(loads < 0) or not np.all(np.isfinite(loads)):
        raise ValueError("EPLB: loads must be finite and non-negative")
    slots_per_gpu = num_slots // num_gpus
    if use_hierarchical(E, num_groups, num_nodes, num_gpus) and num_slots % num_nodes == 0:
        policy = "hierarchical"
        group_size = E // num_groups
        group_node, _ = balanced_packing(loads.reshape(num_groups, group_size).sum(1), num_nodes)
        node_experts = [np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                        for g in range(num_groups) if group_node[g] == node])
                        for node in range(num_nodes)]
    else:
        policy, num_nodes = "global", 1
        node_experts = [np.arange(E)]
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = num_slots // num_nodes
    phys_to_log = np.full(num_slots, -1, dtype=np.int64)
    for node, experts in enumerate(node_experts):
        node_loads = loads[experts]
        slot_expert, counts = replicate_experts(node_loads, slots_per_node)
        pack, pos = balanced_packing(node_loads[slot_expert] / counts[slot_expert], gpus_per_node)
        gpu = node * gpus_per_node + pack
        phys_to_log[gpu * slots_per_gpu + pos] = experts[slot_expert]
    return phys_to_log, policy


def maps_from_phys_to_log(phys_to_log, num_experts: int,
                          max_replicas: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(log_to_phys [E, max_replicas] padded with -1, replica_counts [E]) of a physical→logical map."""
    p2l = np.asarray(phys_to_log, dtype=np.int64)
    counts = np.bincount(p2l, minlength=num_experts).astype(np.int64)
    width = max_replicas if max_replicas is not None else max(1, int(counts.max(initial=1)))
    l2p = np.full((num_experts, width), -1, dtype=np.int64)
    filled = np.zeros(num_experts, dtype=np.int64)
    for slot, e in enumerate(p2l):
        l2p[e, filled[e]] = slot
        filled[e] += 1
    return l2p, counts


def rebalance_experts(loads, num_slots: int, num_groups: int = 1, num_nodes: int = 1,
                      num_gpus: int = 1) -> Placement:
    """Placement of every layer for ``loads`` [L, E] (or [E] for one layer)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim == 1:
        loads = loads[None]
    L, E = loads.shape
    rows, policies = zip(*(rebalance_layer(loads[i], num_slots, num_groups, num_nodes, num_gpus)
                           for i in range(L)))
    return placement_from_phys_to_log(np.stack(rows), E, policies[0])


def placement_from_phys_to_log(phys_to_log, num_experts: int, policy: str = "given") -> Placement:
    p2l = np.asarray(phys_to_log, dtype=np.int64)
    if p2l.ndim == 1:
        p2l = p2l[None]
    maps = [maps_from_phys_to_log(row, num_experts) for row in p2l]
    width = max(m[0].shape[1] for m in maps)
    l2p = np.full((p2l.shape[0], num_experts, width), -1, dtype=np.int64)
    for i, (m, _) in enumerate(maps):
        l2p[i, :, : m.shape[1]] = m
    return Placement(p2l, l2p, np.stack([c for _, c in maps]), policy)


def contiguous_placement(num_experts: int, num_gpus: int, num_layers: int = 1) -> Placement:
    """The placement without EPLB: rank g holds experts [g E/W, (g+1) E/W), no replicas."""
    if num_experts % num_gpus:
        raise ValueError(f"{num_experts} experts do not divide among {num_gpus} GPUs")
    p2l = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
    return placement_from_phys_to_log(p2l, num_experts, "contiguous")


def initial_placement(num_experts: int, num_gpus: int, redundant_per_gpu: int, num_layers: int = 1) -> Placement:
    """A start-up placement before any load is known: the contiguous one, plus on every GPU
    ``redundant_per_gpu`` replicas of the next GPU's first experts (cheap to set up: only those cross
    GPUs; with no load information any replica choice is as good as another)."""
    if num_experts % num_gpus:
        raise ValueError(f"{num_experts} experts do not divide among {num_gpus} GPUs")
    per = num_experts // num_gpus
    rows = []
    for g in range(num_gpus):
        nxt = (g + 1) % num_gpus
        rows.append(list(range(g * per, (g + 1) * per))
                    + [nxt * per + j % per for j in range(redundant_per_gpu)])
    p2l = np.tile(np.asarray(rows, dtype=np.int64).reshape(-1), (num_layers, 1))
    return placement_from_phys_to_log(p2l, num_experts, "initial")


def stabilize_placement(old_phys_to_log, new_phys_to_log, num_gpus: int) -> np.ndarray:
    """Reorder the slots inside every GPU of a new placement so that an expert the GPU already held
    stays in its old slot: the multiset per GPU is unchanged, only fewer weights move."""
    old = np.asarray(old_phys_to_log, dtype=np.int64).reshape(num_gpus, -1)
    new = np.asarray(new_phys_to_log, dtype=np.int64).reshape(num_gpus, -1)
    out = np.full_like(new, -1)
    for g in range(num_gpus):
        left = Counter(new[g].tolist())
        for j in range(min(old.shape[1], new.shape[1])):
            e = int(old[g, j])
            if left[e] > 0:
                out[g, j] = e
                left[e] -= 1
        rest = []
        for e in new[g].tolist():
            if left[e] > 0:
                rest.append(e)
                left[e] -= 1
        free = np.flatnonzero(out[g] < 0)
        out[g, free] = rest
    return out.reshape(-1)


def gpu_loads(loads, phys_to_log, num_gpus: int) -> np.ndarray:
    """Tokens per GPU when each expert's load splits evenly over its replicas: [num_gpus]
    (or [L, num_gpus] for loads [L, E] and phys_to_log [L, S])."""
    loads = np.asarray(loads, dtype=np.float64)
    p2l = np.asarray(phys_to_log, dtype=np.int64)
    if loads.ndim == 2:
        return np.stack([gpu_loads(loads[i], p2l[i], num_gpus) for i in range(loads.shape[0])])
    counts = np.bincount(p2l, minlength=loads.shape[0])
    per_slot = loads[p2l] / counts[p2l]
    return per_slot.reshape(num_gpus, -1).sum(1)


def moe_lb(rank_loads) -> float:
    """Load imbalance of one layer: the busiest rank's tokens over the mean (1.0 is perfect)."""
    r = np.asarray(rank_loads, dtype=np.float64)
    mean = r.mean() if r.size else 0.0
    return float(r.max() / mean) if mean > 0 else 1.0


def moe_lb_overall(rank_loads_per_layer) -> float:
    """Over layers: sum of the busiest rank's tokens per layer over the sum of the means (the MoE
    part of a step waits for the slowest rank in every layer)."""
    r = np.asarray(rank_loads_per_layer, dtype=np.float64)
    if r.ndim == 1:
        return moe_lb(r)
    mean = r.mean(1).sum()
    return float(r.max(1).sum() / mean) if mean > 0 else 1.0


def pick_replicas(ids, log_to_phys, replica_counts, offset: int = 0):
    """Physical slot for every routed (token, k) pair: replica ``(token index + offset) % replicas``
    of its logical expert. Works on numpy arrays and torch tensors alike (ids [T, K])."""
    T = ids.shape[0]
    cnt = replica_counts[ids]
    if isinstance(ids, np.ndarray):
        tok = np.arange(T, dtype=np.int64)[:, None]
    else:
        import torch

        tok = torch.arange(T, dtype=torch.long, device=ids.device)[:, None]
    return log_to_phys[ids, (tok + offset) % cnt]


# ---- traces -------------------------------------------------------------------------------------
def save_trace(path: str | Path, loads, moe_layers: list[int], **meta) -> None:
    """Write per-layer per-expert loads [L, E] (JSON) for a later one-shot recompute."""
    loads = np.asarray(loads)
    doc = {"format": TRACE_FORMAT, "moe_layers": [int(i) for i in moe_layers],
           "num_experts": int(loads.shape[-1]), "loads": loads.tolist(), **meta}
    Path(path).write_text(json.dumps(doc))


def load_trace(path: str | Path) -> tuple[np.ndarray, list[int]]:
    """(loads [L, E] float64, moe layer indices) from :func:`save_trace`'s file. A ``loads`` of
    [steps, L, E] (a per-step trace) is summed over steps."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"EPLB trace file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"EPLB trace file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT or "loads" not in doc:
        raise ValueError(f"EPLB trace file {str(path)!r} is not a {TRACE_FORMAT} document")
    loads = np.asarray(doc["loads"], dtype=np.float64)
    if loads.ndim == 3:
        loads = loads.sum(0)
    if loads.ndim != 2:
        raise ValueError(f"EPLB trace file {str(path)!r}: loads must be [layers, experts], got {loads.shape}")
    layers = [int(i) for i in doc.get("moe_layers", range(loads.shape[0]))]
    if len(layers) != loads.shape[0]:
        raise ValueError(f"EPLB trace file {str(path)!r}: {len(layers)} moe_layers for {loads.shape[0]} rows")
    return loads, layers
