"""A host-memory KV tier: blocks kept in (optionally pinned) CPU memory, evicted LRU-first.

Registered as ``host`` in the ``deepinfer.kv_stores`` entry-point group. It sits between the
device cache and slower persistent tiers: full device blocks that are about to be reused are
copied here, and a later request with the same prefix gets them back without recomputation.

Given the engine's block shape and dtype, the store keeps blocks of that shape in a pool of
reusable buffers: evicted blocks' memory is recycled instead of freed, :meth:`prefault` allocates
and touches memory ahead of time, and :meth:`allocate` / :meth:`adopt` let a reader (the
persistent tier's fetch) fill a pool buffer in place, so no block is copied or allocated twice.
Filling fresh pages costs more than reading a block from the page cache.

Thread-safe: the engine's offload and fetch threads put while the step loop matches and gets.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from deepinfer_core.engine.transfer import can_pin_memory
from deepinfer_core.kv_store import KVStore, KVStoreStats

logger = logging.getLogger("deepinfer.kv_store.host")

#: sys.getrefcount of a buffer inside _release_locked when only the caller's local name holds it
#: (the caller's local, the parameter, getrefcount's argument). More means someone else holds it.
_UNSHARED_REFS = 3


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostMemoryStore(KVStore):
    """KV blocks in host memory, at most ``capacity_bytes`` of them, least recently used evicted first.

    ``put`` copies the block (the caller may reuse its buffer at once); ``get`` returns the stored
    tensor itself, which callers must treat as read-only. A pooled buffer is recycled only when no
    one but the store references it, so a tensor returned by ``get`` stays valid while it is held,
    even after its block is evicted. With ``pin_memory=True`` blocks live in page-locked memory for
    fast asynchronous host-to-device copies; where no accelerator provides a pinned allocator this
    falls back to pageable memory with a warning (see ``self.pinned``).

    ``block_shape`` and ``dtype`` (optional) name the shape blocks usually have; blocks of that
    shape are pooled. ``capacity_bytes`` bounds held blocks plus pooled free buffers.

    ``stats()``: ``evictions`` counts blocks dropped to make room (not explicit ``evict()`` calls);
    ``extra`` holds ``bytes`` (held now), ``blocks``, ``capacity_bytes``, ``pinned``,
    ``pool_free_bytes`` and ``pool_allocated_bytes`` (buffers ever allocated for the pool).
    """

    core_api_version = "1.0"

    def __init__(self, capacity_bytes: int = 1 << 30, pin_memory: bool = False,
                 block_shape: Sequence[int] | None = None, dtype: torch.dtype | None = None, **_) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"HostMemoryStore: capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if (block_shape is None) != (dtype is None):
            raise ValueError("HostMemoryStore: give both block_shape and dtype, or neither")
        self.capacity_bytes = capacity_bytes
        self.pinned = bool(pin_memory) and can_pin_memory()
        if pin_memory and not self.pinned:
            logger.warning("HostMemoryStore: pinned memory is not available here; using pageable memory")
        self.block_shape = tuple(int(d) for d in block_shape) if block_shape is not None else None
        self.dtype = dtype
        self._bb = math.prod(self.block_shape) * dtype.itemsize if dtype is not None else 0  # pooled block bytes
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first
        self._used = 0
        self._free: list[torch.Tensor] = []  # pooled buffers not holding a block
        self._reserved = 0  # bytes of pooled buffers handed out by allocate(), not yet adopted or recycled
        self._allocated = 0
        self._lock = threading.Lock()
        self._stats = KVStoreStats()

    # ---- KVStore ------------------------------------------------------------------------
    def contains(self, key: int) -> bool:
        with self._lock:
            return key in self._blocks

    def match_prefix(self, keys: Sequence[int]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._blocks:
                    break
                n += 1
            return n

    def put(self, key: int, block: torch.Tensor, **meta) -> bool:
        size = _nbytes(block)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._blocks:  # equal keys mean equal KV: refresh recency, keep the copy
                self._blocks.move_to_end(key)
                self._stats.puts += 1
                return True
        if self._pooled(block):
            buf = self.allocate()
            if buf is None:
                return False
            buf.copy_(block.detach())  # outside the lock: a device-to-host copy may take a while
            self.adopt(key, buf)
            return True
        copy = torch.empty(block.shape, dtype=block.dtype, pin_memory=self.pinned)
        copy.copy_(block.detach())
        with self._lock:
            self._pop_locked(key)  # another thread may have put it meanwhile
            while self._used + self._reserved + size > self.capacity_bytes and self._blocks:
                self._evict_lru_locked()
            if self._used + self._reserved + size > self.capacity_bytes:
                return False  # the rest is handed out to fills in progress
            spare = (self.capacity_bytes - self._used - self._reserved - size) // self._bb if self._bb else 0
            del self._free[max(0, spare):]  # pooled spares count toward the capacity too
            self._insert_locked(key, copy, size)
        return True

    def get(self, key: int) -> torch.Tensor | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self._stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self._stats.hits += 1
            self._stats.read_bytes += _nbytes(block)
            return block

    def evict(self, key: int) -> bool:
        with self._lock:
            return self._pop_locked(key)

    def stats(self) -> KVStoreStats:
        with self._lock:
            s = self._stats
            return KVStoreStats(
                hits=s.hits, misses=s.misses, puts=s.puts, evictions=s.evictions, read_bytes=s.read_bytes,
                write_bytes=s.write_bytes, errors=s.errors,
                extra={"bytes": self._used, "blocks": len(self._blocks), "capacity_bytes": self.capacity_bytes,
                       "pinned": self.pinned, "pool_free_bytes": len(self._free) * self._bb,
                       "pool_allocated_bytes": self._allocated},
            )

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._free.clear()
            self._used = 0

    # ---- the pool -----------------------------------------------------------------------
    def allocate(self) -> torch.Tensor | None:
        """A buffer of ``block_shape`` to fill and then :meth:`adopt` (or :meth:`recycle`): a pooled
        one, a new one, or an evicted block's. None without a block shape, or when every byte of the
        capacity is handed out already."""
        if not self._bb or self._bb > self.capacity_bytes:
            return None
        with self._lock:
            while not self._free and self._used + self._reserved + self._bb > self.capacity_bytes and self._blocks:
                self._evict_lru_locked()
            if self._free:
                buf = self._free.pop()
            elif self._used + self._reserved + self._bb <= self.capacity_bytes:
                buf = None
            else:
                return None
            self._reserved += self._bb
        if buf is None:
            buf = torch.empty(self.block_shape, dtype=self.dtype, pin_memory=self.pinned)
            with self._lock:
                self._allocated += self._bb
        return buf

    def adopt(self, key: int, buf: torch.Tensor) -> None:
        """Hold ``buf`` (from :meth:`allocate`, now filled) as the block ``key``, without a copy."""
        with self._lock:
            self._reserved -= self._bb
            if key in self._blocks:  # put by another thread meanwhile: same content; the caller keeps buf
                self._blocks.move_to_end(key)
                self._stats.puts += 1
                return
            self._insert_locked(key, buf, self._bb)

    def recycle(self, buf: torch.Tensor) -> None:
        """Give back an unused buffer from :meth:`allocate`."""
        with self._lock:
            self._reserved -= self._bb
            self._release_locked(buf, given_up=True)

    def prefault(self, nbytes: int) -> int:
        """Allocate up to ``nbytes`` of pooled buffers now (within the capacity) and touch their
        pages, so later blocks need no fresh memory. Returns the bytes added."""
        if not self._bb:
            return 0
        with self._lock:
            room = self.capacity_bytes - self._used - self._reserved - len(self._free) * self._bb
            n = max(0, min(nbytes, room) // self._bb)
            self._reserved += n * self._bb
        if n == 0:
            return 0
        try:
            slab = torch.empty((n, *self.block_shape), dtype=self.dtype, pin_memory=self.pinned)
            slab.view(torch.uint8).zero_() if slab.dtype.itemsize == 1 else slab.zero_()
        except BaseException:
            with self._lock:
                self._reserved -= n * self._bb
            raise
        with self._lock:
            self._reserved -= n * self._bb
            self._free.extend(slab.unbind(0))
            self._allocated += n * self._bb
        return n * self._bb

    # ---- extras -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of block data held now."""
        with self._lock:
            return self._used

    def keys(self) -> Iterator[int]:
        """The held keys, least recently used first (a snapshot: safe while others put and evict)."""
        with self._lock:
            return iter(list(self._blocks))

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    # ---- internals (callers hold self._lock) --------------------------------------------
    def _pooled(self, t: torch.Tensor) -> bool:
        return bool(self._bb) and tuple(t.shape) == self.block_shape and t.dtype == self.dtype

    def _insert_locked(self, key: int, buf: torch.Tensor, size: int) -> None:
        self._blocks[key] = buf
        self._used += size
        self._stats.puts += 1
        self._stats.write_bytes += size

    def _pop_locked(self, key: int) -> bool:
        block = self._blocks.pop(key, None)
        if block is None:
            return False
        self._used -= _nbytes(block)
        self._release_locked(block)
        return True

    def _evict_lru_locked(self) -> None:
        _, victim = self._blocks.popitem(last=False)
        self._used -= _nbytes(victim)
        self._stats.evictions += 1
        self._release_locked(victim)

    def _release_locked(self, buf: torch.Tensor, given_up: bool = False) -> None:
        """Return a pooled buffer to the free list unless someone else still references it (a
        caller of get(), an in-flight copy); then it is left to them and forgotten here.
        ``given_up``: the caller's references are going away (recycle())."""
        if (self._pooled(buf) and buf.is_contiguous() and (given_up or sys.getrefcount(buf) <= _UNSHARED_REFS)
                and self._used + self._reserved + (len(self._free) + 1) * self._bb <= self.capacity_bytes):
            self._free.append(buf)
