"""One data-parallel / expert-parallel rank: its own engine (requests, KV cache, scheduler, the
attention weights and this rank's experts), driven step by step by the driver
(:mod:`deepinfer_core.parallel.launcher`).

Every driver step reaches every rank, and every rank runs exactly one model forward in it: a rank
without scheduled work runs a forward over zero tokens, so that the MoE collectives of all ranks
stay in lock step. Ranks also all call ``step_finished`` once per step (the point where EPLB may
move expert weights, itself a collective).

Messages from the driver (tuples, first item the kind) and replies:
  ("init", payload)   -> ("ready", info)      build the process group (unless up) and the engine
  ("step", work)      -> ("ok", result)       add/abort requests, run one step, report progress
  ("metrics",)        -> ("ok", dict)
  ("reform", payload) -> ("ready", info)      elastic EP: join the survivors' new group (elastic.py)
  ("check_no_leaks",) -> ("ok", None | str)   what KV blocks leaked, if any
  ("shutdown",)       -> ("ok", None)         then the serving loop ends
Any failure replies ("error", exception, traceback text).

``python -m deepinfer_core.parallel.worker`` is the entry point of a locally spawned rank; it reads
its bootstrap (rank, the fd of its pipe to the driver) from stdin.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import LLMEngine
from deepinfer_core.engine.model_runner import empty_metadata
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.parallel.expert_parallel import ExpertParallel
from deepinfer_core.selection import select_platform

logger = logging.getLogger("deepinfer.parallel.worker")


class RankEngine(LLMEngine):
    """An :class:`LLMEngine` that holds only its rank's experts and runs MoE layers expert-parallel.

    A step error that no single request explains is not recovered here: the other ranks may be
    waiting in a collective, so it goes to the driver, which fails the job (a WorkerFailure)."""

    recover_from_step_errors = False

    def __init__(self, cfg: EngineConfig, comm, local_rank: int = 0, num_nodes: int = 1) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.device_index = local_rank
        self.num_nodes = num_nodes
        self.expert_parallel: ExpertParallel | None = None
        self.dummy_steps = 0
        self.experts_loaded = 0  # experts read from the checkpoint at the last re-form (elastic EP)
        self.prefill_budgets: list[float] = []  # the MIN-reduced prefill budget of each step (seconds)
        super().__init__(cfg)

    def build_model(self, expert_range=None):
        E = getattr(self.model_config, "n_routed_experts", None)
        if not E:
            raise ValueError(f"expert parallelism (dp/ep > 1) needs a MoE model; {self.model_config.architecture} "
                             "has no n_routed_experts")
        per = E // self.world_size
        model = super().build_model((self.rank * per, (self.rank + 1) * per))
        moes = list(model.moe_layers().values())  # the routed-expert layers the model declares
        if not moes:
            raise ValueError(f"{self.model_config.architecture} declares no MoE layers (CausalLM.moe_layers); "
                             "dp/ep > 1 cannot run it")
        self.expert_parallel = ExpertParallel(self.comm, E, moes, self.device)
        return model

    # ---- elastic EP: the group re-formed without a dead rank ------------------------------
    def regroup(self, comm, survivors: list[int]) -> None:
        """Continue in a smaller group: ``comm`` spans the survivors (``survivors[i]``: the old rank
        of new rank i). This rank keeps its requests and their KV (:meth:`undo_broken_step` puts them
        back where the last completed step left them; the driver re-routes only the dead ranks'
        requests), and the placement features lay the experts out anew over the survivors, reading
        the experts no survivor holds from the checkpoint."""
        ep = self.expert_parallel
        old_spr = {i: ep.slots_per_rank(i) for i in ep.moes}
        old = {i: [e for r in survivors for e in ep.phys_to_log[i][r * n : (r + 1) * n].tolist()]
               for i, n in old_spr.items()}
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        ep.regroup(comm)
        self.undo_broken_step()
        self.experts_loaded = 0
        if not self.pm.hook.ep_group_resized(engine=self, old_placement=old, load_expert=self.load_expert):
            raise ValueError("the expert-parallel group shrank but no feature re-places the experts "
                             "(ep_group_resized); enable one with redundant slots (features = ['eplb'])")

    def undo_broken_step(self) -> None:
        """A peer died in a collective of this rank's step: put every request back where the last
        completed step left it. A step changes a request's state only after its forward (which the
        collective failure interrupted) returned, so: the step still in flight (async scheduling,
        forward done but its results never read) is undone (its tokens' KV counts as not computed,
        its placeholders go), drafts not yet verified are dropped with their KV slots. Blocks
        registered in the prefix cache hold only KV of completed steps; requests that finished keep
        their result for the next reply."""
        step = self.pipeline.inflight
        self.pipeline.drop()
        if step is not None:
            for s in step.batch.scheduled:
                seq = s.seq
                if seq.num_computed_tokens <= seq.num_prompt_tokens:
                    seq.metrics.num_computed_prompt_tokens -= s.num_new_tokens
                seq.num_computed_tokens -= s.num_new_tokens
        for seq in self._seqs.values():
            if seq.is_finished:
                continue
            seq.drop_pending()
            if seq.spec_tokens:
                seq.spec_tokens, seq.spec_probs = [], None
                self.blocks.truncate(seq, seq.num_tokens)
            seq.num_computed_tokens = min(seq.num_computed_tokens, max(0, seq.num_tokens - 1))
        self._step_seqs = []

    def load_expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        read = getattr(self.model, "read_expert", None)
        if read is None or self.cfg.load_format == "random":
            raise ValueError(f"cannot reload expert {expert} of layer {layer}: {type(self.model).__name__} "
                             f"(load_format={self.cfg.load_format!r}) cannot read one expert from the checkpoint")
        from deepinfer_core.models.loader import SafetensorsReader

        self.experts_loaded += 1
        return read(SafetensorsReader(self.model_dir), layer, expert)

    def step(self) -> list[Sequence]:
        self._share_prefill_budget()
        calls = self.expert_parallel.calls
        finished = super().step()
        if self.expert_parallel.calls == calls:  # nothing ran here: keep the collectives in step
            self.dummy_forward()
            self.pm.hook.step_finished(engine=self, step_stats=self.stats)
        return finished

    def _share_prefill_budget(self) -> None:
        """Prefill LB inside a DP group: each rank's time budget for this step's prefill chunks is
        ``compute_quota_limit`` less its own decode cost (the fitted cost of one token per running
        decode), and every rank takes the MIN over the group. The ranks meet in every MoE layer's
        all-to-all, so the step lasts as long as its slowest rank: a rank with room left over could
        only wait for the others, and the one all-reduce keeps every rank's chunks in one budget."""
        quota = self.cfg.compute_quota_limit
        if quota is None or self.cost_model is None:
            return
        decode = sum(self.cost_model.cost(1, s.num_computed_tokens) for s in self.scheduler.running_requests()
                     if not s.in_prefill and not s.is_finished)
        budget = torch.tensor([max(0.0, quota - decode)], dtype=torch.float64)
        self.comm.all_reduce(budget, "min")
        self.scheduler.budget.compute_quota_limit = float(budget.item())
        self.prefill_budgets.append(float(budget.item()))

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """A forward over zero tokens: no attention work, but every MoE collective."""
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        self.model(empty, empty, empty_metadata(self.cache_layout, self.device), self.kv_caches)
        self.dummy_steps += 1

    def metrics(self) -> dict:
        out = super().metrics()
        layers, pairs = self.expert_parallel.rank_pairs_matrix()
        out["rank"] = self.rank
        out["dummy_steps"] = self.dummy_steps
        out["prefill_budgets"] = self.prefill_budgets[-256:]
        out["ep_rank_pairs"] = {int(i): row.tolist() for i, row in zip(layers, pairs)}
        return out


