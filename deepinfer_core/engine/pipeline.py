"""The step pipeline: launch a scheduled step on the device, and complete it on the host.

    launch(N):   prepare -> forward -> prompt logprobs, process_logits, sample -> copy to host
    complete(N): wait for the copy -> prompt logprobs, prefix-cache blocks, tokens, stops, hooks

Async scheduling (``async_scheduling``) pipelines the engine's loop one step deep. While the device
runs forward(N) and sample(N), the host runs schedule(N+1), launches forward(N+1), and only then
post-processes N (``overlap``); else each step is launched and completed at once (``run_sync``).
``plan`` decides before each step which of the two it is:

    step N+1:  schedule(N+1) -> prepare(N+1) -> launch forward+sample(N+1) -> complete(N)

* Placeholders. Launching a step advances the requests' scheduling state at once: their
  ``num_computed_tokens``, and for each request that samples, a placeholder id ``-(i + 1)`` (``i``: its
  row in the step's sampled-token tensor) appended to ``token_ids``. schedule(N+1) thus sees the right
  lengths and block needs. prepare(N+1) turns placeholders into step N's tokens on the device
  (``ModelRunner.prepare(prev_tokens=...)``: a gather, and a scatter in mixed steps); complete(N) writes the
  real tokens over them once the asynchronous copy to the host (pinned buffer + event) has landed.
  Hook order on completion: ``tokens_sampled`` for every placed token, then ``request_finished``
  for the requests that stopped on them.
* Stops are found one step late. A request that stopped at N (eos, stop strings, stop_token_ids) was
  already launched in N+1: that extra token is discarded, never emitted, and the request's KV blocks
  are released when it finishes (the in-flight step's writes are ordered before any later reuse on
  the stream). Stops known on the host (max_tokens, max_model_len) are not scheduled at all: the
  request is marked ``last_token_pending`` when its last token is launched. Prefix-cache blocks are
  registered only from real tokens and only up to what the completed step computed, exactly as in
  synchronous mode, so outputs and cache contents are the same as with ``async_scheduling = false``.
* Synchronous steps. A request whose next step needs its previous token on the host (penalties count
  output tokens; the ``request_needs_sync`` hook, e.g. a grammar mask) makes every step run
  synchronously while it is unfinished, and so does any step for which a feature's ``step_needs_sync``
  hook says so, and every speculative step whose proposer drafts on the host only
  (``engine/speculative.py``: the verify decides the next step's input). Such a step first completes
  the step in flight, so every token is on the host before it is scheduled.
* Speculative steps with a proposer that drafts on the device (``engine/spec_async.py``) overlap:
  schedule(N+1) reserves draft slots counting step N's drafts as accepted; launch(N+1) proposes, picks
  draft lengths and corrects positions and slots on the device from step N's accepted counts (a
  sampling row with m drafts gets m + 1 placeholders ``-(i * stride + j + 1)``); complete(N) settles
  them (kept tokens placed, the rejected drafts' placeholders dropped, their KV slots rolled back),
  one step late.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.model_runner import StepBatch
from deepinfer_core.engine.sampler import DeviceSample, Sampler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec_async import LaunchDrafts, SpecFlight
from deepinfer_core.engine.transfer import HostCopy, to_device
from deepinfer_core.outputs import Logprob
from deepinfer_core.scheduler import SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine


@dataclass
class InflightStep:
    """A launched step whose results are not yet post-processed."""

    batch: StepBatch
    sample: DeviceSample | None
    copy: HostCopy  # the sampled tokens, logprobs and prompt logprobs on their way to the host
    computed: list[int]  # per batch.scheduled: its num_computed_tokens after this step
    prompt_lp: list[tuple[Sequence, int]]  # (request, first position) per prompt-logprob block
    spec: SpecFlight | None = None  # a speculative step's verify results (engine/spec_async.py)

    def tokens(self) -> torch.Tensor | None:
        """The step's emitted tokens on the device, indexed by its placeholders (``-(id + 1)``)."""
        if self.spec is not None:
            return self.spec.flat()
        return self.sample.tokens if self.sample is not None else None

    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.batch.scheduled]


