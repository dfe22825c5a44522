"""Speculative steps under async scheduling: drafts proposed, verified and rolled back without a
host sync between steps (the proposer must propose on the device: ``Proposer.proposes_on_device``).

    schedule(N+1): each decode is offered ``k`` draft slots (capped by its length limits, counted
                   with step N's drafts all accepted: an upper bound); the scheduler reserves them in
                   the token and KV budgets like any lookahead
    launch(N+1):   from step N's device results (emitted tokens, accepted counts): each request's
                   last token, true length and tokens in flight -> ``propose_on_device`` -> draft
                   lengths on the device (``draft_lengths`` op, from the proposer's confidences, under
                   the verify budget the host fixed) -> inputs, positions, slot mappings and context
                   lengths corrected on the device, decode rows laid out anew (decodes + budget rows,
                   the rest padding) -> forward -> verify on the device
                   (``rejection.verify_on_device``) -> copy to the host
    complete(N):   the host learns the accepted tokens one step late: it writes them over their
                   placeholders, drops the placeholders of rejected drafts, rolls back
                   ``num_computed_tokens`` and the KV slots past the kept tokens, registers blocks

Host bookkeeping is optimistic while a step is in flight: launching a request with m drafts appends
m + 1 placeholders (``-(i * stride + j + 1)``: row i, emitted slot j of the step's ``emitted``
tensor) and counts its drafts as computed. The next step's lengths are thus upper bounds (slots and
blocks are reserved for them) and its device inputs are shifted back by the rejected count. A
request preempted while its drafts are undecided is not readmitted before they are
(``Sequence.pending_drafts``). The host lays the step out with 1 + slots rows per decode; when the
verify budget is below the slots (``AsyncSpec.budget``: the proposer's ``verify_budget``, else the
share of slots recent steps filled), the device re-lays the decode rows to 1 + length each within
decodes + budget rows (``spec_layout.compact_rows``); logits are computed for those rows only. Not used with window
cache groups, with batch-invariant kernels the rows are not re-laid (every slot is verified).

Host cost: every host-built tensor of a launch reaches the device in two transfers
(``transfer.Upload``): ``prepare``'s inputs with what resolving and drafting read, then the step's
index maps (``_index_maps``: each decode row's request and input source, the block tables, the
re-layout's entries, the verify's grid, seeds and filters), so the patch and the verify are a few
gathers each. A proposer with ``needs_hidden`` gets the step in flight's hidden states
(``StepHidden``: each request's rows and true first positions on the device).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.model_runner import StepBatch
from deepinfer_core.engine.rejection import SamplingRows, verify_on_device
from deepinfer_core.engine.sampler import DeviceSample
from deepinfer_core.engine.sequence import Sequence, Status
from deepinfer_core.engine.spec_layout import compact_rows, patch_rows
from deepinfer_core.engine.spec_timing import StepClock, StepShape
from deepinfer_core.engine.transfer import Upload, to_device
from deepinfer_core.proposer import DeviceDraft, StepHidden
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.engine.pipeline import InflightStep
    from deepinfer_core.engine.speculative import SpecDecoder

logger = logging.getLogger("deepinfer.speculative")
SLOT = 0  # the token id of a reserved draft slot until the device fills it


@dataclass
class LaunchDrafts:
    """The device drafts of a step being launched (decodes with draft slots, in ``out.decodes`` order)."""

    seqs: list[Sequence] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # per request: draft rows laid out (host-fixed)
    tokens: torch.Tensor | None = None  # [n, K] int64
    lengths: torch.Tensor | None = None  # [n] int64: drafts to verify (<= slots), chosen on the device
    first_pos: torch.Tensor | None = None  # [n] int64: true length (index of d_1)
    where: torch.Tensor | None = None  # [n] int64: each request's index in ``out.decodes``
    budget: int = 0  # verify rows for drafts this step (host-fixed): sum(lengths) <= budget <= sum(slots)
    wanted: torch.Tensor | None = None  # [n] int64: drafts each request had before the budget cut
    expand: torch.Tensor | None = None  # compacted steps: logits row of each host-layout logit entry
    maps: dict = field(default_factory=dict)  # the step's index maps on the device (``AsyncSpec._index_maps``)
    rows: torch.Tensor | None = None  # compacted steps: each scheduled request's first row, on the device
    shape: StepShape | None = None  # what the step runs (its launch, decodes and forward rows), for its timing


@dataclass
class SpecFlight:
    """A launched step's verify results: on the device for the next launch, copied for the host."""

    stride: int  # emitted slots per sampling row (largest draft count + 1)
    drafts: list[int]  # per sampling row: its draft rows (0: a plain row)
    emitted: torch.Tensor  # [R, stride] int64: row i emits its first accepted[i] + 1
    accepted: torch.Tensor  # [R] int64
    plain: list[int]  # sampling rows sampled by the plain sampler (its DeviceSample rows, in order)
    drafted: list[int]  # sampling rows verified against drafts
    extra: list[torch.Tensor | None]  # [lengths, wanted, logprobs [Rd, stride], top ids, top logprobs] of the drafted
    epochs: list[int] = field(default_factory=list)  # per sampling row: its preemptions at launch
    drafts_t: torch.Tensor | None = None  # ``drafts`` on the device
    rows: torch.Tensor | None = None  # steps laid out on the device: each scheduled request's first row
    shape: StepShape | None = None  # what the step ran (``spec_timing``)

    NUM_TENSORS = 7

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.emitted, self.accepted, *self.extra]

    def flat(self) -> torch.Tensor:
        return self.emitted.reshape(-1)


