"""The hand-off payload: a request's tokens and the KV of its computed positions, self-verifying.

    MAGIC (8) | header length (u32 LE) | SHA-256 of the header (32) | header (JSON) | body

The header is JSON (never pickle: the bytes come from shared memory, a shared store or another
process) and carries the model fingerprint, the cache-layout signature, the request's tokens, how
many positions have KV, per cache pool the block indices present (window pools may have freed
some), and the SHA-256 of the body. The body is, for each cache group in layout order and each of
its layer tensors, the rows of those blocks, raw. :func:`unpack` checks every length, both hashes,
the fingerprint and the layout before it builds a tensor; any mismatch is a :class:`HandoffError`
and the receiver recomputes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from deepinfer_core.kv_cache_spec import CacheLayout

MAGIC = b"DIKVHO01"
MAX_HEADER = 64 << 20
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                               torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)}


class HandoffError(ValueError):
    """A payload that must not be used (wrong format, hash, model, layout or request)."""


def layout_signature(layout: CacheLayout, block_size: int, dtype: torch.dtype) -> str:
    """What the KV bytes mean: every group's geometry, the block size and the model dtype."""
    parts = [f"{block_size}|{dtype}"]
    for g in layout.groups:
        parts.append(f"{g.name}:{g.layers}:{g.signature}:{g.tokens_per_entry}:{g.window}:"
                     f"{g.prefix_cacheable}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass
class RequestState:
    """A request as handed off: its tokens and the KV rows of its first ``num_computed`` positions."""

    token_ids: list[int]
    num_prompt: int
    num_computed: int
    output_logprobs: list[float]  # per output token: its logprob (or 0.0 past the first when not kept)
    output_tops: list[list[tuple[int, float]]]  # per output token: its top-N (token, logprob), [] if none
    blocks: dict[str, list[int]]  # pool name -> block indices present, ascending
    rows: dict[str, list[torch.Tensor]]  # group name -> per layer [len(blocks of its pool), entries, dim]


def pack(state: RequestState, fingerprint: str, signature: str) -> bytes:
    body_parts, parts = [], []
    for group, tensors in state.rows.items():
        for t in tensors:
            t = t.contiguous()
            body_parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            parts.append([group, str(t.dtype), list(t.shape)])
    body = b"".join(body_parts)
    header = json.dumps({
        "v": 1, "fingerprint": fingerprint, "layout": signature, "token_ids": state.token_ids,
        "num_prompt": state.num_prompt, "num_computed": state.num_computed,
        "output_logprobs": state.output_logprobs, "output_tops": state.output_tops,
        "blocks": state.blocks, "parts": parts,
        "body_bytes": len(body), "body_sha256": hashlib.sha256(body).hexdigest(),
    }, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + hashlib.sha256(header).digest() + header + body


def unpack(data: bytes | memoryview, fingerprint: str, signature: str, pool_of: dict[str, str]) -> RequestState:
    """Verify and decode a payload for an engine of ``fingerprint``/``signature`` whose groups map
    to pools by ``pool_of``. Raises HandoffError naming the first problem."""
    data = memoryview(data)
    if len(data) < 44 or bytes(data[:8]) != MAGIC:
        raise HandoffError("not a hand-off payload (bad magic or truncated)")
    (hlen,) = struct.unpack("<I", data[8:12])
    if hlen > MAX_HEADER or 44 + hlen > len(data):
        raise HandoffError(f"header length {hlen} does not fit the payload of {len(data)} bytes")
    header_bytes = bytes(data[44 : 44 + hlen])
    if hashlib.sha256(header_bytes).digest() != bytes(data[12:44]):
        raise HandoffError("header hash mismatch (corrupt payload)")
    try:
        h = json.loads(header_bytes)
    except ValueError as exc:
        raise HandoffError(f"header is not JSON: {exc}") from None
    if not isinstance(h, dict) or h.get("v") != 1:
        raise HandoffError("unknown payload version")
    if h.get("fingerprint") != fingerprint:
        raise HandoffError(f"model fingerprint {h.get('fingerprint')!r} != this engine's {fingerprint!r}")
    if h.get("layout") != signature:
        raise HandoffError(f"cache layout {h.get('layout')!r} != this engine's {signature!r}")
    body = data[44 + hlen :]
    if len(body) != h.get("body_bytes") or hashlib.sha256(body).hexdigest() != h.get("body_sha256"):
        raise HandoffError("body hash mismatch (corrupt or truncated payload)")
    try:
        tokens, blocks = [int(t) for t in h["token_ids"]], {str(k): [int(b) for b in v] for k, v in h["blocks"].items()}
        num_prompt, num_computed = int(h["num_prompt"]), int(h["num_computed"])
        lps = [float(x) for x in h["output_logprobs"]]
        tops = [[(int(t), float(lp)) for t, lp in entry] for entry in h["output_tops"]]
        rows: dict[str, list[torch.Tensor]] = {}
        at = 0
        for group, dtype_name, shape in h["parts"]:
            dtype = _DTYPES[dtype_name]
            if group not in pool_of or shape[0] != len(blocks.get(pool_of[group], ())):
                raise HandoffError(f"part of group {group!r} does not match the block list")
            n = dtype.itemsize
            for s in shape:
                n *= int(s)
            t = torch.frombuffer(bytearray(body[at : at + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=dtype)
            rows.setdefault(group, []).append(t.view(dtype).view(*[int(s) for s in shape]))
            at += n
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, HandoffError):
            raise
        raise HandoffError(f"malformed header: {type(exc).__name__}: {exc}") from None
    if at != len(body):
        raise HandoffError("body length does not match its parts")
    if not 0 < num_prompt <= len(tokens) or not 0 <= num_computed < len(tokens):
        raise HandoffError("token counts out of range")
    if len(lps) != len(tokens) - num_prompt or len(tops) != len(lps):
        raise HandoffError("one logprob and one top-N list per output token expected")
    return RequestState(tokens, num_prompt, num_computed, lps, tops, blocks, rows)
