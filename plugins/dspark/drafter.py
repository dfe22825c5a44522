"""DSpark's drafting: the catch-up forward over what the target computed, the autoregressive draft
loop with a confidence per draft, and whether drafting pays at all (a mixin of the feature)."""

from __future__ import annotations

import time

import torch

from deepinfer_core.engine.rejection import STREAM_DRAFT, draw, filtered_probs, stream
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, PrefillMeta
from deepinfer_core.proposer import MAX_K
from deepinfer_core.scheduler import SchedulerOutput
from plugins.dspark import confidence as conf_mod
from plugins.dspark.lean import context_slot_table
from plugins.dspark.lookup import LookupRows
from plugins.dspark.policy import async_can_pay, budget_settled, worth_drafting
from plugins.dspark.state import KEY, _Rows, _State

DECODE_SPAN = MAX_K + 1  # catch-up spans up to this long use the decode (absorbed) attention path
EXPLORE_ROWS = 4  # requests drafting in an exploratory step while drafting does not pay
MAX_KEPT = 512  # most positions of target hidden states an MTP request keeps while not drafting
# ... while dormant (async steps that do not draft): the latest ones only. Bounded tighter, as it holds device memory
# for every running request (V3: 14 KB a position, so 64 positions at 256 requests are 235 MB)
MAX_KEPT_DORMANT = 64
# A request's last first-draft confidence predicts its next one only weakly (lag-1 autocorrelation 0.16
# on held-out prompts), so whether to draft at all is forecast this far from the running mean towards it.
SKIP_FORECAST_BLEND = 0.5
RESUME_MARGIN = 0.03  # relative gain in tokens/s that drafting must promise to resume after not drafting
PROBE_STEPS = 8  # plain steps measured at a batch size where drafting ran and plain decoding never did
# drafting must measure this much faster than plain decoding to go on (resume): a rate measured over a
# few dozen steps of a shared machine is off by several percent, and a tie must fall to plain decoding
MEASURED_KEEP_MARGIN = 0.08
# the measured check applies from this many decoding requests: a step's tokens vary from 1 to k + 1 per
# request, so at a few requests dozens of steps measure the rate too loosely to overrule the forecast
# (which there is rarely a close call: at one request drafting pays 1.3-1.6x on this CPU)
MEASURED_MIN_ROWS = 8
MEASURED_RESUME_MARGIN = 0.15
TRIAL_STEPS = 8  # drafting steps of a trial where drafting measured slower before
TRIAL_MAX_SHORTFALL = 0.1  # no trial where drafting measured more than this much slower than plain decoding
SMALL_EXPLORE_EVERY = 64  # most skipped steps between exploratory drafts below MEASURED_MIN_ROWS requests
# fewest skipped steps between exploratory drafts from MEASURED_MIN_ROWS requests on (a step there drafts a
# few requests but verifies beside the whole batch): doubling while explorations keep losing, up to 4096
LARGE_EXPLORE_EVERY = 256
KEEP_RUN = 64  # drafting steps in a row after which drafting counts as paying (the exploration gap resets)


