"""The store's in-memory index: its entries, their on-disk snapshot (``index.v1``), and the rebuild at start
(the snapshot plus a rescan of the shard directories changed since it was saved).

The snapshot is a fixed header (magic, format version, entry count, when it was saved, CRC32 of the body)
followed by one packed row per block (key, file size, created, last access, TTL): plain numbers, never
pickle. A snapshot whose header, length or checksum does not match is unusable (the store rescans).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plugins.kv_3fs import record
from plugins.kv_3fs.confined import ConfinedDir
from plugins.kv_3fs.fileio import write_all
from plugins.kv_3fs.record import HEADER_SIZE, RecordError

logger = logging.getLogger("deepinfer.kv_store.3fs")

SUFFIX = ".kvb"  # a record file: <key as 16 hex digits>.kvb in the shard directory of its first two digits
FILE_NAME = "index.v1"
_MAGIC = b"DIKVIDX\x00"
_HEAD = struct.Struct("<8sIQdI")  # magic, version, count, saved at, CRC32 of the body
_ROW = np.dtype([("key", "<u8"), ("size", "<u8"), ("created", "<f8"), ("atime", "<f8"), ("ttl", "<f8")])


@dataclass
class Entry:
    size: int  # file bytes, header included
    created: float
    atime: float  # last access (unix time)
    ttl: float  # seconds after the last access; 0 = no expiry
    touched: float = 0.0  # when the file's mtime was last set to a last access

    def expired(self, now: float) -> bool:
        return self.ttl > 0 and now - self.atime > self.ttl


def encode(entries: dict[int, Entry], saved_at: float) -> list[bytes]:
    """The snapshot of ``entries`` as (header, body) buffers."""
    rows = np.empty(len(entries), dtype=_ROW)
    for i, (k, e) in enumerate(entries.items()):
        rows[i] = (k, e.size, e.created, e.atime, e.ttl)
    body = rows.tobytes()
    return [_HEAD.pack(_MAGIC, 1, len(rows), saved_at, zlib.crc32(body) & 0xFFFFFFFF), body]


def decode(raw: bytes) -> tuple[dict[int, Entry], float] | None:
    """(entries, saved at) from a snapshot's bytes; None when they are not a whole, intact snapshot."""
    if len(raw) < _HEAD.size:
        return None
    magic, version, count, saved, crc = _HEAD.unpack_from(raw)
    body = raw[_HEAD.size :]
    if (magic != _MAGIC or version != 1 or len(body) != count * _ROW.itemsize
            or zlib.crc32(body) & 0xFFFFFFFF != crc):
        return None
    rows = np.frombuffer(body, dtype=_ROW)
    return ({int(k): Entry(int(size), float(created), float(atime), float(ttl), float(atime))
             for k, size, created, atime, ttl in rows.tolist()}, saved)


def write_snapshot(cdir: ConfinedDir, buffers: list[bytes]) -> None:
    """Write an ``encode``d snapshot atomically (a unique temporary file, then replaced over ``index.v1``; over
    a link the link itself is replaced). Raises OSError."""
    tmp = f"{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = cdir.open("", tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, buffers)
        finally:
            os.close(fd)
        cdir.replace("", tmp, FILE_NAME)
    except OSError:
        cdir.unlink("", tmp)
        raise


def read_snapshot(cdir: ConfinedDir, root: str) -> tuple[dict[int, Entry], float] | None:
    """The saved snapshot; None when it is absent, a link (refused), unreadable or unusable (logged)."""
    try:
        fd = cdir.open("", FILE_NAME)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    snap = decode(raw)
    if snap is None:
        logger.warning("KV store: index snapshot in %s is unusable; rescanning the directory", root)
    return snap


Check = Callable[[record.Header, int, int], None]  # (header, key, file size): raises RecordError when unusable


def rebuild(cdir: ConfinedDir, root: str, snap: tuple[dict[int, Entry], float] | None, check: Check,
            corrupt: dict[str, int]) -> tuple[dict[int, Entry], int]:
    """The index from the snapshot (or nothing) plus a rescan of every shard directory modified since it was
    saved (all of them without one); unusable records are removed and counted in ``corrupt`` by reason.
    Returns (entries, shard directories scanned)."""
    entries, saved = snap if snap is not None else ({}, None)
    by_shard: dict[str, list[int]] = {}
    for key in entries:
        by_shard.setdefault(f"{key:016x}"[:2], []).append(key)
    shards = []
    for d in cdir.scandir():
        if len(d.name) != 2:
            continue
        if d.is_symlink():
            cdir.refuse(d.name, "shard directory")
        elif d.is_dir(follow_symlinks=False) and cdir.dir_fd(d.name) is not None:
            shards.append(d)
    scanned = 0
    for d in shards:
        try:
            changed = saved is None or d.stat(follow_symlinks=False).st_mtime >= saved - 2.0
        except OSError:
            continue
        if changed:
            scanned += 1
            _rescan(cdir, root, d.name, entries, by_shard.get(d.name, []), check, corrupt)
    on_disk = {d.name for d in shards}
    for name, keys in by_shard.items():
        if name not in on_disk:
            for key in keys:
                entries.pop(key, None)
    return entries, scanned


def _rescan(cdir: ConfinedDir, root: str, shard: str, entries: dict[int, Entry], known: list[int],
            check: Check, corrupt: dict[str, int]) -> None:
    now = time.time()
    seen: set[int] = set()
    for de in cdir.scandir(shard):
        name = de.name
        if de.is_symlink():
            if name.endswith((SUFFIX, ".tmp")):
                cdir.refuse(f"{shard}/{name}", "record")
            continue
        try:
            st = de.stat(follow_symlinks=False)
        except OSError:
            continue
        if name.endswith(".tmp"):
            if now - st.st_mtime > 3600:  # left by a writer that died
                cdir.unlink(shard, name)
            continue
        if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
            continue
        try:
            key = int(name[:16], 16)
        except ValueError:
            continue
        seen.add(key)
        e = entries.get(key)
        if e is not None and e.size == st.st_size:
            e.atime = e.touched = max(e.atime, st.st_mtime)
            continue
        path = f"{root}/{shard}/{name}"
        try:
            with os.fdopen(cdir.open(shard, name), "rb") as f:
                hdr = record.unpack_header(f.read(HEADER_SIZE))
            check(hdr, key, st.st_size)
        except (OSError, RecordError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ELOOP:  # became a link since the listing
                continue
            reason = getattr(exc, "reason", "io_error")
            corrupt[reason] = corrupt.get(reason, 0) + 1
            logger.warning("KV store: %s is unusable (%s); removed", path, exc)
            cdir.unlink(shard, name)
            entries.pop(key, None)
            continue
        entries[key] = Entry(st.st_size, hdr.created, st.st_mtime, hdr.ttl_seconds, st.st_mtime)
    for key in known:
        if key not in seen:
            entries.pop(key, None)
