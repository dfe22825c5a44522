"""Paged KV blocks: allocation with reference counts, and the device tier of the prefix cache.

Freed blocks keep their contents and hash and join an LRU free list; a later request with the
same prefix takes them back (a prefix hit). A free block is only overwritten when the free list
runs out of never-hashed blocks: its hash is dropped then, after ``on_evict`` had a chance to copy
it to a lower tier. The block manager is also the device :class:`KVStore`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from deepinfer_core.engine.hashing import ROOT_HASH, block_hash
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.kv_store import KVStore, KVStoreStats

EvictCallback = Callable[[list[int], list[int]], None]  # (hashes, block ids)


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager(KVStore):
    core_api_version = "1.0"

    def __init__(self, num_blocks: int, block_size: int, kv_caches: list[torch.Tensor] | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_caches = kv_caches or []
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of = [-1] * num_blocks
        self.block_of: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: EvictCallback | None = None
        self._stats = KVStoreStats()

    # ---- allocation ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self.free)} free")
        taken = [self.free.popitem(last=False)[0] for _ in range(n)]
        evicted = [b for b in taken if self.hash_of[b] != -1]
        if evicted:
            hashes = [self.hash_of[b] for b in evicted]
            if self.on_evict is not None:
                self.on_evict(hashes, evicted)
            for b, h in zip(evicted, hashes):
                del self.block_of[h]
                self.hash_of[b] = -1
            self._stats.evictions += len(evicted)
        for b in taken:
            self.ref[b] = 1
        return taken

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (raises NoFreeBlocks)."""
        n = self.blocks_needed(seq, num_tokens)
        if n:
            seq.block_table.extend(self._take(n))

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; deeper blocks go to the LRU tail first, so evicted first."""
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []

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

    def acquire_cached(self, seq: Sequence, hashes: list[int]) -> int:
        """Take the device-resident leading blocks of ``hashes``; returns how many."""
        n = 0
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            seq.block_table.append(b)
            n += 1
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
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        for i in range(len(seq.block_hashes), full):
            parent = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(parent)
            b = seq.block_table[i]
            if parent not in self.block_of and self.hash_of[b] == -1:
                self.block_of[parent] = b
                self.hash_of[b] = parent

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back to ``num_tokens`` tokens (speculative rejection): free blocks past the end."""
        keep = -(-num_tokens // self.block_size)
        for b in seq.block_table[keep:]:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size :]

    # ---- KVStore interface (device tier) ------------------------------------------------
    def contains(self, key: int) -> bool:
        return key in self.block_of

    def get(self, key: int) -> torch.Tensor | None:
        b = self.block_of.get(key)
        if b is None:
            return None
        return torch.stack([c[b] for c in self.kv_caches])  # [layers, block_size, entry_dim]

    def put(self, key: int, block: torch.Tensor, **meta) -> bool:
        if key in self.block_of:
            return True
        if not self.free:
            return False
        (b,) = self._take(1)
        self.write_block(b, block)
        self.block_of[key], self.hash_of[b] = key, key
        self.ref[b] = 0
        self.free[b] = None
        self._stats.puts += 1
        return True

    def write_block(self, b: int, block: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            cache[b].copy_(block[layer], non_blocking=True)

    def evict(self, key: int) -> bool:
        b = self.block_of.pop(key, None)
        if b is None:
            return False
        self.hash_of[b] = -1
        return True

    def stats(self) -> KVStoreStats:
        return self._stats

    def check_no_leaks(self) -> None:
        """Every block is free (used by tests after all requests finished)."""
        held = [b for b, r in enumerate(self.ref) if r != 0]
        if held or len(self.free) != self.num_blocks:
            raise AssertionError(f"KV blocks leaked: {len(held)} referenced, {self.num_blocks - len(self.free)} "
                                 "not in the free list")