@dataclass(frozen=True)
class StepPlan:
    """How the coming step runs (``StepPipeline.plan``)."""

    overlap: bool  # launched before the step in flight is post-processed
    speculate: bool  # a speculative step (drafts verified)

    @property
    def drafts_on_device(self) -> bool:
        """Draft slots are reserved at schedule time and filled on the device at launch."""
        return self.overlap and self.speculate


class StepPipeline:
    """Launches and completes an engine's steps; holds the one step in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InflightStep | None = None

    # ---- the ways to run a step -----------------------------------------------------------
    def plan(self, speculate: bool) -> StepPlan:
        """Whether the coming step overlaps the one in flight; when it cannot, the step in flight is
        completed now (every token on the host before scheduling). It cannot with async scheduling
        off, while a request needs its tokens on the host (penalties, ``request_needs_sync``), when a
        feature's ``step_needs_sync`` says so, or for a speculative step whose proposer drafts on the
        host only (``engine/speculative.py``)."""
        eng = self.engine
        overlap = (eng.async_scheduling and not eng._sync_requests
                   and not (speculate and eng.spec.on_device is None)
                   and not any(eng.pm.hook.step_needs_sync(engine=eng)))
        if not overlap:
            drained = self.drain()
            if speculate and drained is not None and drained.spec is None and drained.batch.hidden is not None:
                # the host drafts next: the proposer keeps that step's hidden rows
                eng.spec.ask("step_drained", None, eng.spec.proposer.step_drained, eng, drained.batch)
        return StepPlan(overlap, speculate)

    def schedule(self, plan: StepPlan) -> SchedulerOutput:
        """``scheduler.schedule()``; with drafts on the device, every decode-ready request is first
        offered draft slots to reserve (``AsyncSpec.offer_slots``), which the scheduled ones keep in
        ``ScheduledSeq.spec_tokens``."""
        eng = self.engine
        offered = eng.spec.on_device.offer_slots() if plan.drafts_on_device else []
        try:
            return eng.scheduler.schedule()
        finally:
            for seq in offered:
                seq.spec_tokens = []

    def run(self, out: SchedulerOutput, plan: StepPlan) -> None:
        """Run a scheduled step as planned: overlapped, synchronous speculative, or synchronous."""
        if plan.overlap:
            self.overlap(out)
        elif plan.speculate:
            self.engine.spec.run(out)
        else:
            self.run_sync(out)

    def run_sync(self, out: SchedulerOutput) -> None:
        """Launch a step and complete it at once (nothing is in flight)."""
        self.complete(self.launch(out))

    def overlap(self, out: SchedulerOutput) -> None:
        """Launch a step, then complete the one that was in flight while this one runs."""
        prev = self.inflight
        self.inflight = self.launch(out, prev)
        if prev is not None:
            self.engine.stats.overlapped_steps += 1
            self.complete(prev)

    def drain(self) -> InflightStep | None:
        """Complete the step in flight, if any (returned): afterwards every token is on the host."""
        if self.inflight is None:
            return None
        step, self.inflight = self.inflight, None
        self.complete(step)
        return step

    def inflight_seqs(self) -> list[Sequence]:
        return self.inflight.seqs() if self.inflight is not None else []

    def drop(self) -> list[Sequence]:
        """Forget the step in flight (a failed step); returns its requests."""
        seqs, self.inflight = self.inflight_seqs(), None
        return seqs

    # ---- launch ---------------------------------------------------------------------------
    def launch(self, out: SchedulerOutput, prev: InflightStep | None = None) -> InflightStep:
        """prepare + forward + sampling of a scheduled step, queued without waiting for the device.
        ``prev``: the step still in flight, whose sampled tokens fill this step's placeholders."""
        eng = self.engine
        start = eng._idle.start() if eng._idle is not None else None  # before any of this step's device work
        prev_tokens = prev.tokens() if prev is not None else None
        on_device = eng.spec.on_device if eng.spec is not None else None
        drafts = None
        if on_device is not None and ((prev is not None and prev.spec is not None)
                                      or any(s.spec_tokens for s in out.decodes)):
            batch, drafts = on_device.launch(out, prev)  # drafts proposed on the device
        else:  # (with the hidden states a proposer that reads them drafts from at the next launch)
            keep = on_device is not None and eng.spec.proposer.needs_hidden
            if keep and prev is not None and prev.spec is None and prev.batch.hidden is not None:
                # plain after plain: nothing will read the step in flight's hidden states but the proposer now
                eng.spec.ask("step_passed_dormant", None, eng.spec.proposer.step_passed_dormant, eng, prev.batch)
            batch = eng.runner.prepare(out, prev_tokens=prev_tokens, keep_hidden=keep)
        tf = time.perf_counter()
        logits = eng.runner.forward(batch)
        if drafts is not None and drafts.expand is not None:  # decode rows laid out on the device
            logits = logits[drafts.expand]
        eng.stats.forward_time += time.perf_counter() - tf
        step = self.submit(batch, logits, drafts)
        if eng._idle is not None:
            eng._idle.end(start)
        return step

    def submit(self, batch: StepBatch, logits: torch.Tensor, drafts: LaunchDrafts | None = None) -> InflightStep:
        """Queue a step's device work after its forward (prompt logprobs, ``process_logits``, sampling,
        the copy of the results to the host) and advance its requests' scheduling state. ``drafts``:
        drafts proposed on the device (async speculative steps), verified on the device; their
        placeholders count them as accepted until the host learns better (``spec_async.settle``)."""
        eng = self.engine
        tensors: list[torch.Tensor | None] = []
        prompt_lp = []
        for seq, first, count, start in batch.prompt_lp:
            try:
                lp = self.prompt_logprob_tensors(seq, first, count, logits[start : start + count])
            except Exception as exc:
                eng._fail_request(seq, "prompt logprobs", exc)
                continue
            prompt_lp.append((seq, first))
            tensors += lp
        sample = flight = None
        if batch.sample_seqs and drafts is not None:
            sample, flight = self.engine.spec.on_device.sample(batch, logits, drafts)
            tensors = flight.tensors() + (sample.tensors() if sample is not None else
                                          [None] * DeviceSample.NUM_TENSORS) + tensors
        elif batch.sample_seqs:
            batch, sample = self._sample(batch, logits)
        if sample is not None and flight is None:
            tensors = sample.tensors() + tensors
        copy = HostCopy(tensors, eng.platform, eng._pin)
        computed = []
        for s in batch.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens + (len(s.spec_tokens) if flight is not None else 0)
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                seq.metrics.num_computed_prompt_tokens += s.num_new_tokens
            computed.append(seq.num_computed_tokens)
        stride = flight.stride if flight is not None else 1
        for i, seq in enumerate(batch.sample_seqs):
            if seq.is_finished:  # its sampling failed (a speculative step keeps the row)
                continue
            m = flight.drafts[i] if flight is not None else 0
            seq.token_ids.extend(-(i * stride + j + 1) for j in range(m + 1))
            seq.num_pending_tokens += m + 1
            seq.pending_drafts = m
            max_tokens = seq.params.max_tokens
            if ((max_tokens is not None and seq.num_tokens - seq.num_prompt_tokens >= max_tokens)
                    or seq.num_tokens >= eng.max_model_len):
                seq.last_token_pending = True
        eng.stats.launched_steps += 1
        return InflightStep(batch, sample, copy, computed, prompt_lp, flight)

    def _sample(self, batch: StepBatch, logits: torch.Tensor) -> tuple[StepBatch, DeviceSample | None]:
        """``process_logits`` and sampling of the batch's sampling rows. Rows are independent (a draw
        depends only on the request's seed and position), so when the batch raises each row is tried
        alone: a request whose row raises fails alone, the others are sampled together again. Returns
        the batch without the failed requests, and its sample (None when none is left)."""
        try:
            return batch, self._sample_rows(batch, logits)
        except Exception:
            rows = list(zip(batch.sample_seqs, batch.sample_rows))
            bad = []
            for seq, row in rows:
                try:
                    self._sample_rows(replace(batch, sample_seqs=[seq], sample_rows=[row]), logits)
                except Exception as row_exc:
                    bad.append((seq, row_exc))
            if not bad:
                raise  # only the batch as a whole fails: not attributable (the step's requests fail)
            for seq, row_exc in bad:
                self.engine._fail_request(seq, "sampling", row_exc)
            keep = [(seq, row) for seq, row in rows if not seq.is_finished]
            batch = replace(batch, sample_seqs=[s for s, _ in keep], sample_rows=[r for _, r in keep])
            return batch, self._sample_rows(batch, logits) if keep else None

    @torch.inference_mode()
    def _sample_rows(self, batch: StepBatch, logits: torch.Tensor) -> DeviceSample:
        """Sampling rows gathered into a tensor of their own (row i: ``batch.sample_seqs[i]``), which
        ``process_logits`` may edit in place (inference mode: the forward made inference tensors)."""
        eng = self.engine
        if batch.sample_rows == list(range(logits.shape[0])):
            sample_logits = logits  # prompt logprobs were taken already: the step's own tensor is free
        else:
            sample_logits = logits[to_device(batch.sample_rows, torch.long, eng.device, eng._pin)]
        eng.pm.hook.process_logits(engine=eng, batch=batch, logits=sample_logits)
        return eng.sampler.sample(sample_logits, batch.sample_seqs, self._positions(batch))

    def process_rows(self, batch: StepBatch, gather, row_seqs: list[Sequence]) -> tuple[torch.Tensor, set[int]]:
        """``process_logits`` on the rows ``gather()`` returns (row i: ``row_seqs[i]``; a speculative step's
        verify rows), edited in place. When the hook raises, each request's rows are tried alone on a fresh
        gather: a request whose rows raise fails alone, as a plain step's sampling row does, and its rows
        stay unedited (its results are discarded). Returns (the rows, ids of the requests that failed); a
        failure no single request explains is raised."""
        eng = self.engine

        def hook(rows: torch.Tensor, seqs: list[Sequence]) -> None:
            view = replace(batch, scheduled=[], sample_seqs=seqs, sample_rows=list(range(len(seqs))))
            eng.pm.hook.process_logits(engine=eng, batch=view, logits=rows)

        rows = gather()
        try:
            hook(rows, row_seqs)
            return rows, set()
        except Exception:
            rows, bad = gather(), []  # (the failed call may have edited some rows)
            for seq in dict.fromkeys(row_seqs):
                idx = torch.tensor([i for i, s in enumerate(row_seqs) if s is seq], device=rows.device)
                own = rows[idx]
                try:
                    hook(own, [seq] * len(idx))
                    rows[idx] = own
                except Exception as exc:
                    bad.append((seq, exc))
            if not bad:
                raise
        for seq, exc in bad:
            eng._fail_request(seq, "process_logits", exc)
        return rows, {id(seq) for seq, _ in bad}

    def _positions(self, batch: StepBatch) -> list[int] | torch.Tensor:
        """The position each sampling row draws at (its draw's RNG key): the host's lengths, or after a
        speculative step in flight the device's true ones (``StepBatch.sample_pos``)."""
        if batch.sample_pos is None:
            return [s.num_tokens for s in batch.sample_seqs]
        pos, at = batch.sample_pos
        idx = [at[id(s)] for s in batch.sample_seqs]
        if idx == list(range(pos.shape[0])):
            return pos
        return pos[to_device(idx, torch.long, pos.device, self.engine._pin)]

    # ---- complete -------------------------------------------------------------------------
    def complete(self, step: InflightStep) -> None:
        """Wait for a launched step's results on the host and post-process them: prompt logprobs,
        prefix-cache blocks, the sampled tokens over their placeholders, stop checks, hooks. Requests
        that finished since the step was launched (stopped one step earlier, aborted) are skipped:
        their tokens are discarded."""
        eng = self.engine
        tw = time.perf_counter()
        host = step.copy.wait()
        eng.stats.forward_time += time.perf_counter() - tw
        if step.spec is not None:
            base = SpecFlight.NUM_TENSORS + DeviceSample.NUM_TENSORS
        else:
            base = DeviceSample.NUM_TENSORS if step.sample is not None else 0
        for j, (seq, first) in enumerate(step.prompt_lp):
            if not seq.is_finished:
                self._add_prompt_logprobs(seq, first, *host[base + 3 * j : base + 3 * j + 3])
        for s, computed in zip(step.batch.scheduled, step.computed):
            if not s.seq.is_finished:
                eng.blocks.register_full_blocks(s.seq, computed)
        if step.spec is not None:
            eng.spec.on_device.settle(step, host)
        elif step.sample is not None:
            self._complete_tokens(step, host)
        eng.stats.completed_steps += 1

    def _complete_tokens(self, step: InflightStep, host: list[torch.Tensor | None]) -> None:
        eng = self.engine
        res = Sampler.to_result(step.sample.want, host[:DeviceSample.NUM_TENSORS])
        now = time.perf_counter()
        kept: list[int] = []
        stops = []
        for i, seq in enumerate(step.batch.sample_seqs):
            if seq.is_finished:
                eng.stats.discarded_tokens += 1
                continue
            if seq.num_pending_tokens <= 0:
                raise RuntimeError(f"request {seq.request_id}: a sampled token has no placeholder")
            seq.token_ids[seq.num_known_tokens] = res.tokens[i]
            seq.num_pending_tokens -= 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            reason = eng._accept_token(seq, res.tokens[i], res.logprobs[i], res.top[i], res.ranks[i])
            if reason is not None:
                stops.append((seq, reason))
            kept.append(i)
        batch = step.batch
        if len(kept) < len(batch.sample_seqs):
            batch = replace(batch, sample_seqs=[batch.sample_seqs[i] for i in kept],
                            sample_rows=[batch.sample_rows[i] for i in kept])
        eng.pm.hook.tokens_sampled(engine=eng, batch=batch, token_ids=[res.tokens[i] for i in kept])
        eng.finish_stopped(stops)

    # ---- prompt logprobs ------------------------------------------------------------------
    def prompt_logprob_tensors(self, seq: Sequence, first: int, count: int,
                               logits: torch.Tensor) -> list[torch.Tensor | None]:
        """On the device: logprob of prompt tokens first+1 .. first+count, and their top-N."""
        eng = self.engine
        targets = to_device(seq.token_ids[first + 1 : first + 1 + count], torch.long, eng.device, eng._pin)
        lse = eng.kernels.logsumexp(logits)
        own = logits.gather(1, targets[:, None])[:, 0] - lse
        n = min(seq.params.prompt_logprobs or 0, logits.shape[-1])  # clamped to the vocabulary, like logprobs
        if not n:
            return [own, None, None]
        vals, idx = logits.topk(n, dim=-1)
        return [own, idx, vals - lse[:, None]]

    @staticmethod
    def _add_prompt_logprobs(seq: Sequence, first: int, own: torch.Tensor, top_ids: torch.Tensor | None,
                             top_lps: torch.Tensor | None) -> None:
        """Record prompt logprobs from the host copies. Positions already recorded are skipped (a
        request preempted and re-admitted while its earlier chunk was in flight scores them twice)."""
        lps = own.tolist()
        tops = (top_ids.tolist(), top_lps.tolist()) if top_ids is not None else None
        for j, tok in enumerate(seq.token_ids[first + 1 : first + 1 + len(lps)]):
            if first + j < len(seq.prompt_logprobs) - 1:
                continue
            entry = {tok: Logprob(lps[j])}
            if tops:
                for rank, (t, lp) in enumerate(zip(tops[0][j], tops[1][j]), start=1):
                    entry.setdefault(t, Logprob(lp)).rank = rank  # the sampled token too
            seq.prompt_logprobs.append(entry)
