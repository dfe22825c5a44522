"""One pool of paged KV blocks: allocation with reference counts, and its part of the prefix cache.

Freed blocks keep their contents and hash and join an LRU free list; a later request with the
same prefix takes them back (a prefix hit). Blocks are taken from the head of the free list: a
block released when its request ends goes to the tail (evicted last), a window block that left
its request's window goes to the head (reused first), so transient window blocks never push a
cached prefix out (vLLM PR #43447). A hashed block is overwritten only when it is taken: its hash
is dropped then, after ``on_evict`` had a chance to copy it to a lower tier.

A pool serves the cache groups of one lifetime (``kv_cache_spec``); every request has one block
table per pool, a list of block ids indexed by ``position // block_size`` where -1 marks a window
block already freed. :class:`~deepinfer_core.engine.kv_cache_manager.KVCacheManager` coordinates
the pools of a model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

EvictCallback = Callable[[list[int], list[int]], None]  # (hashes, block ids)


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    """The blocks of one pool. ``window``: tokens a query reads back (the reading token included),
    None for a full-history pool."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None,
                 enable_prefix_caching: bool = True, name: str = "kv") -> None:
        self.name, self.num_blocks, self.block_size, self.window = name, num_blocks, block_size, window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of = [-1] * num_blocks
        self.block_of: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: EvictCallback | None = None
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    # ---- allocation ---------------------------------------------------------------------
    def first_needed(self, num_computed: int) -> int:
        """Index of the first block the next token (at position ``num_computed``) reads."""
        if self.window is None:
            return 0
        return max(0, (num_computed - self.window + 1) // self.block_size)

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        """New blocks to hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def freeable(self, table: list[int], num_computed: int) -> int:
        """Blocks of ``table`` that left the window and would return to the free list now."""
        lo = min(self.first_needed(num_computed), len(table))
        return sum(1 for b in table[:lo] if b != -1 and self.ref[b] == 1)

    def free_outside_window(self, table: list[int], num_computed: int) -> None:
        """Free the blocks no later token reads (window pools): to the head of the free list."""
        for i in range(min(self.first_needed(num_computed), len(table))):
            b = table[i]
            if b == -1:
                continue
            table[i] = -1
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                self.free.move_to_end(b, last=False)

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocks(f"need {n} KV blocks of pool {self.name!r}, {len(self.free)} free")
        taken = [self.free.popitem(last=False)[0] for _ in range(n)]
        evicted = [b for b in taken if self.hash_of[b] != -1]
        if evicted:
            hashes = [self.hash_of[b] for b in evicted]
            if self.on_evict is not None:
                self.on_evict(hashes, evicted)
            for b, h in zip(evicted, hashes):
                del self.block_of[h]
                self.hash_of[b] = -1
            self.evictions += len(evicted)
        for b in taken:
            self.ref[b] = 1
        return taken

    def allocate(self, table: list[int], num_tokens: int) -> None:
        """Grow ``table`` to hold ``num_tokens`` tokens (raises NoFreeBlocks)."""
        n = self.blocks_needed(table, num_tokens)
        if n:
            table.extend(self._take(n))

    def _unref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None

    def release(self, table: list[int]) -> None:
        """Drop a request's references; deeper blocks go to the LRU tail first, so evicted first."""
        for b in reversed(table):
            if b != -1:
                self._unref(b)
        table.clear()

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Free the blocks past ``num_tokens`` tokens (speculative rejection)."""
        keep = -(-num_tokens // self.block_size)
        for b in table[keep:]:
            if b != -1:
                self._unref(b)
        del table[keep:]

    # ---- prefix cache -------------------------------------------------------------------
    def _window_start(self, n: int) -> int:
        """First block a hit of ``n`` blocks must hold: the window of position n * block_size."""
        return self.first_needed(n * self.block_size)

    def longest_hit(self, hashes: list[int], cap: int) -> int:
        """The most leading blocks of ``hashes`` (at most ``cap``) this pool can serve a hit of:
        all of them (full pools), or those the window of the first recomputed token reads."""
        if self.window is None:
            n = 0
            while n < cap and hashes[n] in self.block_of:
                n += 1
            return n
        for n in range(cap, 0, -1):
            if all(h in self.block_of for h in hashes[self._window_start(n) : n]):
                return n
        return 0

    def acquire(self, table: list[int], hashes: list[int], n: int, required: bool = True) -> None:
        """Take the cached blocks of a hit of ``n`` blocks into an empty ``table`` (window pools: the
        blocks the window reads, -1 before; ``required=False``: -1 for any block not cached)."""
        lo = self._window_start(n)
        table.extend([-1] * lo)
        for h in hashes[lo:n]:
            b = self.block_of.get(h)
            if b is None:
                if required:
                    raise RuntimeError(f"pool {self.name!r}: block of hash {h:#x} is not cached")
                table.append(-1)
                continue
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            table.append(b)

    def register(self, table: list[int], hashes: list[int], start: int) -> None:
        """Hash blocks ``start ..`` of ``table`` (``hashes[i]`` for block i) for later requests."""
        for i in range(start, min(len(hashes), len(table))):
            b, h = table[i], hashes[i]
            if b != -1 and h not in self.block_of and self.hash_of[b] == -1:
                self.block_of[h] = b
                self.hash_of[b] = h

    def take_for(self, key: int) -> int | None:
        """A free block now holding ``key`` (a store put into the device tier), or None."""
        if key in self.block_of or not self.free:
            return None
        (b,) = self._take(1)
        self.block_of[key], self.hash_of[b] = b, key
        self.ref[b] = 0
        self.free[b] = None
        return b

    def forget(self, key: int) -> bool:
        b = self.block_of.pop(key, None)
        if b is None:
            return False
        self.hash_of[b] = -1
        return True

    def check_no_leaks(self) -> None:
        held = [b for b, r in enumerate(self.ref) if r != 0]
        if held or len(self.free) != self.num_blocks:
            raise AssertionError(f"KV blocks of pool {self.name!r} leaked: {len(held)} referenced, "
                                 f"{self.num_blocks - len(self.free)} not in the free list")
