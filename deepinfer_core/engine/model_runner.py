"""Runs one scheduled step on the device: builds the flat batch, runs the model, samples.

Layout: prefill chunks' tokens first, then decode tokens (see ``models.metadata``). Logits are
computed only for the rows that need them: each request's last row when it samples, and every
prefill row of requests that asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, PrefillMeta
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class StepBatch:
    """A scheduled step turned into device tensors, plus the bookkeeping to read results back."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    scheduled: list[ScheduledSeq]
    logit_rows: list[int] = field(default_factory=list)  # token rows whose logits are computed
    sample_seqs: list[Sequence] = field(default_factory=list)  # requests that draw a token this step
    sample_rows: list[int] = field(default_factory=list)  # their index into logit_rows' result
    prompt_lp: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # (seq, first, count, start)
    keep_hidden: bool = False  # forward() keeps every row's final hidden state in ``hidden`` (MTP drafts)
    hidden: torch.Tensor | None = None


def _block_table_tensor(seqs: list[Sequence], device) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                        dtype=torch.int32, device=device)


def _cumsum(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.long, device=device)


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, device: torch.device,
                 batch_invariant: bool = False) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        #: Batch-invariant mode: prefill chunks go through the decode (absorbed MLA) path too, so a
        #: token's result does not depend on how its prompt was chunked.
        self.batch_invariant = batch_invariant

    def prepare(self, out: SchedulerOutput, draft_tokens: dict[str, list[int]] | None = None,
                keep_hidden: bool = False) -> StepBatch:
        """``draft_tokens`` (speculative decoding): tokens appended after a decode request's query
        token, verified in the same forward. Their KV slots must be allocated; the request's logit
        rows are then its query row and every draft row, consecutive from its sample row."""
        bs, dev = self.block_size, self.device
        drafts = draft_tokens or {}
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_lp = []
        for i, s in enumerate(out.prefills + out.decodes):
            seq, n = s.seq, s.num_new_tokens
            c = seq.num_computed_tokens
            row0 = len(ids)
            ids.extend(seq.token_ids[c : c + n])
            extra = drafts.get(seq.request_id, ()) if drafts and i >= len(out.prefills) else ()
            ids.extend(extra)
            pos.extend(range(c, c + n + len(extra)))
            bt = seq.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(c, c + n + len(extra)))
            done_lp = len(seq.prompt_logprobs) - 1  # prompt positions already scored (kept on recompute)
            if seq.params.prompt_logprobs is not None and max(c, done_lp) < seq.num_prompt_tokens - 1:
                first = max(c, done_lp)
                count = min(c + n, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_lp.append((seq, first, count, len(logit_rows)))
                    logit_rows.extend(range(row0 + first - c, row0 + first - c + count))
            if c + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(len(logit_rows))
                logit_rows.extend(range(row0 + n - 1, row0 + n + len(extra)))

        prefill = decode = None
        prefills, decodes = out.prefills, out.decodes
        if self.batch_invariant:  # same token layout; every sequence in the decode metadata
            prefills, decodes = [], out.prefills + out.decodes
        if prefills:
            seqs = [s.seq for s in prefills]
            q_lens = [s.num_new_tokens for s in prefills]
            k_lens = [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills]
            prefill = PrefillMeta(
                cu_q_lens=_cumsum(q_lens, dev), cu_k_lens=_cumsum(k_lens, dev),
                seq_lens=torch.tensor(k_lens, dtype=torch.long, device=dev),
                block_tables=_block_table_tensor(seqs, dev),
                has_prefix=any(s.seq.num_computed_tokens > 0 for s in prefills),
            )
        if decodes:
            seqs = [s.seq for s in decodes]
            q_lens = [s.num_new_tokens + len(drafts.get(s.seq.request_id, ())) for s in decodes]
            decode = DecodeMeta(
                cu_q_lens=_cumsum(q_lens, dev),
                seq_lens=torch.tensor([s.seq.num_computed_tokens + q for s, q in zip(decodes, q_lens)],
                                      dtype=torch.long, device=dev),
                block_tables=_block_table_tensor(seqs, dev), max_q_len=max(q_lens),
            )
        num_prefill_tokens = sum(s.num_new_tokens for s in prefills)
        meta = AttentionMetadata(num_prefill_tokens, torch.tensor(slots, dtype=torch.long, device=dev),
                                 prefill, decode)
        return StepBatch(torch.tensor(ids, dtype=torch.long, device=dev),
                         torch.tensor(pos, dtype=torch.long, device=dev), meta, out.prefills + out.decodes,
                         logit_rows, sample_seqs, sample_rows, prompt_lp, keep_hidden)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] float32."""
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        if batch.keep_hidden:
            batch.hidden = hidden
        if not batch.logit_rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden[rows])
