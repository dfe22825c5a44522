"""The driver of a data-parallel attention + expert-parallel MoE job: request routing.

``LLM(dp=N, ep=N)`` builds a :class:`ParallelEngine`. It offers the interface ``LLM`` uses from an
``LLMEngine`` (``add_request``, ``step``, ``has_unfinished``, ``tokenizer``, ``metrics``,
``shutdown``) and runs the model on N ranks, started and spoken to by its base
:class:`~deepinfer_core.parallel.ranks.RankProcesses` (local worker processes, or ``torchrun``
peers; see README.md in this package).

Each rank owns the requests the driver's :class:`DPLoadBalancer` gives it (fewest unfinished
requests, then lowest KV usage) and their KV cache. All ranks step in lock step: the driver sends
every step to every rank and waits for all answers, at most ``worker_timeout_s``. A rank that dies,
hangs or fails is named in a :class:`WorkerFailure`; the unfinished requests then finish with
``finish_reason == "error"`` and that error, every worker is killed, and later calls raise it
(with ``elastic_ep``, the group re-forms over the survivors instead: ``elastic.py``).
Shutdown, a driver exception, Ctrl-C and the driver's exit all end every worker process.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from deepinfer_core.config import ConfigError, EngineConfig, check_number
from deepinfer_core.engine.engine import EngineDrainingError, LLMEngine
from deepinfer_core.engine.handoff import check_params
from deepinfer_core.engine.sequence import Sequence, Status
from deepinfer_core.engine.tokenizer import HFTokenizer
from deepinfer_core.features import load_features, make_plugin_manager
from deepinfer_core.kv_transfer import check_parallel_transport
from deepinfer_core.models.config import ModelConfig
from deepinfer_core.models.loader import load_model_config, resolve_model_dir
from deepinfer_core.parallel.elastic import RanksLost, check_elastic, reform
from deepinfer_core.parallel.expert_parallel import moe_lb_from_pairs
from deepinfer_core.parallel.ranks import RankProcesses, WorkerFailure, torchrun_env
from deepinfer_core.platform import Platform
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.selection import select_platform

logger = logging.getLogger("deepinfer.parallel")
__all__ = ["DPLoadBalancer", "ParallelEngine", "WorkerFailure", "check_parallel_config", "merge_feature_metrics",
           "torchrun_env"]


def merge_feature_metrics(pm, per_rank: list[dict]) -> dict:
    """The features' own merge of their metrics over the ranks (``merge_metrics`` hook); keys no
    feature merges keep rank 0's value."""
    out: dict = {}
    for merged in pm.hook.merge_metrics(per_rank=per_rank):
        out.update(merged or {})
    return out

# ---- configuration checks ------------------------------------------------------------------------
def check_parallel_config(cfg: EngineConfig, mc: ModelConfig, platform: Platform, local_world_size: int,
                          launched_world_size: int | None = None) -> None:
    """ConfigError for a dp/ep combination this engine cannot run."""
    if cfg.dp != cfg.ep:
        raise ConfigError(f"dp={cfg.dp} with ep={cfg.ep} is not supported: data-parallel attention runs one "
                          "attention replica per expert-parallel rank, so dp must equal ep")
    W = cfg.ep
    E = mc.n_routed_experts
    if not E:
        raise ConfigError(f"dp=ep={W} needs a MoE model, but {cfg.model or 'the model'} has no routed "
                          "experts")
    if W > E:
        raise ConfigError(f"ep={W} is more ranks than the model's n_routed_experts={E}; every rank needs at "
                          "least one expert")
    if E % W:
        raise ConfigError(f"ep={W} does not divide the model's n_routed_experts={E}; choose an ep that "
                          f"divides {E}")
    if launched_world_size is not None and launched_world_size != W:
        raise ConfigError(f"launched with WORLD_SIZE={launched_world_size} processes but dp=ep={W}; run one "
                          "process per rank (torchrun --nproc-per-node x --nnodes = ep)")
    if platform.device_type != "cpu":
        have = platform.device_count()
        if local_world_size > have:
            raise ConfigError(f"{local_world_size} ranks on this machine need {local_world_size} "
                              f"{platform.name} devices, but {have} are visible")


