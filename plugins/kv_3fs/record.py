"""The on-disk record of one KV block: a fixed 128-byte header, then the raw tensor bytes.

Header (little-endian)::

    offset size field
         0    8 magic            b"DIKVBLK\\0"
         8    2 version          FORMAT_VERSION
        10    2 header_size      128
        12    4 checksum_algo    1 = CRC32 (zlib), 2 = xxh3-64 (``xxhash``)
        16    8 key              prefix-hash-chain value of the block
        24   16 fingerprint      model fingerprint, ASCII, NUL-padded ("" when the store has no layout)
        40   16 dtype            torch dtype name, ASCII ("float32", "bfloat16", ...)
        56    4 ndim             1..3
        60   12 dims             [num_layers, block_size, entry_dim] (unused dims are 0)
        72    8 payload_len      bytes after the header
        80    8 created          unix time the block was first written
        88    8 ttl_seconds      retention after the last access (0: forever)
        96   16 ttl_class        traffic class name, ASCII
       112    8 checksum         of the payload, per checksum_algo
       120    4 reserved
       124    4 header_crc       CRC32 of bytes 0..123

No pickle anywhere: a record is parsed with ``struct`` and the payload is copied into a tensor
allocated from the header's dtype and shape (the dtype name must be one of ``DTYPES``).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"DIKVBLK\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 128
CRC32, XXH3 = 1, 2
_HEADER = struct.Struct("<8sHHIQ16s16sI3IQdd16sQ4xI")
assert _HEADER.size == HEADER_SIZE

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8,
    "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
}

try:  # a much faster checksum where the optional ``xxhash`` package is installed
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None
xxh3_64 = _xxhash.xxh3_64_intdigest if _xxhash is not None else None


class RecordError(ValueError):
    """A record that must be treated as a miss; ``reason`` is a metrics label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Header:
    key: int
    fingerprint: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    created: float
    ttl_seconds: float
    ttl_class: str
    checksum_algo: int
    checksum: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.payload_len


def available_checksums() -> tuple[int, ...]:
    return (CRC32, XXH3) if _xxhash is not None else (CRC32,)


def default_checksum() -> int:
    return XXH3 if _xxhash is not None else CRC32


def checksum(algo: int, data) -> int:
    """Checksum of a bytes-like object (both functions release the GIL on large buffers)."""
    if algo == CRC32:
        return zlib.crc32(data) & 0xFFFFFFFF
    if algo == XXH3 and _xxhash is not None:
        return _xxhash.xxh3_64_intdigest(data)
    raise RecordError("unsupported_checksum", f"checksum algorithm {algo} is not available here")


def _ascii(text: str, what: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 16:
        raise ValueError(f"{what} {text!r} is longer than 16 bytes")
    return raw


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be stored")
    return name


def payload_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def pack_header(key: int, block: torch.Tensor, payload_checksum: int, algo: int, fingerprint: str,
                created: float, ttl_seconds: float, ttl_class: str) -> bytes:
    if not 1 <= block.dim() <= 3:
        raise ValueError(f"a KV block has 1 to 3 dims, got shape {tuple(block.shape)}")
    dims = list(block.shape) + [0] * (3 - block.dim())
    body = _HEADER.pack(
        MAGIC, FORMAT_VERSION, HEADER_SIZE, algo, key, _ascii(fingerprint, "fingerprint"),
        _ascii(dtype_name(block.dtype), "dtype"), block.dim(), *dims, block.numel() * block.element_size(),
        created, ttl_seconds, _ascii(ttl_class, "ttl class"), payload_checksum, 0,
    )
    return body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]) & 0xFFFFFFFF)


def unpack_header(raw: bytes) -> Header:
    """Parse and check a header; raises RecordError (never anything else) for bad bytes."""
    if len(raw) < HEADER_SIZE:
        raise RecordError("truncated", f"header has {len(raw)} of {HEADER_SIZE} bytes")
    raw = bytes(raw[:HEADER_SIZE])
    if raw[:8] != MAGIC:
        raise RecordError("corrupt", "bad magic")
    (_, version, header_size, algo, key, fp, dt, ndim, d0, d1, d2, payload_len, created, ttl_s, ttl_class,
     payload_crc, header_crc) = _HEADER.unpack(raw)
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise RecordError("wrong_version", f"format version {version} (header {header_size} bytes); "
                          f"this reader handles version {FORMAT_VERSION}")
    if zlib.crc32(raw[:-4]) & 0xFFFFFFFF != header_crc:
        raise RecordError("corrupt", "header checksum mismatch")
    try:
        dtype = DTYPES[dt.rstrip(b"\x00").decode("ascii")]
        fingerprint = fp.rstrip(b"\x00").decode("ascii")
        cls = ttl_class.rstrip(b"\x00").decode("ascii")
    except (KeyError, UnicodeDecodeError) as exc:
        raise RecordError("corrupt", f"bad header field ({exc})") from None
    if not 1 <= ndim <= 3:
        raise RecordError("corrupt", f"ndim {ndim}")
    shape = (d0, d1, d2)[:ndim]
    if payload_len != math.prod(shape) * dtype.itemsize:
        raise RecordError("corrupt", f"payload_len {payload_len} does not match {dtype} {shape}")
    return Header(key, fingerprint, dtype, shape, payload_len, created, ttl_s, cls, algo, payload_crc)
