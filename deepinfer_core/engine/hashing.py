"""Prefix hash chain over full KV blocks.

hash_i = H(hash_{i-1} || tokens of block i). Equal hashes mean equal prefixes, so equal KV; a block
shared only partially never matches. The hash is a stable 63-bit BLAKE2b digest, identical across
processes and machines (the persistent tiers key files by it).
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0x5EED_DEEB


def block_hash(parent: int, tokens) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def chain(tokens: list[int], block_size: int, num_blocks: int | None = None, parent: int = ROOT_HASH,
          start_block: int = 0) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from ``start_block`` (``parent`` = hash before it)."""
    n = len(tokens) // block_size if num_blocks is None else num_blocks
    out = []
    for b in range(start_block, n):
        parent = block_hash(parent, tokens[b * block_size : (b + 1) * block_size])
        out.append(parent)
    return out
