"""Per-step batch layout handed to the model: which tokens are prefill chunks and which decode,
where each token's KV goes, and each sequence's block table.

Tokens are laid out prefill tokens first, then decode tokens. A "decode" sequence may have several
query tokens (speculative verification); it always uses the absorbed MLA path over the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillMeta:
    cu_q_lens: torch.Tensor  # [Bp+1] int64, new tokens per sequence
    cu_k_lens: torch.Tensor  # [Bp+1] int64, cached prefix + new tokens
    seq_lens: torch.Tensor  # [Bp] int64 (= k lens)
    block_tables: torch.Tensor  # [Bp, M] int32
    has_prefix: bool  # any sequence with an already-cached prefix (then K/V come from the cache)


@dataclass
class DecodeMeta:
    cu_q_lens: torch.Tensor  # [Bd+1] int64
    seq_lens: torch.Tensor  # [Bd] int64, context length including the new tokens
    block_tables: torch.Tensor  # [Bd, M] int32
    max_q_len: int = 1
    host_seq_lens: list[int] | None = None  # seq_lens on the host (for Platform.graph_replay)


@dataclass
class GroupMeta:
    """One cache group's view of a step (``deepinfer_core.kv_cache_spec``)."""

    #: [T] int64: flat slot (block * entries_per_block + offset) of the entry token t writes; -1 where
    #: it writes none (a compressed group's token that closes no entry, or a token not to be cached)
    slot_mapping: torch.Tensor
    #: [B, M] int32 for every sequence of the step in batch order (prefills, then decodes); -1 marks a
    #: freed window block. Columns past a sequence's blocks are padding (-1 or 0): read only the blocks
    #: of positions below its ``seq_lens``
    block_tables: torch.Tensor


@dataclass
class AttentionMetadata:
    num_prefill_tokens: int
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot per token (-1: do not write)
    prefill: PrefillMeta | None
    decode: DecodeMeta | None
    #: per layer, device events that layer must wait for before it touches its cache: KV blocks being
    #: swapped in from host memory on a side stream (layer i computes while layer i+1's copy runs)
    layer_ready: list[list] | None = None
    #: per cache group (by ``KVCacheSpec.name``): its slot mapping and block tables. ``slot_mapping``,
    #: ``prefill.block_tables`` and ``decode.block_tables`` above are the first group's.
    groups: dict[str, GroupMeta] | None = None
    #: [B+1] int64 new tokens per sequence, and [B] context length including them, for every sequence
    #: of the step in batch order (prefills, then decodes)
    cu_q_lens: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
