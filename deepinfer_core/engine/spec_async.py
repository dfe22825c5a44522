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
decodes + budget rows (``_compact``); logits are computed for those rows only. Not used with window
cache groups, with batch-invariant kernels the rows are not re-laid (every slot is verified).
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
from deepinfer_core.engine.transfer import to_device
from deepinfer_core.proposer import DeviceDraft
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine
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
        self.n = dict(spec_verify_budget=0, spec_draft_slots=0)

    def budget(self, requests: int, slots: int) -> int:
        """The step's verify budget (draft rows laid out), fixed by the host before the drafts exist:
        the proposer's (``Proposer.verify_budget``), else the share of slots recent steps filled, with
        headroom, so that slots no draft fills cost no verify rows; the device picks the lengths
        within it (``draft_lengths``)."""
        own = self.spec.proposer.verify_budget(self.engine, requests, slots)
        if own is not None:
            return max(0, min(slots, int(own)))
        return max(0, min(slots, math.ceil(slots * self.used * 1.15 - 0.25)))

    # ---- schedule ----------------------------------------------------------------------------
    def offer_slots(self) -> list[Sequence]:
        """Give every decode-ready request ``k`` draft slots (within its length limits, counted as if
        the step in flight accepts all its drafts) for the scheduler to reserve. Returns them."""
        eng, k = self.engine, self.spec.k
        offered = []
        for seq in eng.scheduler.running_requests():
            if seq.status != Status.RUNNING or seq.in_prefill or seq.last_token_pending:
                continue
            m = min(k, eng.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                m = min(m, seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens) - 1)
            if m > 0:
                seq.spec_tokens, seq.spec_probs = [SLOT] * m, None
                offered.append(seq)
        return offered

    # ---- launch ------------------------------------------------------------------------------
    def launch(self, out: SchedulerOutput, prev_flight: SpecFlight | None, prev_tokens: torch.Tensor | None,
               ) -> tuple[StepBatch, LaunchDrafts | None]:
        """Prepare step N+1 from step N's device results: propose its drafts, then correct its inputs."""
        eng = self.engine
        dev, pin = eng.device, eng._pin
        decodes = out.decodes
        last, rej, pending = self._resolve(decodes, prev_flight, prev_tokens)
        host_len = to_device([s.seq.num_tokens for s in decodes], torch.long, dev, pin) if decodes else None
        true_len = host_len - rej if decodes else None
        drafts = self._draft(decodes, last, true_len, pending)
        batch = eng.runner.prepare(out, prev_tokens=prev_tokens, keep_hidden=self.spec.proposer.needs_hidden)
        for s in decodes:  # the slots live on in ``ScheduledSeq.spec_tokens``
            s.seq.spec_tokens, s.seq.spec_probs = [], None
        if decodes and (prev_flight is not None or drafts is not None):
            self._patch(batch, out, last, rej, drafts)
        if drafts is not None and drafts.budget < sum(drafts.slots):
            self._compact(batch, out, drafts)
        return batch, drafts

    def _resolve(self, decodes: list[ScheduledSeq], prev: SpecFlight | None, prev_tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Per decode, on the device: its last (query) token, how many of its placeholders the step
        in flight rejected (0 where its tokens are known or that step was a plain one), and the
        tokens that step emits for it ([R, stride], -1 padded)."""
        if not decodes:
            return None, None, None
        eng = self.engine
        dev, pin = eng.device, eng._pin
        stride = prev.stride if prev is not None else 1
        src, host_tok = [], []
        for s in decodes:
            tok = s.seq.token_ids[-1]
            if tok < 0 and prev_tokens is None:
                raise RuntimeError(f"request {s.seq.request_id}: a placeholder token without a step in flight")
            src.append((-tok - 1) // stride if tok < 0 else -1)
            host_tok.append(max(tok, 0))
        src_t = to_device(src, torch.long, dev, pin)
        host_t = to_device(host_tok, torch.long, dev, pin)
        none = torch.full((len(decodes), 1), -1, dtype=torch.long, device=dev)
        if prev_tokens is None:
            return host_t, torch.zeros_like(host_t), none
        row = src_t.clamp(min=0)
        pending = src_t >= 0
        if prev is None:  # a plain step in flight: its one token per row
            last = torch.where(pending, prev_tokens[row], host_t)
            return last, torch.zeros_like(host_t), torch.where(pending[:, None], last[:, None], none)
        acc = prev.accepted[row]
        drafts = to_device(prev.drafts, torch.long, dev, pin)[row]
        last = torch.where(pending, prev.emitted[row, acc], host_t)
        rej = torch.where(pending, drafts - acc, torch.zeros_like(acc))
        j = torch.arange(prev.stride, device=dev)
        tail = torch.where(pending[:, None] & (j[None, :] <= acc[:, None]), prev.emitted[row], -1)
        return last, rej, tail

    def _draft(self, decodes: list[ScheduledSeq], last: torch.Tensor | None, true_len: torch.Tensor | None,
               pending: torch.Tensor | None) -> LaunchDrafts | None:
        """Device drafts for the decodes given slots; a proposer that raises or returns a malformed
        result loses its drafts for this step (their slots go unused)."""
        idx = [j for j, s in enumerate(decodes) if s.spec_tokens]
        if not idx:
            return None
        eng, spec = self.engine, self.spec
        dev, pin = eng.device, eng._pin
        seqs = [decodes[j].seq for j in idx]
        slots = [len(decodes[j].spec_tokens) for j in idx]
        sel = to_device(idx, torch.long, dev, pin)
        K = max(slots)
        try:
            got = spec.proposer.propose_on_device(eng, seqs, slots, last[sel], true_len[sel], pending[sel])
            if (not isinstance(got, DeviceDraft) or not isinstance(got.tokens, torch.Tensor)
                    or got.tokens.dim() != 2 or got.tokens.shape[0] != len(seqs) or got.tokens.shape[1] < K):
                raise TypeError(f"propose_on_device() must return a DeviceDraft with tokens of shape "
                                f"[{len(seqs)}, >= {K}], got {got!r}")
            if got.confidences is not None and tuple(got.confidences.shape[:1]) != (len(seqs),):
                raise TypeError(f"DeviceDraft confidences must have {len(seqs)} rows, got "
                                f"{tuple(got.confidences.shape)}")
        except Exception as exc:  # noqa: BLE001  (a proposer's bug costs its drafts, not the requests)
            spec.broken(f"propose_on_device() raised {type(exc).__name__}: {exc}", exc)
            for j in idx:
                decodes[j].spec_tokens = []
            return None
        tokens = got.tokens[:, :K].to(dev, torch.long)
        cap = to_device(slots, torch.long, dev, pin)
        V = eng.model_config.vocab_size
        inside = ((tokens >= 0) & (tokens < V)).long().cumprod(1).sum(1)  # an id outside ends the drafts
        lengths = wanted = torch.minimum(cap, inside)
        budget = sum(slots) if eng.runner.batch_invariant else self.budget(len(decodes), sum(slots))
        if got.confidences is not None or budget < sum(slots):  # lengths under the step's verify budget
            conf = (got.confidences[:, :K].to(dev, torch.float32).contiguous() if got.confidences is not None
                    else torch.ones(tokens.shape, dtype=torch.float32, device=dev))  # no confidences: fair shares
            lengths = eng.kernels.draft_lengths(conf, lengths, budget, float(got.min_confidence))
        spec.n["spec_proposed"] += sum(slots)
        self.n["spec_verify_budget"] += budget
        self.n["spec_draft_slots"] += sum(slots)
        return LaunchDrafts(seqs, slots, tokens.clamp(0, V - 1), lengths, true_len[sel], sel, budget, wanted)

    def _patch(self, batch: StepBatch, out: SchedulerOutput, last: torch.Tensor, rej: torch.Tensor,
               drafts: LaunchDrafts | None) -> None:
        """Correct the prepared (optimistic) decode rows on the device: positions and context lengths
        shifted back by the rejected drafts, the query token and draft tokens placed, slots recomputed."""
        eng = self.engine
        dev, pin, bs = eng.device, eng._pin, eng.block_size
        meta = batch.meta
        nd = len(out.decodes)
        rows, req, first = [], [], []
        draft_rows, draft_src = [], []
        slot_of = {id(s): j for j, s in enumerate(drafts.seqs)} if drafts is not None else {}
        for j, s in enumerate(out.decodes):
            r0 = batch.row_starts[batch.num_prefills + j]
            m = len(s.spec_tokens)
            rows.extend(range(r0, r0 + 1 + m))
            req.extend([j] * (1 + m))
            first.append(r0)
            if m:
                d = slot_of[id(s.seq)]
                draft_rows.extend(range(r0 + 1, r0 + 1 + m))
                draft_src.extend(d * drafts.tokens.shape[1] + t for t in range(m))
        rows_t = to_device(rows, torch.long, dev, pin)
        req_t = to_device(req, torch.long, dev, pin)
        pos = batch.positions[rows_t] - rej[req_t]
        batch.positions[rows_t] = pos
        batch.input_ids[to_device(first, torch.long, dev, pin)] = last
        if draft_rows:
            batch.input_ids[to_device(draft_rows, torch.long, dev, pin)] = \
                drafts.tokens.reshape(-1)[to_device(draft_src, torch.long, dev, pin)]
        seqs = [s.seq for s in out.decodes]
        done = set()
        for (pool, m), names in eng.runner._slot_keys.items():
            slot = meta.groups[names[0]].slot_mapping if meta.groups else meta.slot_mapping
            if id(slot) in done:
                continue
            done.add(id(slot))
            width = max(len(s.block_tables[pool]) for s in seqs)
            tables = to_device([s.block_tables[pool] + [0] * (width - len(s.block_tables[pool])) for s in seqs],
                               torch.long, dev, pin)
            block = tables[req_t, (pos // bs).clamp(max=width - 1)]
            if m == 1:
                new = block * bs + pos % bs
            else:
                new = torch.where((pos + 1) % m == 0, block * (bs // m) + (pos % bs) // m, torch.full_like(pos, -1))
            slot[rows_t] = new
        d = meta.decode
        d.seq_lens[d.seq_lens.shape[0] - nd :] -= rej  # (batch-invariant mode: the prefills come first)
        d.host_seq_lens = None  # not known on the host until the step in flight completes
        if meta.seq_lens is not None and meta.seq_lens is not d.seq_lens:
            meta.seq_lens[batch.num_prefills : batch.num_prefills + nd] -= rej

    def _compact(self, batch: StepBatch, out: SchedulerOutput, drafts: LaunchDrafts) -> None:
        """Lay the decode rows out anew on the device: request j keeps its first 1 + length_j rows, at
        row ``cu[j]`` (cumulative on the device), within decodes + budget rows fixed by the host; the
        rows left over form one padding sequence that writes no KV. Logit rows past a request's length
        repeat its last one (the verify ignores them)."""
        eng = self.engine
        dev, pin, bs = eng.device, eng._pin, eng.block_size
        meta, d = batch.meta, batch.meta.decode
        P, np_, R = meta.num_prefill_tokens, batch.num_prefills, len(out.decodes)
        T = R + drafts.budget
        starts = to_device(batch.row_starts[np_ : np_ + R], torch.long, dev, pin)
        ell = torch.zeros(R, dtype=torch.long, device=dev)
        ell[drafts.where] = drafts.lengths
        cu = torch.zeros(R + 1, dtype=torch.long, device=dev)
        cu[1:] = torch.cumsum(1 + ell, 0)
        r = torch.arange(T, device=dev)
        j = torch.searchsorted(cu[1:], r, right=True)  # R: a padding row
        pad = j >= R
        jc = j.clamp(max=R - 1)
        old = torch.where(pad, starts[0], starts[jc] + r - cu[jc])
        batch.input_ids = torch.cat([batch.input_ids[:P], torch.where(pad, 0, batch.input_ids[old])])
        batch.positions = torch.cat([batch.positions[:P], torch.where(pad, 0, batch.positions[old])])
        new_slots = {}
        for g in meta.groups.values():
            key = id(g.slot_mapping)
            if key not in new_slots:
                s = g.slot_mapping
                new_slots[key] = torch.cat([s[:P], torch.where(pad, -1, s[old])])
            g.slot_mapping = new_slots[key]
        meta.slot_mapping = new_slots.get(id(meta.slot_mapping), meta.slot_mapping)
        pad_len = (T - cu[R]).reshape(1)
        slots = to_device([len(s.spec_tokens) for s in out.decodes], torch.long, dev, pin)
        seq_lens = torch.cat([d.seq_lens - (slots - ell), pad_len])
        cu_q = torch.cat([cu, torch.full((1,), T, dtype=torch.long, device=dev)])
        width = -(-drafts.budget // bs)

        def with_pad_row(t: torch.Tensor) -> torch.Tensor:  # a table row for the padding sequence (reads only)
            if t.shape[1] < width:
                t = torch.cat([t, torch.zeros(t.shape[0], width - t.shape[1], dtype=t.dtype, device=dev)], 1)
            return torch.cat([t, torch.zeros(1, t.shape[1], dtype=t.dtype, device=dev)])

        tables = {}
        for g in meta.groups.values():
            key = id(g.block_tables)
            if key not in tables:
                tables[key] = with_pad_row(g.block_tables)
            g.block_tables = tables[key]
        only = meta.cu_q_lens is d.cu_q_lens
        d.block_tables = tables[id(d.block_tables)] if id(d.block_tables) in tables else with_pad_row(d.block_tables)
        if only:
            meta.cu_q_lens, meta.seq_lens = cu_q, seq_lens
        else:
            meta.cu_q_lens = torch.cat([meta.cu_q_lens[: np_ + 1], P + cu_q[1:]])
            meta.seq_lens = torch.cat([meta.seq_lens[:np_], seq_lens])
        d.cu_q_lens, d.seq_lens, d.max_q_len = cu_q, seq_lens, max(d.max_q_len, drafts.budget)
        # logits of every decode row (decodes + budget of them), then the host layout's entries
        # gathered from them: request j's entries t = 0..slots_j read its row cu[j] + min(t, length_j)
        pos_of = {id(s): i for i, s in enumerate(batch.sample_seqs)}
        e_p = batch.sample_rows[pos_of[id(out.decodes[0].seq)]]  # the decodes' entries come last
        ent_j, ent_t = [], []
        for jj, s in enumerate(out.decodes):
            ent_j.extend([jj] * (len(s.spec_tokens) + 1))
            ent_t.extend(range(len(s.spec_tokens) + 1))
        ej = to_device(ent_j, torch.long, dev, pin)
        batch.logit_index = torch.cat([batch.logit_index[:e_p], P + r])
        batch.logit_rows = batch.logit_rows[:e_p] + list(range(P, P + T))
        drafts.expand = torch.cat([torch.arange(e_p, device=dev),
                                   e_p + cu[ej] + torch.minimum(to_device(ent_t, torch.long, dev, pin), ell[ej])])

    # ---- sample and verify -------------------------------------------------------------------
    def sample(self, batch: StepBatch, logits: torch.Tensor, drafts: LaunchDrafts
               ) -> tuple[DeviceSample | None, SpecFlight]:
        """The plain rows through the pipeline's sampler, the drafted rows verified on the device."""
        eng = self.engine
        dev, pin = eng.device, eng._pin
        slot_of = {id(s): j for j, s in enumerate(drafts.seqs)}
        plain = [i for i, s in enumerate(batch.sample_seqs) if id(s) not in slot_of]
        drafted = [i for i, s in enumerate(batch.sample_seqs) if id(s) in slot_of]
        R = len(batch.sample_seqs)
        K = drafts.tokens.shape[1]
        stride = K + 1
        sample = None
        if plain:
            sub = replace(batch, sample_seqs=[batch.sample_seqs[i] for i in plain],
                          sample_rows=[batch.sample_rows[i] for i in plain])
            kept, sample = eng.pipeline._sample(sub, logits)
            alive = {id(s) for s in kept.sample_seqs}
            plain = [i for i in plain if id(batch.sample_seqs[i]) in alive]
        emitted = torch.zeros(R, stride, dtype=torch.long, device=dev)
        accepted = torch.zeros(R, dtype=torch.long, device=dev)
        if sample is not None:
            emitted[to_device(plain, torch.long, dev, pin), 0] = sample.tokens
        with torch.inference_mode():
            extra = self._verify(batch, logits, drafts, [batch.sample_seqs[i] for i in drafted], emitted, accepted,
                                 to_device(drafted, torch.long, dev, pin))
        slots = [0] * R
        for i in drafted:
            slots[i] = drafts.slots[slot_of[id(batch.sample_seqs[i])]]
        epochs = [s.metrics.num_preemptions for s in batch.sample_seqs]
        return sample, SpecFlight(stride, slots, emitted, accepted, plain, drafted, extra, epochs)

    def _verify(self, batch: StepBatch, logits: torch.Tensor, drafts: LaunchDrafts, seqs: list[Sequence],
                emitted: torch.Tensor, accepted: torch.Tensor, where: torch.Tensor) -> list:
        eng = self.engine
        dev, pin = eng.device, eng._pin
        K = drafts.tokens.shape[1]
        pos_of = {id(s): i for i, s in enumerate(batch.sample_seqs)}
        slot_of = {id(s): j for j, s in enumerate(drafts.seqs)}
        grid, row_seqs, flat = [], [], []
        for seq in seqs:
            r0, m = batch.sample_rows[pos_of[id(seq)]], drafts.slots[slot_of[id(seq)]]
            grid.append([r0 + min(t, m) for t in range(K + 1)])
            flat.extend(range(r0, r0 + m + 1))
            row_seqs.extend([seq] * (m + 1))
        spec = logits[to_device(flat, torch.long, dev, pin)]
        view = replace(batch, scheduled=[], sample_seqs=row_seqs, sample_rows=list(range(len(flat))))
        eng.pm.hook.process_logits(engine=eng, batch=view, logits=spec)
        # the grid [Rd, K + 1] over the processed rows (rows past a request's slots repeat its last)
        local, start = [], 0
        for g in grid:
            local.append([start + (r - g[0]) for r in g])
            start += g[-1] - g[0] + 1
        target = spec[to_device(local, torch.long, dev, pin)]  # [Rd, K + 1, V]
        sel = to_device([slot_of[id(s)] for s in seqs], torch.long, dev, pin)
        params = [s.params for s in seqs]
        rows = None if all(p.temperature <= 0 for p in params) else SamplingRows.from_params(params, dev)
        seeds = to_device([s.seed for s in seqs], torch.long, dev, pin)
        lengths = drafts.lengths[sel]
        tokens, acc = verify_on_device(target, drafts.tokens[sel], lengths, rows, seeds, drafts.first_pos[sel],
                                       params)
        emitted[where, : K + 1] = tokens
        accepted[where] = acc
        lse = torch.logsumexp(target, dim=-1)  # [Rd, K + 1]
        lps = target.gather(2, tokens[..., None])[..., 0] - lse
        n = min(max((p.logprobs or 0) for p in params), target.shape[-1])
        top_ids = top_lps = None
        if n:
            top_lps, top_ids = target.topk(n, dim=-1)
            top_lps = top_lps - lse[..., None]
        return [lengths, drafts.wanted[sel], lps, top_ids, top_lps]

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
            self.spec.proposer.verified(eng, fb_seqs, fb_drafts, fb_acc)
