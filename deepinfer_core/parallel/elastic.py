"""Elastic expert parallelism: when a rank dies, the driver re-forms the group with the survivors.

``elastic_ep = true`` (with ``dp = ep = N`` on one machine). The sequence, all bounded in time:

1. **Detection.** The driver waits for every rank's answer to a step over private pipes. A killed
   rank's pipe closes at once (EOF, and its exit status names the signal); its peers, blocked in a
   gloo collective with it, get a read error within milliseconds, close their own group at once
   (so that a peer waiting on *them*, e.g. further along an all_gather ring, fails too) and answer.
   A hung rank (stopped, wedged) is found by the existing ``worker_timeout_s`` deadline and
   liveness probe; the driver kills it, which fails its peers' collectives the same way. So the
   slowest case is bounded by ``worker_timeout_s`` plus the probe (1 s); no collective timeout is
   waited for (it is longer, and a timeout cannot tell a dead peer from a slow step).
2. **Capacity.** Each survivor keeps its number of expert slots (its memory was sized for them, the
   KV cache took the rest), so ``survivors x slots_per_rank`` must hold every routed expert; EPLB's
   redundant slots give that room. Otherwise the engine fails with an error saying so.
3. **Re-form.** The driver kills what is left of the lost ranks and sends each survivor its new
   rank, the new world size and a fresh ``tcp://`` rendezvous; the survivors destroy the broken
   process group and form the new one, and the placement feature (``ep_group_resized``; EPLB runs
   its normal rebalance path) lays the experts out over the survivors: experts a survivor still
   holds move over the new group's ``all_to_all``, experts only the dead rank held are read from
   the checkpoint.
4. **Re-routing.** Each survivor keeps its requests and their KV: the step the death broke off
   changed no request state before its forward returned, so the survivor only undoes the step
   still in flight (async scheduling) and unverified drafts (``RankEngine.undo_broken_step``),
   and its tokens not yet reported reach the driver with the next step. The driver re-adds only
   the dead ranks' unfinished requests to the survivors, balanced by their load, with the tokens
   they had emitted: the new owner recomputes their KV (prompt + emitted tokens) and continues.
   No request is lost or restarted from scratch; greedy outputs are those of an undisturbed run.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from deepinfer_core.config import ConfigError

logger = logging.getLogger("deepinfer.parallel")


class RanksLost(Exception):
    """Raised inside the driver's exchange: ranks died (or went silent) mid-step, elastic EP is on."""

    def __init__(self, lost: list[int], errors: dict[int, str], detected_at: float) -> None:
        super().__init__(f"rank(s) {lost} lost")
        self.lost, self.errors, self.detected_at = lost, errors, detected_at


def lost_ranks(errors: dict[int, str]) -> list[int]:
    """The ranks an exchange's errors say are gone (died, connection lost, hung, silent); a rank that
    only raised (e.g. the collective error its dead peer caused) survives."""
    return sorted(r for r, e in errors.items()
                  if e.startswith(("died", "connection", "no answer")) or "hung" in e)


PEER_UNBLOCK_S = 10.0  # after a hung rank is killed, its peers' collectives fail within milliseconds


def kill_hung(chans: list, pending: set[int], errors: dict[int, str]) -> bool:
    """A rank that does not even answer the probe (stopped, wedged) blocks its peers' collectives
    for good: kill it, so that they fail at once and answer. True when some were killed; the
    peers are pending again (their diagnosis is dropped)."""
    hung = [r for r in pending if "hung" in errors.get(r, "") and chans[r].proc is not None]
    if not hung or len(hung) == len(chans):
        return False
    for r in hung:
        chans[r].proc.kill()
        pending.discard(r)
    for r in pending:
        errors.pop(r, None)
    return True


def check_elastic(cfg, torchrun: bool) -> None:
    if cfg.elastic_ep and torchrun:
        raise ConfigError("elastic_ep re-forms the group of locally spawned ranks; under torchrun the "
                          "launcher (torchrun's agent) owns the processes: leave elastic_ep off there")


def capacity_error(survivors: int, slots_per_rank: int, num_experts: int) -> str | None:
    if survivors * slots_per_rank >= num_experts:
        return None
    return (f"cannot re-form the expert-parallel group: {survivors} surviving rank(s) x {slots_per_rank} "
            f"expert slots = {survivors * slots_per_rank} < the model's {num_experts} routed experts; every "
            f"rank needs {-(-num_experts // survivors)} slots to survive this loss: add redundant expert slots "
            "(features = ['eplb'], [eplb] redundant_experts_per_rank)")


