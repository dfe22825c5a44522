"""The KV cache of one engine, derived from the cache groups the model declares (``kv_cache_spec``).

* Tensors: per group, one ``[num_blocks, block_size // tokens_per_entry, entry_dim]`` tensor per
  layer (``kv_caches[group][j]``), or the tuple of its planes where the platform splits the entry
  (``Platform.kv_cache_planes``; ``kv_cache_spec``, "Planes").
* Pools: groups of one lifetime (same window and prefix-cacheability) share a
  :class:`BlockManager` and one block table per request: their blocks are taken and freed in
  lockstep, so separate tables would only repeat each other.
* Budget (:func:`split_budget`): every FULL pool grows one block per ``block_size`` tokens, so all
  FULL pools get the same block count. A window block is only ever held next to a FULL block of
  the same index, and at once all requests hold at most their windows plus the step's tokens
  (:func:`window_pool_bound`: ``max_num_seqs * (ceil((W-1)/B) + 2) + ceil(max_num_batched_tokens/B)``),
  so a window pool larger than ``min(full blocks, that bound)`` could never be used: it gets exactly
  that, and the rest of the budget goes to the FULL pools. This is SGLang's ``swa_full_tokens_ratio``
  chosen from the model and the batch limits instead of by hand, and vLLM's rule that a
  sliding-window group needs at most its window per request. (A window-only model scales the bound
  down to the budget, keeping at least one request's window.)
* Admission: allocation is all-or-nothing across pools (:meth:`KVCacheManager.can_allocate`
  accounts every pool, counting the window blocks it frees first); release frees every pool.
* Prefix hits: the minimum over the pools whose groups require them (``HitRule``). A pool of
  groups that are not prefix-cacheable never limits a hit: its table starts with -1 entries for the
  hit (the model declares such state unneeded at a block boundary).
* Device tier of the prefix cache (the :class:`KVStore` methods): a block record carries the rows
  of every group of the first FULL prefix-cacheable pool ("record pool"); window pools are not
  recorded (a hit that needs them is served from device memory only).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.engine.block_manager import BlockManager, NoFreeBlocks
from deepinfer_core.engine.hashing import ROOT_HASH, block_hash
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.kv_cache_spec import CacheLayout, HitRule, KVCacheSpec, LayerCache, cache_planes
from deepinfer_core.kv_store import KVStore, KVStoreStats

logger = logging.getLogger("deepinfer.kv_cache")

__all__ = ["KVCacheManager", "NoFreeBlocks", "PoolSpec", "allocate_caches", "blocks_for_all_requests", "pool_specs",
           "size_pools", "split_budget", "window_pool_bound"]


@dataclass(frozen=True)
class PoolSpec:
    name: str  # the name of its first group
    groups: tuple[KVCacheSpec, ...]
    window: int | None
    required: bool  # a prefix hit must be held by this pool (a pool that is never hashed cannot be)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return sum(g.block_bytes(block_size, dtype) for g in self.groups)

    def max_blocks_per_request(self, block_size: int, max_model_len: int, max_step_tokens: int) -> int:
        return max(g.max_blocks_per_request(block_size, max_model_len, max_step_tokens) for g in self.groups)


def pool_specs(layout: CacheLayout) -> list[PoolSpec]:
    """The layout's groups gathered into pools, in the order of their first group."""
    by_key: dict[tuple, list[KVCacheSpec]] = {}
    for g in layout.groups:
        by_key.setdefault(g.pool_key, []).append(g)
    return [PoolSpec(gs[0].name, tuple(gs), gs[0].window,
                     gs[0].prefix_cacheable and any(g.hit_rule == HitRule.REQUIRED for g in gs))
            for gs in by_key.values()]