class Drafter:
    """The drafting half of :class:`plugins.dspark.feature.DSpark` (its state lives there)."""

    def _propose(self, engine, scheduled: SchedulerOutput, batch, rowmap: dict | None) -> None:
        """Catch the draft up on what the target computed this step and propose the next drafts."""
        bs, src = engine.block_size, self.source
        mtp = src.needs_hidden
        items = []  # (seq, st, lo, hi, cap)
        n_live = sum(1 for s in scheduled.prefills + scheduled.decodes if not s.seq.is_finished)
        # the "budget" policy drafts every step, like fixed k (the step's verify budget does the cutting)
        allowed = self._worth_speculating(scheduled, n_live) if self.varlen and not self.budgeted else True
        if self._host_below and n_live >= self._host_below:
            # a host step where the device path owns the batch size (``step_needs_sync``: e.g. the step that
            # prefills a wave of requests): drafting here would make the next step verify the whole batch's
            # drafts, which the device path's own policy would not have asked for
            allowed = False
        kept = {}  # request_id -> kept hidden states of positions lo..c0-1 (MTP)
        for s in scheduled.prefills + scheduled.decodes:
            seq = s.seq
            if seq.is_finished:
                continue
            if allowed is False or (allowed is not True and seq.request_id not in allowed):
                if mtp and (st := self._state(seq)) is not None:
                    self._defer(st, seq.num_computed_tokens, *rowmap[seq.request_id], batch.hidden)
                continue  # the draft catches up when this request drafts again
            st = self._state(seq)
            if st is None:
                continue
            C, L = seq.num_computed_tokens, seq.num_tokens
            ready = C == L - 1
            if mtp:
                row0, c0 = rowmap[seq.request_id]
                if st.kept_rows and st.done + st.kept_rows == c0:
                    lo, kept[seq.request_id] = st.done, torch.cat(st.kept_hidden)
                else:
                    lo = max(st.done, c0)
                st.kept_hidden, st.kept_rows = [], 0
                hi = C
            else:
                lo, hi = st.done, (L if ready else C)
            cap = 0
            if ready:  # the engine reserved the slots of the last token and `room` drafts
                cap = self._room.get(seq.request_id, -1)
                cap = min(cap, max(src.max_positions - L, 0)) if cap >= 0 else -1
                if cap < 0:  # not even the last token's slot: sync what fits, no drafts
                    hi = min(hi, len(seq.block_table) * bs)
                    cap = 0
            if hi > lo or cap > 0:
                items.append((seq, st, lo, hi, cap))
            else:
                st.drafts = []
        if not items:
            return
        # 1. one forward over every catch-up span; the last row of each drafting request proposes d_1
        pre = [it for it in items if it[2] == 0 or it[3] - it[2] > DECODE_SPAN]
        dec = [it for it in items if not (it[2] == 0 or it[3] - it[2] > DECODE_SPAN)]
        ids, pos, slots, hid_parts, last_rows = [], [], [], [], []
        for seq, _, lo, hi, cap in pre + dec:
            bt = seq.block_table
            if mtp:
                ids.extend(seq.token_ids[lo + 1 : hi + 1])
                row0, c0 = rowmap[seq.request_id]
                if seq.request_id in kept:
                    hid_parts.append(kept[seq.request_id])
                hid_parts.append(batch.hidden[row0 + max(lo, c0) - c0 : row0 + hi - c0])
            else:
                ids.extend(seq.token_ids[lo:hi])
            pos.extend(range(lo, hi))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(lo, hi))
            if cap > 0:
                last_rows.append(len(pos) - 1)
        dev = engine.device
        self._caught = len(ids)
        ids_t, pos_t = torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev)
        prev = torch.cat(hid_parts) if mtp else None
        if not pre and ids and hasattr(src, "decode"):  # lean path: short catch-up spans only
            table = context_slot_table(self._meta_tables(dec, dev), bs)
            which = torch.tensor([i for i, it in enumerate(dec) for _ in range(it[3] - it[2])], device=dev)
            S = max(it[3] for it in dec)
            args = (ids_t, pos_t, torch.tensor(slots, dtype=torch.long, device=dev), table[which, :S])
            if mtp:
                carry, normed = src.decode(*args, masked=len(ids) > 1, prev_hidden=prev)
            else:
                carry = normed = src.decode(*args, masked=len(ids) > 1)
        else:
            meta = self._meta(pre, dec, slots, dev)
            carry, normed = src.forward(ids_t, pos_t, meta, prev)
        for _, st, _, hi, _ in items:
            st.done = hi
            st.drafts, st.q, st.feats = [], None, None
        drafting = [it for it in pre + dec if it[4] > 0]
        if not drafting:
            return
        lr = torch.tensor(last_rows, device=dev)
        target = None
        if mtp and (self.head.uses_target or self.outcome_log is not None):
            # the target's state at each drafting request's last verified position (confidence features)
            frac = torch.tensor([it[1].prev_frac for it in drafting], dtype=torch.float32, device=dev)
            target = conf_mod.target_features(src.logits(prev[lr]), frac)
        self._draft_loop(_Rows([it[0] for it in drafting], [it[4] for it in drafting], bs, dev),
                         [it[1] for it in drafting], carry[lr], normed[lr], n_live, target)

    def step_drained(self, engine, batch) -> None:
        """(``Proposer.step_drained``) An MTP draft keeps the drained step's hidden rows of each request
        whose draft KV reaches that step's first position, as a host step that does not draft would
        (``_defer``): e.g. prompts prefilled in an overlapped step before host steps, so the next host
        catch-up writes their draft KV. A request with a gap before it keeps its gap."""
        if not self.needs_hidden:
            return
        for s, row0, c0 in zip(batch.scheduled, batch.row_starts, batch.computed_before):
            st = None if s.seq.is_finished else self._state(s.seq)
            if st is not None and st.done + st.kept_rows == c0:
                self._defer(st, s.seq.num_computed_tokens, row0, c0, batch.hidden)

    def step_passed_dormant(self, engine, batch) -> None:
        """(``Proposer.step_passed_dormant``) An MTP draft keeps each request's rows of a dormant overlapped step,
        as ``step_drained`` does for a drained one, so that the catch-up when drafting resumes writes their draft
        KV. A step whose every row is kept (a decode step) costs no launch: the kept rows are views of its hidden
        states. Otherwise each request's rows are copied, so that a prefill chunk's other rows are not held. A step
        launched right after a speculative one knows its positions only on the device (``first_dev``): it keeps
        nothing, and its positions stay a gap in the draft KV."""
        if not self.needs_hidden or batch.first_dev is not None:
            return
        take = []  # (state, first row, first position, rows)
        for s, row0, c0 in zip(batch.scheduled, batch.row_starts, batch.computed_before):
            st = None if s.seq.is_finished else self._state(s.seq)
            if st is not None and s.num_new_tokens > 0:
                take.append((st, row0, c0, s.num_new_tokens))
        views = sum(n for *_, n in take) == batch.hidden.shape[0]
        for st, row0, c0, n in take:
            rows = batch.hidden[row0 : row0 + n]
            self._keep_latest(st, c0, rows, MAX_KEPT_DORMANT, copy=not views)

    @staticmethod
    def _keep_latest(st: _State, c0: int, rows: torch.Tensor, cap: int, copy: bool) -> None:
        """Keep ``rows`` (the target's hidden states of positions c0..; a copy of them with ``copy``) after the
        request's kept ones, at most ``cap`` positions, the latest: older kept positions are given up (their draft
        KV stays stale: fewer drafts are accepted, outputs stay exact). After a gap the kept ones are given up
        too."""
        n = rows.shape[0]
        if st.done + st.kept_rows != c0:  # a gap (or the draft KV is written past c0 already)
            st.kept_hidden, st.kept_rows, st.done = [], 0, max(st.done, c0)
            if st.done != c0:
                return
        if n > cap:  # alone past the cap: nothing is kept, the draft KV keeps its gap
            st.kept_hidden, st.kept_rows, st.done = [], 0, c0 + n
            return
        while st.kept_rows + n > cap:
            st.done += st.kept_hidden[0].shape[0]
            st.kept_rows -= st.kept_hidden.pop(0).shape[0]
        st.kept_hidden.append(rows.clone() if copy else rows)
        st.kept_rows += n

    @staticmethod
    def _defer(st: _State, computed: int, row0: int, c0: int, hidden: torch.Tensor) -> None:
        """An MTP request that does not draft this step keeps the target's hidden states of the
        positions computed now (c0..computed-1), so that its catch-up can write their draft KV when it
        drafts again: at most ``MAX_KEPT`` positions, the latest (``_keep_latest``)."""
        if computed > c0:
            Drafter._keep_latest(st, c0, hidden[row0 : row0 + computed - c0], MAX_KEPT, copy=True)

    def _worth_speculating(self, scheduled: SchedulerOutput, n_live: int) -> bool | set[str]:
        """Whether drafting for the next step can pay at this batch size at all, given the drafts'
        running accept rate (``observe_accepts``) and each request's latest first-draft confidence. After 64 skipped
        steps it drafts once anyway to refresh them, waiting twice as long after each such try that
        does not make drafting pay. Such a try drafts for the ``EXPLORE_ROWS`` requests with the
        least draft catch-up (their ids are returned): a sample refreshes the estimates, and the
        draft does not have to catch up on every request's skipped tokens."""
        ready = [s.seq for s in scheduled.prefills + scheduled.decodes
                 if not s.seq.is_finished and s.seq.num_computed_tokens == s.seq.num_tokens - 1
                 and s.seq.feature_state.get(KEY) is not False]
        if not ready:
            return False
        R = len(ready)
        if self.resume_after is not None and self.skipped > self.resume_after:  # a plain-rate probe ended
            self.resume_after = None
        if self.trial_left:
            self.trial_left -= 1
        states = [seq.feature_state.get(KEY) for seq in ready]
        mean = self.mean_conf
        conf = [mean + SKIP_FORECAST_BLEND * (st.recent_conf - mean) if st and st.recent_conf is not None else mean
                for st in states]
        # hysteresis: resuming drafting (from dormant, or after an exploratory step) asks for a clear gain
        resuming = self.skipped > 0 or self.exploring
        worth = worth_drafting([1.0] * R, conf, R, n_live, R, self.live, self.live.overhead(n_live), self.k,
                               start_s=self.live.catchup(R) - self.live.draft(R),
                               margin=RESUME_MARGIN if resuming else 0.0)
        forecast = worth
        if worth and not self.trial_left and R >= MEASURED_MIN_ROWS:  # the measured rates may veto the forecast
            verdict = self.rates.verdict(R, MEASURED_RESUME_MARGIN if resuming else MEASURED_KEEP_MARGIN)
            if verdict is False:
                worth = False
                self.n["measured_vetoes"] += 1
            elif self.rates.needs_plain_probe(R):  # measure plain decoding here (first, or again)
                worth, self.resume_after = False, PROBE_STEPS
                self.n["plain_probes"] += 1
            elif self.live.async_steps and self.async_verdict(R, mean) is False:
                worth = False  # the whole async steps measured here say drafting loses at this accept rate
                self.n["async_vetoes"] += 1
        gap = self.explore_gap(n_live)
        if worth:
            if not self.trial_left:
                self.exploring = False
            self.skipped = 0
            self.drafting_run += 1
            if self.drafting_run >= KEEP_RUN:  # drafting has paid for a while: explore soon after it stops
                self.explore_every, self.resumed = 64, False
            return True
        # the last exploratory draft, or drafting resumed after one but stopped within KEEP_RUN steps, did
        # not make drafting pay: from MEASURED_MIN_ROWS requests on, wait twice as long (at a few requests
        # an exploratory step costs little, and it is the only refresh of the accept rate while dormant:
        # every SMALL_EXPLORE_EVERY steps there, ``explore_gap``)
        lost = self.exploring or (0 < self.drafting_run < KEEP_RUN and self.resumed)
        if lost and R >= MEASURED_MIN_ROWS:
            self.explore_every = min(max(self.explore_every, gap) * 2, 4096)
            gap = self.explore_gap(n_live)
        self.exploring = self.resumed = False
        self.drafting_run = 0
        if self.skipped >= gap and forecast and R >= MEASURED_MIN_ROWS and self._may_explore(R) and \
                self.rates.verdict(R) is False and self.rates.verdict(R, -TRIAL_MAX_SHORTFALL) and \
                self.resume_after is None:
            # the forecast says drafting pays but it measured a little slower here before: a short trial of
            # real drafting refreshes the measurement (where the forecast says it does not pay either, a
            # trial would stop after one step of the whole batch, having measured nothing; where it measured
            # far slower, 8 steps of the whole batch drafting cost more than the trial can find: the
            # exploratory steps, which count as drafting ones, refresh the measured rate instead)
            self.skipped, self.exploring, self.resumed, self.trial_left = 0, True, True, TRIAL_STEPS
            self.n["trials"] += 1
            return True
        if self.skipped >= gap and self._may_explore(R):
            self.skipped, self.exploring, self.resumed = 0, True, True
            order = sorted(range(R), key=lambda i: ready[i].num_tokens - (states[i].done if states[i] else 0))
            chosen = {ready[i].request_id for i in order[:EXPLORE_ROWS]}
            for seq, st in zip(ready, states):
                if st and seq.request_id not in chosen:
                    st.drafts, st.q, st.feats = [], None, None
            return chosen
        self.skipped = 1 if self.skipped >= gap else self.skipped + 1
        for st in states:
            if st:
                st.drafts, st.q, st.feats = [], None, None
                if st.recent_conf is not None:  # drift back to the mean while not drafting
                    st.recent_conf = 0.8 * st.recent_conf + 0.2 * self.mean_conf
        self.n["skipped_steps"] += 1
        return False

    def explore_gap(self, rows: int) -> int:
        """Skipped steps before an exploratory draft at ``rows`` running requests: ``explore_every``
        (doubling while explorations lose), at most ``SMALL_EXPLORE_EVERY`` below ``MEASURED_MIN_ROWS``
        requests (a gap grown at a large batch does not carry over) and at least ``LARGE_EXPLORE_EVERY``
        from there on, where an exploratory step costs a large batch's time and rarely wins."""
        if rows < MEASURED_MIN_ROWS:
            return min(self.explore_every, SMALL_EXPLORE_EVERY)
        return max(self.explore_every, LARGE_EXPLORE_EVERY)

    def async_verdict(self, rows: int, conf: float) -> bool | None:
        """Whether drafting at ``rows`` requests with drafts accepted at ``conf`` beats plain decoding by
        what was measured with async scheduling: the whole async speculative steps at this batch size
        (``LiveCost.step``) against the measured plain rate here; None while either is unmeasured."""
        return async_can_pay(rows, self.live, self.k, conf, self.rates.plain.get(self.rates.bucket(rows)))

    @staticmethod
    def _meta_tables(its: list, dev) -> torch.Tensor:
        width = max(len(it[0].block_table) for it in its)
        return torch.tensor([it[0].block_table + [0] * (width - len(it[0].block_table)) for it in its],
                            dtype=torch.int32, device=dev)

    @classmethod
    def _meta(cls, pre: list, dec: list, slots: list[int], dev) -> AttentionMetadata:
        def cumsum(lens):
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.long, device=dev)

        def tables(its):
            return cls._meta_tables(its, dev)

        prefill = decode = None
        if pre:
            q = [hi - lo for _, _, lo, hi, _ in pre]
            kl = [hi for _, _, _, hi, _ in pre]
            prefill = PrefillMeta(cu_q_lens=cumsum(q), cu_k_lens=cumsum(kl),
                                  seq_lens=torch.tensor(kl, dtype=torch.long, device=dev), block_tables=tables(pre),
                                  has_prefix=any(lo > 0 for _, _, lo, _, _ in pre))
        if dec:
            q = [hi - lo for _, _, lo, hi, _ in dec]
            decode = DecodeMeta(cu_q_lens=cumsum(q),
                                seq_lens=torch.tensor([hi for _, _, _, hi, _ in dec], dtype=torch.long, device=dev),
                                block_tables=tables(dec), max_q_len=max(q))
        num_pre = sum(hi - lo for _, _, lo, hi, _ in pre)
        return AttentionMetadata(num_pre, torch.tensor(slots, dtype=torch.long, device=dev), prefill, decode)

    def _pick(self, rows: _Rows, logits: torch.Tensor, normed: torch.Tensor, depth: int):
        """Draft token, draft distribution (sampled rows), confidence and features (log q(d), entropy,
        log q(top-2), lookup features or None) at one depth."""
        if rows.head_rows is None:
            rows.head_rows = (self.head.per_row(rows.greedy),)
        if rows.all_greedy:  # the draft tokens, log q(d), log q(top-2) and entropy from one log-softmax
            logp = torch.log_softmax(logits.float(), dim=-1)
            top, tok = logp.topk(2, dim=-1)
            tok, logq, logq2 = tok[:, 0], top[:, 0], top[:, 1]
            ent = -(logp.exp() * logp).sum(-1)
            q = None
            if rows.lookup is not None:
                tok = rows.lookup.follow(depth, tok)
                if any(rows.lookup.overridden):
                    logq = logp.gather(1, tok[:, None])[:, 0]
        else:
            greedy_tok = logits.argmax(-1)
            if rows.lookup is not None:  # greedy rows only: a sampled row's draft is drawn from q
                greedy_tok = rows.lookup.follow(depth, greedy_tok)
            q = filtered_probs(logits, rows.params)
            sampled = draw(q, stream(rows.seeds, STREAM_DRAFT), rows.base + (depth - 1))
            tok = torch.where(rows.greedy, greedy_tok, sampled)
            logq, ent, logq2 = conf_mod.draft_stats(logits, tok)
        term, lk = (None, None) if rows.lookup is None else rows.lookup.step(depth, tok)
        c = self.head.fast(normed, logq, ent, rows.greedy, rows.head_rows[0], logq2, term)
        return tok, q, self._calibrated(c, depth), (logq, ent, logq2, lk)

    def _calibrated(self, conf: torch.Tensor, depth: int) -> torch.Tensor:
        return conf if self.calib is None else self.calib.apply(conf, depth)

    def _ar_step(self, rows: _Rows, prev_tok: torch.Tensor, prev_carry: torch.Tensor | None, depth: int):
        """Feed d_{depth-1}; returns (carry, normed) of the rows."""
        bs = rows.block_size
        if hasattr(self.source, "decode"):  # lean path: one query token per row
            ctx = rows.ctx
            off = 1 if self.source.needs_hidden else 0  # an MTP layer sits one position before the token
            S = min(rows.base_max + depth - 1 - off, ctx.shape[1], self.source.max_positions)
            pos = (rows.base + (depth - 2 - off)).clamp(max=S - 1)
            slot = torch.where(rows.cap_t >= depth, ctx.gather(1, pos[:, None])[:, 0], torch.full_like(pos, -1))
            if self.source.needs_hidden:
                return self.source.decode(prev_tok, pos, slot, ctx[:, :S], masked=len(rows.seqs) > 1,
                                          prev_hidden=prev_carry)
            normed = self.source.decode(prev_tok, pos, slot, ctx[:, :S], masked=len(rows.seqs) > 1)
            return normed, normed
        tok_index = rows.base + (depth - 2)  # token index of d_{depth-1}
        pos = tok_index - 1 if self.source.needs_hidden else tok_index
        pos = pos.clamp(max=self.source.max_positions - 1)
        blk = rows.bt_long.gather(1, (pos // bs).clamp(max=rows.bt_long.shape[1] - 1)[:, None])[:, 0]
        slot = torch.where(rows.cap_t >= depth, blk * bs + pos % bs, torch.full_like(pos, -1))
        meta = AttentionMetadata(0, slot, None, DecodeMeta(cu_q_lens=rows.cu, seq_lens=pos + 1,
                                                           block_tables=rows.block_tables, max_q_len=1))
        return self.source.forward(prev_tok, pos, meta, prev_carry)

    def _draft_loop(self, rows: _Rows, states: list[_State], carry: torch.Tensor, normed: torch.Tensor,
                    n_live: int, target: torch.Tensor | None = None) -> None:
        """``target``: the target's confidence features at each row's last verified position."""
        src, cost = self.source, self.live
        R = len(states)
        K = max(rows.caps)
        rows.head_rows = (self.head.per_row(rows.greedy, None if target is None else self.head.target_term(target)),)
        log = self.outcome_log is not None
        if self.head.uses_lookup or log or self.lookup_drafts:
            follow = rows.greedy_list if self.lookup_drafts else None
            rows.lookup = LookupRows([s.token_ids for s in rows.seqs], K, self.head.w_lookup, normed.device, log,
                                     follow)
        logits = src.logits(normed)
        tok, q, c, feats = self._pick(rows, logits, normed, 1)
        toks, qs, confs, hs, lqs, ents, lq2s, lks = [tok], [q], [c], [normed], [feats[0]], [feats[1]], [feats[2]], \
            [feats[3]]
        cum = c.tolist()
        cum_hist = [cum]
        expected = R + sum(cum)
        depth = 1
        t_loop = time.perf_counter()
        budget = self.share_budget(sum(rows.caps)) if self.varlen and self.budgeted else None
        while depth < K:
            if budget is not None:
                if budget_settled(cum_hist, [i for i in range(R) if rows.caps[i] > depth], cum, budget):
                    break
            elif self.varlen:
                live = [i for i in range(R) if rows.caps[i] > depth]
                c_last = confs[-1].tolist()
                fixed = cost.overhead(n_live) + cost.drafting(R, depth)
                if not worth_drafting([cum[i] for i in live], [c_last[i] for i in live], R,
                                      n_live + depth * R, expected, cost, fixed, K - depth):
                    break
            depth += 1
            carry, normed = self._ar_step(rows, tok, carry if src.needs_hidden else None, depth)
            logits = src.logits(normed)
            tok, q, c, feats = self._pick(rows, logits, normed, depth)
            toks.append(tok)
            qs.append(q)
            confs.append(c)
            if log:
                hs.append(normed)
                lqs.append(feats[0])
                ents.append(feats[1])
                lq2s.append(feats[2])
                lks.append(feats[3])
            c_list = c.tolist()
            cum = [a * b if depth <= rows.caps[i] else 0.0 for i, (a, b) in enumerate(zip(cum, c_list))]
            cum_hist.append(cum)
            expected += sum(cum)
        self.last_depth = depth
        self.engine.platform.synchronize()
        self._drafted = (R, depth - 1, time.perf_counter() - t_loop)
        self.n["proposals"] += 1
        self.n["depth"] += depth
        tok_m = torch.stack(toks, dim=1).tolist()
        conf_m = torch.stack(confs, dim=1).tolist()
        q_m = None if rows.all_greedy else torch.stack(qs, dim=1)  # [R, depth, V]
        if log:
            h_m, lq_m, ent_m = torch.stack(hs, 1), torch.stack(lqs, 1), torch.stack(ents, 1)
            lq2_m, lk_m = torch.stack(lq2s, 1), torch.stack(lks, 1)
        for i, (seq, st) in enumerate(zip(rows.seqs, states)):
            n = min(depth, rows.caps[i])
            st.drafts = tok_m[i][:n]
            st.conf = conf_m[i][:n]
            st.cum = [cum_hist[j][i] for j in range(n)]
            st.q = None if rows.greedy_list[i] or q_m is None else q_m[i, :n]
            st.base_len = seq.num_tokens
            st.fed = n - 1
            st.recent_conf = conf_m[i][0]
            if log:
                st.feats = (h_m[i, :n].float().cpu(), lq_m[i, :n].cpu(), ent_m[i, :n].cpu(), lq2_m[i, :n].cpu(),
                            None if target is None else target[i].cpu(), lk_m[i, :n].cpu())
