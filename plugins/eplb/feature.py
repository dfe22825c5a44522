"""The ``eplb`` feature: expert-parallel load balancing with redundant experts.

Enable it with ``features=["eplb"]`` on an expert-parallel engine (``ep > 1``) and configure it in
its ``[eplb]`` section:

    window_steps                int, 1000   steps of routing counts the balancer looks at
    rebalance_every             int, 10000  steps between rebalances (0: never; the start-up
                                            placement, or the trace's, stays)
    redundant_experts_per_rank  int, 1      extra expert slots on every rank, filled with replicas
    trace_file                  str, ""     a recorded trace (``save_trace`` format): the start-up
                                            placement is computed once from it
    record_trace                str, ""     on shutdown, rank 0 writes the loads seen so far there
    num_nodes                   int, 0      nodes for the hierarchical policy (0: from the launch)
    policy                      str, "auto" "auto": hierarchical when the expert groups divide evenly
                                            among several nodes, else global; or "global" /
                                            "hierarchical" (the latter must apply)

Every rank runs one instance. Its ``route_hook`` counts each MoE layer's tokens per logical
expert and maps every routed (token, expert) pair to one of the expert's replicas: replica
``(token index + rank) % replicas``. Every ``rebalance_every`` steps (in ``step_finished``, the
step boundary every rank reaches together) the ranks sum their counts of the last
``window_steps`` steps, all compute the same placement (:mod:`plugins.eplb.algorithm`) and move
expert weights between ranks; outputs do not change.

Metrics (``collect_metrics``): ``moe_lb`` (busiest rank's routed tokens over the mean, over all
MoE layers, since the last placement change), ``moe_lb_per_layer``, ``eplb_rebalances``,
``eplb_experts_moved``, ``eplb_moe_lb_before`` (``moe_lb`` of the placement replaced last),
``eplb_policy``.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from deepinfer_core.config import ConfigError
from deepinfer_core.features import Feature
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.parallel.expert_parallel import migrate_layer, moe_lb_from_pairs
from plugins.eplb.algorithm import (
    Placement,
    initial_placement,
    load_trace,
    maps_from_phys_to_log,
    pick_replicas,
    rebalance_experts,
    save_trace,
    stabilize_placement,
    use_hierarchical,
)

logger = logging.getLogger("deepinfer.eplb")
DEFAULTS = {"window_steps": 1000, "rebalance_every": 10000, "redundant_experts_per_rank": 1,
            "trace_file": "", "record_trace": "", "num_nodes": 0, "policy": "auto"}
NUM_BUCKETS = 10  # the window slides in steps of window_steps / NUM_BUCKETS


class EPLB(Feature):
    name = "eplb"
    core_api_version = "1.0"

    def __init__(self, section: dict) -> None:
        o = self.check_keys(self.name, section, DEFAULTS)
        for key, low in (("window_steps", 1), ("rebalance_every", 0), ("redundant_experts_per_rank", 0),
                         ("num_nodes", 0)):
            if o[key] < low:
                raise ConfigError(f"[eplb] {key} must be >= {low}, got {o[key]}")
        if o["policy"] not in ("auto", "global", "hierarchical"):
            raise ConfigError(f"[eplb] policy must be 'auto', 'global' or 'hierarchical', got {o['policy']!r}")
        self.opts = o
        self.engine = None
        self.steps = 0
        self.rebalances = 0
        self.experts_moved = 0
        self.moe_lb_before: float | None = None

    # ---- start-up ------------------------------------------------------------------------
    @hookimpl
    def engine_started(self, engine) -> None:
        ep = engine.expert_parallel
        if ep is None or engine.cfg.ep <= 1:
            raise ConfigError(f"feature 'eplb' balances experts over expert-parallel ranks and needs ep > 1 "
                              f"(got ep={engine.cfg.ep}); set ep=N (with dp=N) or remove 'eplb' from "
                              "features")
        mc = engine.model_config
        self.engine, self.ep, self.comm = engine, ep, engine.comm
        self.rank, self.world_size = ep.rank, ep.world_size
        self.layers = sorted(ep.moes)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = E = ep.num_experts
        self.slots_per_rank = E // self.world_size + self.opts["redundant_experts_per_rank"]
        self.num_slots = self.slots_per_rank * self.world_size
        grouped = mc.topk_method in ("group_limited_greedy", "noaux_tc")
        self.num_groups = mc.n_group if grouped and mc.n_group else 1
        self.num_nodes = self.opts["num_nodes"] or engine.num_nodes
        if self.opts["policy"] == "global":
            self.num_nodes = 1
        elif self.opts["policy"] == "hierarchical" and not use_hierarchical(E, self.num_groups, self.num_nodes,
                                                                            self.world_size):
            raise ConfigError(f"[eplb] policy 'hierarchical' needs the {self.num_groups} expert groups to divide "
                              f"evenly among {self.num_nodes} nodes (and the ranks too); use 'auto' or 'global'")
        self.bucket_size = max(1, self.opts["window_steps"] // NUM_BUCKETS)
        self.buckets: deque = deque(maxlen=-(-self.opts["window_steps"] // self.bucket_size))
        self.bucket = torch.zeros(len(self.layers), E, dtype=torch.long, device=engine.device)
        self.total = torch.zeros(len(self.layers), E, dtype=torch.long)
        self.l2p: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.policy = ""

        if self.opts["trace_file"]:
            try:
                loads, layers = load_trace(self.opts["trace_file"])
            except ValueError as exc:
                raise ConfigError(f"[eplb] trace_file: {exc}") from None
            if layers != self.layers or loads.shape[1] != E:
                raise ConfigError(f"[eplb] trace_file {self.opts['trace_file']!r} has loads for MoE layers "
                                  f"{layers} x {loads.shape[1]} experts; this model has {self.layers} x {E}")
            self._place(placement=rebalance_experts(loads, self.num_slots, self.num_groups, self.num_nodes,
                                                    self.world_size))
        else:  # no load known yet: the contiguous placement plus a neighbour's experts as replicas
            self._place(placement=initial_placement(E, self.world_size, self.opts["redundant_experts_per_rank"],
                                                    len(self.layers)))
        self._mark()

    @hookimpl
    def moe_route_hook(self, engine):
        """Every MoE layer maps logical experts to replicas and counts its loads (``_route``)."""
        return self._route if self.engine is not None else None

    # ---- per step ------------------------------------------------------------------------
    def _route(self, layer: int, weights: torch.Tensor, ids: torch.Tensor):
        self.bucket[self.row[layer]] += torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        return weights, pick_replicas(ids, self.l2p[layer], self.counts[layer], offset=self.rank)

    @hookimpl
    def step_finished(self, engine, step_stats) -> None:
        if self.engine is None:
            return
        self.steps += 1
        if self.steps % self.bucket_size == 0:
            b = self.bucket.cpu()
            self.buckets.append(b)
            self.total += b
            self.bucket.zero_()
        every = self.opts["rebalance_every"]
        if every and self.steps % every == 0:
            self.rebalance()

    def window_loads(self) -> torch.Tensor:
        """This rank's routed tokens per (MoE layer, logical expert) over the window."""
        out = self.bucket.cpu().clone()
        for b in self.buckets:
            out += b
        return out

    def rebalance(self, old: dict[int, list[int]] | None = None, load_expert=None) -> None:
        """Collective: every rank must call it at the same step. ``old``/``load_expert``: after the
        group shrank (``ep_group_resized``), the survivors' slots and the checkpoint reader."""
        loads = self.comm.all_reduce(self.window_loads().to(self.engine.device), "sum").cpu().numpy()
        self.moe_lb_before = self.current_moe_lb()[0] if old is None else None
        moved = self._place(loads, old=old, load_expert=load_expert)
        self.rebalances += 1
        self._mark()
        logger.info("EPLB rebalance %d at step %d over %d ranks: %d experts moved", self.rebalances,
                    self.steps, self.world_size, moved)

    @hookimpl
    def ep_group_resized(self, engine, old_placement, load_expert) -> bool | None:
        """Elastic EP: every rank keeps its slot count; the survivors' slots must hold all experts."""
        if self.engine is None:
            return None
        self.comm, self.rank, self.world_size = engine.comm, self.ep.rank, self.ep.world_size
        self.num_slots = self.slots_per_rank * self.world_size
        if self.num_slots < self.num_experts:
            raise ValueError(f"elastic EP: {self.world_size} ranks x {self.slots_per_rank} expert slots cannot "
                             f"hold {self.num_experts} experts")
        self.rebalance(old=old_placement, load_expert=load_expert)
        return True

    def _place(self, loads: np.ndarray | None = None, placement: Placement | None = None,
               old: dict[int, list[int]] | None = None, load_expert=None) -> int:
        if placement is None:
            placement = rebalance_experts(loads, self.num_slots, self.num_groups, self.num_nodes,
                                          self.world_size)
        self.policy = placement.policy
        moved = 0
        for i, layer in enumerate(self.layers):
            prev = old[layer] if old is not None else self.ep.phys_to_log[layer].tolist()
            new = stabilize_placement(prev, placement.phys_to_log[i], self.world_size).tolist()
            load = None if load_expert is None else (lambda e, layer=layer: load_expert(layer, e))
            w13, w2, n = migrate_layer(self.comm, self.ep.moes[layer], prev, new, load)
            layout = self.engine.platform.linear_weight_layout  # the new tensors keep the platform's layout
            self.ep.set_placement(layer, torch.tensor(new), layout(w13), layout(w2))
            l2p, counts = maps_from_phys_to_log(new, self.num_experts)
            self.l2p[layer] = torch.tensor(l2p, device=self.engine.device)
            self.counts[layer] = torch.tensor(counts, device=self.engine.device)
            moved += n
        self.experts_moved += moved
        return moved

    # ---- metrics -------------------------------------------------------------------------
    def _mark(self) -> None:
        self._pairs_mark = {layer: self.ep.rank_pairs[layer].clone() for layer in self.layers}

    def current_moe_lb(self) -> tuple[float, dict[int, float]]:
        """moe_lb of the current placement (every rank sees every rank's load, so no collective)."""
        pairs = {layer: (self.ep.rank_pairs[layer] - self._pairs_mark[layer]).tolist()
                 for layer in self.layers}
        return moe_lb_from_pairs(pairs)

    @hookimpl
    def collect_metrics(self, engine) -> dict | None:
        if self.engine is None:
            return None
        overall, per_layer = self.current_moe_lb()
        return {"moe_lb": overall, "moe_lb_per_layer": per_layer, "eplb_rebalances": self.rebalances,
                "eplb_experts_moved": self.experts_moved, "eplb_moe_lb_before": self.moe_lb_before,
                "eplb_policy": self.policy, "eplb_slots_per_rank": self.slots_per_rank}

    @hookimpl
    def engine_shutdown(self, engine) -> None:
        if self.engine is None or not self.opts["record_trace"]:
            return
        loads = self.total + self.bucket.cpu()
        loads = self.comm.all_reduce(loads.to(self.engine.device), "sum").cpu().numpy()
        if self.rank == 0:
            save_trace(self.opts["record_trace"], loads, self.layers, steps=self.steps)
