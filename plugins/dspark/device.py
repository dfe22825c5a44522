"""DSpark's drafts proposed on the device (async scheduling: ``Proposer.propose_on_device``).

With async scheduling the engine launches step N+1 before the host knows step N's accepted tokens,
so the draft runs from device tensors only (a mixin of the feature; see ``engine/spec_async.py``):

1. **Catch-up**: one draft forward over what the target settled since the draft last ran, laid out
   by the host as fixed spans whose tail may not exist: a row writes its draft KV only when its
   position is below the request's true length (a device mask), and the row that proposes d_1 is
   found on the device. A draft model re-reads the tokens from its last catch-up on (the host's lower
   bound, the last token at most a step's tokens back); an MTP layer reads the target's hidden states
   of the step in flight (``StepHidden``) with the token after each.
2. **Drafts**: ``max(max_drafts)`` autoregressive draft steps for every row (the host cannot see the
   confidences, so there is no early stop), greedy (point-mass drafts: exact for sampled requests
   too), with the confidence head's estimate per draft.
3. **Lengths**: the engine cuts them on the device with the ``draft_lengths`` op from the
   (calibrated, where the policy reads the calibration) confidences, under the verify budget this
   feature fixes on the host (``verify_budget``: ``verify_share`` of the slots for the "budget"
   policy, the step-time curve and the running accept rate for "throughput", every slot for "fixed",
   the ``min_confidence`` cut under ``verify_budget`` for "threshold").

Greedy outputs equal synchronous DSpark and plain decoding (``tests/test_dspark.py``).
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.transfer import Upload
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, PrefillMeta
from deepinfer_core.proposer import DeviceDraft, StepHidden
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput
from plugins.dspark import confidence as conf_mod
from plugins.dspark import lookup as lookup_mod
from plugins.dspark.drafter import DECODE_SPAN
from plugins.dspark.lean import context_slot_table
from plugins.dspark.state import _Rows

EXPLORE_VERIFY_EVERY = 16  # async steps between verifying one row more than chosen (measures that size)
ACCEPT_DECAY = 0.95  # per verified request: the running accept rate's memory (about 20 verifications)
ACCEPT_PRIOR = 8.0  # weight (in decided drafts) of the start value, decaying like the samples
DEPTH_PRIOR = 2.0  # drafts at the running rate added to each depth's conditional accept rate


class DeviceDrafter:
    """The device half of :class:`plugins.dspark.feature.DSpark` (its state lives there)."""

    proposes_on_device = True

    def propose_on_device(self, engine, requests, max_drafts, last_tokens, num_tokens, pending,
                          hidden: StepHidden | None = None) -> DeviceDraft:
        dev = engine.device
        R, K = len(requests), max(max_drafts)
        states = [self._state(seq) for seq in requests]
        launch = self.launched_steps  # steps the engine launched before this one
        tokens = torch.full((R, K), -1, dtype=torch.long, device=dev)
        conf = torch.zeros(R, K, dtype=torch.float32, device=dev)
        for st in states:
            if st:
                st.decode_steps += 1
                self.n["decode_steps"] += 1
        # (whether to draft, and for which requests, was decided before scheduling: ``draft_slots``)
        items = self._catchup_items(requests, states, launch, hidden)  # (i, seq, st, lo, hi)
        if not items:
            return DeviceDraft(tokens, conf)
        mtp = self.source.needs_hidden
        seqs, caps = [it[1] for it in items], [max_drafts[it[0]] for it in items]
        up = Upload(dev, engine.platform.supports_pinned_memory())  # every host-built tensor, one copy
        h = self._catchup_parts(up, engine, items, pending.shape[1], mtp)
        width = max(len(q.block_table) for q in seqs)
        h_rows = (up.add([q.block_table + [0] * (width - len(q.block_table)) for q in seqs], torch.int32),
                  up.add(caps), up.add([q.params.temperature <= 0 for q in seqs], torch.bool))
        h_frac = up.add([st.prev_frac for _, _, st, _, _ in items], torch.float32) if mtp else None
        h_look = self._lookup_parts(up, seqs) if self.head.uses_lookup or self.lookup_drafts else None
        t = up.send()
        with torch.inference_mode():
            catchup = self._catchup_mtp if mtp else self._catchup_model
            carry, normed, prev_last = catchup(t, h, items, num_tokens, pending, hidden)
            sel = t[h["sel"]]
            rows = _Rows.from_tensors(seqs, caps, engine.block_size, t[h_rows[0]], num_tokens[sel], t[h_rows[1]],
                                      t[h_rows[2]])
            frac = t[h_frac] if mtp else None
            cont = None
            if h_look is not None:  # the lookup window: host-known tokens, then the step in flight's
                win, n_win, w0 = (t[i] for i in h_look)
                hist = torch.cat([win, torch.full_like(pending[sel], -1)], 1)
                hist.scatter_(1, n_win[:, None] + torch.arange(pending.shape[1], device=dev)[None, :], pending[sel])
                cont = lookup_mod.continuations(hist, num_tokens[sel] - w0, K)
            tok, c = self._device_loop(rows, carry, normed, prev_last, frac, cont)
            tokens[sel, : tok.shape[1]] = tok
            conf[sel, : c.shape[1]] = c
        for _, _, st, _, _ in items:
            st.dev_launch, st.dev_pending = launch, True
            st.drafts, st.q, st.feats = [], None, None
            st.kept_hidden, st.kept_rows = [], 0  # (an MTP catch-up wrote their draft KV)
        self.n["proposals"] += 1
        self.n["depth"] += K
        return DeviceDraft(tokens, conf, float(self.opts["min_confidence"]) if self.threshold else 0.0)

    def _catchup_items(self, requests, states, launch: int, hidden: StepHidden | None) -> list[tuple]:
        """Per request that can draft: its catch-up span [lo, hi) of positions (host-known bounds),
        long spans first (as the catch-up's metadata lays them out). An MTP request's span starts with the
        rows it kept while it did not draft (``Drafter._defer``, ``step_drained``: host steps), where they
        reach the step in flight's first position; kept rows that do not are dropped (their draft KV stays
        stale: fewer drafts accepted, outputs exact)."""
        items = []
        for i, (seq, st) in enumerate(zip(requests, states)):
            if not st:
                continue
            if self.source.needs_hidden:  # the step in flight's rows of this request (host bounds)
                if hidden is None or not hidden.counts[i]:
                    continue
                first = hidden.first_bound[i]  # (exact while the request kept rows: it did not draft since)
                if st.kept_rows and st.done + st.kept_rows != first:
                    st.kept_hidden, st.kept_rows = [], 0
                lo, hi = first - st.kept_rows, first + hidden.counts[i]
            else:  # from the last catch-up's true end (one launch back) or the host's lower bound
                known = seq.num_known_tokens
                lo = known if st.dev_launch == launch - 1 and st.done <= known else st.done
                # (at least the last token's row, which proposes d_1: after a synchronous speculative
                # step the draft's KV already covers it, and rewriting it writes the same values)
                lo, hi = min(lo, known, seq.num_tokens - 1), seq.num_tokens
                st.done = max(st.done, known)
            items.append((i, seq, st, lo, hi))
        return [it for it in items if self._long_span(it)] + [it for it in items if not self._long_span(it)]

    @staticmethod
    def _lookup_parts(up: Upload, seqs: list) -> tuple[int, int, int]:
        """Queue each request's last ``lookup.WINDOW`` host-known tokens (-1 padded), their count and
        the position of the first (the tokens in flight go after them on the device)."""
        w0 = [max(0, q.num_known_tokens - lookup_mod.WINDOW) for q in seqs]
        wins = [q.token_ids[a : q.num_known_tokens] for a, q in zip(w0, seqs)]
        W = max(len(w) for w in wins)
        return up.add([w + [-1] * (W - len(w)) for w in wins]), up.add([len(w) for w in wins]), up.add(w0)

    @staticmethod
    def _long_span(item: tuple) -> bool:
        """A span the catch-up lays out as a prefill (from position 0, or longer than a decode span)."""
        return item[3] == 0 or item[4] - item[3] > DECODE_SPAN

    def _catchup_parts(self, up: Upload, engine, items: list[tuple], P: int, mtp: bool) -> dict:
        """Queue the catch-up's host-known lists: per row its request and offset in its span (and for
        a draft model its token or where in flight it is, and its KV slot), per request its span's
        start row, and the attention metadata of the spans (a prefill's for long ones)."""
        bs = engine.block_size
        req, offs, starts, host_ids, gather, slots, wins = [], [], [], [], [], [], []
        for i, seq, _, lo, hi in items:
            known, bt = seq.num_known_tokens, seq.block_table
            starts.append(len(req))
            req.extend([i] * (hi - lo))
            offs.extend(range(hi - lo))
            if mtp:  # tokens from DECODE_SPAN before the host's first (the true one is at most that far back)
                w0 = max(0, lo - DECODE_SPAN)
                wins.append((w0, seq.token_ids[w0:known]))
                continue
            for p in range(lo, hi):
                host_ids.append(seq.token_ids[p] if p < known else -1)
                gather.append(0 if p < known else i * P + min(p - known, P - 1))
                slots.append(bt[p // bs] * bs + p % bs)
        h = {"req": up.add(req), "offs": up.add(offs), "starts": up.add(starts),
             "sel": up.add([it[0] for it in items]), "lo": up.add([it[3] for it in items])}
        if mtp:
            W = max(len(w) for _, w in wins)
            h.update(W=W, win=up.add([w + [0] * (W - len(w)) for _, w in wins]), w0=up.add([w0 for w0, _ in wins]),
                     known=up.add([w0 + len(w) for w0, w in wins]), item=up.add(list(range(len(items)))),
                     count=up.add([it[4] - it[3] for it in items]),
                     dec=up.add([j for j, it in enumerate(items) if not self._long_span(it)]),
                     kept=up.add([it[2].kept_rows for it in items]))
            # the kept rows (device tensors already) and their rows in the catch-up's layout
            kept_at = [s + r for s, it in zip(starts, items) for r in range(it[2].kept_rows)]
            h["kept_at"] = up.add(kept_at) if kept_at else None
            h["kept_hidden"] = torch.cat([x for it in items for x in it[2].kept_hidden]) if kept_at else None

        else:
            h.update(host_ids=up.add(host_ids), gather=up.add(gather), slots=up.add(slots))
        width = max(len(it[1].block_table) for it in items)
        h["tables"] = up.add([it[1].block_table + [0] * (width - len(it[1].block_table)) for it in items])
        # all spans short: the source's lean decode path (its context from the block tables), else
        # its forward with attention metadata
        h["lean"] = hasattr(self.source, "decode") and not any(self._long_span(it) for it in items)
        h["S"] = max(it[4] for it in items)  # context width: past every row's position
        h["meta"] = None if h["lean"] else self._catchup_meta_parts(up, items)
        return h

    def _catchup_forward(self, t: list[torch.Tensor], h: dict, ids: torch.Tensor, pos: torch.Tensor,
                         slots: torch.Tensor, r_t: torch.Tensor, prev: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(carry, normed) of the catch-up rows: ``r_t`` each row's item, ``slots`` its KV slot (-1:
        none), ``prev`` (MTP) the target's hidden states fed with the tokens."""
        src = self.source
        if not h["lean"]:
            return src.forward(ids, pos, self._catchup_meta(t, h["meta"], slots), prev)
        ctx = context_slot_table(t[h["tables"]], self.engine.block_size)[:, : h["S"]][r_t]
        if prev is not None:
            return src.decode(ids, pos, slots, ctx, masked=True, prev_hidden=prev)
        normed = src.decode(ids, pos, slots, ctx, masked=True)
        return normed, normed

    @staticmethod
    def _catchup_meta_parts(up: Upload, items: list[tuple]) -> dict:
        """The catch-up forward's attention metadata (as ``Drafter._meta``), queued for one upload."""
        def cumsum(lens):
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return out

        def tables(its):
            width = max(len(it[1].block_table) for it in its)
            return up.add([it[1].block_table + [0] * (width - len(it[1].block_table)) for it in its], torch.int32)

        pre = [it for it in items if DeviceDrafter._long_span(it)]
        dec = [it for it in items if not DeviceDrafter._long_span(it)]
        h = {"num_pre": sum(it[4] - it[3] for it in pre), "pre": None, "dec": None}
        if pre:
            q, kl = [it[4] - it[3] for it in pre], [it[4] for it in pre]
            h["pre"] = (up.add(cumsum(q)), up.add(cumsum(kl)), up.add(kl), tables(pre), any(it[3] > 0 for it in pre))
        if dec:
            q = [it[4] - it[3] for it in dec]
            h["dec"] = (up.add(cumsum(q)), up.add([it[4] for it in dec]), tables(dec), max(q))
        return h

    @staticmethod
    def _catchup_meta(t: list[torch.Tensor], h: dict, slots: torch.Tensor) -> AttentionMetadata:
        prefill = decode = None
        if h["pre"] is not None:
            cu_q, cu_k, kl, tab, has_prefix = h["pre"]
            prefill = PrefillMeta(cu_q_lens=t[cu_q], cu_k_lens=t[cu_k], seq_lens=t[kl], block_tables=t[tab],
                                  has_prefix=has_prefix)
        if h["dec"] is not None:
            cu_q, lens, tab, max_q = h["dec"]
            decode = DecodeMeta(cu_q_lens=t[cu_q], seq_lens=t[lens], block_tables=t[tab], max_q_len=max_q)
        return AttentionMetadata(h["num_pre"], slots, prefill, decode)

    def _catchup_model(self, t: list[torch.Tensor], h: dict, items: list[tuple], num_tokens: torch.Tensor,
                       pending: torch.Tensor, hidden: None):
        """A draft model's catch-up: one forward over each request's tokens from its span's start to
        its host length; rows at or past its true length (the rejected drafts' positions) write no
        draft KV. Returns (carry, normed) of the row of each request that proposes d_1 (its last
        token's), and None."""
        req_t, lo_t, sel = t[h["req"]], t[h["lo"]], t[h["sel"]]
        host_t = t[h["host_ids"]]
        ids = torch.where(host_t >= 0, host_t, pending.reshape(-1)[t[h["gather"]]].clamp(min=0))
        r_t = self._item_of(t, h, pending)[req_t]
        pos = lo_t[r_t] + t[h["offs"]]
        slots = torch.where(pos < num_tokens[req_t], t[h["slots"]], -1)
        carry, normed = self._catchup_forward(t, h, ids, pos, slots, r_t, None)
        last = t[h["starts"]] + (num_tokens[sel] - 1 - lo_t)
        return carry[last], normed[last], None

    @staticmethod
    def _item_of(t: list[torch.Tensor], h: dict, pending: torch.Tensor) -> torch.Tensor:
        """[R] each request's index among the items (0 for requests without one)."""
        sel = t[h["sel"]]
        out = torch.zeros(pending.shape[0], dtype=torch.long, device=sel.device)
        return out.index_copy_(0, sel, torch.arange(sel.shape[0], device=sel.device))

    def _catchup_mtp(self, t: list[torch.Tensor], h: dict, items: list[tuple], num_tokens: torch.Tensor,
                     pending: torch.Tensor, hidden: StepHidden):
        """An MTP layer's catch-up over the step in flight's rows of each request: the target's hidden
        state at position p with the token after it (host-known, else in flight). Positions are the
        device's (``hidden.first``: shifted back by the rejected drafts of the step before); rows whose
        next token does not exist write no draft KV. A span may start with rows kept from host steps
        (``_catchup_items``), whose hidden states come from the kept tensors. Returns (carry, normed) and
        the target's hidden state of the row of each request that proposes d_1 (position true length - 2)."""
        bs, P, W = self.engine.block_size, pending.shape[1], h["W"]
        req_t, offs_t, sel = t[h["req"]], t[h["offs"]], t[h["sel"]]
        r_t = self._item_of(t, h, pending)[req_t]  # each row's item
        kept = t[h["kept"]]  # rows kept from host steps before the step in flight's (``_catchup_items``)
        first = hidden.first[sel] - kept  # the items' spans' true first positions
        pos = first[r_t] + offs_t
        q = pos + 1  # the token fed with the hidden state at p
        known, w0 = t[h["known"]][r_t], t[h["w0"]][r_t]
        src = torch.cat([t[h["win"]], pending[sel].clamp(min=0)], 1)
        col = torch.where(q < known, q - w0, W + (q - known).clamp(0, P - 1))
        ids = src[r_t, col.clamp(0, W + P - 1)]
        bt = t[h["tables"]]
        blk = bt[r_t, (pos // bs).clamp(max=bt.shape[1] - 1)]
        slots = torch.where(pos < num_tokens[req_t] - 1, blk * bs + pos % bs, -1)
        prev = hidden.hidden[(hidden.rows[req_t] + offs_t - kept[r_t]).clamp(0, hidden.hidden.shape[0] - 1)]
        if h["kept_at"] is not None:
            prev[t[h["kept_at"]]] = h["kept_hidden"].to(prev.dtype)
        if h["lean"]:
            carry, normed = self._catchup_forward(t, h, ids, pos, slots, r_t, prev)
        else:
            meta = self._catchup_meta(t, h["meta"], slots)
            if meta.decode is not None:  # the decode spans' true lengths (prefill chunks' are exact on the host)
                dec = t[h["dec"]]
                meta.decode.seq_lens = first[dec] + t[h["count"]][dec]
            carry, normed = self.source.forward(ids, pos, meta, prev)
        last = t[h["starts"]] + (num_tokens[sel] - 2 - first)
        return carry[last], normed[last], prev[last]

    def _device_loop(self, rows: _Rows, carry: torch.Tensor, normed: torch.Tensor, prev_last: torch.Tensor | None,
                     frac: torch.Tensor | None, cont: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft steps from the catch-up's proposing rows: tokens and confidences [R, K]
        (``prev_last``, ``frac``: the target's hidden state there and each request's last accepted
        fraction, for a confidence head that reads the target's features; ``cont``: the lookup
        continuations [R, N, K], for one that reads the lookup features)."""
        src = self.source
        K = max(rows.caps)
        target = None
        if src.needs_hidden and self.head.uses_target:
            target = conf_mod.target_features(src.logits(prev_last), frac)
        toks, feats = [], []
        tok = None
        # ``lookup_drafts``: the drafts follow each request's 4-gram run while it goes on (point masses)
        follow = cont[:, lookup_mod.FOLLOW] if cont is not None and self.lookup_drafts else None
        going = None if follow is None else torch.ones_like(follow[:, 0], dtype=torch.bool)
        overs = []
        for depth in range(1, K + 1):
            if depth > 1:
                carry, normed = self._ar_step(rows, tok, carry if src.needs_hidden else None, depth)
            logp = torch.log_softmax(src.logits(normed).float(), dim=-1)
            top, idx = logp.topk(2, dim=-1)
            tok = idx[:, 0]
            if follow is not None:
                going &= follow[:, depth - 1] >= 0
                overs.append(going & (follow[:, depth - 1] != tok))
                tok = torch.where(going, follow[:, depth - 1], tok)
                top = torch.stack((logp.gather(1, tok[:, None])[:, 0], top[:, 1]), -1)
            toks.append(tok)
            feats.append((normed, top, -(logp.exp() * logp).sum(-1)))
        # the confidences of every depth at once (no early stop on the device: none is needed sooner)
        normed, top, ent = (torch.stack(x, 1).flatten(0, 1) for x in zip(*feats))  # [R * K, ...], row-major
        greedy = rows.greedy.repeat_interleave(K)
        term = None if target is None else self.head.target_term(target).repeat_interleave(K)
        toks = torch.stack(toks, 1)
        over = torch.stack(overs, 1) if overs else None
        lk = None if cont is None or not self.head.uses_lookup else \
            self.head.lookup_term(lookup_mod.features(cont, toks, over)).flatten()
        c = self.head.fast(normed, top[:, 0], ent, greedy, self.head.per_row(greedy, term), top[:, 1], lk).view(-1, K)
        if self.calib is not None:  # the per-depth calibration (``plugins.dspark.calibration``)
            c = torch.stack([self._calibrated(c[:, d], d + 1) for d in range(K)], 1)
        return toks, c

    def draft_slots(self, engine, requests, slots: list[int]) -> list[int]:
        """Async steps (``Proposer.draft_slots``), before scheduling: whether drafting pays at this batch
        size (as the host path decides it after a step: ``_worth_speculating``), and for which requests
        (an exploratory step: a few); the others get no slots, so a step that does not draft lays out,
        proposes and verifies nothing beyond a plain step. The "budget" and fixed policies draft every
        step."""
        if not self.varlen or self.budgeted:
            return slots
        allowed = self._worth_speculating(SchedulerOutput(decodes=[ScheduledSeq(r, 1) for r in requests]),
                                          engine.load_stats()["running"])
        if allowed is True:
            return slots
        out = [m if allowed and seq.request_id in allowed else 0 for seq, m in zip(requests, slots)]
        if not any(out):  # a plain step: its time is a plain step's (``step_finished``), no async sample
            self._regime, self._pending = False, None
        return out

    def device_budget(self, engine, num_requests: int, num_slots: int) -> int:
        """The verify rows of an async step, fixed before its drafts exist: every slot for the fixed
        policy (and the threshold policy, whose ``min_confidence`` cut then decides), under the
        ``verify_budget`` setting; for the throughput policy the budget whose expected tokens per
        second of step time is best, a request's first j drafts all accepted with the running
        probability of that depth (``level_probs``), taken level by level over the requests given
        slots. The step time is the
        async steps' own measured curve (``LiveCost.step``: whole steps timed one step late, as
        ``step_timed`` feeds them), the decomposed curve scaled where a size is unmeasured. Every
        ``EXPLORE_VERIFY_EVERY``-th step verifies one row more than chosen, so the next size is
        measured too."""
        cap = min(num_slots, self.opts["verify_budget"] or num_slots)
        if not self.varlen or self.threshold or self.live is None or num_requests <= 0:
            return cap
        live, R = self.live, num_requests
        rows = min(R, max(1, -(-num_slots // self.k)))  # requests given slots (an exploratory step: a few)
        depth = max(1, -(-num_slots // rows))
        probs = self.level_probs(depth)
        best, best_b, expected = -1.0, 0, float(R)
        times = live.step_curve(R, list(range(R, R + cap + 1)), depth)
        for b in range(cap + 1):
            if b:
                expected += probs[min((b - 1) // rows, depth - 1)]  # the b-th best slot: level (b - 1) // rows + 1
            value = expected / max(times[b], 1e-9)
            if value > best:
                best, best_b = value, b
        self.n["budgets"] += 1
        if self.n["budgets"] % EXPLORE_VERIFY_EVERY == 0 and best_b < cap:
            best_b += 1
        return best_b

    def relayout_pays(self, engine, num_requests: int, num_slots: int, budget: int) -> bool:
        """(``Proposer.relayout_pays``) By the async steps' measured curve: re-laid steps at the budget's
        rows against steps computing every slot's row (a size's estimate is capped by the larger sizes
        measured, so where the full layout measured no dearer, the rows are not re-laid)."""
        if self.live is None:
            return True
        R = num_requests
        depth = max(1, -(-num_slots // max(1, min(R, -(-num_slots // self.k)))))
        return self.live.step(R, R + budget, depth) < self.live.step(R, R + num_slots, depth)

    def level_probs(self, depth: int) -> list[float]:
        """``P[j - 1]``: the probability that a request's first j device drafts are all accepted, as a
        product of running per-depth conditional accept rates (accepted over decided at each depth,
        ``DEPTH_PRIOR`` drafts at the running rate as a prior): acceptance runs in streaks (a request
        whose first drafts were accepted accepts the next more often), which one rate per draft, raised
        to the depth, underestimates at depth (0.54 per draft read 1.1 accepted of 5, against 2.5 seen)."""
        out, p, mean = [], 1.0, min(max(self.mean_conf, 0.0), 0.999)
        for j in range(depth):
            acc = self._depth_acc[j] if j < len(self._depth_acc) else 0.0
            dec = self._depth_dec[j] if j < len(self._depth_dec) else 0.0
            p *= min((acc + DEPTH_PRIOR * mean) / (dec + DEPTH_PRIOR), 0.999)
            out.append(p)
        return out

    def step_timed(self, engine, tokens: int, requests: int, seconds: float) -> None:
        """An async speculative step's wall time (``Proposer.step_timed``) into the live curve of
        whole async steps, keyed by the decodes and verified rows that step ran."""
        if self.live is not None:
            self.live.observe_step(requests, tokens, seconds, self.k)

    def device_verified(self, st, m: int, a: int) -> None:
        """Feedback of a device proposal (its draft KV bookkeeping is the catch-up's own): the running
        per-draft accept rate, a ratio of running sums (accepted drafts over drafts the target
        decided: those until the first rejection), so that it estimates the per-draft rate without
        bias (a running mean of each step's ratio a / (a + 1) underestimates it: 0.40 for a true 0.6
        at 5 drafts). The request's own last ratio is not kept as its forecast: a single outcome
        (0 whenever the first draft is rejected) would make the next steps skip drafting; its
        forecast is the running rate (``recent_conf`` None)."""
        st.dev_pending = False
        if m > 0:
            self.observe_accepts(m, a, host=False)
            st.recent_conf = None

    @property
    def mean_conf(self) -> float:
        """The running accept rate (accepted over decided drafts) of the path the coming steps draft on:
        host drafts are cut by their confidences and accepted more often than the device's, which run
        as deep as the budget, so each path keeps its own (``observe_accepts``); whether drafting pays
        at all is forecast from it."""
        return self._rate[self._host_path]

    @mean_conf.setter
    def mean_conf(self, value: float) -> None:  # both paths' (a start value, tests)
        self._rate = {True: float(value), False: float(value)}
        self._acc, self._dec = {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}

    def observe_accepts(self, m: int, a: int, host: bool) -> None:
        """One verification of ``m`` drafts with ``a`` accepted into the running accept rate of its
        path (a ratio of decaying sums) and, for device drafts, the per-depth rates (``level_probs``)."""
        decided = min(a + 1, m)
        if self._dec[host] <= 0:  # the running value so far as a prior of ACCEPT_PRIOR drafts, decaying away
            self._acc[host], self._dec[host] = self._rate[host] * ACCEPT_PRIOR, ACCEPT_PRIOR
        self._acc[host] = ACCEPT_DECAY * self._acc[host] + a
        self._dec[host] = ACCEPT_DECAY * self._dec[host] + decided
        self._rate[host] = self._acc[host] / self._dec[host]
        if host:
            return
        while len(self._depth_dec) < decided:
            self._depth_dec.append(0.0)
            self._depth_acc.append(0.0)
        for j in range(decided):  # per depth: drafts decided there (their earlier ones all accepted)
            self._depth_dec[j] = ACCEPT_DECAY * self._depth_dec[j] + 1.0
            self._depth_acc[j] = ACCEPT_DECAY * self._depth_acc[j] + (j < a)
