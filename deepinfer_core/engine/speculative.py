"""Speculative decoding in the engine: proposals become scheduled lookahead tokens.

    after a step:  proposer.propose(decode-ready requests) -> seq.spec_tokens
    schedule:      the scheduler reserves each decode's lookahead slots (``ScheduledSeq.spec_tokens``)
    step:          one forward over [last token, d_1..d_m] per decode; rows without drafts are
                   sampled and post-processed as usual; drafted rows go through ``process_logits``,
                   rejection sampling (``engine.rejection``), ``append_tokens`` and a roll-back of
                   the rejected tokens (KV slots past the kept tokens, block registration)

Without async scheduling, or with a proposer that proposes on the host only, speculative steps run
synchronously: the verify result decides the next step's input. With async scheduling and a proposer
that proposes on the device (``Proposer.proposes_on_device``) they overlap like plain steps:
``engine/spec_async.py`` keeps the accepted counts, positions and slots on the device and the host
learns the kept tokens one step later; a step with a request that needs its tokens on the host
(penalties, grammar masks) runs here, synchronously.
Hook order is the engine's: ``tokens_sampled`` for every kept token, then ``request_finished``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from deepinfer_core import plugins
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.model_runner import StepBatch
from deepinfer_core.engine.rejection import SamplingRows, filtered_probs, verify
from deepinfer_core.engine.sampler import has_penalty
from deepinfer_core.engine.sequence import Sequence, Status
from deepinfer_core.engine.spec_async import AsyncSpec
from deepinfer_core.engine.spec_floor import SpecFloor
from deepinfer_core.proposer import GROUP, MAX_K, Draft, Proposer
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger("deepinfer.speculative")
# a draft distribution's row sum may be this far from 1 (a low-precision softmax); rows are renormalised
PROBS_SUM_TOL = 1e-2


def load_proposer(section: dict, engine) -> tuple[Proposer, int, bool]:
    """The ``[speculative]`` table -> (proposer instance, started on ``engine``; k; floor)."""
    sec = dict(section)
    name = sec.pop("proposer", None)
    k = sec.pop("k", 4)
    floor = sec.pop("floor", True)
    if not isinstance(floor, bool):
        raise ConfigError(f"[speculative] floor must be true or false, got {floor!r}")
    if not isinstance(name, str) or not name:
        names = ", ".join(plugins.installed_names(GROUP)) or "none"
        raise ConfigError(f"[speculative] needs proposer = '<name>' (installed proposers: {names}), got {name!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ConfigError(f"[speculative] k must be an int in 1..{MAX_K}, got {k!r}")
    cls = plugins.load(GROUP, name, what="proposer")
    what = "construct"
    try:
        proposer = cls(sec)
        what = "start"
        proposer.start(engine)
    except ConfigError:
        raise
    except Exception as exc:
        raise plugins.PluginError(f"proposer {name!r} failed to {what}: {type(exc).__name__}: {exc}") from exc
    return proposer, k, floor


class _RowView:
    """A verify row as the sampler's penalties read it: the request with ``extra`` drafts as output."""

    __slots__ = ("params", "prompt_token_ids", "output_token_ids")

    def __init__(self, seq: Sequence, extra: list[int]) -> None:
        self.params, self.prompt_token_ids = seq.params, seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + extra


