"""The router's metadata-only prefix match against the shared KV store.

The store keys full KV blocks by the prompt's hash chain (``engine/hashing.py``), so the router
can tell how many leading prompt tokens any prefill engine could load instead of compute, by
asking the store whether each chain hash exists (``KVStore.contains``: a stat, no block read),
stopping at the first miss. It is computed before routing because the Prefill LB weighs requests
by their uncached tokens. The store is opened with the record layout the prefill engines write
(``GET /v1/kv_layout`` of an engine: block size, model and layout fingerprint), so only their
blocks count.
"""

from __future__ import annotations

import torch

from deepinfer_core import plugins
from deepinfer_core.engine.hashing import ROOT_HASH, block_hash
from deepinfer_core.kv_store import KVLayout, KVStore

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def open_store(section: dict | None, layout: dict | None) -> KVStore | None:
    """The KV store a ``[kv_store]`` table names, for lookups of records of ``layout`` (an engine's
    ``kv_layout_info()["kv_store_layout"]``); None without a store or a layout."""
    if not section or not layout:
        return None
    from deepinfer_core.engine.kv_tiers import TIER_KEYS

    lay = KVLayout(layout["model_fingerprint"], int(layout["num_layers"]), int(layout["block_size"]),
                   int(layout["entry_dim"]), _DTYPES[layout["dtype"]],
                   tuple(layout["shape"]) if layout.get("shape") else None)
    kw = {k: v for k, v in section.items() if k not in TIER_KEYS and k != "backend"}
    cls = plugins.load("deepinfer.kv_stores", section["backend"], what="KV store")
    return cls(layout=lay, **kw)


class PrefixMatcher:
    def __init__(self, store: KVStore | None, block_size: int) -> None:
        self.store, self.block_size = store, block_size

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of ``token_ids`` whose KV blocks the store holds (never the last token:
        it is computed to produce the first output token)."""
        if self.store is None:
            return 0
        bs, parent, hit = self.block_size, ROOT_HASH, 0
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if not self.store.contains(parent):
                break
            hit += bs
        return hit
