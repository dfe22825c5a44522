"""First-come-first-served scheduling with chunked prefill, prefix reuse and preemption.

Each step: running decodes first (oldest first), then prefill chunks of running and waiting
requests, within ``max_num_batched_tokens`` and, when a cost model is present, the prefill time
budget ``compute_quota_limit``. A step's blocks are reserved in every KV cache pool at once (all or
nothing). When blocks run out, the newest running request is preempted: its blocks in every pool
are released and it is recomputed later (its prefix may still hit the cache).
"""

from __future__ import annotations

from collections import deque

from deepinfer_core.engine.sequence import Sequence, Status
from deepinfer_core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

MIN_PREFILL_CHUNK = 16  # a step with no other prefill always gets at least this much progress


class FcfsScheduler(Scheduler):
    name = "fcfs"
    core_api_version = "1.0"

    def __init__(self, budget, blocks, cost_model, admission=None) -> None:
        super().__init__(budget, blocks, cost_model, admission)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_index = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running(self) -> int:
        return len(self.running)

    def running_requests(self) -> list[Sequence]:
        return list(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def remove_waiting(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    # ---- the policy ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.running.sort(key=lambda s: s.arrival_index)  # oldest first: victims are never scheduled yet
        tokens_left = self.budget.max_num_batched_tokens
        quota = self.budget.compute_quota_limit if self.cost_model is not None else None

        # 1. decodes, oldest first; preempt the newest to make room
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.in_prefill or seq.last_token_pending:
                continue  # (last_token_pending: its final token is being sampled, nothing left to run)
            if tokens_left <= 0:
                break
            n = seq.num_tokens - seq.num_computed_tokens
            spec = self._lookahead(seq, n, tokens_left)
            if not spec and not self._reserve(seq, seq.num_tokens, out):
                continue  # seq itself was preempted
            out.decodes.append(ScheduledSeq(seq, n, spec))
            tokens_left -= n + len(spec)

        # 2. running requests still in prefill (chunked), oldest first
        for seq in self.running:
            if tokens_left <= 0 or not seq.in_prefill or seq.status != Status.RUNNING:
                continue
            n = self._chunk(seq, tokens_left, quota, first=not out.prefills)
            if n == 0 or not self._reserve(seq, seq.num_computed_tokens + n, out, preempt=False):
                break
            out.prefills.append(ScheduledSeq(seq, n))
            tokens_left -= n
            if quota is not None:
                quota -= self.cost_model.cost(n, seq.num_computed_tokens)

        # 3. admit waiting requests
        skipped: list[Sequence] = []
        while self.waiting and tokens_left > 0 and len(self.running) < self.budget.max_num_seqs:
            seq = self.waiting.popleft()
            if not self.admission.is_ready(seq):
                skipped.append(seq)
                continue
            if seq.num_computed_tokens == 0 and not seq.block_table:
                cached = self.admission.admit_prefix(seq)
                seq.num_computed_tokens = cached
            n = self._chunk(seq, tokens_left, quota, first=not out.prefills)
            if n == 0 or not self._reserve(seq, seq.num_computed_tokens + n, out, preempt=False):
                self.blocks.release(seq)
                seq.num_computed_tokens = 0
                self.waiting.appendleft(seq)
                break
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.prefills.append(ScheduledSeq(seq, n))
            tokens_left -= n
            if quota is not None:
                quota -= self.cost_model.cost(n, seq.num_computed_tokens)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _lookahead(self, seq: Sequence, n: int, tokens_left: int) -> list[int]:
        """The proposed tokens this decode verifies, with their KV slots reserved: as many as the
        token budget leaves, only when their blocks are free without preempting anyone and leave a
        block per running request (drafts never displace work)."""
        spec = seq.spec_tokens[: max(0, tokens_left - n)] if n == 1 else []
        while spec:
            total = seq.num_tokens + len(spec)
            extra = self.blocks.blocks_needed(seq, total)
            if self.blocks.can_allocate(seq, total) and self.blocks.num_free - extra >= len(self.running):
                self.blocks.allocate(seq, total)
                return spec
            spec = spec[:-1]
        return []

    def _chunk(self, seq: Sequence, tokens_left: int, quota: float | None, first: bool) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, tokens_left)
        if quota is not None:
            fit = self.cost_model.max_tokens(seq.num_computed_tokens, quota, n)
            n = max(fit, min(n, MIN_PREFILL_CHUNK)) if first else fit
        return n

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, preempt: bool = True) -> bool:
        """Allocate blocks for ``num_tokens`` tokens of ``seq``, preempting newer requests if allowed.
        False when it cannot (``seq`` may have been preempted itself)."""
        while not self.blocks.can_allocate(seq, num_tokens):
            if not preempt:
                return False
            victim = max((s for s in self.running if s.status == Status.RUNNING), key=lambda s: s.arrival_index)
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.blocks.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