class AsyncSpec:
    """The device-resident speculative path of an engine (see the module docstring)."""

    def __init__(self, engine: LLMEngine, spec: SpecDecoder) -> None:
        self.engine, self.spec = engine, spec
        self.used = 1.0  # running share of the offered draft slots the proposer filled (learned one step late)
        self.n = dict(spec_verify_budget=0, spec_draft_slots=0, spec_timed_steps=0, spec_relayouts_skipped=0)
        # per-step wall times for the proposer (``Proposer.step_timed``; ``spec_timing``)
        self.clock = StepClock(inline=not engine.platform.supports_async_overlap())

    def budget(self, requests: int, slots: int) -> int:
        """The step's verify budget (draft rows laid out), fixed by the host before the drafts exist:
        the proposer's (``Proposer.verify_budget``), else the share of slots recent steps filled, with
        headroom, so that slots no draft fills cost no verify rows; the device picks the lengths
        within it (``draft_lengths``)."""
        own = self.spec.ask("verify_budget", None, self.spec.proposer.verify_budget, self.engine, requests, slots)
        if own is not None and (isinstance(own, bool) or not isinstance(own, (int, float)) or math.isnan(own)):
            self.spec.broken(f"verify_budget() must return a number of rows or None, got {own!r}")
            own = None
        if own is not None:  # (+-inf: every slot, none)
            return int(max(0, min(slots, own)))
        return max(0, min(slots, math.ceil(slots * self.used * 1.15 - 0.25)))

    # ---- schedule ----------------------------------------------------------------------------
    def offer_slots(self) -> list[Sequence]:
        """Give every decode-ready request ``k`` draft slots (within its length limits, counted as if
        the step in flight accepts all its drafts; as many of them as the proposer's ``draft_slots``
        takes) for the scheduler to reserve. Returns the requests given slots."""
        eng, k = self.engine, self.spec.k
        ready, room = [], []
        for seq in eng.scheduler.running_requests():
            if seq.status != Status.RUNNING or seq.in_prefill or seq.last_token_pending:
                continue
            m = min(k, eng.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                m = min(m, seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens) - 1)
            if m > 0:
                ready.append(seq)
                room.append(m)
        if ready:  # the proposer may offer fewer (``Proposer.draft_slots``: none makes a plain step)
            try:
                got = list(self.spec.proposer.draft_slots(eng, ready, room))
                if len(got) != len(room):
                    raise TypeError(f"draft_slots() must return {len(room)} counts, got {len(got)}")
                room = [max(0, min(m, int(g))) for m, g in zip(room, got)]
            except Exception as exc:  # noqa: BLE001  (a proposer's bug costs its drafts, not the requests)
                self.spec.broken(f"draft_slots() raised {type(exc).__name__}: {exc}", exc)
                room = [0] * len(room)
        offered = []
        for seq, m in zip(ready, room):
            if m > 0:
                seq.spec_tokens, seq.spec_probs = [SLOT] * m, None
                offered.append(seq)
        return offered

    # ---- launch ------------------------------------------------------------------------------
    def launch(self, out: SchedulerOutput, prev: InflightStep | None) -> tuple[StepBatch, LaunchDrafts | None]:
        """Prepare step N+1 from step N's device results: propose its drafts, then correct its inputs.
        Every host-built tensor goes to the device in two transfers: one with ``prepare``'s inputs
        (plus what resolving and drafting need), one with the step's index maps (``_index_maps``)."""
        eng = self.engine
        decodes = out.decodes
        prev_flight = prev.spec if prev is not None else None
        prev_tokens = prev.tokens() if prev is not None else None
        up = Upload(eng.device, eng._pin)
        h = self._launch_parts(up, decodes, prev_flight, prev_tokens)
        if self.spec.proposer.needs_hidden:
            h["hidden"] = self._hidden_parts(up, [decodes[j].seq for j in h["idx"]], prev)
        batch = eng.runner.prepare(out, prev_tokens=prev_tokens, keep_hidden=self.spec.proposer.needs_hidden,
                                   upload=up)
        if not decodes:
            return batch, None
        t = up.tensors
        last, rej, pending = self._resolve(t, h, prev_flight, prev_tokens)
        true_len = t[h["host_len"]] - rej
        drafts = self._draft(decodes, t, h, last, true_len, pending)
        maps = self._index_maps(batch, out, drafts)
        if drafts is not None:
            drafts.maps = maps
        if prev_flight is not None:  # draws keyed by the true positions, as plain decoding keys them
            mt = maps["t"]
            dec = mt[maps["sample_dec"]]
            pos = mt[maps["sample_len"]] - torch.where(dec >= 0, rej[dec.clamp(min=0)], 0)
            batch.sample_pos = (pos, {id(s): i for i, s in enumerate(batch.sample_seqs)})
        for s in decodes:  # the slots live on in ``ScheduledSeq.spec_tokens``
            s.seq.spec_tokens, s.seq.spec_probs = [], None
        if prev_flight is not None or drafts is not None:
            patch_rows(self.engine, batch, out, maps, last, rej, drafts)
        if self.spec.proposer.needs_hidden and (prev_flight is not None or drafts is not None):
            # the true positions the next draft reads, shifted back on the device: also for a plain
            # step after a speculative one, whose host positions are upper bounds too
            c, np_ = maps["t"][maps["computed"]], batch.num_prefills
            batch.first_dev = torch.cat([c[:np_], c[np_:] - rej])
        if drafts is not None and drafts.budget < sum(drafts.slots):
            compact_rows(self.engine, batch, out, drafts, maps, self.spec.proposer.needs_hidden)
        if drafts is not None:
            drafts.shape = StepShape(eng.stats.launched_steps, len(decodes), int(batch.input_ids.shape[0]),
                                     batch.num_prefills > 0)
        return batch, drafts

    def _launch_parts(self, up: Upload, decodes: list[ScheduledSeq], prev: SpecFlight | None,
                      prev_tokens: torch.Tensor | None) -> dict:
        """Queue what resolving and drafting read: per decode the step in flight's row of its
        placeholders (-1: none), its host-known last token and length; the drafting decodes."""
        stride = prev.stride if prev is not None else 1
        src, host_tok = [], []
        for s in decodes:
            tok = s.seq.token_ids[-1]
            if tok < 0 and prev_tokens is None:
                raise RuntimeError(f"request {s.seq.request_id}: a placeholder token without a step in flight")
            src.append((-tok - 1) // stride if tok < 0 else -1)
            host_tok.append(max(tok, 0))
        idx = [j for j, s in enumerate(decodes) if s.spec_tokens]
        return {"src": up.add(src), "host_tok": up.add(host_tok),
                "host_len": up.add([s.seq.num_tokens for s in decodes]), "idx": idx, "sel": up.add(idx),
                "cap": up.add([len(decodes[j].spec_tokens) for j in idx]),
                "any_pending": any(x >= 0 for x in src)}

    @staticmethod
    def _hidden_parts(up: Upload, seqs: list[Sequence], prev: InflightStep | None) -> dict | None:
        """Queue where each drafting request's rows lie in the step in flight's hidden states."""
        if prev is None or prev.batch.hidden is None or not seqs:
            return None
        batch = prev.batch
        at = {id(s.seq): i for i, s in enumerate(batch.scheduled)}
        where, first, counts = [], [], []
        for seq in seqs:
            i = at.get(id(seq))
            s = batch.scheduled[i] if i is not None else None
            where.append(i if i is not None else 0)
            first.append(batch.computed_before[i] if i is not None else 0)
            counts.append(s.num_new_tokens + len(s.spec_tokens) if s is not None else 0)
        flight = prev.spec
        rows = flight.rows if flight is not None and flight.rows is not None else None
        firsts = batch.first_dev  # (None: a step whose positions are the host's, as laid out)
        return {"where": up.add(where), "counts": counts, "first": first, "dev_rows": rows, "dev_first": firsts,
                "host_rows": None if rows is not None else up.add(batch.row_starts),
                "host_first": None if firsts is not None else up.add(first), "hidden": batch.hidden}

    @staticmethod
    def _step_hidden(t: list[torch.Tensor], h: dict | None) -> StepHidden | None:
        if h is None:
            return None
        rows = h["dev_rows"][t[h["where"]]] if h["dev_rows"] is not None else t[h["host_rows"]][t[h["where"]]]
        first = h["dev_first"][t[h["where"]]] if h["dev_first"] is not None else t[h["host_first"]]
        return StepHidden(h["hidden"], rows, first, h["counts"], h["first"])

    def _resolve(self, t: list[torch.Tensor], h: dict, prev: SpecFlight | None, prev_tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per decode, on the device: its last (query) token, how many of its placeholders the step
        in flight rejected (0 where its tokens are known or that step was a plain one), and the
        tokens that step emits for it ([R, stride], -1 padded)."""
        src, host_t = t[h["src"]], t[h["host_tok"]]
        R = host_t.shape[0]
        if prev_tokens is None or not h["any_pending"]:
            none = torch.full((R, 1), -1, dtype=torch.long, device=host_t.device)
            return host_t, torch.zeros_like(host_t), none
        row = src.clamp(min=0)
        pending = src >= 0
        if prev is None:  # a plain step in flight: its one token per row
            last = torch.where(pending, prev_tokens[row], host_t)
            return last, torch.zeros_like(host_t), torch.where(pending[:, None], last[:, None], -1)
        acc = prev.accepted[row]
        emitted = prev.emitted[row]  # [R, stride]
        last = torch.where(pending, emitted.gather(1, acc[:, None])[:, 0], host_t)
        rej = torch.where(pending, prev.drafts_t[row] - acc, 0)
        j = torch.arange(prev.stride, device=host_t.device)
        tail = torch.where(pending[:, None] & (j[None, :] <= acc[:, None]), emitted, -1)
        return last, rej, tail

    def _draft(self, decodes: list[ScheduledSeq], t: list[torch.Tensor], h: dict, last: torch.Tensor,
               true_len: torch.Tensor, pending: torch.Tensor) -> LaunchDrafts | None:
        """Device drafts for the decodes given slots; a proposer that raises or returns a malformed
        result loses its drafts for this step (every length 0: their slots go unused)."""
        idx = h["idx"]
        if not idx:
            return None
        eng, spec = self.engine, self.spec
        dev = eng.device
        seqs = [decodes[j].seq for j in idx]
        slots = [len(decodes[j].spec_tokens) for j in idx]
        sel, cap = t[h["sel"]], t[h["cap"]]
        K = max(slots)
        budget = sum(slots) if eng.runner.batch_invariant else self.budget(len(decodes), sum(slots))
        self.n["spec_verify_budget"] += budget
        self.n["spec_draft_slots"] += sum(slots)
        first_pos = true_len[sel]
        # no request verifies more drafts than the budget: the proposer drafts no deeper (the slots stay)
        deep = [max(1, min(m, budget)) for m in slots]
        Kp = max(deep)
        try:
            args = (eng, seqs, deep, last[sel], first_pos, pending[sel])
            if spec.proposer.needs_hidden:
                got = spec.proposer.propose_on_device(*args, hidden=self._step_hidden(t, h.get("hidden")))
            else:
                got = spec.proposer.propose_on_device(*args)
            if (not isinstance(got, DeviceDraft) or not isinstance(got.tokens, torch.Tensor)
                    or got.tokens.dim() != 2 or got.tokens.shape[0] != len(seqs) or got.tokens.shape[1] < Kp):
                raise TypeError(f"propose_on_device() must return a DeviceDraft with tokens of shape "
                                f"[{len(seqs)}, >= {Kp}], got {got!r}")
            c = got.confidences
            if c is not None and (not isinstance(c, torch.Tensor) or c.dim() != 2 or c.shape[0] != len(seqs)
                                  or c.shape[1] < Kp):
                raise TypeError(f"DeviceDraft confidences must be a tensor of shape [{len(seqs)}, >= {Kp}], got "
                                f"{tuple(getattr(c, 'shape', ())) or type(c).__name__}")
            mc = got.min_confidence
            if isinstance(mc, bool) or not isinstance(mc, (int, float)) or not 0.0 <= mc <= 1.0:
                raise ValueError(f"DeviceDraft min_confidence must be a number in [0, 1], got {mc!r}")
        except Exception as exc:  # noqa: BLE001  (a proposer's bug costs its drafts, not the requests)
            spec.broken(f"propose_on_device() raised {type(exc).__name__}: {exc}", exc)
            none = torch.zeros(len(seqs), K, dtype=torch.long, device=dev)
            zero = torch.zeros(len(seqs), dtype=torch.long, device=dev)
            return LaunchDrafts(seqs, slots, none, zero, first_pos, sel, budget, zero)
        tokens = got.tokens[:, :Kp].to(dev, torch.long)
        conf = got.confidences[:, :Kp].to(dev, torch.float32) if got.confidences is not None else None
        if Kp < K:  # drafted no deeper than the budget: the columns past it end every row's drafts
            tokens = torch.nn.functional.pad(tokens, (0, K - Kp), value=-1)
            conf = torch.nn.functional.pad(conf, (0, K - Kp)) if conf is not None else None
        V = eng.model_config.vocab_size
        inside = ((tokens >= 0) & (tokens < V)).long().cumprod(1).sum(1)  # an id outside ends the drafts
        lengths = wanted = torch.minimum(cap, inside)
        if conf is not None or budget < sum(slots):  # lengths under the step's verify budget
            conf = (conf.contiguous() if conf is not None
                    else torch.ones(tokens.shape, dtype=torch.float32, device=dev))  # no confidences: fair shares
            lengths = eng.kernels.draft_lengths(conf, lengths, budget, float(got.min_confidence))
        spec.n["spec_proposed"] += sum(slots)
        if budget < sum(slots) and not spec.ask("relayout_pays", True, spec.proposer.relayout_pays, eng, len(decodes),
                                                 sum(slots), budget):
            # the rows stay as laid out (every slot computed, the lengths still within the budget)
            budget = sum(slots)
            self.n["spec_relayouts_skipped"] += 1
        return LaunchDrafts(seqs, slots, tokens.clamp(0, V - 1), lengths, first_pos, sel, budget, wanted)

    def _index_maps(self, batch: StepBatch, out: SchedulerOutput, drafts: LaunchDrafts | None) -> dict:
        """The step's host-known index maps, sent in one transfer: for the patch (each decode row's
        request, where each input token comes from, the block tables), the re-layout (``compact_rows``)
        and the verify (``sample``: which sampling rows are drafted, their logit grid, seeds, filters)."""
        eng = self.engine
        up = Upload(eng.device, eng._pin)
        nd = len(out.decodes)
        D0 = batch.row_starts[batch.num_prefills]
        K = drafts.tokens.shape[1] if drafts is not None else 0
        slot_of = {id(s): j for j, s in enumerate(drafts.seqs)} if drafts is not None else {}
        req, src, ms = [], [], []
        for j, s in enumerate(out.decodes):
            m = len(s.spec_tokens)
            ms.append(m)
            req.extend([j] * (1 + m))
            src.append(j)  # the query row reads ``last``, draft rows the drafts (after ``last`` in one tensor)
            if m:
                d = slot_of[id(s.seq)]
                src.extend(nd + d * K + t for t in range(m))
        h = {"D0": D0, "req": up.add(req), "src": up.add(src), "tables": {}, "computed": up.add(batch.computed_before)}
        seqs = [s.seq for s in out.decodes]
        dec_of = {id(q): j for j, q in enumerate(seqs)}  # each sampling row's decode (-1: a prefill's)
        h.update(sample_dec=up.add([dec_of.get(id(q), -1) for q in batch.sample_seqs]),
                 sample_len=up.add([q.num_tokens for q in batch.sample_seqs]))
        for (pool, _), _names in eng.runner._slot_keys.items():
            if pool not in h["tables"]:
                width = max(len(s.block_tables[pool]) for s in seqs)
                h["tables"][pool] = up.add([s.block_tables[pool] + [0] * (width - len(s.block_tables[pool]))
                                            for s in seqs])
        if drafts is not None:
            if drafts.budget < sum(drafts.slots):  # the re-layout's entry map
                ent_j, ent_t = [], []
                for jj, m in enumerate(ms):
                    ent_j.extend([jj] * (m + 1))
                    ent_t.extend(range(m + 1))
                h.update(starts=up.add([r - D0 for r in batch.row_starts[batch.num_prefills:]]), slots=up.add(ms),
                         ent_j=up.add(ent_j), ent_t=up.add(ent_t),
                         prefill_rows=up.add(batch.row_starts[: batch.num_prefills]))
            h["verify"] = self._verify_parts(up, batch, drafts, slot_of, K)
        up.send()
        h["t"] = up.tensors
        return h

    def _verify_parts(self, up: Upload, batch: StepBatch, drafts: LaunchDrafts, slot_of: dict, K: int) -> dict:
        seqs = batch.sample_seqs
        plain = [i for i, s in enumerate(seqs) if id(s) not in slot_of]
        drafted = [i for i, s in enumerate(seqs) if id(s) in slot_of]
        grid, flat, local, start = [], [], [], 0
        for i in drafted:
            r0, m = batch.sample_rows[i], drafts.slots[slot_of[id(seqs[i])]]
            grid.append([r0 + min(t, m) for t in range(K + 1)])
            local.append([start + min(t, m) for t in range(K + 1)])
            flat.extend(range(r0, r0 + m + 1))
            start += m + 1
        params = [seqs[i].params for i in drafted]
        row_drafts = [0] * len(seqs)
        for i in drafted:
            row_drafts[i] = drafts.slots[slot_of[id(seqs[i])]]
        h = {"plain": plain, "drafted": drafted, "row_drafts": row_drafts, "plain_t": up.add(plain),
             "drafted_t": up.add(drafted), "grid": up.add(grid), "flat": up.add(flat), "local": up.add(local),
             "sel": up.add([slot_of[id(seqs[i])] for i in drafted]), "seeds": up.add([seqs[i].seed for i in drafted]),
             "in_order": [slot_of[id(seqs[i])] for i in drafted] == list(range(len(drafted))),
             "row_drafts_t": up.add(row_drafts), "greedy": all(p.temperature <= 0 for p in params)}
        if not h["greedy"]:
            h["rows"] = (up.add([p.temperature for p in params], torch.float32),
                         up.add([max(p.top_k, 0) for p in params]),
                         up.add([p.top_p for p in params], torch.float32), up.add([p.min_p for p in params],
                                                                                  torch.float32))
        return h

    # ---- sample and verify -------------------------------------------------------------------
    def sample(self, batch: StepBatch, logits: torch.Tensor, drafts: LaunchDrafts
               ) -> tuple[DeviceSample | None, SpecFlight]:
        """The plain rows through the pipeline's sampler, the drafted rows verified on the device."""
        eng = self.engine
        dev, pin = eng.device, eng._pin
        h = drafts.maps["verify"]
        t = drafts.maps["t"]
        plain, drafted = h["plain"], h["drafted"]
        R = len(batch.sample_seqs)
        K = drafts.tokens.shape[1]
        stride = K + 1
        sample = None
        plain_t = t[h["plain_t"]]
        if plain:
            sub = replace(batch, sample_seqs=[batch.sample_seqs[i] for i in plain],
                          sample_rows=[batch.sample_rows[i] for i in plain])
            kept, sample = eng.pipeline._sample(sub, logits)
            alive = {id(s) for s in kept.sample_seqs}
            if len(alive) < len(plain):  # a row's sampling failed: the others' places
                plain = [i for i in plain if id(batch.sample_seqs[i]) in alive]
                plain_t = to_device(plain, torch.long, dev, pin)
        if plain or drafted != list(range(R)):
            emitted = torch.zeros(R, stride, dtype=torch.long, device=dev)
            accepted = torch.zeros(R, dtype=torch.long, device=dev)
        else:  # every sampling row verified, in order: the verify's own tensors
            emitted = accepted = None
        if sample is not None:
            emitted[plain_t, 0] = sample.tokens
        with torch.inference_mode():
            extra, emitted, accepted = self._verify(batch, logits, drafts, h, t, emitted, accepted)
        epochs = [s.metrics.num_preemptions for s in batch.sample_seqs]
        return sample, SpecFlight(stride, h["row_drafts"], emitted, accepted, plain, drafted, extra, epochs,
                                  t[h["row_drafts_t"]], drafts.rows, drafts.shape)

    def _verify(self, batch: StepBatch, logits: torch.Tensor, drafts: LaunchDrafts, h: dict,
                t: list[torch.Tensor], emitted: torch.Tensor | None, accepted: torch.Tensor | None
                ) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Verify the drafted rows on the device into ``emitted``/``accepted`` (None: every sampling
        row is drafted, in order; the verify's own tensors are returned as them)."""
        eng = self.engine
        K = drafts.tokens.shape[1]
        seqs = [batch.sample_seqs[i] for i in h["drafted"]]
        if eng.pm.hook.process_logits.get_hookimpls():  # the verified rows, for the hooks to edit
            row_seqs = [seq for seq, i in zip(seqs, h["drafted"]) for _ in range(h["row_drafts"][i] + 1)]
            # (a request whose rows make the hooks raise fails alone; its results are discarded at settle)
            spec, _ = eng.pipeline.process_rows(batch, lambda: logits[t[h["flat"]]], row_seqs)
            target = spec[t[h["local"]]]  # [Rd, K + 1, V]: rows past a request's slots repeat its last
        else:
            target = logits[t[h["grid"]]]
        params = [s.params for s in seqs]
        rows = None if h["greedy"] else SamplingRows(*(t[i] for i in h["rows"]))
        if h["in_order"]:  # the sampling rows list the drafting requests in their order
            lengths, dtok, first, wanted = drafts.lengths, drafts.tokens, drafts.first_pos, drafts.wanted
        else:
            sel = t[h["sel"]]
            lengths, dtok, first, wanted = (drafts.lengths[sel], drafts.tokens[sel], drafts.first_pos[sel],
                                            drafts.wanted[sel])
        tokens, acc = verify_on_device(target, dtok, lengths, rows, t[h["seeds"]], first, params, eng.kernels.sample)
        if emitted is None:
            emitted, accepted = tokens, acc
        else:
            where = t[h["drafted_t"]]
            emitted[where, : K + 1] = tokens
            accepted[where] = acc
        lse = torch.logsumexp(target, dim=-1)  # [Rd, K + 1]
        lps = target.gather(2, tokens[..., None])[..., 0] - lse
        n = min(max((p.logprobs or 0) for p in params), target.shape[-1])
        top_ids = top_lps = None
        if n:
            top_lps, top_ids = target.topk(n, dim=-1)
            top_lps = top_lps - lse[..., None]
        return [lengths, wanted, lps, top_ids, top_lps], emitted, accepted

    # ---- complete ----------------------------------------------------------------------------
    def settle(self, step, host: list[torch.Tensor | None]) -> None:
        """Post-process a completed speculative step: place each request's kept tokens over their
        placeholders, drop the rejected ones, roll back computed tokens and KV slots, register
        blocks; then ``tokens_sampled``, ``request_finished`` (stops) and the proposer's feedback."""
        eng, flight = self.engine, step.spec
        emitted, accepted, lengths, wanted, lps, top_ids, top_lps = (t.tolist() if t is not None else None
                                                             for t in host[: SpecFlight.NUM_TENSORS])
        res = None
        if step.sample is not None:
            from deepinfer_core.engine.sampler import Sampler

            base = SpecFlight.NUM_TENSORS
            res = Sampler.to_result(step.sample.want, host[base : base + DeviceSample.NUM_TENSORS])
        d_of = {i: j for j, i in enumerate(flight.drafted)}
        p_of = {i: j for j, i in enumerate(flight.plain)}
        placed_seqs, placed, stops = [], [], []
        fb_seqs, fb_drafts, fb_acc = [], [], []
        for i, seq in enumerate(step.batch.sample_seqs):
            m = flight.drafts[i]
            if seq.is_finished:
                eng.stats.discarded_tokens += 1
                continue
            if i not in d_of and i not in p_of:  # its sampling failed: the request failed with it
                continue
            a = accepted[i] if i in d_of else 0
            k0 = seq.num_known_tokens
            if seq.num_pending_tokens < m + 1 or seq.token_ids[k0] != -(i * flight.stride + 1):
                raise RuntimeError(f"request {seq.request_id}: the step's placeholders are not where expected")
            del seq.token_ids[k0 + a + 1 : k0 + m + 1]  # the rejected drafts' placeholders
            seq.num_pending_tokens -= m - a
            seq.pending_drafts = 0
            same = seq.status == Status.RUNNING and seq.metrics.num_preemptions == flight.epochs[i]
            if same:
                seq.num_computed_tokens -= m - a
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = time.perf_counter()
            for j in range(a + 1):
                tok = emitted[i][j]
                seq.token_ids[seq.num_known_tokens] = tok
                seq.num_pending_tokens -= 1
                if i in d_of:
                    r = d_of[i]
                    top = list(zip(top_ids[r][j], top_lps[r][j])) if top_ids is not None and seq.params.logprobs \
                        else None
                    if top is not None:
                        top = top[: seq.params.logprobs]
                    reason = eng._accept_token(seq, tok, lps[r][j], top)
                else:
                    r = p_of[i]
                    reason = eng._accept_token(seq, tok, res.logprobs[r], res.top[r], res.ranks[r])
                placed_seqs.append(seq)
                placed.append(tok)
                if reason is not None:
                    stops.append((seq, reason))
                    break
            if same:
                eng.blocks.truncate(seq, seq.num_tokens)  # slots past what is kept or still in flight
                eng.blocks.register_full_blocks(seq, seq.num_known_tokens - 1)
            seq.last_token_pending = bool(seq.num_pending_tokens) and (
                (seq.params.max_tokens is not None and seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens)
                or seq.num_tokens >= eng.max_model_len)
            if i in d_of:
                fb_seqs.append(seq)
                fb_drafts.append(lengths[d_of[i]])
                fb_acc.append(a)
                seq.metrics.num_draft_tokens += lengths[d_of[i]]
                seq.metrics.num_accepted_draft_tokens += a
        if flight.drafted:
            self.used = 0.5 * self.used + 0.5 * sum(wanted) / max(1, sum(flight.drafts[i] for i in flight.drafted))
            n = self.spec.n
            n["spec_steps"] += 1
            n["spec_verified"] += sum(lengths)
            n["spec_accepted"] += sum(accepted[i] for i in flight.drafted)
        view = replace(step.batch, scheduled=[], sample_seqs=placed_seqs, sample_rows=list(range(len(placed))))
        eng.pm.hook.tokens_sampled(engine=eng, batch=view, token_ids=placed)
        eng.finish_stopped(stops)
        if fb_seqs:
            self.spec.ask("verified", None, self.spec.proposer.verified, eng, fb_seqs, fb_drafts, fb_acc)
        timed = self.clock.completed(eng, flight)
        if timed is not None:
            self.n["spec_timed_steps"] += 1
            self.spec.ask("step_timed", None, self.spec.proposer.step_timed, eng, *timed)