# ---- load balancing ------------------------------------------------------------------------------
class DPLoadBalancer:
    """Picks the rank for a new request: fewest unfinished requests, then lowest KV-cache usage,
    then lowest rank."""

    def __init__(self, world_size: int) -> None:
        self.unfinished = [0] * world_size
        self.running = [0] * world_size
        self.kv_usage = [0.0] * world_size
        self.assigned_total = [0] * world_size

    def pick(self) -> int:
        r = min(range(len(self.unfinished)), key=lambda i: (self.unfinished[i], self.kv_usage[i], i))
        self.unfinished[r] += 1
        self.assigned_total[r] += 1
        return r

    def finished(self, rank: int) -> None:
        self.unfinished[rank] -= 1

    def report(self, rank: int, num_running: int, kv_usage: float) -> None:
        self.running[rank], self.kv_usage[rank] = num_running, kv_usage


# ---- the driver ----------------------------------------------------------------------------------
class ParallelEngine(RankProcesses):
    """Driver of ``dp`` = ``ep`` ranks; see the module docstring."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.log_level is not None:
            logging.getLogger("deepinfer").setLevel(cfg.log_level.upper())
        self.platform = select_platform(cfg.accelerator)
        self.model_dir = resolve_model_dir(cfg.model)
        self.model_config = mc = load_model_config(self.model_dir)
        tr = torchrun_env()
        self.world_size = cfg.ep
        local_world = tr["local_world_size"] if tr else self.world_size
        if cfg.kv_transfer:
            check_parallel_transport(cfg.kv_transfer, cfg.dp, cfg.ep)
        check_parallel_config(cfg, mc, self.platform, local_world, tr["world_size"] if tr else None)
        check_elastic(cfg, tr is not None)
        self.pm = pm = make_plugin_manager()
        load_features(cfg, pm)  # unknown features and bad sections fail here, before any process starts
        self.claimed_options = {o for opts in pm.hook.request_options() for o in (opts or [])}
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.tokenizer = HFTokenizer.load(self.model_dir, mc.bos_token_id, mc.eos_token_id)
        self.balancer = DPLoadBalancer(self.world_size)
        self._seqs: dict[str, Sequence] = {}
        self._owner: dict[str, int] = {}
        self._sent: dict[str, tuple] = {}  # what each unfinished request was sent as (re-routing re-sends it)
        self.reforms: list[dict] = []  # elastic EP: one record per re-form (elastic.py)
        self._pending_add: list[list] = [[] for _ in range(self.world_size)]
        self._pending_abort: list[list[str]] = [[] for _ in range(self.world_size)]
        self._failed_seqs: list[Sequence] = []
        self._sent_aborts: set[str] = set()
        self._drain: float | None = None  # start_drain()'s grace, sent with the next step
        self.draining = False
        self._closed = False
        self._next_id = 0
        self.steps = 0
        self._init_ranks(tr)
        self._kv_layout = self.worker_info[0]["kv_layout"]  # every rank's (the same), kept across re-forms

    def _fail_requests(self, failure: WorkerFailure) -> None:
        """The job failed: every unfinished request finishes with ``failure``."""
        for seq in self._seqs.values():
            seq.status = Status.FINISHED
            seq.finish_reason, seq.error = "error", failure
            seq.metrics.finished_time = time.perf_counter()
            self._failed_seqs.append(seq)
        self._seqs.clear()

    # ---- the LLMEngine interface -----------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | dict | None,
                    request_id: str | None = None, sibling: bool = False) -> Sequence:
        """Validate a request and give it to a rank (sent with the next step). Returns its handle,
        a :class:`Sequence` the driver updates from the rank's results. ``sibling``: another sample
        of an admitted request, taken even while draining (``LLMEngine.add_request``)."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the parallel engine is shut down")
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        if self.draining and not sibling:
            raise EngineDrainingError("this engine is draining (start_drain): it takes no new requests; send them "
                                      "to another")
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = LLMEngine.new_sequence(self, prompt, params, request_id)  # needs no model, only its config
        if self.cfg.kv_transfer and seq.params.kv_transfer_params is not None:
            check_params(seq.params.kv_transfer_params)  # the rank that receives it would refuse it too
        sent = dataclasses.replace(seq.params, seq_seed=seq.seed, seed=seq.seed)  # the driver's seed, on every rank
        rank = self.balancer.pick()
        self._seqs[request_id] = seq
        self._owner[request_id] = rank
        self._sent[request_id] = (seq.prompt_token_ids, sent)
        self._pending_add[rank].append((request_id, seq.prompt_token_ids, sent, None, sibling))
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if request_id in self._seqs:
            self._pending_abort[self._owner[request_id]].append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._failed_seqs)

    def load_stats(self) -> dict:
        """Running/waiting requests over all ranks, the most that run at once (``max_num_seqs`` per rank)
        and mean KV-cache usage, as of the last step."""
        b = self.balancer
        running = sum(b.running)
        return {"running": running, "waiting": max(0, sum(b.unfinished) - running),
                "max_running": self.cfg.max_num_seqs * len(b.running), "kv_usage": sum(b.kv_usage) / len(b.kv_usage)}

    def step(self) -> list[Sequence]:
        """One lock-step step on every rank; returns the requests that finished in it."""
        if self._failure is not None or self._closed:
            out, self._failed_seqs = self._failed_seqs, []
            return out
        if not self._seqs:
            return []
        drain = None if self._drain is None else (self._drain,)
        msgs = [("step", {"add": self._pending_add[r], "abort": self._pending_abort[r], "drain": drain})
                for r in range(self.world_size)]
        self._drain = None
        self._sent_aborts = {rid for ab in self._pending_abort for rid in ab}  # re-sent after a re-form
        self._pending_add = [[] for _ in range(self.world_size)]
        self._pending_abort = [[] for _ in range(self.world_size)]
        try:
            results = self._roundtrip(msgs, float(self.cfg.worker_timeout_s))
        except RanksLost as lost:  # elastic EP: continue on the survivors (or fail, saying why)
            try:
                reform(self, lost)
            except WorkerFailure:
                pass
            out, self._failed_seqs = self._failed_seqs, []
            return out
        except WorkerFailure:
            out, self._failed_seqs = self._failed_seqs, []
            return out
        self.steps += 1
        finished = []
        for r, res in enumerate(results):
            self.balancer.report(r, res["num_running"], res["kv_usage"])
            for rid, up in res["updates"].items():
                seq = self._seqs.get(rid)
                if seq is None:
                    continue
                self._apply(seq, up, r)
                if up["finished"]:
                    finished.append(seq)
                    del self._seqs[rid]
                    self._owner.pop(rid, None)
                    self._sent.pop(rid, None)
                    self.balancer.finished(r)
        return finished

    def _apply(self, seq: Sequence, up: dict, rank: int) -> None:
        seq.token_ids.extend(up["tokens"])
        seq.output_logprobs.extend(up["out_lp"])
        seq.prompt_logprobs.extend(up["prompt_lp"])
        seq.sum_logprob = up["sum_logprob"]
        m = up["metrics"]
        if m is not None:
            arrival = seq.metrics.arrival_time
            if self._rebase[rank]:  # another host's clock: keep the intervals, rebase on our arrival
                shift = arrival - m.arrival_time
                for name in ("first_scheduled_time", "first_token_time", "finished_time"):
                    if getattr(m, name) is not None:
                        setattr(m, name, getattr(m, name) + shift)
            m.arrival_time = arrival
            for name in ("first_scheduled_time", "first_token_time"):  # a re-routed request's first ones stay
                if getattr(seq.metrics, name) is not None:
                    setattr(m, name, getattr(seq.metrics, name))
            seq.metrics = m
        if seq.status == Status.WAITING and (up["tokens"] or seq.metrics.first_scheduled_time is not None):
            seq.status = Status.RUNNING
        if up["finished"]:
            seq.status = Status.FINISHED
            seq.finish_reason, seq.stop_reason = up["finish_reason"], up["stop_reason"]
            seq.error = up["error"]
            seq.kv_transfer_out = up.get("kv_transfer_out")  # a hand-off from the rank (P/D, drain)
            if seq.metrics.finished_time is None:
                seq.metrics.finished_time = time.perf_counter()

    def metrics(self) -> dict:
        """Summed counters over ranks, rank 0's view of global ones (moe_lb), and ``ranks``."""
        if self._failure is not None or self._closed:
            return {"failed": str(self._failure) if self._failure else None, "closed": self._closed,
                    "steps": self.steps}
        per_rank = self._roundtrip([("metrics",)] * self.world_size, float(self.cfg.worker_timeout_s))
        out = dict(per_rank[0])
        for key in ("prefill_tokens", "decode_tokens", "preemptions", "kv_blocks_free", "kv_blocks_total",
                    "dummy_steps", "spec_steps", "spec_verified", "spec_accepted", "spec_proposed",
                    "spec_verify_budget", "spec_draft_slots", "spec_relayouts_skipped"):
            if key in out:
                out[key] = sum(m.get(key, 0) for m in per_rank)
        for key in {k for m in per_rank for k in m}:  # KV hand-off counters and seconds (handoff.py), drain
            if key.startswith(("handoff_", "drain_forwarded")):
                out[key] = sum(m.get(key, 0) for m in per_rank)
            elif key == "drain_forward_s":  # the ranks forward at once
                out[key] = max(m.get(key, 0.0) for m in per_rank)
        if out.get("spec_verified"):
            out["spec_accept_rate"] = out["spec_accepted"] / out["spec_verified"]
        out["overhead_share"] = sum(m.get("overhead_share", 0.0) for m in per_rank) / len(per_rank)
        out["steps"] = self.steps
        out["dp"] = out["ep"] = self.world_size  # the configured size until elastic EP shrinks it
        out["dp_requests_per_rank"] = list(self.balancer.assigned_total)
        out["elastic_reforms"] = [dict(r) for r in self.reforms]
        out.pop("rank", None)
        pairs = out.pop("ep_rank_pairs", {})
        if "moe_lb" not in out and pairs:  # no feature measured it (EPLB does, since its last rebalance)
            out["moe_lb"], out["moe_lb_per_layer"] = moe_lb_from_pairs(pairs)
        out.update(merge_feature_metrics(self.pm, per_rank))
        out["ranks"] = [{k: v for k, v in m.items() if k != "ep_rank_pairs"} for m in per_rank]
        return out

    def kv_layout_info(self) -> dict:
        """Rank 0's ``LLMEngine.kv_layout_info()`` (every rank has the same layout), for a router."""
        return self._kv_layout

    def start_drain(self, grace_s: float | None = None) -> None:
        """``LLMEngine.start_drain`` on every rank: no new requests now; after the grace period each
        rank hands its unfinished requests off (``finish_reason == "forwarded"``, ``kv_transfer_params``)."""
        if not self.cfg.kv_transfer:
            raise ConfigError("drain with forwarding needs a [kv_transfer] transport to hand requests off through")
        grace = self.cfg.drain_grace_s if grace_s is None else grace_s
        check_number("drain grace_s", grace, 0)
        self._drain = grace if self._drain is None else min(self._drain, grace)
        self.draining = True

    def check_no_leaks(self) -> None:
        """AssertionError naming every rank whose KV blocks are not all free (tests, after all requests)."""
        reports = self._roundtrip([("check_no_leaks",)] * self.world_size, float(self.cfg.worker_timeout_s))
        leaks = [f"rank {r}: {rep}" for r, rep in enumerate(reports) if rep]
        if leaks:
            raise AssertionError("; ".join(leaks))

    def shutdown(self) -> None:
        """Stop every rank (gracefully when healthy) and make sure no worker process is left."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None and self._chans:
            try:
                timeout = min(30.0, float(self.cfg.worker_timeout_s))
                self._roundtrip([("shutdown",)] * self.world_size, timeout)
            except WorkerFailure:
                pass
        self._kill_all(grace_s=5.0)
        self._finalizer.detach()
