"""Prefix hits and window KV snapshots for models whose cache layout has window groups.

The engine builds one :class:`WindowCache` when the model declares a prefix-cacheable window group
(DeepSeek-V4's ``swa`` and compressor-overlap ``csa_state``); nothing here names a model. Admission
(:meth:`WindowCache.admit`) follows ``window_prefix.plan_prefix``.

Snapshots (``swa_prefix_policy`` hits in this process, across requests): the window state a hit at
boundary ``a`` needs, i.e. per required window group the rows of positions ``[a - r, a)`` with
``r = min(window, unit)`` (128 rows of the V4-Flash window KV), every layer, each row MXFP8-packed
(``mxfp8_quant``: 528 bytes for a 512-wide row). They are taken at ``unit`` granularity:

* after prefill: at the prompt length aligned down to ``unit`` (nothing under one unit);
* during decode: at every ``unit`` boundary;
* at finish (or preemption): the last complete boundary not yet taken.

They are copied right before the request's window blocks may be freed (``KVCacheManager``'s
``before_window_free``: every allocation and the release), so the rows are still in its blocks;
rows a replay recomputed are never snapshotted. They live in host memory: in the host tier's store
when ``[kv_store]`` is configured (sharing its capacity and LRU with the other host blocks), else in
a store of ``window_snapshot_memory`` bytes. A snapshot-fed hit is exact up to MXFP8 rounding
(relative 2**-4 per value); a hit on device-resident window blocks is exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from deepinfer_core.engine.hashing import block_hash, chain
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.window_prefix import hit_cap_blocks, plan_prefix, window_unit
from deepinfer_core.kv_cache_spec import HitRule, cache_planes

logger = logging.getLogger("deepinfer.window_cache")

SNAPSHOT_TAG = [-1]  # hashed after a prefix's chain hash: a snapshot's key never equals a block's


@dataclass
class WindowCounters:
    hits_device: int = 0  # hits whose window state was in device blocks (exact)
    hits_snapshot: int = 0  # ... restored from a host snapshot (MXFP8)
    hits_replay: int = 0  # ... recomputed (bounded_replay / recompute)
    replay_tokens: int = 0  # tokens recomputed by those replays
    replay_tokens_per_hit: list[int] = field(default_factory=list)  # the last 64
    snapshots: int = 0
    snapshot_bytes: int = 0  # of the snapshots taken
    snapshots_skipped: int = 0  # rows already freed or replayed, or the store refused them


def hit_groups(layout) -> list:
    """The window groups whose state a prefix hit needs (prefix-cacheable, ``HitRule.REQUIRED``)."""
    return [g for g in layout.groups if g.window is not None and g.prefix_cacheable and g.hit_rule == HitRule.REQUIRED]


def snapshot_parts(layout, block_size: int, model_dtype: torch.dtype) -> list[tuple]:
    """(group, rows, bytes per row, MXFP8?) of one window snapshot of ``layout``: ``min(window, unit)``
    rows per layer; rows of a width divisible by 32 MXFP8-packed (``entry_dim + entry_dim / 32``
    bytes), others raw. V4-Flash: swa 128 rows x 43 layers x 528 B, csa_state 8 x 21 x 2640 B."""
    groups = hit_groups(layout)
    unit = window_unit(max(g.window for g in groups), block_size)
    out = []
    for g in groups:
        mx = g.entry_dim % 32 == 0
        width = g.entry_dim + g.entry_dim // 32 if mx else g.entry_dim * (g.dtype or model_dtype).itemsize
        out.append((g, min(g.window, unit), width, mx))
    return out


class WindowCache:
    def __init__(self, engine, store) -> None:
        self.engine, self.store = engine, store
        cfg, blocks = engine.cfg, engine.blocks
        self.policy, self.bs = cfg.swa_prefix_policy, engine.block_size
        self.groups = hit_groups(engine.cache_layout)
        self.window = max(g.window for g in self.groups)
        self.unit = window_unit(self.window, self.bs)
        drafts = engine.spec.k if engine.spec is not None else 0
        self.spec_lookback = cfg.spec_lookback if cfg.spec_lookback is not None else drafts + 1
        self.num_layers = engine.model_config.num_hidden_layers
        # rows are stored MXFP8, V4's float32 compressor-overlap inputs too: storing those exactly (4.6x
        # their bytes) left the drift of a snapshot hit unchanged on the tiny V4
        parts = snapshot_parts(engine.cache_layout, self.bs, engine.dtype)
        self.rows = {g.name: rows for g, rows, _, _ in parts}
        self._row_bytes = {g.name: width for g, _, width, _ in parts}
        self.mxfp8 = {g.name: mx for g, _, _, mx in parts}
        self.counters = WindowCounters()
        full_pools = [p for p in blocks.specs if p.window is None]
        if self.policy != "retain" and blocks.record_pool is not None and len(full_pools) == 1:
            blocks.external_hits = True  # lower tiers extend the compressed hit; the policy completes it
        if store is not None:
            blocks.before_window_free = self.snapshot
        logger.info("window prefix: policy %s, window %d, unit %d, spec_lookback %d, snapshots %s",
                    self.policy, self.window, self.unit, self.spec_lookback,
                    "off" if store is None else type(store).__name__)

    # ---- admission ----------------------------------------------------------------------
    def admit(self, seq: Sequence, hashes: list[int]) -> int:
        """Take a new request's prefix hit; returns its first computed token."""
        e, blocks, bs = self.engine, self.engine.blocks, self.bs
        seq.replay_until = 0
        hashes = hashes[: hit_cap_blocks(seq.num_tokens, self.window, self.spec_lookback, bs)]
        n_dev = blocks.full_hit(hashes)
        n_full = n_dev
        if blocks.external_hits and n_dev < len(hashes):
            ext = e.pm.hook.match_external_prefix(engine=e, request=seq, block_hashes=hashes,
                                                  num_device_blocks=n_dev)
            n_full = max(n_dev, ext or 0)
        snaps: dict[int, torch.Tensor | None] = {}

        def snapshot_of(n: int) -> torch.Tensor | None:
            if n not in snaps:
                snaps[n] = self._get(hashes[n - 1]) if self.store is not None else None
            return snaps[n]

        plan = plan_prefix(self.policy, n_full, seq.num_tokens, bs, self.window, self.spec_lookback,
                           self.num_layers, lambda n: blocks.window_held(hashes, n) or snapshot_of(n) is not None)
        if plan.blocks == 0:
            blocks.acquire_planned(seq, hashes, 0, None, 0)
            return 0
        end, c = plan.blocks * bs, self.counters
        info = {"compressed_hit_tokens": end, "replay_tokens": plan.replay_tokens}
        if plan.retain and blocks.window_held(hashes, plan.blocks):
            blocks.acquire_planned(seq, hashes, plan.blocks, plan.blocks, end)
            c.hits_device += 1
            info["window"] = "device"
        elif plan.retain:
            blocks.acquire_planned(seq, hashes, plan.blocks, None, max(0, end - self.unit))
            if not self._restore(seq, snapshot_of(plan.blocks), end):
                blocks.release(seq)
                blocks.acquire_planned(seq, hashes, 0, None, 0)
                return 0
            c.hits_snapshot += 1
            info["window"] = "snapshot"
        else:
            took = min(plan.blocks, n_dev)
            blocks.acquire_planned(seq, hashes, took, None, plan.start)
            if plan.blocks > took and not self._load_external(seq, hashes, took, plan.blocks):
                blocks.release(seq)
                return self._admit_device_only(seq, hashes, n_dev)
            seq.replay_until = plan.replay_until
            c.hits_replay += 1
            c.replay_tokens += plan.replay_tokens
            c.replay_tokens_per_hit = (c.replay_tokens_per_hit + [plan.replay_tokens])[-64:]
            info["window"] = self.policy
        seq.metrics.extra["window_prefix"] = info
        tiers = seq.metrics.num_cached_tokens_by_tier
        tiers["device"] = min(n_dev * bs, plan.start)
        if plan.start > n_dev * bs:
            tiers.setdefault("external", plan.start - n_dev * bs)
        return plan.start

    def _admit_device_only(self, seq: Sequence, hashes: list[int], n_dev: int) -> int:
        """Admission when loading lower-tier blocks failed: the device part of the hit only."""
        saved, self.engine.blocks.external_hits = self.engine.blocks.external_hits, False
        try:
            return self.admit(seq, hashes[:n_dev])
        finally:
            self.engine.blocks.external_hits = saved

    def _load_external(self, seq: Sequence, hashes: list[int], lo: int, hi: int) -> bool:
        """Copy lower-tier (host, persistent) blocks [lo, hi) of the record pool into new device blocks."""
        e, blocks = self.engine, self.engine.blocks
        pool = blocks.record_pool
        table = blocks.tables(seq)[pool.name]
        if hi - lo > pool.num_free:
            return False
        pool.allocate(table, hi * self.bs)
        e.pm.hook.load_external_blocks(engine=e, request=seq, block_ids=table[lo:hi], block_hashes=hashes[lo:hi])
        pool.register(table, hashes[:hi], lo)
        seq.block_hashes = hashes[:hi]
        return True

    # ---- snapshots ----------------------------------------------------------------------
    def _key(self, chain_hash: int) -> int:
        return block_hash(chain_hash, SNAPSHOT_TAG)

    def _get(self, chain_hash: int) -> torch.Tensor | None:
        blob = self.store.get(self._key(chain_hash))
        return blob if isinstance(blob, torch.Tensor) and blob.numel() == self.snapshot_bytes() else None

    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot (:func:`snapshot_parts`)."""
        return sum(len(g.layers) * self.rows[g.name] * self._row_bytes[g.name] for g in self.groups)

    def _slots(self, seq: Sequence, group, end: int) -> list[int] | None:
        table, bs = self.engine.blocks.table(seq, group.name), self.bs
        lo = end - self.rows[group.name]
        if lo < 0 or any(b == -1 for b in table[lo // bs: -(-end // bs)]) or len(table) < -(-end // bs):
            return None
        return [table[p // bs] * bs + p % bs for p in range(lo, end)]

    def snapshot(self, seq: Sequence) -> None:
        """Take the snapshot due for ``seq`` now (module docstring), if any."""
        c, known = seq.num_computed_tokens, seq.num_known_tokens
        if c < seq.num_prompt_tokens or not self.engine.cfg.enable_prefix_caching:
            return
        a = min(c, known) // self.unit * self.unit
        if a < self.unit or a <= seq.window_snapshot_at:
            return
        seq.window_snapshot_at = a
        slots = {g.name: self._slots(seq, g, a) for g in self.groups}
        if any(s is None for s in slots.values()) or a - self.unit < seq.replay_until:
            self.counters.snapshots_skipped += 1
            return
        n = a // self.bs
        h = seq.block_hashes[n - 1] if len(seq.block_hashes) >= n else chain(seq.token_ids, self.bs, n)[-1]
        k, parts = self.engine.kernels, []
        for g in self.groups:
            idx = torch.tensor(slots[g.name], dtype=torch.long, device=self.engine.device)
            for t in self.engine.kv_caches[g.name]:
                rows = torch.cat([p.view(-1, p.shape[-1])[idx] for p in cache_planes(t)], dim=-1)
                parts.append((k.mxfp8_quant(rows) if self.mxfp8[g.name] else rows.contiguous().view(torch.uint8))
                             .reshape(-1))
        blob = torch.cat(parts).cpu()
        if self.store.put(self._key(h), blob):
            self.counters.snapshots += 1
            self.counters.snapshot_bytes += blob.numel()
        else:
            self.counters.snapshots_skipped += 1

    def _restore(self, seq: Sequence, blob: torch.Tensor | None, end: int) -> bool:
        """Allocate ``seq``'s window blocks up to ``end`` and fill them from a snapshot."""
        blocks = self.engine.blocks
        if blob is None:
            return False
        for pool in blocks.window_pools:
            table = blocks.tables(seq)[pool.name]
            if -(-end // self.bs) - len(table) > pool.num_free:
                return False
            pool.allocate(table, end)
        blob, at = blob.to(self.engine.device), 0
        for g in self.groups:
            idx = torch.tensor(self._slots(seq, g, end), dtype=torch.long, device=self.engine.device)
            width = self._row_bytes[g.name]
            for t in self.engine.kv_caches[g.name]:
                n = len(idx) * width
                part = blob[at: at + n].view(len(idx), width)
                if self.mxfp8[g.name]:
                    rows = self.engine.kernels.mxfp8_dequant(part, cache_planes(t)[0].dtype)
                else:
                    rows = part.view(cache_planes(t)[0].dtype)
                col = 0
                for p in cache_planes(t):
                    p.view(-1, p.shape[-1])[idx] = rows[:, col: col + p.shape[-1]]
                    col += p.shape[-1]
                at += n
        return True

    def metrics(self) -> dict:
        c = self.counters
        out = {"policy": self.policy, "hits_device": c.hits_device, "hits_snapshot": c.hits_snapshot,
               "hits_replay": c.hits_replay, "replay_tokens": c.replay_tokens, "snapshots": c.snapshots,
               "snapshot_bytes": c.snapshot_bytes, "snapshots_skipped": c.snapshots_skipped}
        if c.replay_tokens_per_hit:
            out["max_replay_tokens_per_hit"] = max(c.replay_tokens_per_hit)
        return out
