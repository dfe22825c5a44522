"""The KV block store interface.

A KV block is the cache of ``block_size`` consecutive tokens for every layer (of every cache group
the record carries, see ``KVCacheManager``). Its key is the
prefix-hash-chain value of the tokens up to and including the block (see
``deepinfer_core.engine.hashing``), so equal keys mean equal KV. The engine's device cache and the
persistent tiers (host memory, 3FS, ...) implement this interface; stores are plugins in the
``deepinfer.kv_stores`` entry-point group.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class KVStoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    errors: int = 0
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class KVLayout:
    """What a block holds, recorded with every persistent block so a mismatch is a miss."""

    model_fingerprint: str  # of the model and this layout (for_model); 16 ASCII characters in a record
    num_layers: int
    block_size: int
    entry_dim: int  # values per token per layer (kv_lora_rank + qk_rope_head_dim)
    dtype: torch.dtype
    #: a record of several cache groups (``KVCacheManager.read_block``): its flat shape, overriding
    #: ``(num_layers, block_size, entry_dim)``; the fingerprint then covers the group layout too
    shape: tuple[int, ...] | None = None

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape if self.shape is not None else (self.num_layers, self.block_size, self.entry_dim)

    @classmethod
    def for_model(cls, model_fingerprint: str, num_layers: int, block_size: int, entry_dim: int,
                  dtype: torch.dtype, encoding: str = "") -> KVLayout:
        """The layout of an engine's blocks, its ``model_fingerprint`` extended with the layout itself:
        engines whose blocks differ (weights, load format, dtype, block size, entry size) never read,
        nor evict as malformed, each other's blocks in a shared store. ``encoding``: the cache group's
        (``KVCacheSpec.encoding``, e.g. FP8 latent rows), so encoded and plain rows never mix."""
        tag = f"{model_fingerprint}|{num_layers}|{block_size}|{entry_dim}|{dtype}"
        tag += f"|{encoding}" if encoding else ""
        return cls(hashlib.sha256(tag.encode()).hexdigest()[:16], num_layers, block_size, entry_dim, dtype)


class KVStore(ABC):
    """A store of KV blocks keyed by content hash.

    The abstract methods are required; the others are optional capabilities with working defaults
    (a store overrides them when it can do better: batched reads, retention classes, a buffer pool)."""

    core_api_version: str = ""

    @abstractmethod
    def contains(self, key: int) -> bool:
        """Whether ``key`` is held (metadata only; no data is read)."""

    def match_prefix(self, keys: Sequence[int]) -> int:
        """How many leading keys of a hash chain are held (metadata only)."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    @abstractmethod
    def put(self, key: int, block: torch.Tensor, **meta) -> bool:
        """Store ``block`` ([layers, block_size, entry_dim]) under ``key``. False when not stored."""

    @abstractmethod
    def get(self, key: int) -> torch.Tensor | None:
        """The block stored under ``key``, or None on a miss (including a corrupt record)."""

    @abstractmethod
    def evict(self, key: int) -> bool:
        """Drop ``key``; True when it was held."""

    # ---- optional capabilities (defaults work for any store) ------------------------------
    def get_many(self, keys: Sequence[int], ttl_class: str | None = None,
                 out: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """Read several blocks (None per miss). ``ttl_class``: the traffic class the read refreshes
        (stores with retention classes). ``out``: caller-owned buffers (one per key, or None) the
        store may read into and return instead of new tensors. Default: one ``get`` per key."""
        return [self.get(key) for key in keys]

    def ttl_seconds(self, traffic_class: str | None) -> float | None:
        """Retention of a traffic class (0: forever), or None when the store has no classes."""
        return None

    def allocate(self) -> torch.Tensor | None:
        """A pooled block buffer to fill and hand back with :meth:`adopt` or :meth:`recycle`; None
        when the store keeps no pool (the default)."""
        return None

    def adopt(self, key: int, buf: torch.Tensor) -> None:
        """Hold ``buf`` (from :meth:`allocate`, now filled) as block ``key``. Default: ``put``."""
        self.put(key, buf)

    def recycle(self, buf: torch.Tensor) -> None:
        """Give back an unused buffer from :meth:`allocate`. Default: nothing to do."""

    def prefault(self, nbytes: int) -> int:
        """Allocate and touch up to ``nbytes`` of pooled buffers now; returns the bytes added (0)."""
        return 0

    def stats(self) -> KVStoreStats:
        return KVStoreStats()

    def close(self) -> None:
        """Release files, threads and memory."""
