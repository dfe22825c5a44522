"""A host-memory KV tier: blocks kept in (optionally pinned) CPU memory, evicted LRU-first.

Registered as ``host`` in the ``deepinfer.kv_stores`` entry-point group. It sits between the
device cache and slower persistent tiers: full device blocks that are about to be reused are
copied here, and a later request with the same prefix gets them back without recomputation.

Thread-safe: the engine's offload thread puts while the step loop matches and gets.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from deepinfer_core.kv_store import KVStore, KVStoreStats

logger = logging.getLogger("deepinfer.kv_store.host")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostMemoryStore(KVStore):
    """KV blocks in host memory, at most ``capacity_bytes`` of them, least recently used evicted first.

    ``put`` copies the block (the caller may reuse its buffer at once); ``get`` returns the stored
    tensor itself, which callers must treat as read-only. With ``pin_memory=True`` blocks live in
    page-locked memory for fast asynchronous host-to-device copies; where no accelerator provides
    a pinned allocator this falls back to pageable memory with a warning (see ``self.pinned``).

    ``stats()``: ``evictions`` counts blocks dropped to make room (not explicit ``evict()`` calls);
    ``extra`` holds ``bytes`` (held now), ``blocks``, ``capacity_bytes`` and ``pinned``.
    """

    core_api_version = "1.0"

    def __init__(self, capacity_bytes: int = 1 << 30, pin_memory: bool = False, **_) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"HostMemoryStore: capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.pinned = bool(pin_memory) and self._can_pin()
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._stats = KVStoreStats()

    @staticmethod
    def _can_pin() -> bool:
        try:
            torch.empty(1, pin_memory=True)
            return True
        except RuntimeError as exc:
            logger.warning("HostMemoryStore: pinned memory is not available here (%s); using pageable memory",
                           exc)
            return False

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
        copy = self._copy(block)  # outside the lock: a device-to-host copy may take a while
        with self._lock:
            old = self._blocks.pop(key, None)  # another thread may have put it meanwhile
            if old is not None:
                self._used -= _nbytes(old)
            while self._used + size > self.capacity_bytes and self._blocks:
                _, victim = self._blocks.popitem(last=False)
                self._used -= _nbytes(victim)
                self._stats.evictions += 1
            self._blocks[key] = copy
            self._used += size
            self._stats.puts += 1
            self._stats.write_bytes += size
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
            block = self._blocks.pop(key, None)
            if block is None:
                return False
            self._used -= _nbytes(block)
            return True

    def stats(self) -> KVStoreStats:
        with self._lock:
            s = self._stats
            return KVStoreStats(
                hits=s.hits, misses=s.misses, puts=s.puts, evictions=s.evictions, read_bytes=s.read_bytes,
                write_bytes=s.write_bytes, errors=s.errors,
                extra={"bytes": self._used, "blocks": len(self._blocks),
                       "capacity_bytes": self.capacity_bytes, "pinned": self.pinned},
            )

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._used = 0

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

    def _copy(self, block: torch.Tensor) -> torch.Tensor:
        out = torch.empty(block.shape, dtype=block.dtype, pin_memory=self.pinned)
        out.copy_(block.detach())
        return out