class SpecDecoder:
    """Runs an engine's steps when a proposer is configured."""

    def __init__(self, engine, proposer: Proposer, k: int, from_feature: bool, floor: bool = True) -> None:
        self.engine, self.proposer, self.k = engine, proposer, k
        #: speculative against plain steps, measured per batch size (a proposer that paces itself: None)
        self.floor = SpecFloor() if floor and not proposer.paces_itself else None
        self.from_feature = from_feature  # a feature's proposer gets request_finished as a hook already
        self.name = type(proposer).__name__
        self.n = dict(spec_steps=0, spec_verified=0, spec_accepted=0, spec_proposed=0, spec_dormant_steps=0,
                      spec_proposer_errors=0)
        self._active = True
        self._pending_drafts = False  # the last speculative step proposed drafts
        #: async speculative steps (drafts proposed and verified on the device), or None: synchronous ones.
        #: Not with window cache groups: their blocks are freed from the (optimistic) computed count.
        #: ``async_speculation = false`` keeps them synchronous (plain steps still overlap); a proposer may
        #: also ask for a synchronous step now and then (``step_needs_sync``, as DSpark does at a few requests
        #: where the forward runs inline).
        windows = any(g.window is not None for g in engine.cache_layout.groups)
        self.on_device = (AsyncSpec(engine, self) if proposer.proposes_on_device and engine.async_scheduling
                          and engine.cfg.async_speculation and not windows else None)
        if engine.async_scheduling and self.on_device is None:
            why = ("with window cache groups" if windows else "which does not propose on the device"
                   if not proposer.proposes_on_device else "async_speculation = false")
            logger.info("async scheduling: speculative steps (proposer %s, %s) run synchronously; plain steps "
                        "while it is dormant overlap", self.name, why)

    def active(self) -> bool:
        """Whether the coming step is speculative (synchronous, verified, proposals after it). With
        async scheduling on the proposer may go dormant (``Proposer.active``): plain async steps;
        never while drafts proposed by the last step wait to be verified."""
        eng = self.engine
        if self._pending_drafts:  # drafts proposed last step are verified now
            now = True
        else:  # a proposer that fails to answer goes dormant for the step
            now = not eng.async_scheduling or bool(self.ask("active", False, self.proposer.active, eng))
            now = now and self._floor_says()
        if self._active and not now:  # going dormant: drafts left on requests not in the last step go too
            for seq in eng.unfinished_requests():
                seq.spec_tokens, seq.spec_probs = [], None
        self._active = now
        self.n["spec_dormant_steps"] += not now
        return now

    def _floor_says(self) -> bool:
        return self.floor is None or self.floor.speculate(self.engine.scheduler.num_running())

    def observe(self, speculative: bool, out: SchedulerOutput, seconds: float, tokens: int) -> None:
        """A ``step()`` call's mode, wall time and emitted tokens, for the floor."""
        if self.floor is not None:
            self.floor.observe(speculative, self.engine.scheduler.num_running(), tokens, seconds, bool(out.prefills))

    @classmethod
    def create(cls, engine) -> SpecDecoder | None:
        """The engine's speculative decoder: from the ``[speculative]`` table (an entry-point
        proposer) or a feature's ``speculative_proposer`` hook; None when neither."""
        hooked = engine.pm.hook.speculative_proposer(engine=engine)
        if engine.cfg.speculative and hooked is not None:
            raise ConfigError(f"[speculative] is set but feature proposer {type(hooked).__name__} is enabled "
                              "too; use one")
        if hooked is not None:
            return cls(engine, hooked, hooked.k, from_feature=True)
        if not engine.cfg.speculative:
            return None
        proposer, k, floor = load_proposer(engine.cfg.speculative, engine)
        return cls(engine, proposer, k, from_feature=False, floor=floor)

    def request_finished(self, seq: Sequence) -> None:
        if not self.from_feature:
            self.ask("request_finished", None, self.proposer.request_finished, self.engine, seq)

    def eligible(self, seq: Sequence) -> bool:
        """Whether a request may get drafts: every request (penalties are applied per verified row,
        feature masks per verified row through ``process_logits``)."""
        return True

    # ---- one step --------------------------------------------------------------------------
    def run(self, out: SchedulerOutput) -> None:
        """prepare + forward + post-processing of a scheduled step, drafts verified; then the
        proposals for the next step."""
        eng = self.engine
        idle = eng._idle.start() if eng._idle is not None else None  # measure_device_idle (before the inputs)
        batch = eng.runner.prepare(out, keep_hidden=self.proposer.needs_hidden)
        tf = time.perf_counter()
        logits = eng.runner.forward(batch)
        eng.platform.synchronize()  # the verify reads the results at once: time the forward alone
        batch.forward_s = time.perf_counter() - tf
        eng.stats.forward_time += batch.forward_s
        drafted = [s for s in out.decodes if s.spec_tokens]
        if drafted:
            ids = {id(s.seq) for s in drafted}
            keep = [i for i, s in enumerate(batch.sample_seqs) if id(s) not in ids]
            normal = replace(batch, scheduled=[s for s in batch.scheduled if id(s.seq) not in ids],
                             sample_seqs=[batch.sample_seqs[i] for i in keep],
                             sample_rows=[batch.sample_rows[i] for i in keep])
            eng.pipeline.complete(eng.pipeline.submit(normal, logits))
            with torch.inference_mode():
                self._verify(batch, logits, drafted)
        else:
            eng.pipeline.complete(eng.pipeline.submit(batch, logits))
        for s in out.prefills + out.decodes:
            s.seq.spec_tokens, s.seq.spec_probs = [], None
        self._pending_drafts = False
        if self._floor_says():  # (else the next step is a plain one)
            self._propose(out, batch)
        if eng._idle is not None:  # the device works through verify and drafting: idle is what follows
            eng._idle.end(idle)

    def _verify(self, batch: StepBatch, logits: torch.Tensor, drafted: list[ScheduledSeq]) -> None:
        eng = self.engine
        dev = logits.device
        where = {id(s): i for i, s in enumerate(batch.sample_seqs)}
        rows, row_seqs = [], []
        for s in drafted:
            r0 = batch.sample_rows[where[id(s.seq)]]
            rows.extend(range(r0, r0 + len(s.spec_tokens) + 1))
            row_seqs.extend([s.seq] * (len(s.spec_tokens) + 1))
        rows_t = torch.tensor(rows, device=dev)
        spec, failed = eng.pipeline.process_rows(batch, lambda: logits[rows_t], row_seqs)
        if failed:  # those requests failed alone: the others are verified
            keep = [i for i, s in enumerate(row_seqs) if id(s) not in failed]
            drafted = [s for s in drafted if id(s.seq) not in failed]
            if not drafted:
                return
            spec = spec[torch.tensor(keep, device=dev)]
        seqs = [s.seq for s in drafted]
        drafts = [s.spec_tokens for s in drafted]
        greedy = [s.params.temperature <= 0 for s in seqs]
        first_pos = [s.num_tokens for s in seqs]
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev)
        target = self._penalised(spec, seqs, drafts)  # what is sampled; logprobs come from ``spec``
        if all(greedy):
            probs, q, argmax = None, None, target.argmax(-1).tolist()
        else:
            probs = filtered_probs(target, SamplingRows.from_params([s.params for s in row_seqs], dev))
            q = torch.cat([self._draft_probs(seq, d, spec.shape[-1], dev) for seq, d in zip(seqs, drafts)])
            argmax = None
        point = [s.spec_probs is None for s in seqs]  # a deterministic proposer's drafts: coupled draws
        tokens, accepted = verify(probs, q, drafts, seeds, first_pos, greedy, argmax, point)
        logprobs, tops = self._logprobs(spec, seqs, tokens, self._starts(drafts))
        computed = [s.num_computed_tokens + 1 + a for s, a in zip(seqs, accepted)]
        stops = eng.append_tokens(seqs, tokens, logprobs, tops)
        kept = []
        for seq, toks, first, c, d, a in zip(seqs, tokens, first_pos, computed, drafts, accepted):
            seq.metrics.num_draft_tokens += len(d)
            seq.metrics.num_accepted_draft_tokens += a
            seq.num_computed_tokens = min(c, seq.num_tokens - 1)  # a stop may end the kept tokens early
            eng.blocks.truncate(seq, seq.num_tokens)  # roll back the rejected tokens' KV slots
            eng.blocks.register_full_blocks(seq)
            kept.append(toks[: seq.num_tokens - first])
        n = self.n
        n["spec_steps"] += 1
        n["spec_verified"] += sum(len(d) for d in drafts)
        n["spec_accepted"] += sum(accepted)
        flat = [s for s, toks in zip(seqs, kept) for _ in toks]
        view = replace(batch, scheduled=[], sample_seqs=flat, sample_rows=list(range(len(flat))))
        eng.pm.hook.tokens_sampled(engine=eng, batch=view, token_ids=[t for toks in kept for t in toks])
        eng.finish_stopped(stops)
        self.ask("verified", None, self.proposer.verified, eng, seqs, [len(d) for d in drafts], accepted)

    def _penalised(self, spec: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """The verify rows with each request's penalties, row j counting its drafts d_1..d_j as
        output (what plain decoding would see had they been sampled); no state to roll back."""
        if not any(has_penalty(s) for s in seqs):
            return spec
        views = [_RowView(s, d[:j]) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
        return self.engine.sampler.penalise(spec.clone(), views)

    @staticmethod
    def _starts(drafts: list[list[int]]) -> list[int]:
        out, r = [], 0
        for d in drafts:
            out.append(r)
            r += len(d) + 1
        return out

    @staticmethod
    def _draft_probs(seq: Sequence, draft: list[int], vocab: int, dev) -> torch.Tensor:
        """q rows of a request's drafts: the proposer's distributions, else point masses."""
        if seq.spec_probs is not None:
            q = seq.spec_probs[: len(draft)].to(dev, torch.float32)
            return q / q.sum(-1, keepdim=True)
        q = torch.zeros(len(draft), vocab, device=dev)
        q[torch.arange(len(draft), device=dev), torch.tensor(draft, device=dev)] = 1.0
        return q

    @staticmethod
    def _logprobs(spec: torch.Tensor, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]):
        """Logprob (and requested top-N) of each emitted token under its target row."""
        dev = spec.device
        rows = [starts[i] + j for i, toks in enumerate(tokens) for j in range(len(toks))]
        er = torch.tensor(rows, device=dev)
        lse = torch.logsumexp(spec[er], dim=-1)
        flat = (spec[er, torch.tensor([t for toks in tokens for t in toks], device=dev)] - lse).tolist()
        logprobs, tops, k = [], [], 0
        for seq, toks in zip(seqs, tokens):
            logprobs.append(flat[k : k + len(toks)])
            n = min(seq.params.logprobs or 0, spec.shape[-1])
            if n:
                vals, idx = spec[er[k : k + len(toks)]].topk(n, dim=-1)
                vals = vals - lse[k : k + len(toks), None]
                tops.append([list(zip(a, b)) for a, b in zip(idx.tolist(), vals.tolist())])
            else:
                tops.append([None] * len(toks))
            k += len(toks)
        return logprobs, tops

    # ---- proposals -------------------------------------------------------------------------
    def _propose(self, out: SchedulerOutput, batch: StepBatch) -> None:
        eng = self.engine
        ready, room = [], []
        for s in out.prefills + out.decodes:
            seq = s.seq
            if (seq.is_finished or seq.status != Status.RUNNING or seq.num_pending_tokens
                    or seq.num_computed_tokens != seq.num_tokens - 1 or not self.eligible(seq)):
                continue
            m = min(self.k, eng.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                m = min(m, seq.params.max_tokens - seq.num_output_tokens - 1)
            if m > 0 or self.proposer.writes_draft_kv:
                ready.append(seq)
                room.append(max(m, 0))
        if self.proposer.writes_draft_kv:
            ready, room = self._reserve(out, ready, room)
        if not ready:
            return
        try:
            drafts = self.proposer.propose(eng, ready, room, batch)
        except Exception as exc:  # noqa: BLE001  (a proposer's bug costs its drafts, not the requests)
            drafts = None
            self.broken(f"propose() raised {type(exc).__name__}: {exc}", exc)
        self._check(ready, room, drafts)
        if self.proposer.writes_draft_kv:  # give back the reserved slots no kept draft uses
            for seq in ready:
                eng.blocks.truncate(seq, seq.num_tokens + len(seq.spec_tokens))

    def _reserve(self, out: SchedulerOutput, ready: list[Sequence], room: list[int]
                 ) -> tuple[list[Sequence], list[int]]:
        """KV blocks for each request's last token and its ``room`` drafts, for a proposer that
        writes KV at the draft positions (``Proposer.writes_draft_kv``): fewer drafts when memory is
        short (a block of headroom per live request is kept); a request without even its last
        token's slot is left out."""
        blocks = self.engine.blocks
        n_live = sum(1 for s in out.prefills + out.decodes if not s.seq.is_finished)
        got, got_room = [], []
        for seq, m in zip(ready, room):
            L = seq.num_tokens
            if not blocks.can_allocate(seq, L):
                continue
            blocks.allocate(seq, L)
            while m > 0:
                extra = blocks.blocks_needed(seq, L + m)
                if extra == 0 or (blocks.can_allocate(seq, L + m) and blocks.num_free - extra >= n_live):
                    blocks.allocate(seq, L + m)
                    break
                m -= 1
            got.append(seq)
            got_room.append(m)
        return got, got_room

    def _check(self, ready: list[Sequence], room: list[int], drafts) -> None:
        """Keep the drafts that meet the contract (``seq.spec_tokens``); drop the others, logged."""
        if drafts is None:
            return
        if not isinstance(drafts, list) or len(drafts) != len(ready):
            return self.broken(f"propose() must return a list of {len(ready)} drafts (one Draft or None per "
                                f"request), got {type(drafts).__name__}")
        V = self.engine.model_config.vocab_size
        for seq, m, d in zip(ready, room, drafts):
            if d is None or (isinstance(d, Draft) and not d.tokens):
                continue
            if not isinstance(d, Draft) or len(d.tokens) > m or not all(
                    isinstance(t, int) and 0 <= t < V for t in d.tokens):
                self.broken(f"request {seq.request_id} got an invalid draft {d!r}; expected a Draft of at most "
                             f"{m} token ids in [0, {V})")
                continue
            if d.probs is not None and (not isinstance(d.probs, torch.Tensor)
                                        or tuple(d.probs.shape) != (len(d.tokens), V)):
                self.broken(f"request {seq.request_id}: draft probs of shape {tuple(getattr(d.probs, 'shape', ()))}, "
                             f"expected a tensor of shape {(len(d.tokens), V)}")
                continue
            why = self._probs_problem(d.probs, d.tokens) if d.probs is not None and seq.params.temperature > 0 else None
            if why:  # rejection sampling against a wrong q would bias the request's samples, silently
                self.broken(f"request {seq.request_id}: draft probs with {why}; expected each row the "
                             f"distribution its draft token was drawn from")
                continue
            seq.spec_tokens, seq.spec_probs = list(d.tokens), d.probs
            self.n["spec_proposed"] += len(d.tokens)
            self._pending_drafts = True

    @staticmethod
    def _probs_problem(probs: torch.Tensor, tokens: list[int]) -> str | None:
        """What is wrong with a sampled request's draft distributions ``[m, V]``, or None: rejection
        sampling is exact only against the distributions the drafts were drawn from."""
        if not probs.is_floating_point():
            return f"dtype {probs.dtype} (not floating point)"
        q = probs.detach().float()
        at = q[torch.arange(len(tokens), device=q.device), torch.tensor(tokens, device=q.device)]
        checks = {"a value that is not finite": ~torch.isfinite(q), "a negative value": q < 0,
                  f"a row whose sum is not 1 (within {PROBS_SUM_TOL})": (q.sum(-1) - 1).abs() > PROBS_SUM_TOL,
                  "probability 0 at its own draft token": at <= 0}
        bad = torch.stack([c.any() for c in checks.values()]).tolist()  # one read back for all four
        return next((name for name, b in zip(checks, bad) if b), None)

    def ask(self, what: str, default, method, *args):
        """``method(*args)``, one of the proposer's answers or notifications: if it raises, the error is
        logged naming the proposer (``broken``) and ``default`` stands in, so a proposer's bug costs its
        drafts, never the step's requests."""
        try:
            return method(*args)
        except Exception as exc:  # noqa: BLE001
            self.broken(f"{what}() raised {type(exc).__name__}: {exc}", exc)
            return default

    def broken(self, what: str, exc: Exception | None = None) -> None:
        """A proposer broke its contract: the drafts concerned are dropped for this step (those
        requests decode one token, as without speculation), logged with the proposer named and
        counted (``spec_proposer_errors``)."""
        self.n["spec_proposer_errors"] += 1
        logger.error("proposer %s: %s; its drafts are dropped for this step", self.name, what,
                     exc_info=exc is not None)

    def metrics(self) -> dict:
        n = self.n
        if self.on_device is not None:
            n = {**n, **self.on_device.n}
        if self.floor is not None:
            n = {**n, **self.floor.metrics(), "spec_floor_switches": self.floor.switches}
        return {**n, "spec_proposer": self.proposer.name or self.name, "spec_k": self.k,
                "spec_accept_rate": n["spec_accepted"] / n["spec_verified"] if n["spec_verified"] else 0.0,
                "spec_accepted_per_step": n["spec_accepted"] / n["spec_steps"] if n["spec_steps"] else 0.0}