def portable(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it pickles, else a RuntimeError carrying its type and message."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RankWorker:
    """Handles the driver's messages for one rank (in its own process, or in the driver's process
    for rank 0 under torchrun)."""

    def __init__(self, rank: int, world_size: int, local_rank: int = 0, local_world_size: int = 1,
                 num_nodes: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size, self.num_nodes = local_rank, local_world_size, num_nodes
        self.engine: RankEngine | None = None
        self._reported: dict[str, tuple[int, int, int]] = {}  # per request: tokens, logprobs the driver has
        self._failed_adds: dict[str, BaseException] = {}
        self.doing = "idle"
        self.num_steps = 0
        self.generation = 0  # process groups this rank has joined since its first (elastic EP re-forms)

    def describe(self) -> str:
        """What the main thread is doing (answered to the driver's liveness probe)."""
        ep = self.engine.expert_parallel if self.engine is not None else None
        where = f", {ep.where}" if ep is not None and ep.where != "idle" else ""
        return f"{self.doing}{where}"

    # ---- messages ------------------------------------------------------------------------
    def handle(self, msg: tuple) -> tuple:
        kind = msg[0]
        self.doing = f"step {self.num_steps + 1}" if kind == "step" else kind
        try:
            if kind == "init":
                return ("ready", self.init(msg[1]))
            if kind == "step":
                return ("ok", self.step(msg[1]))
            if kind == "reform":
                return ("ready", self.reform(msg[1]))
            if kind == "metrics":
                return ("ok", self.engine.metrics())
            if kind == "check_no_leaks":
                return ("ok", self.leak_report())
            if kind == "shutdown":
                self.close()
                return ("ok", None)
            raise ValueError(f"unknown message {kind!r}")
        except BaseException as exc:  # reported to the driver, which decides
            logger.error("rank %d: %s failed: %s", self.rank, kind, exc)
            if kind == "step":  # the frames of the failed collective keep the group alive: drop them
                traceback.clear_frames(exc.__traceback__)
                reply = ("error", portable(exc.with_traceback(None)), traceback.format_exc())
                self.leave_group()
                return reply
            return ("error", portable(exc), traceback.format_exc())
        finally:
            self.doing = "idle"

    def init(self, p: dict) -> dict:
        cfg: EngineConfig = p["cfg"]
        platform = select_platform(cfg.accelerator)
        platform.set_device(self.local_rank)
        if platform.device_type == "cpu":
            if "OMP_NUM_THREADS" not in os.environ:
                # ranks share the host's cores; oversubscribed OpenMP threads spin and crawl
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                torch.set_num_threads(max(1, cores // self.local_world_size))
            if not isinstance(cfg.kv_cache_memory, int):  # a share of host memory: split among the ranks
                share = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else platform.kv_cache_memory_fraction
                cfg = dataclasses.replace(cfg, kv_cache_memory=share / self.local_world_size)
        if not dist.is_initialized():
            dist.init_process_group(platform.dist_backend, init_method=p["init_method"], rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=p["timeout_s"]))
        comm = platform.communicator()
        self.engine = RankEngine(cfg, comm, self.local_rank, self.num_nodes)
        return {"pid": os.getpid(), "kv_blocks": self.engine.blocks.num_blocks,
                "kv_layout": self.engine.kv_layout_info(),
                "slots_per_rank": {i: self.engine.expert_parallel.slots_per_rank(i)
                                   for i in self.engine.expert_parallel.moes}}

    def leave_group(self) -> None:
        """A step failed: this rank's collectives are out of step for good. Aborting its communicator
        (closing its connections) at once fails the collectives of peers still blocked on it (e.g. in
        an all_gather ring behind a dead rank) within milliseconds, instead of at the group's timeout."""
        if self.engine is not None:
            self.engine.comm.abort()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                logger.warning("rank %d: leaving the process group: %s", self.rank, exc)
            gc.collect()  # the group's connections close when its last reference goes

    def reform(self, p: dict) -> dict:
        """Elastic EP: leave the broken group, join the survivors' new one, re-place the experts; this
        rank's requests stay (what the driver has not been told yet goes in the next step's reply)."""
        t0 = time.perf_counter()
        self.leave_group()  # normally already left when the step failed
        platform = select_platform(self.engine.cfg.accelerator)
        dist.init_process_group(platform.dist_backend, init_method=p["init_method"], rank=p["rank"],
                                world_size=p["world_size"], timeout=datetime.timedelta(seconds=p["timeout_s"]))
        self.rank, self.world_size = p["rank"], p["world_size"]
        self.generation = p["generation"]
        eng = self.engine
        eng.regroup(platform.communicator(), p["survivors"])
        ep = eng.expert_parallel
        return {"pid": os.getpid(), "seconds": time.perf_counter() - t0, "experts_loaded": eng.experts_loaded,
                "slots_per_rank": {i: ep.slots_per_rank(i) for i in ep.moes},
                "requests_kept": sum(not s.is_finished for s in eng._seqs.values()),
                "prefill_tokens": eng.stats.prefill_tokens}

    def step(self, work: dict) -> dict:
        eng = self.engine
        for rid, ids, params, restored, admitted in work.get("add", ()):
            try:  # admitted: a sibling or re-routed request, taken even while draining
                seq = eng.add_request({"prompt_token_ids": ids}, params, request_id=rid, sibling=admitted)
            except (ValueError, TypeError) as exc:  # kept until a step's reply carries it (elastic EP)
                self._failed_adds[rid] = exc
                continue
            if restored:  # re-routed (elastic EP): its emitted tokens, recomputed on admission
                tokens, sum_logprob = restored
                eng.append_tokens([seq], [tokens], [[sum_logprob] + [0.0] * (len(tokens) - 1)])
            # what the driver has: the prompt (and its first, empty, prompt-logprob entry), and a re-routed
            # request's tokens; a received KV hand-off's tokens (appended by add_request) are news to it
            self._reported[rid] = ((seq.num_tokens, len(seq.output_logprobs), len(seq.prompt_logprobs))
                                   if restored else (len(ids), 0, min(1, len(seq.prompt_logprobs))))
        for rid in work.get("abort", ()):
            eng.abort(rid)
        if work.get("drain") is not None:
            eng.start_drain(work["drain"][0])
        finished = eng.step()
        self.num_steps += 1
        updates = self._updates(finished)
        for rid, exc in self._failed_adds.items():
            updates[rid] = {"tokens": [], "out_lp": [], "prompt_lp": [], "metrics": None, "sum_logprob": 0.0,
                            "finished": True, "finish_reason": "error", "stop_reason": None,
                            "error": portable(exc), "kv_transfer_out": None}
        self._failed_adds.clear()
        sched = eng.scheduler
        return {"updates": updates, "num_running": sched.num_running(),
                "num_waiting": sched.num_waiting(),
                "kv_usage": 1.0 - eng.blocks.num_free / max(1, eng.blocks.num_blocks)}

    def abort_group(self, generation: int) -> None:
        """The driver saw a peer of this rank's group die mid-step (elastic EP): abort the communicator
        (from the probe thread) so that a collective blocked on the dead peer ends now: NCCL and HCCL
        would otherwise wait for it until the group's timeout. Ignored for an older group."""
        eng = self.engine
        if eng is not None and generation == self.generation:
            logger.warning("rank %d: a peer died; aborting the process group", self.rank)
            eng.comm.abort()

    def leak_report(self) -> str | None:
        """None when every KV block is free (no request left), else what leaked."""
        try:
            self.engine.blocks.check_no_leaks()
        except AssertionError as exc:
            return str(exc)
        return None

    def _updates(self, finished: list[Sequence]) -> dict[str, dict]:
        seqs = {s.request_id: s for s in self.engine._seqs.values()}
        seqs.update((s.request_id, s) for s in finished)
        out = {}
        for rid, s in seqs.items():
            if rid not in self._reported:
                continue
            n_tok, n_olp, n_plp = self._reported[rid]
            known = s.num_known_tokens  # not async scheduling's placeholders
            if not (s.is_finished or known > n_tok or len(s.output_logprobs) > n_olp
                    or len(s.prompt_logprobs) > n_plp):
                continue
            up: dict[str, Any] = {"tokens": s.token_ids[n_tok:known], "out_lp": s.output_logprobs[n_olp:],
                                  "prompt_lp": s.prompt_logprobs[n_plp:], "metrics": s.metrics,
                                  "sum_logprob": s.sum_logprob, "finished": s.is_finished}
            if s.is_finished:
                up.update(finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=portable(s.error),
                          kv_transfer_out=s.kv_transfer_out)
                del self._reported[rid]
            else:
                self._reported[rid] = (known, len(s.output_logprobs), len(s.prompt_logprobs))
            out[rid] = up
        return out

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(conn, worker: RankWorker) -> bool:
    """Answer the driver's messages until it says shutdown (True) or goes away (False)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            logger.warning("rank %d: the driver went away; exiting", worker.rank)
            return False
        reply = worker.handle(msg)
        try:
            conn.send(reply)
        except (OSError, pickle.PicklingError) as exc:
            logger.error("rank %d: cannot answer the driver: %s", worker.rank, exc)
            return False
        if msg[0] == "shutdown":
            return True


def serve_probes(conn, worker: RankWorker) -> None:
    """Answer the driver's liveness probes from a thread: a rank blocked in a collective (waiting
    for a peer) still answers, a stopped or wedged one does not. ("abort", generation) aborts the
    rank's process group (elastic EP, a peer died) and is not answered."""
    while True:
        try:
            msg = conn.recv()
            if msg[0] == "abort":  # not answered: the driver's next probe must get its own answer
                worker.abort_group(msg[1])
                continue
            conn.send(("alive", worker.describe()))
        except (EOFError, OSError):
            return


def start_probe_thread(conn, worker: RankWorker) -> None:
    import threading

    threading.Thread(target=serve_probes, args=(conn, worker), daemon=True, name="deepinfer-probe").start()


def die_with_parent(expected_ppid: int) -> None:
    """Linux: get SIGKILL when the driver exits, however it exits (no orphans)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the driver's pipe closing still ends the serving loop
        pass
    if os.getppid() != expected_ppid:  # the driver died before prctl took effect
        os._exit(1)


def main() -> None:
    boot = json.loads(sys.stdin.readline())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the driver, which shuts us down
    die_with_parent(boot["ppid"])
    rank = boot["rank"]
    logging.basicConfig(level=logging.WARNING,
                        format=f"[deepinfer rank {rank}] %(levelname)s %(name)s: %(message)s")
    from multiprocessing.connection import Connection

    conn = Connection(boot["fd"])
    worker = RankWorker(rank, boot["world_size"], boot["local_rank"], boot["local_world_size"],
                        boot["num_nodes"])
    start_probe_thread(Connection(boot["probe_fd"]), worker)
    graceful = serve(conn, worker)
    conn.close()
    # Without the driver, peers may be stuck in collectives: leave at once, skipping clean-up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if graceful else 1)


if __name__ == "__main__":
    main()