def window_pool_bound(pool: PoolSpec, block_size: int, max_num_seqs: int, max_model_len: int,
                      max_step_tokens: int) -> int:
    """The most blocks a window pool can hold at once: each request its window plus its tokens of the
    step (and a block of misalignment on each side), the step's tokens shared by all requests."""
    per_request = pool.max_blocks_per_request(block_size, max_model_len, max_step_tokens)
    window = max(g.window for g in pool.groups)
    shared = max_num_seqs * (-(-(window - 1) // block_size) + 2) + -(-max_step_tokens // block_size)
    return min(max_num_seqs * per_request, shared)


def split_budget(pools: list[PoolSpec], budget: int, block_size: int, dtype: torch.dtype, max_num_seqs: int,
                 max_model_len: int, max_step_tokens: int, max_full_blocks: int | None = None) -> dict[str, int]:
    """Blocks per pool within ``budget`` bytes (module docstring). ``max_full_blocks``: at most this
    many blocks per FULL pool (no more than ``max_num_seqs`` requests of ``max_model_len`` need)."""
    full = [p for p in pools if p.window is None]
    windows = [p for p in pools if p.window is not None]
    cap = {p.name: window_pool_bound(p, block_size, max_num_seqs, max_model_len, max_step_tokens) for p in windows}
    row = {p.name: p.block_bytes(block_size, dtype) for p in pools}
    if not full:  # window-only model: as many whole-window requests as fit
        scale = min(1.0, budget / sum(cap[p.name] * row[p.name] for p in windows))
        return {p.name: max(p.max_blocks_per_request(block_size, max_model_len, max_step_tokens),
                            int(cap[p.name] * scale)) for p in windows}
    full_row = sum(row[p.name] for p in full)

    def cost(x: int) -> int:
        return x * full_row + sum(min(x, cap[p.name]) * row[p.name] for p in windows)

    lo, hi = 0, budget // full_row
    while lo < hi:  # the most FULL blocks x with cost(x) <= budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
    x = lo if max_full_blocks is None else min(lo, max_full_blocks)
    out = {p.name: x for p in full}
    out.update({p.name: min(x, cap[p.name]) for p in windows})
    return out


def size_pools(layout: CacheLayout, budget: int, block_size: int, dtype: torch.dtype, max_num_seqs: int,
               max_model_len: int, max_step_tokens: int, budget_is_share: bool, at_least_one_request: bool,
               setting=None) -> dict[str, int]:
    """Blocks per pool for the engine: :func:`split_budget`, capped at what ``max_num_seqs`` requests
    of ``max_model_len`` need when the budget is a share of free memory, and (``at_least_one_request``,
    the default budget) never below one ``max_model_len`` request. ``setting``: the configured
    ``kv_cache_memory``, named in the error when the budget holds fewer than 2 blocks."""
    pools = pool_specs(layout)
    cap = blocks_for_all_requests(max_num_seqs, max_model_len, block_size) if budget_is_share else None
    num = split_budget(pools, budget, block_size, dtype, max_num_seqs, max_model_len, max_step_tokens, cap)
    if at_least_one_request:
        for p in pools:
            one = min(-(-max_model_len // block_size), p.max_blocks_per_request(block_size, max_model_len,
                                                                              max_step_tokens))
            num[p.name] = max(num[p.name], one)
    if min(num.values()) < 2:
        per_block = sum(p.block_bytes(block_size, dtype) for p in pools)
        raise ValueError(f"kv_cache_memory={setting} holds {min(num.values())} KV blocks of {per_block} bytes "
                         "(all cache groups); at least 2 are needed")
    for p in pools:
        logger.info("KV cache pool %r (%s): %d blocks x %d tokens (%.1f MiB)", p.name,
                    ", ".join(g.name for g in p.groups), num[p.name], block_size,
                    num[p.name] * p.block_bytes(block_size, dtype) / 2**20)
    return num


def allocate_caches(layout: CacheLayout, num_blocks: dict[str, int], block_size: int, dtype: torch.dtype,
                    device: torch.device, planes: Callable[[KVCacheSpec], tuple[int, ...]] | None = None,
                    ) -> dict[str, list[LayerCache]]:
    """Zeroed caches of every group: per layer one tensor, or the tuple of its planes where ``planes``
    (``Platform.kv_cache_planes``) splits the group's entry."""
    out = {}
    for p in pool_specs(layout):
        for g in p.groups:
            widths = (g.entry_dim,) if planes is None else tuple(planes(g))
            g.check_planes(widths)
            shape = (num_blocks[p.name], g.entries_per_block(block_size))
            layer = [torch.zeros(*shape, w, dtype=g.dtype or dtype, device=device) for w in widths * len(g.layers)]
            out[g.name] = layer if len(widths) == 1 else [tuple(layer[i : i + len(widths)])
                                                          for i in range(0, len(layer), len(widths))]
    return {g.name: out[g.name] for g in layout.groups}


class KVCacheManager(KVStore):
    """``engine.blocks``: the pools, the per-request block tables and the device prefix-cache tier."""

    core_api_version = "1.0"

    def __init__(self, layout: CacheLayout, block_size: int, num_blocks: dict[str, int],
                 kv_caches: dict[str, list[LayerCache]], enable_prefix_caching: bool = True) -> None:
        self.layout, self.block_size, self.kv_caches = layout, block_size, kv_caches
        self.enable_prefix_caching = enable_prefix_caching
        self.specs = pool_specs(layout)
        self.pools = {p.name: BlockManager(num_blocks[p.name], block_size, p.window, enable_prefix_caching, p.name)
                      for p in self.specs}
        self._pool_items = list(self.pools.items())
        self.pool_of = {g.name: p.name for p in self.specs for g in p.groups}
        self.primary = self.pools[self.specs[0].name]  # the first group's pool: ``seq.block_table``
        record = next((p for p in self.specs if p.window is None and all(g.prefix_cacheable for g in p.groups)),
                      None)
        #: the pool whose blocks the lower tiers store (None: nothing is recorded)
        self.record_pool: BlockManager | None = self.pools[record.name] if record is not None else None
        self.record_groups = record.groups if record is not None else ()
        self._hashing = [self.pools[p.name] for p in self.specs if all(g.prefix_cacheable for g in p.groups)]
        self._required = [(self.pools[p.name], p.required) for p in self.specs]
        self._windows = [self.pools[p.name] for p in self.specs if p.window is not None]
        #: whether a hit may extend past device memory (lower tiers): only the record pool limits hits
        #: (window models under a replaying swa_prefix_policy set it, engine/window_prefix.py)
        self.external_hits = self.record_pool is not None and not any(
            req and pool is not self.record_pool for pool, req in self._required)
        #: the prefix-cacheable window pools whose state a hit needs (window_prefix decides how)
        self.window_pools = [self.pools[p.name] for p in self.specs if p.window is not None and p.required]
        self._full_required = [self.pools[p.name] for p in self.specs if p.window is None and p.required]
        self._stats = KVStoreStats()
        #: called with a request before its window blocks may be freed (allocation, release): window
        #: KV snapshots (engine/window_cache.py) copy what they need then
        self.before_window_free = None

    # ---- sizes --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks of the first group's pool (the only pool of single-group models)."""
        return self.primary.num_blocks

    @property
    def num_free(self) -> int:
        return self.primary.num_free

    @property
    def block_of(self) -> dict[int, int]:
        """Hash -> block of the record pool (the first pool if none is recorded)."""
        return (self.record_pool or self.primary).block_of

    @property
    def on_evict(self):
        return self.record_pool.on_evict if self.record_pool is not None else None

    @on_evict.setter
    def on_evict(self, fn) -> None:
        if self.record_pool is not None:
            self.record_pool.on_evict = fn

    def usage(self) -> dict[str, int]:
        """Blocks in use per pool."""
        return {name: pool.num_used for name, pool in self.pools.items()}

    # ---- per-request tables -------------------------------------------------------------
    def tables(self, seq: Sequence) -> dict[str, list[int]]:
        if not seq.block_tables:
            seq.block_tables = {name: [] for name in self.pools}
        return seq.block_tables

    def table(self, seq: Sequence, group: str) -> list[int]:
        """``seq``'s block table for a cache group."""
        return self.tables(seq)[self.pool_of[group]]

    # ---- allocation ---------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks of the first pool to hold ``num_tokens`` tokens (see :meth:`can_allocate`)."""
        return self.primary.blocks_needed(self.tables(seq)[self.primary.name], num_tokens)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether every pool can grow ``seq`` to ``num_tokens`` tokens now (counting the window
        blocks that allocation frees first)."""
        tables, n = seq.block_tables or self.tables(seq), -(-num_tokens // self.block_size)
        for name, pool in self._pool_items:
            t = tables[name]
            new = n - len(t)
            if new > pool.num_free and (pool.window is None
                                        or new > pool.num_free + pool.freeable(t, seq.num_computed_tokens)):
                return False
        return True

    def fits(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` tokens fits in the free blocks now."""
        n = -(-num_tokens // self.block_size)
        return all(n <= p.num_free for p in self.pools.values())

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow every table of ``seq`` to ``num_tokens`` tokens, first freeing the window blocks no
        coming token reads; all or nothing (raises NoFreeBlocks, changing nothing)."""
        tables, n = seq.block_tables or self.tables(seq), -(-num_tokens // self.block_size)
        if not self._windows and all(len(tables[name]) >= n for name, _ in self._pool_items):
            return  # the common decode step: nothing to free or add
        if not self.can_allocate(seq, num_tokens):
            short = {name: p.num_free for name, p in self._pool_items}
            raise NoFreeBlocks(f"request {seq.request_id}: {num_tokens} tokens do not fit; free blocks {short}")
        if self.before_window_free is not None:
            self.before_window_free(seq)
        for pool in self._windows:
            pool.free_outside_window(tables[pool.name], seq.num_computed_tokens)
        for name, pool in self._pool_items:
            if len(tables[name]) < n:
                pool.allocate(tables[name], num_tokens)

    def release(self, seq: Sequence) -> None:
        if self.before_window_free is not None and seq.block_tables:
            self.before_window_free(seq)
        for name, table in seq.block_tables.items():
            self.pools[name].release(table)
        seq.block_hashes = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back to ``num_tokens`` tokens (speculative rejection): free blocks past the end."""
        for name, table in self.tables(seq).items():
            self.pools[name].truncate(table, num_tokens)
        del seq.block_hashes[num_tokens // self.block_size :]

    # ---- prefix cache -------------------------------------------------------------------
    def prefix_hashes(self, seq: Sequence) -> list[int]:
        """Hash chain of the full blocks a new request may reuse (never its last token's block:
        the last token must be computed to produce logits)."""
        n = (seq.num_tokens - 1) // self.block_size
        out, parent, bs = [], ROOT_HASH, self.block_size
        for i in range(n):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def longest_hit(self, hashes: list[int], cap: int | None = None) -> int:
        """The minimum over the pools that require hits of the leading blocks each can serve."""
        n = len(hashes) if cap is None else min(cap, len(hashes))
        while True:  # a window pool's answer may shrink a full pool's and vice versa: to a fixed point
            m = n
            for pool, required in self._required:
                if required:
                    m = pool.longest_hit(hashes, m)
            if m == n:
                return n
            n = m

    # ---- prefix hits of window models (engine/window_prefix.py decides, these take) ---------
    def full_hit(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` every required full-history pool holds on the device."""
        n = len(hashes)
        for pool in self._full_required:
            n = pool.longest_hit(hashes, n)
        return n

    def window_held(self, hashes: list[int], n: int) -> bool:
        """Whether the device window pools hold the state a hit of ``n`` blocks reads."""
        return all(all(h in pool.block_of for h in hashes[pool.first_needed(n * self.block_size): n])
                   for pool in self.window_pools)

    def acquire_planned(self, seq: Sequence, hashes: list[int], full_blocks: int, window_blocks: int | None,
                        start: int) -> None:
        """Take ``full_blocks`` cached blocks of the full-history pools; the window pools take the
        cached blocks a hit of ``window_blocks`` reads (None: none, their tables start with -1 up to
        token ``start``). Pools that never limit hits get -1 entries for what they do not hold."""
        tables = self.tables(seq)
        for name, pool in self._pool_items:
            if pool.window is None:
                if full_blocks:
                    pool.acquire(tables[name], hashes, full_blocks, pool in self._full_required)
            elif window_blocks and pool in self.window_pools:
                pool.acquire(tables[name], hashes, window_blocks)
            else:
                tables[name].extend([-1] * (start // self.block_size))
        seq.block_hashes = hashes[:full_blocks]
        self._stats.hits += full_blocks
        self._stats.misses += len(hashes) - full_blocks

    def acquire_cached(self, seq: Sequence, hashes: list[int]) -> int:
        """Take the device-resident blocks of the longest prefix hit; returns its length in blocks."""
        n = self.longest_hit(hashes) if self.enable_prefix_caching else 0
        tables = self.tables(seq)
        if n:
            for pool, required in self._required:
                pool.acquire(tables[pool.name], hashes, n, required)
        seq.block_hashes = hashes[:n]
        self._stats.hits += n
        self._stats.misses += len(hashes) - n
        return n

    def register_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Hash the blocks that became full and computed, so later requests can share them. Only
        real tokens count (never async scheduling's placeholders), and at most ``upto`` tokens."""
        if not self.enable_prefix_caching:
            return
        n = min(seq.num_computed_tokens, seq.num_known_tokens)
        full = (n if upto is None else min(n, upto)) // self.block_size
        start = len(seq.block_hashes)
        if full <= start:
            return
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        for i in range(start, full):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(parent)
        tables = self.tables(seq)
        for pool in self._hashing:
            pool.register(tables[pool.name], seq.block_hashes, start)

    # ---- KVStore interface (device tier): records of the record pool ---------------------
    def record_parts(self) -> list[tuple[int, torch.Tensor, Any]]:
        """(model layer, cache tensor or plane, index of its rows in a record) of everything a record
        carries, in record order. A single group's record is ``[layers, entries, entry_dim]`` (a plane's
        index: its layer and columns), whatever planes the platform stores; several groups' record is
        flat, every plane's rows flattened and concatenated (``record_layout`` fingerprints the planes)."""
        out: list[tuple[int, torch.Tensor, Any]] = []
        single, at = len(self.record_groups) == 1, 0
        for g in self.record_groups:
            for j, (layer, cache) in enumerate(zip(g.layers, self.kv_caches[g.name])):
                col = 0
                for t in cache_planes(cache):
                    w = t.shape[-1]
                    if single:
                        out.append((layer, t, (j, Ellipsis, slice(col, col + w))))
                    else:
                        out.append((layer, t, slice(at, at + t[0].numel())))
                        at += t[0].numel()
                    col += w
        return out

    def read_block(self, b: int) -> torch.Tensor:
        """Block ``b`` of the record pool as one record (see :meth:`record_parts`)."""
        parts = self.record_parts()
        t0 = parts[0][1]
        if len(self.record_groups) == 1:
            g = self.record_groups[0]
            shape = (len(g.layers), g.entries_per_block(self.block_size), g.entry_dim)
        else:
            shape = (sum(t[0].numel() for _, t, _ in parts),)
        record = torch.empty(shape, dtype=t0.dtype, device=t0.device)
        for _, t, index in parts:
            record[index].view(t[b].shape).copy_(t[b])
        return record

    def write_block(self, b: int, block: torch.Tensor) -> None:
        for _, t, index in self.record_parts():
            t[b].copy_(block[index].view(t[b].shape), non_blocking=True)

    def contains(self, key: int) -> bool:
        return self.record_pool is not None and key in self.record_pool.block_of

    def get(self, key: int) -> torch.Tensor | None:
        b = self.record_pool.block_of.get(key) if self.record_pool is not None else None
        return None if b is None else self.read_block(b)

    def put(self, key: int, block: torch.Tensor, **meta) -> bool:
        if self.record_pool is None:
            return False
        if key in self.record_pool.block_of:
            return True
        b = self.record_pool.take_for(key)
        if b is None:
            return False
        self.write_block(b, block)
        self._stats.puts += 1
        return True

    def evict(self, key: int) -> bool:
        return self.record_pool is not None and self.record_pool.forget(key)

    def stats(self) -> KVStoreStats:
        self._stats.evictions = sum(p.evictions for p in self.pools.values())
        return self._stats

    def check_no_leaks(self) -> None:
        """Every block of every pool is free (used by tests after all requests finished)."""
        for pool in self.pools.values():
            pool.check_no_leaks()


def blocks_for_all_requests(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that ``max_num_seqs`` requests of ``max_model_len`` tokens hold (plus one)."""
    return max_num_seqs * math.ceil(max_model_len / block_size) + 1
