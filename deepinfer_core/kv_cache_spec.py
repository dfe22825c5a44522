"""What a model declares about its KV cache; the engine derives allocation, block tables and
attention metadata from it (as vLLM's ``kv_cache_interface.py`` does with typed specs).

A model groups its per-layer caches into *cache groups*. All layers of a group share one block
table per request, one pool of blocks and one slot mapping per step. Every group is paged with the
same ``block_size`` in *tokens*: one block of a group covers ``block_size`` consecutive token
positions of a request and holds ``block_size // tokens_per_entry`` entries, so the block index of
token position ``p`` is ``p // block_size`` in every group.

Group tensors: for each layer of the group one tensor ``[num_blocks, block_size // tokens_per_entry,
entry_dim]`` (``dtype`` or the model's dtype). The engine hands the model
``kv_caches[group.name][j]`` for the j-th layer of ``group.layers``.

Encoded entries: a group whose entry is not ``entry_dim`` plain values of its dtype (a quantised row)
declares ``dtype=torch.uint8``, ``entry_dim`` = its bytes, and names the encoding (``encoding``, e.g.
``"fp8_ds_mla"``: the FP8 MLA latent row of ``kernels_cpu/kv_fp8.py``, 656 bytes for DeepSeek V3). The engine
sizes, pages, prefix-caches, stores and hands off such rows as opaque bytes; the encoding enters every
fingerprint and layout signature (host/3FS tiers, P/D hand-off), so rows of different encodings never mix.
Only the kernels that read the rows interpret them.

Planes: a group may name the natural parts of its entry (``parts``, e.g. MLA's latent and rope key,
``(kv_lora_rank, qk_rope_head_dim)``). The platform then chooses its storage
(``Platform.kv_cache_planes``): one tensor per layer (the default), or one tensor per plane and layer,
``[num_blocks, entries_per_block, width]`` each, a plane holding consecutive parts; an entry is then the
concatenation of its rows in the planes. A layer's cache is a :data:`LayerCache` either way; kernels
and the KV tiers read it through :func:`cache_planes`.

Lifetimes:

* ``FULL``: append-only for the request's life; blocks are hashed into the prefix cache.
  A compressed group (``tokens_per_entry`` m > 1) gets entry ``w`` written when the token at
  position ``(w + 1) * m - 1`` is computed (the entry "closes"); the engine's slot mapping for such a
  group is -1 for every other token.
* ``WINDOW``: the newest token at position ``p`` reads only positions ``p - window + 1 .. p``.
  Blocks that fall wholly before the window of the request's next token are freed at once (their
  block-table entries become ``-1``); freed window blocks go to the head of the free list so they
  never push a cached prefix out.

Groups with the same window and ``prefix_cacheable`` allocate in lockstep, so the engine gives
them one block pool and one block table per request (the same block ids), as vLLM does for layers
of one spec; each group still has its own tensors and slot mapping.

Prefix hits (``hit_rule``): a hit of n blocks is the minimum over the groups whose rule is
``REQUIRED`` of what each holds: a FULL group every block before n, a WINDOW group the blocks
that the window of the first recomputed token (position ``n * block_size``) reads (vLLM's
``SlidingWindowManager`` rule). A ``NOT_NEEDED`` group does not limit hits; it gets the blocks it
still holds and -1 elsewhere (the model must cope, e.g. by replaying the window). A group that is
not ``prefix_cacheable`` is never hashed, so it never limits a hit either (its entries for the hit
are -1: state the model does not read after a block boundary).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch


class Lifetime(str, enum.Enum):
    FULL = "full"
    WINDOW = "window"


class HitRule(str, enum.Enum):
    """Whether a prefix hit must be held by a group (module docstring, "Prefix hits")."""

    REQUIRED = "required"
    NOT_NEEDED = "not_needed"


@dataclass(frozen=True)
class KVCacheSpec:
    """One cache group."""

    name: str  # unique within the model, e.g. "latent", "swa", "csa", "hca"
    layers: tuple[int, ...]  # the model layers that own one cache tensor each in this group
    entry_dim: int  # values per entry
    tokens_per_entry: int = 1  # compression ratio: one entry per this many token positions
    window: int | None = None  # WINDOW groups: tokens (the reading token included) ever read
    dtype: torch.dtype | None = None  # None: the model's activation dtype
    prefix_cacheable: bool = True  # blocks may be shared across requests through the prefix cache
    hit_rule: HitRule = HitRule.REQUIRED  # the per-model policy for prefix hits (module docstring)
    #: widths of the entry's parts, where a platform may split it into planes (module docstring, "Planes")
    parts: tuple[int, ...] = ()
    #: how an entry is encoded when it is not plain values of ``dtype`` (module docstring, "Encoded entries")
    encoding: str = ""

    def __post_init__(self) -> None:
        if self.tokens_per_entry < 1:
            raise ValueError(f"cache group {self.name!r}: tokens_per_entry must be >= 1")
        if self.window is not None and self.window < 1:
            raise ValueError(f"cache group {self.name!r}: window must be >= 1 or None")
        if not self.layers:
            raise ValueError(f"cache group {self.name!r} has no layers")
        if self.encoding and self.dtype != torch.uint8:
            raise ValueError(f"cache group {self.name!r}: an encoded entry ({self.encoding!r}) is stored as bytes "
                             f"(dtype torch.uint8), got dtype {self.dtype}")
        if self.parts and (sum(self.parts) != self.entry_dim or min(self.parts) < 1):
            raise ValueError(f"cache group {self.name!r}: parts {self.parts} must be positive and sum to "
                             f"entry_dim {self.entry_dim}")

    def check_planes(self, planes: tuple[int, ...]) -> None:
        """``planes`` (a platform's answer) must be ``(entry_dim,)`` or group whole parts in order."""
        cuts = set(itertools.accumulate(self.parts)) | {self.entry_dim}
        ends = list(itertools.accumulate(planes))
        if ends and ends[-1] == self.entry_dim and min(planes) >= 1 and set(ends) <= cuts:
            return
        raise ValueError(f"cache group {self.name!r}: planes {planes} do not group its parts {self.parts} "
                         f"(entry_dim {self.entry_dim})")

    @property
    def pool_key(self) -> tuple[int | None, bool]:
        """Groups with equal keys share one block pool and block table."""
        return (self.window, self.prefix_cacheable)

    @property
    def lifetime(self) -> Lifetime:
        return Lifetime.FULL if self.window is None else Lifetime.WINDOW

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.tokens_per_entry:
            raise ValueError(f"block_size {block_size} is not a multiple of cache group {self.name!r}'s "
                             f"tokens_per_entry {self.tokens_per_entry}")
        return block_size // self.tokens_per_entry

    @property
    def signature(self) -> str:
        """What one entry is, for fingerprints: its width, dtype and encoding."""
        return f"{self.entry_dim}:{self.dtype}" + (f":{self.encoding}" if self.encoding else "")

    def block_bytes(self, block_size: int, model_dtype: torch.dtype) -> int:
        """Bytes of one block over all the group's layers."""
        itemsize = (self.dtype or model_dtype).itemsize
        return len(self.layers) * self.entries_per_block(block_size) * self.entry_dim * itemsize

    def bytes_per_token(self, model_dtype: torch.dtype) -> float:
        """Amortised bytes per token over all the group's layers (window groups: while in the window)."""
        itemsize = (self.dtype or model_dtype).itemsize
        return len(self.layers) * self.entry_dim * itemsize / self.tokens_per_entry

    def max_blocks_per_request(self, block_size: int, max_model_len: int, max_step_tokens: int) -> int:
        """Blocks one request can hold at once: its whole length, or for a window group the window
        plus the tokens one step may add (and one block of misalignment on each side)."""
        full = -(-max_model_len // block_size) + 1
        if self.window is None:
            return full
        return min(full, -(-(self.window - 1 + max_step_tokens) // block_size) + 1)


@dataclass(frozen=True)
class CacheLayout:
    """Everything a model declares about its cache."""

    groups: tuple[KVCacheSpec, ...]
    #: ``block_size`` must be a multiple of this (V4: 128, so a block closes every compression window)
    block_size_multiple: int = 1

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"cache group names must be unique, got {names}")

    def group(self, name: str) -> KVCacheSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no cache group {name!r}; groups: {[g.name for g in self.groups]}")

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.block_size_multiple:
            raise ValueError(f"block_size={block_size}: this model needs a multiple of {self.block_size_multiple}")
        for g in self.groups:
            g.entries_per_block(block_size)


#: One layer's cache in a group: a ``[num_blocks, entries_per_block, entry_dim]`` tensor, or the tuple
#: of its planes when the platform splits the entry (module docstring, "Planes").
LayerCache = torch.Tensor | tuple[torch.Tensor, ...]


def cache_planes(cache: LayerCache) -> tuple[torch.Tensor, ...]:
    """The planes of one layer's cache (a single tensor is one plane)."""
    return cache if isinstance(cache, tuple) else (cache,)
