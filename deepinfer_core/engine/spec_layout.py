"""The device side of an async speculative step's layout (``engine/spec_async.py``): the prepared
(optimistic) decode rows corrected from the step in flight's accepted counts (``patch_rows``), and
laid out anew within the verify budget (``compact_rows``). Both read the step's index maps, built on
the host and sent in one transfer (``AsyncSpec._index_maps``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.model_runner import StepBatch
from deepinfer_core.scheduler import SchedulerOutput

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.engine.spec_async import LaunchDrafts


def _after(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """``torch.cat([head, tail])``, or ``tail`` itself when ``head`` is empty (no copy)."""
    return tail if head.shape[0] == 0 else torch.cat([head, tail])


def patch_rows(eng: LLMEngine, batch: StepBatch, out: SchedulerOutput, maps: dict, last: torch.Tensor,
               rej: torch.Tensor, drafts: LaunchDrafts | None) -> None:
    """Correct the prepared (optimistic) decode rows on the device: positions and context lengths
    shifted back by the rejected drafts, the query token and draft tokens placed, slots recomputed."""
    bs = eng.block_size
    meta, t, D0 = batch.meta, maps["t"], maps["D0"]
    nd = len(out.decodes)
    req = t[maps["req"]]
    pos = batch.positions[D0:] - rej[req]
    batch.positions[D0:] = pos
    tokens = last if drafts is None else torch.cat([last, drafts.tokens.reshape(-1)])
    batch.input_ids[D0:] = tokens[t[maps["src"]]]
    done = set()
    for (pool, m), names in eng.runner._slot_keys.items():
        slot = meta.groups[names[0]].slot_mapping if meta.groups else meta.slot_mapping
        if id(slot) in done:
            continue
        done.add(id(slot))
        tables = t[maps["tables"][pool]]
        width = tables.shape[1]
        block = tables.view(-1)[req * width + (pos // bs).clamp(max=width - 1)]
        if m == 1:
            new = block * bs + pos % bs
        else:
            new = torch.where((pos + 1) % m == 0, block * (bs // m) + (pos % bs) // m, -1)
        slot[D0:] = new
    d = meta.decode
    d.seq_lens[d.seq_lens.shape[0] - nd :] -= rej  # (batch-invariant mode: the prefills come first)
    d.host_seq_lens = None  # not known on the host until the step in flight completes
    if meta.seq_lens is not None and meta.seq_lens is not d.seq_lens:
        meta.seq_lens[batch.num_prefills : batch.num_prefills + nd] -= rej

def compact_rows(eng: LLMEngine, batch: StepBatch, out: SchedulerOutput, drafts: LaunchDrafts, maps: dict,
                 keep_rows: bool) -> None:
    """Lay the decode rows out anew on the device: request j keeps its first 1 + length_j rows, at
    row ``cu[j]`` (cumulative on the device), within decodes + budget rows fixed by the host; the
    rows left over form one padding sequence that writes no KV. Logit rows past a request's length
    repeat its last one (the verify ignores them)."""
    dev, bs, t = eng.device, eng.block_size, maps["t"]
    meta, d = batch.meta, batch.meta.decode
    P, np_, R = meta.num_prefill_tokens, batch.num_prefills, len(out.decodes)
    T = R + drafts.budget
    starts = t[maps["starts"]]
    ell = torch.zeros(R, dtype=torch.long, device=dev).index_copy_(0, drafts.where, drafts.lengths)
    cu = torch.zeros(R + 1, dtype=torch.long, device=dev)
    torch.cumsum(1 + ell, 0, out=cu[1:])
    r = torch.arange(T, device=dev)
    j = torch.searchsorted(cu[1:], r, right=True)  # R: a padding row
    pad = j >= R
    jc = j.clamp(max=R - 1)
    old = P + torch.where(pad, starts[0], starts[jc] + r - cu[jc])  # rows of the host layout
    batch.input_ids = _after(batch.input_ids[:P], torch.where(pad, 0, batch.input_ids[old]))
    batch.positions = _after(batch.positions[:P], torch.where(pad, 0, batch.positions[old]))
    new_slots = {}
    for g in meta.groups.values():
        key = id(g.slot_mapping)
        if key not in new_slots:
            s = g.slot_mapping
            new_slots[key] = _after(s[:P], torch.where(pad, -1, s[old]))
        g.slot_mapping = new_slots[key]
    meta.slot_mapping = new_slots.get(id(meta.slot_mapping), meta.slot_mapping)
    pad_len = (T - cu[R]).reshape(1)
    seq_lens = torch.cat([d.seq_lens - (t[maps["slots"]] - ell), pad_len])
    cu_q = torch.cat([cu, pad_len.new_full((1,), T)])
    width = -(-drafts.budget // bs)

    def with_pad_row(tab: torch.Tensor) -> torch.Tensor:  # a table row for the padding sequence (reads only)
        return torch.nn.functional.pad(tab, (0, max(0, width - tab.shape[1]), 0, 1))

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
    ej = t[maps["ent_j"]]
    batch.logit_index = _after(batch.logit_index[:e_p], P + r)
    batch.logit_rows = batch.logit_rows[:e_p] + list(range(P, P + T))
    drafts.expand = _after(torch.arange(e_p, device=dev), e_p + cu[ej] + torch.minimum(t[maps["ent_t"]], ell[ej]))
    if keep_rows:  # where each request's hidden states lie now (a proposer reading hidden states)
        drafts.rows = torch.cat([t[maps["prefill_rows"]], P + cu[:R]])
