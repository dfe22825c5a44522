"""Device graphs for pure-decode steps: the whole forward plus the LM head replayed as one graph.

A step qualifies when it has no prefill tokens, every sequence has exactly one query token, no
caller wants the hidden states, and its logits rows are exactly its tokens (``logit_rows == range(B)``).
Its B sequences replay the graph of the smallest captured size >= B: the step's inputs are copied
into static buffers (rows ``B:`` are padding), the graph runs, and the first B rows of its static
logits are returned. Padding rows write no KV (slot -1), attend over one cached key of a real block
(``seq_len`` 1), and their results are dropped. Larger or mixed steps run eagerly.

Capture safety: the graph freezes the launches and their grids, so nothing on the decode path may
depend on tensor values on the host. The decode ops of a capturing platform compute their
per-sequence work on the device; what the host decides (MLA split-KV count, MoE tile configuration,
padded widths) comes only from shapes that are fixed per captured size. See
``docs/cuda_graphs.md`` for the audit.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

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
    """Static buffers and one graph per batch size, sharing one memory pool.

    ``capture=False`` keeps everything but the graphs: steps run eagerly through the same padded
    static buffers (how the CPU tests exercise this path, and a reference on a GPU).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, sizes: list[int],
                 max_blocks_per_seq: int, device: torch.device, platform: Platform | None = None,
                 capture: bool = True, layout: CacheLayout | None = None,
                 pool_of: dict[str, str] | None = None) -> None:
        if capture and platform is None:
            raise ValueError("DecodeGraphs: capture=True needs the platform that captures the graphs")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"DecodeGraphs: batch sizes must be a non-empty list of integers >= 1, got {sizes!r}")
        self.model, self.kv_caches, self.platform = model, kv_caches, platform
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.capture_enabled = capture
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.long, device=device)  # q_len 1 everywhere: constant
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
            self.group_slots[g.name] = self.slot_mapping if same else torch.full((n,), -1, dtype=torch.long,
                                                                                 device=device)
            self.group_pool[g.name] = pool
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        #: steps run per padded size (replayed, or eager through the static buffers when not capturing)
        self.runs: Counter[int] = Counter()
        self.capture_seconds = 0.0

    # ---- capture -------------------------------------------------------------------------
    def _forward(self, n: int) -> torch.Tensor:
        """The captured computation: the model over the first ``n`` static rows, then their logits."""
        groups = {g: GroupMeta(slots[:n], self.pool_tables[self.group_pool[g]][:n])
                  for g, slots in self.group_slots.items()}
        meta = AttentionMetadata(0, self.slot_mapping[:n], None,
                                 DecodeMeta(self.cu_q_lens[: n + 1], self.seq_lens[:n], self.block_tables[:n], 1),
                                 groups=groups, cu_q_lens=self.cu_q_lens[: n + 1], seq_lens=self.seq_lens[:n])
        hidden = self.model(self.input_ids[:n], self.positions[:n], meta, self.kv_caches)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first, into one shared pool; returns the seconds it took.

        Every row is padding while capturing (slot -1: the KV cache is not touched)."""
        if not self.capture_enabled:
            return 0.0
        p = self.platform
        t0 = time.perf_counter()
        pool = None
        for n in reversed(self.sizes):
            self._pad_from(0)
            try:
                self._forward(n)  # warm-up outside the capture: kernel compilation, library handles
                p.synchronize()
                graph = p.graph()
                with p.graph_capture(graph, pool):
                    out = self._forward(n)
            except Exception as exc:
                raise RuntimeError(
                    f"capturing the decode graph for batch size {n} on platform {p.name!r} failed "
                    f"({type(exc).__name__}: {exc}); an op on the decode path synchronises with the host. "
                    "Set enforce_eager=True to run every step eagerly") from exc
            if pool is None:
                pool = graph.pool()
            self.graphs[n], self.outputs[n] = graph, out
        p.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    # ---- replay --------------------------------------------------------------------------
    def accepts(self, batch: StepBatch) -> bool:
        """Whether ``batch`` is a pure-decode step this object can run (else the caller runs it eagerly)."""
        m = batch.meta
        d = m.decode
        if batch.keep_hidden or m.prefill is not None or d is None or m.num_prefill_tokens:
            return False
        B = d.seq_lens.shape[0]
        if d.max_q_len != 1 or batch.input_ids.shape[0] != B or not 0 < B <= self.max_size:
            return False
        if d.block_tables.shape[1] > self.max_blocks:
            return False
        if m.groups is not None and any(g.block_tables.shape[1] > self.max_blocks for g in m.groups.values()):
            return False
        rows = batch.logit_rows
        return len(rows) == B and rows == list(range(B))

    def padded_size(self, B: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, B)]

    def _pad_from(self, B: int) -> None:
        """Rows ``B:`` become padding: no KV write, one key to attend over (a real block: in bounds).
        Their token ids, positions and block-table rows keep earlier, valid values."""
        for slots in dict.fromkeys(self.group_slots.values()):
            slots[B:].fill_(-1)
        self.seq_lens[B:].fill_(1)
        for pool in self.window_pools:  # a stale row may hold -1 (a freed window block): keep reads in bounds
            self.pool_tables[pool][B:].clamp_(min=0)

    def _copy_groups(self, meta: AttentionMetadata, B: int) -> None:
        """The other groups' slot mappings and pools' block tables into their static buffers."""
        done = {id(self.slot_mapping), id(self.block_tables)}
        for name, gm in meta.groups.items():
            slots, table = self.group_slots[name], self.pool_tables[self.group_pool[name]]
            if id(slots) not in done:
                slots[:B].copy_(gm.slot_mapping)
                done.add(id(slots))
            if id(table) not in done:
                table[:B, : gm.block_tables.shape[1]].copy_(gm.block_tables)
                done.add(id(table))

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of an accepted batch (a fresh tensor, not the static output)."""
        d = batch.meta.decode
        B = d.seq_lens.shape[0]
        n = self.padded_size(B)
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
        if n in self.graphs:
            lens = d.host_seq_lens if d.host_seq_lens is not None else d.seq_lens.tolist()
            self.platform.graph_replay(self.graphs[n], lens + [1] * (n - B))  # padding rows: seq_len 1
            return self.outputs[n][:B].clone()  # the static output is overwritten by the next replay
        return self._forward(n)[:B]
