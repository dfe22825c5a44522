"""Device graphs for pure-decode steps: the whole forward plus the LM head replayed as one graph.

A step qualifies when it has no prefill tokens and its logits rows are exactly its tokens
(``logit_rows == range(T)``). Graphs are keyed by ``(n, R)``: ``n`` sequences of ``R`` query rows
(``graph_buckets``). Plain decode steps (one query token each) replay ``(n, 1)``: their B sequences
take the smallest captured size >= B, rows ``B:`` are padding. Speculative verify steps (the query
token plus drafts, ``q_i`` rows per request) replay ``(n, R)`` with ``R >= max q_i``: each request
gets ``R`` rows, its real rows first (``graph_buckets.padded_layout``). The step's inputs are copied
into static buffers, the graph runs, and the real rows of its static logits (and hidden states, when
the caller keeps them) are returned. Padding rows write no KV (slot -1), attend over keys of real
blocks (in bounds) and their results are dropped. Larger or mixed steps run eagerly.

Capture safety: the graph freezes the launches and their grids, so nothing on the decode path may
depend on tensor values on the host. The decode ops of a capturing platform compute their
per-sequence work on the device; what the host decides (MLA split-KV count, MoE tile configuration,
padded widths) comes only from shapes that are fixed per captured key. See
``docs/cuda_graphs.md`` for the audit.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.engine.graph_buckets import DEFAULT_VERIFY_TOKENS, padded_layout, pick_key, verify_buckets
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, GroupMeta

if TYPE_CHECKING:
    from deepinfer_core.engine.model_runner import StepBatch
    from deepinfer_core.kv_cache_spec import CacheLayout
    from deepinfer_core.models.interface import KVCaches
    from deepinfer_core.platform import Platform

logger = logging.getLogger("deepinfer.graphs")

#: Captured batch sizes when ``graph_batch_sizes`` is unset (capped at ``max_num_seqs``).
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """:data:`DEFAULT_BATCH_SIZES` up to ``min(max_num_seqs, 256)``, plus that cap itself."""
    cap = min(max_num_seqs, DEFAULT_BATCH_SIZES[-1])
    sizes = [s for s in DEFAULT_BATCH_SIZES if s < cap]
    return sizes + [cap]


class DecodeGraphs:
    """Static buffers and one graph per key ``(n, R)``, sharing one memory pool.

    ``verify_rows`` (the speculative draft length k plus one; 1: no verify graphs) and
    ``verify_tokens`` (largest ``n * R``) choose the verify keys (``graph_buckets.verify_buckets``).
    ``capture=False`` keeps everything but the graphs: steps run eagerly through the same padded
    static buffers (how the CPU tests exercise this path, and a reference on a GPU).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, sizes: list[int],
                 max_blocks_per_seq: int, device: torch.device, platform: Platform | None = None,
                 capture: bool = True, layout: CacheLayout | None = None,
                 pool_of: dict[str, str] | None = None, *, block_size: int = 1, verify_rows: int = 1,
                 verify_tokens: int = DEFAULT_VERIFY_TOKENS) -> None:
        if capture and platform is None:
            raise ValueError("DecodeGraphs: capture=True needs the platform that captures the graphs")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"DecodeGraphs: batch sizes must be a non-empty list of integers >= 1, got {sizes!r}")
        self.model, self.kv_caches, self.platform = model, kv_caches, platform
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.capture_enabled = capture
        #: rows per request R >= 2 -> the batch sizes captured with R rows
        self.verify_sizes = verify_buckets(self.sizes, verify_rows, verify_tokens)
        n = self.max_size
        self.max_tokens = max([n] + [m * R for R, ms in self.verify_sizes.items() for m in ms])
        t = self.max_tokens
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # R query rows everywhere: constant per R
        self.cu_q = {R: torch.arange(n + 1, dtype=torch.long, device=device) * R
                     for R in [1, *self.verify_sizes]}
        self.cu_q_lens = self.cu_q[1]
        # Per cache group: a static slot mapping and, per block pool, a static block table. The first
        # group's are the two buffers above; groups of one pool share its table.
        layout = layout if layout is not None else model.cache_layout()
        pool_of = pool_of or {g.name: g.name for g in layout.groups}
        first = layout.groups[0]
        self.pool_tables = {pool_of[first.name]: self.block_tables}
        self.window_pools = {pool_of[g.name] for g in layout.groups if g.window is not None}
        self.group_slots: dict[str, torch.Tensor] = {}
        self.group_pool: dict[str, str] = {}
        for g in layout.groups:
            pool = pool_of[g.name]
            if pool not in self.pool_tables:
                self.pool_tables[pool] = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
            same = pool == pool_of[first.name] and g.tokens_per_entry == first.tokens_per_entry
            self.group_slots[g.name] = self.slot_mapping if same else torch.full((t,), -1, dtype=torch.long,
                                                                                 device=device)
            self.group_pool[g.name] = pool
        self.graphs: dict[tuple[int, int], Any] = {}
        #: per key: the static (hidden, logits) a replay writes. Verify keys share one pair of buffers
        #: (``verify_out``): their logits are large (n * R x vocab) and one step replays one graph.
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.verify_out: tuple[torch.Tensor, torch.Tensor] | None = None
        #: plain steps run per padded size (replayed, or eager through the static buffers when not capturing)
        self.runs: Counter[int] = Counter()
        #: verify steps run per key (n, R)
        self.verify_runs: Counter[tuple[int, int]] = Counter()
        self.capture_seconds = 0.0

    @property
    def keys(self) -> list[tuple[int, int]]:
        """Every key, plain sizes first."""
        return [(n, 1) for n in self.sizes] + [(n, R) for R, ns in self.verify_sizes.items() for n in ns]

    # ---- capture -------------------------------------------------------------------------
    def _forward(self, n: int, R: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured computation: the model over the first ``n`` static sequences of ``R`` rows,
        then the logits of every row. Returns (hidden, logits)."""
        T = n * R
        cu = self.cu_q[R][: n + 1]
        groups = {g: GroupMeta(slots[:T], self.pool_tables[self.group_pool[g]][:n])
                  for g, slots in self.group_slots.items()}
        meta = AttentionMetadata(0, self.slot_mapping[:T], None,
                                 DecodeMeta(cu, self.seq_lens[:n], self.block_tables[:n], R),
                                 groups=groups, cu_q_lens=cu, seq_lens=self.seq_lens[:n])
        hidden = self.model(self.input_ids[:T], self.positions[:T], meta, self.kv_caches)
        return hidden, self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every key, most rows first, into one shared pool; returns the seconds it took.

        Every row is padding while capturing (slot -1: the KV cache is not touched)."""
        if not self.capture_enabled:
            return 0.0
        p = self.platform
        t0 = time.perf_counter()
        pool = None
        for n, R in sorted(self.keys, key=lambda k: (k[0] * k[1], k[1]), reverse=True):
            self._pad_from(0, R)
            try:
                hidden, logits = self._forward(n, R)  # warm-up outside the capture: compilation, library handles
                if R > 1 and self.verify_out is None:  # the largest verify key comes first
                    self.verify_out = (hidden.new_empty(n * R, hidden.shape[-1]),
                                       logits.new_empty(n * R, logits.shape[-1]))
                p.synchronize()
                graph = p.graph()
                with p.graph_capture(graph, pool):
                    hidden, logits = self._forward(n, R)
                    if R > 1:
                        self.verify_out[0][: n * R].copy_(hidden)
                        self.verify_out[1][: n * R].copy_(logits)
            except Exception as exc:
                what = f"batch size {n}" + (f", {R} rows per request (verify)" if R > 1 else "")
                raise RuntimeError(
                    f"capturing the decode graph for {what} on platform {p.name!r} failed "
                    f"({type(exc).__name__}: {exc}); an op on the decode path synchronises with the host. "
                    "Set enforce_eager=True to run every step eagerly") from exc
            if pool is None:
                pool = graph.pool()
            self.graphs[(n, R)] = graph
            self.outputs[(n, R)] = (hidden, logits) if R == 1 else self.verify_out
        p.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    # ---- replay --------------------------------------------------------------------------
    def key(self, batch: StepBatch) -> tuple[int, int] | None:
        """The graph key ``(n, R)`` that runs ``batch``, or None (the caller runs it eagerly)."""
        m = batch.meta
        d = m.decode
        if m.prefill is not None or d is None or m.num_prefill_tokens:
            return None
        B, T = d.seq_lens.shape[0], batch.input_ids.shape[0]
        if d.block_tables.shape[1] > self.max_blocks:
            return None
        if m.groups is not None and any(g.block_tables.shape[1] > self.max_blocks for g in m.groups.values()):
            return None
        rows = batch.logit_rows
        if len(rows) != T or rows != list(range(T)):
            return None
        if d.max_q_len == 1:
            return pick_key(self.sizes, {}, B, 1) if T == B else None
        if len(batch.row_starts) != B:  # a batch built by hand: its rows per request are unknown
            return None
        key = pick_key(self.sizes, self.verify_sizes, B, d.max_q_len)
        if key is None:
            return None
        # padding rows read keys up to seq_len + R - q: their block-table column must exist
        lens = d.host_seq_lens if d.host_seq_lens is not None else d.seq_lens.tolist()
        reach = max(s + key[1] - q for s, q in zip(lens, self._q_lens(batch)))
        return key if reach <= self.max_blocks * self.block_size else None

    def accepts(self, batch: StepBatch) -> bool:
        """Whether ``batch`` is a decode or verify step a graph runs (else the caller runs it eagerly)."""
        return self.key(batch) is not None

    def padded_size(self, B: int) -> int:
        return pick_key(self.sizes, {}, B, 1)[0]

    @staticmethod
    def _q_lens(batch: StepBatch) -> list[int]:
        starts = batch.row_starts
        return [b - a for a, b in zip(starts, starts[1:] + [batch.input_ids.shape[0]])]

    def _pad_from(self, B: int, R: int = 1) -> None:
        """Sequences ``B:`` of R rows become padding: no KV write, R keys to attend over (a real block:
        in bounds). Their token ids, positions and block-table rows keep earlier, valid values."""
        for slots in dict.fromkeys(self.group_slots.values()):
            slots[B * R:].fill_(-1)
        self.seq_lens[B:].fill_(R)
        for pool in self.window_pools:  # a stale row may hold -1 (a freed window block): keep reads in bounds
            self.pool_tables[pool][B:].clamp_(min=0)

    def _copy_groups(self, meta: AttentionMetadata, B: int, dst: torch.Tensor | None = None) -> None:
        """The other groups' slot mappings (to rows ``dst``, else ``:B``) and pools' block tables into
        their static buffers."""
        done = {id(self.slot_mapping), id(self.block_tables)}
        for name, gm in meta.groups.items():
            slots, table = self.group_slots[name], self.pool_tables[self.group_pool[name]]
            if id(slots) not in done:
                if dst is None:
                    slots[:B].copy_(gm.slot_mapping)
                else:
                    slots.index_copy_(0, dst, gm.slot_mapping)
                done.add(id(slots))
            if id(table) not in done:
                table[:B, : gm.block_tables.shape[1]].copy_(gm.block_tables)
                done.add(id(table))

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [T, vocab] float32 of an accepted batch (a fresh tensor, not the static output);
        sets ``batch.hidden`` when the batch keeps its hidden states."""
        n, R = self.key(batch)
        if R > 1:
            return self._run_verify(batch, n, R)
        d = batch.meta.decode
        B = d.seq_lens.shape[0]
        self.input_ids[:B].copy_(batch.input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping[:B].copy_(batch.meta.slot_mapping)
        self.seq_lens[:B].copy_(d.seq_lens)
        self.block_tables[:B, : d.block_tables.shape[1]].copy_(d.block_tables)
        if len(self.pool_tables) > 1 or len(self.group_slots) > 1:
            self._copy_groups(batch.meta, B)
        if n > B:
            self._pad_from(B)
        self.runs[n] += 1
        if (n, 1) in self.graphs:
            lens = d.host_seq_lens if d.host_seq_lens is not None else d.seq_lens.tolist()
            self.platform.graph_replay(self.graphs[(n, 1)], lens + [1] * (n - B))  # padding rows: seq_len 1
            hidden, logits = self.outputs[(n, 1)]
        else:
            hidden, logits = self._forward(n)
        if batch.keep_hidden:
            batch.hidden = hidden[:B].clone()
        return logits[:B].clone()  # the static output is overwritten by the next replay

    def _run_verify(self, batch: StepBatch, n: int, R: int) -> torch.Tensor:
        """A verify step padded to n requests of R rows (``graph_buckets.padded_layout``)."""
        d = batch.meta.decode
        B = d.seq_lens.shape[0]
        lens = d.host_seq_lens if d.host_seq_lens is not None else d.seq_lens.tolist()
        rows, padded_lens = padded_layout(self._q_lens(batch), lens, n, R)
        dev = self.input_ids.device
        dst = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
        N = n * R
        # padding rows: token 0 at position 0 (valid inputs whose results are dropped), no KV write
        self.input_ids[:N].zero_()
        self.positions[:N].zero_()
        for slots in dict.fromkeys(self.group_slots.values()):
            slots[:N].fill_(-1)
        self.input_ids.index_copy_(0, dst, batch.input_ids)
        self.positions.index_copy_(0, dst, batch.positions)
        self.slot_mapping.index_copy_(0, dst, batch.meta.slot_mapping)
        self.seq_lens[:n].copy_(torch.tensor(padded_lens, dtype=torch.long).to(dev, non_blocking=True))
        self.block_tables[:B, : d.block_tables.shape[1]].copy_(d.block_tables)
        if len(self.pool_tables) > 1 or len(self.group_slots) > 1:
            self._copy_groups(batch.meta, B, dst)
        for pool in self.window_pools:  # padding rows read past a request's blocks: stale -1 must not be read
            self.pool_tables[pool][:n].clamp_(min=0)
        self.verify_runs[(n, R)] += 1
        if (n, R) in self.graphs:
            self.platform.graph_replay(self.graphs[(n, R)], padded_lens)
            hidden, logits = self.outputs[(n, R)]
        else:
            hidden, logits = self._forward(n, R)
        if batch.keep_hidden:
            batch.hidden = hidden[dst]
        return logits[dst]  # a gather: a fresh tensor