def reform(engine, lost: RanksLost) -> bool:
    """Re-form ``engine``'s (a ParallelEngine) group without ``lost.lost``; True when serving again.
    On False the engine has failed (every request finished with the WorkerFailure)."""
    from deepinfer_core.parallel.ranks import _free_port, group_timeout_s

    t0 = time.perf_counter()
    dead = set(lost.lost)
    survivors = [ch for ch in engine._chans if ch.rank not in dead]
    for ch in engine._chans:
        if ch.rank in dead:
            if ch.proc is not None and ch.proc.poll() is None:
                ch.proc.kill()  # a silent (hung) rank: it cannot rejoin
                ch.proc.wait()
            for conn in (ch.conn, ch.probe):
                conn.close()
    spr = min(min(info["slots_per_rank"].values()) for info in engine.worker_info)
    E = engine.model_config.n_routed_experts
    note = capacity_error(len(survivors), spr, E) if survivors else "no rank survived"
    if note:
        engine._fail(lost.errors, note)
        return False
    old_ranks = [ch.rank for ch in survivors]
    W = len(survivors)
    for i, ch in enumerate(survivors):
        ch.rank = i
    engine._chans, engine.world_size = survivors, W
    engine._rebase = [False] * W
    init = f"tcp://127.0.0.1:{_free_port()}"
    engine.generation += 1
    msgs = [("reform", {"init_method": init, "rank": i, "world_size": W, "survivors": old_ranks,
                        "generation": engine.generation, "timeout_s": group_timeout_s(engine.cfg)})
            for i in range(W)]
    replies = engine._roundtrip(msgs, max(300.0, float(engine.cfg.worker_timeout_s)))  # a WorkerFailure fails all
    engine.worker_info = replies
    rerouted = reroute(engine, old_ranks)
    took = time.perf_counter() - t0
    record = {"lost_ranks": sorted(dead), "old_ranks": old_ranks, "world_size": W, "detected_at": lost.detected_at,
              "detect_to_serving_s": time.perf_counter() - lost.detected_at, "reform_s": took,
              "group_and_placement_s": max(r["seconds"] for r in replies),
              "experts_loaded": sum(r["experts_loaded"] for r in replies), "requests_rerouted": rerouted,
              "requests_kept": [r["requests_kept"] for r in replies],
              "prefill_tokens_at_reform": [r["prefill_tokens"] for r in replies]}
    engine.reforms.append(record)
    logger.warning("elastic EP: lost rank(s) %s; re-formed with %d ranks (old ranks %s) in %.3f s, %d expert(s) "
                   "read from the checkpoint, %d request(s) re-routed", sorted(dead), W, old_ranks, took,
                   record["experts_loaded"], rerouted)
    return True


def reroute(engine, old_ranks: list[int]) -> int:
    """Survivor ``old_ranks[i]`` is rank i now and keeps its requests; every unfinished request of a
    dead rank goes to a survivor with the tokens it has emitted. Returns how many were re-routed."""
    from deepinfer_core.parallel.launcher import DPLoadBalancer

    W = engine.world_size
    new_rank = {old: i for i, old in enumerate(old_ranks)}
    aborted = {rid for ab in engine._pending_abort for rid in ab} | engine._sent_aborts
    engine.balancer = DPLoadBalancer(W)
    engine._pending_add = [[] for _ in range(W)]
    engine._pending_abort = [[] for _ in range(W)]
    orphans = []
    for rid in engine._seqs:
        r = new_rank.get(engine._owner[rid])
        if r is None:
            orphans.append(rid)
        else:
            engine._owner[rid] = r
            engine.balancer.unfinished[r] += 1  # its adds and aborts were handled before the step broke
    for rid in orphans:
        seq = engine._seqs[rid]
        ids, params = engine._sent[rid]
        params = dataclasses.replace(params, kv_transfer_params=None)  # recomputed: a hand-off is read once
        emitted = seq.token_ids[seq.num_prompt_tokens:]
        restore = None
        if emitted:  # the prompt is done: its prompt logprobs (if asked) are all in already
            params = dataclasses.replace(params, prompt_logprobs=None)
            restore = (emitted, seq.sum_logprob)
        else:  # from the start: drop any partial prompt logprobs, they come again
            seq.prompt_logprobs[:] = seq.prompt_logprobs[:1] if seq.params.prompt_logprobs is not None else []
        r = engine.balancer.pick()
        engine._owner[rid] = r
        engine._pending_add[r].append((rid, ids, params, restore, True))  # admitted: taken while draining
        if rid in aborted:
            engine._pending_abort[r].append(rid)
    return len(orphans)
