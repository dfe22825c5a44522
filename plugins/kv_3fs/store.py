"""``3fs``: a persistent KV block store on a file system (a local directory or a 3FS mount).

Each full KV block is one self-describing file (see :mod:`plugins.kv_3fs.record`)::

    <path>/v1/<model fingerprint>/<first two hex digits of the key>/<key as 16 hex digits>.kvb

Writes go to a unique temporary file in the same directory, then ``os.replace`` it over the final
name, so readers see a whole record or none and concurrent writers of one key (same content, as
equal keys mean equal KV) cannot interleave. Reads check the header (magic, format version,
model, layout) and the payload checksum; any mismatch, truncation or IO error is a miss, counted
in ``stats().extra["corrupt"]``, and the bad file is removed so it is written again later.

An in-memory index (key -> size, created, last access, TTL) answers ``contains``/``match_prefix``
without reading data. It is saved to ``index.v1`` on close and rebuilt at start from that snapshot
plus a scan of the shard directories changed since (all of them when there is no snapshot). Keys
written by other processes later are found with one ``stat`` on a lookup miss (negatively cached
for ``negative_cache`` seconds). Last access is kept as the record file's mtime (touched at most
every ``touch_interval``), so it survives restarts and is seen by other processes.

Retention: every record carries its traffic class and TTL; a record not accessed for its TTL is
gone. When usage would pass ``high_watermark * capacity_bytes`` the least recently used records
are removed down to ``low_watermark * capacity_bytes``.

Failures never raise out of ``put``/``get``: a full or read-only directory makes ``put`` return
False (counted in ``write_failures``); the engine then just recomputes.

Nothing outside the store directory is ever read, written, deleted or touched. ``path`` may be
reached through symbolic links (it is resolved once, at open), but nothing under it may be one: every
file operation goes through :class:`~plugins.kv_3fs.confined.ConfinedDir`, so a shard directory,
record or index replaced by a link is refused, never followed, deleted or ``utime``d through; each
is logged once and counted (``stats().extra["symlinks_refused"]``).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import stat
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer_core.config import ConfigError
from deepinfer_core.kv_store import KVLayout, KVStore, KVStoreStats
from plugins.kv_3fs import index, record
from plugins.kv_3fs.confined import ConfinedDir
from plugins.kv_3fs.fileio import errname, miss_reason, pread_full, write_all
from plugins.kv_3fs.index import SUFFIX, Entry
from plugins.kv_3fs.options import StoreOptions
from plugins.kv_3fs.record import HEADER_SIZE, RecordError

logger = logging.getLogger("deepinfer.kv_store.3fs")

_TAIL = struct.Struct("<dd16sQ")  # created, ttl_seconds, ttl_class, checksum at offset 80 of a header


def _longer(a: float, b: float) -> float:
    """The longer of two TTLs, where 0 means no expiry."""
    return 0.0 if a == 0 or b == 0 else max(a, b)


class ThreeFSStore(KVStore):
    """KV blocks as files under ``path`` (see the module docstring). Thread-safe."""

    core_api_version = "1.0"

    def __init__(self, path: str | None = None, layout: KVLayout | None = None, pin_memory: bool = False,
                 **options) -> None:
        """``options``: the ``[kv_store]`` keys of ``options.StoreOptions.parse``; ``pin_memory`` (asked by the
        host tier when it pins its pool) reads blocks into pinned memory."""
        self.opts = StoreOptions.parse(path, pin_memory=pin_memory, **options)  # every bad value refused first
        self.layout, self.path = layout, self.opts.path
        self.fingerprint = layout.model_fingerprint if layout is not None else ""
        self.root = str(self.path / f"v{record.FORMAT_VERSION}" / (self.fingerprint or "any"))
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:  # e.g. a read-only shared store: serve what is there, write nothing
            logger.warning("KV store %s is not writable (%s); it will only be read", self.root, exc)
        if os.path.exists(self.root) and os.path.realpath(self.root) != self.root:
            raise ConfigError(f"[kv_store] {self.root} leads out of the store directory {str(self.path)!r} "
                              f"through a symbolic link (to {os.path.realpath(self.root)!r}); refusing it")
        self._dir = ConfinedDir(self.root)  # every file operation below the root goes through it

        self._lock = threading.Lock()
        self._gc_lock = threading.Lock()
        self._index: dict[int, Entry] = {}
        self._usage = 0
        self._absent: dict[int, float] = {}
        self._stats = KVStoreStats()
        self._corrupt: dict[str, int] = {}
        self._write_failures: dict[str, int] = {}
        self._gc_runs = self._expired = 0
        self._read_time = self._write_time = 0.0
        self._unknown_classes: set[str] = set()
        self._last_sweep = time.time()
        self._last_index_save = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

        self._fixed = None
        if layout is not None:  # header bytes every record of this store shares (the fast read path)
            meta = torch.empty(layout.block_shape, dtype=layout.dtype, device="meta")
            tmpl = record.pack_header(0, meta, 0, record.CRC32, self.fingerprint, 0.0, 0.0, "")
            self._fixed = (tmpl[0:12], tmpl[24:80],
                           HEADER_SIZE + math.prod(layout.block_shape) * layout.dtype.itemsize)
        self._reader = None
        if self.opts.usrbio != "off":
            from plugins.kv_3fs import usrbio

            self._reader = usrbio.open_reader(self.opts.usrbio, str(self.path), self.opts.usrbio_buffer)
        self.usrbio = self._reader is not None
        self._load_index()

    # ---- paths --------------------------------------------------------------------------
    def _path(self, key: int) -> str:
        """The record's path, for messages and USRBIO; file operations go through ``self._dir``."""
        name = f"{key:016x}"
        return f"{self.root}/{name[:2]}/{name}{SUFFIX}"

    @staticmethod
    def _loc(key: int) -> tuple[str, str]:
        """(shard directory, file name) of ``key``'s record."""
        name = f"{key:016x}"
        return name[:2], name + SUFFIX

    def ttl_seconds(self, traffic_class: str | None) -> float:
        """Retention of a traffic class (the default class's for None or an unknown class)."""
        if traffic_class is None:
            return self.opts.ttl[self.opts.default_class]
        ttl = self.opts.ttl.get(traffic_class)
        if ttl is None:
            if traffic_class not in self._unknown_classes:
                self._unknown_classes.add(traffic_class)
                logger.warning("KV store: unknown traffic class %r; using the default class %r (known: %s)",
                               traffic_class, self.opts.default_class, ", ".join(sorted(self.opts.ttl)))
            return self.opts.ttl[self.opts.default_class]
        return ttl

    # ---- KVStore ------------------------------------------------------------------------
    def contains(self, key: int) -> bool:
        now = time.time()
        with self._lock:
            e = self._index.get(key)
            if e is not None:
                if not e.expired(now):
                    return True
                self._drop_locked(key)
                self._expired += 1
                stale = True
            else:
                seen = self._absent.get(key)
                if seen is not None and now - seen < self.opts.negative_cache:
                    return False
                stale = False
        if stale:
            self._dir.unlink(*self._loc(key))
            return False
        try:
            st = self._dir.lstat(*self._loc(key))  # written by another process since the index was built?
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(key)
        except OSError:
            with self._lock:
                if len(self._absent) > 1 << 16:
                    self._absent.clear()
                self._absent[key] = now
            return False
        entry = Entry(st.st_size, st.st_mtime, st.st_mtime, self.opts.ttl[self.opts.default_class], st.st_mtime)
        if st.st_size < HEADER_SIZE or entry.expired(now):
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = entry
                self._usage += entry.size
        return True

    def put(self, key: int, block: torch.Tensor, ttl_class: str | None = None, **meta) -> bool:
        if self.layout is not None and (tuple(block.shape) != self.layout.block_shape
                                        or block.dtype != self.layout.dtype):
            self._count_write_failure("wrong_layout")
            return False
        try:
            record.dtype_name(block.dtype)
        except ValueError:
            self._count_write_failure("unsupported_dtype")
            return False
        nbytes = block.numel() * block.element_size()
        size = HEADER_SIZE + nbytes
        if not 1 <= block.dim() <= 3 or (self.opts.capacity_bytes is not None and size > self.opts.capacity_bytes):
            return False
        ttl = self.ttl_seconds(ttl_class)
        cls = ttl_class if ttl_class in self.opts.ttl else self.opts.default_class
        now = time.time()
        with self._lock:
            e = self._index.get(key)
            if e is not None and not e.expired(now):
                e.atime, e.ttl = now, _longer(e.ttl, ttl)
                self._stats.puts += 1
                return True
        self._make_room(size)
        block = block.detach()
        if block.device.type != "cpu":
            block = block.cpu()
        block = block.contiguous()
        t0 = time.perf_counter()
        if not self._write(key, block, cls, ttl, now):
            return False
        with self._lock:
            old = self._index.get(key)
            self._usage += size - (old.size if old else 0)
            self._index[key] = Entry(size, now, now, ttl, now)
            self._absent.pop(key, None)
            self._stats.puts += 1
            self._stats.write_bytes += size
            self._write_time += time.perf_counter() - t0
        return True

    def get(self, key: int, ttl_class: str | None = None) -> torch.Tensor | None:
        if self._fixed is not None and self._reader is None:
            return self.get_many([key], ttl_class)[0]
        return self._read(key, ttl_class)

    def get_many(self, keys: list[int], ttl_class: str | None = None,
                 out: torch.Tensor | list[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """Read several blocks at once: batched through USRBIO, else on ``io_threads`` threads.

        With ``out`` (a contiguous CPU tensor of shape [>= len(keys), *block shape], or a list of
        contiguous block-shaped CPU tensors, one per key) block i is read into ``out[i]`` and
        returned as that tensor: reading into warm, possibly pinned, memory the caller keeps (e.g.
        the host tier's pool) is much faster than filling fresh pages, and saves a copy."""
        if not keys:
            return []
        keys = list(keys)
        n = len(keys)
        lay = self.layout
        if isinstance(out, torch.Tensor):
            usable = (lay is not None and out.dim() == 4 and out.shape[0] >= n and out.device.type == "cpu"
                      and tuple(out.shape[1:]) == lay.block_shape and out.dtype == lay.dtype
                      and out.is_contiguous())
            out = list(out[:n].unbind(0)) if usable else None
        if out is not None:
            if len(out) < n:
                raise ValueError(f"get_many: {len(out)} output tensors for {n} keys")
            out = [t if self._fits(t) else None for t in out[:n]]
        tensors = [None] * n if out is None else out
        if self._reader is not None:
            return self._read_usrbio(keys, ttl_class, tensors)
        result: list[torch.Tensor | None] = [None] * n
        if self._fixed is not None:
            tensors = [t if t is not None else torch.empty(lay.block_shape, dtype=lay.dtype,
                                                             pin_memory=self.opts.pin_memory) for t in tensors]
            views = [record.payload_view(t) for t in tensors]

            def run(idxs):
                self._read_run(keys, idxs, ttl_class, views, tensors, result)
        else:
            def run(idxs):
                for i in idxs:
                    result[i] = self._read(keys[i], ttl_class, tensors[i])
        if self.opts.io_threads == 1 or n == 1:
            run(range(n))
            return result
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.opts.io_threads, thread_name_prefix="kv-3fs-io")
        # contiguous runs per thread: each thread reads its files in order
        step = -(-n // min(self.opts.io_threads, n))
        list(self._pool.map(run, [range(i, min(i + step, n)) for i in range(0, n, step)]))
        return result

    def _fits(self, t) -> bool:
        lay = self.layout
        return (isinstance(t, torch.Tensor) and lay is not None and t.device.type == "cpu" and t.is_contiguous()
                and tuple(t.shape) == lay.block_shape and t.dtype == lay.dtype)

    def _read_run(self, keys, idxs, ttl_class, views, tensors, result) -> None:
        """The fast path for stores with a layout: every record has the same size and fixed header
        bytes, so one ``preadv`` reads header and payload and a few byte compares check it. Anything
        unexpected goes through :meth:`_read`, which names the problem."""
        fixed_a, fixed_b, fsize = self._fixed
        head = bytearray(HEADER_SIZE)
        hmv, emv = memoryview(head), memoryview(bytearray(1))
        crc32, from_bytes, unpack_tail = zlib.crc32, int.from_bytes, _TAIL.unpack_from
        xxh3 = record.xxh3_64
        hits = []
        t0 = time.perf_counter()
        now = time.time()
        with self._lock:
            expired = [i for i in idxs if (e := self._index.get(keys[i])) is not None and e.expired(now)]
        for i in expired:
            self._take_expired(keys[i], self._path(keys[i]))
        skip = set(expired)
        for i in idxs:
            if i in skip:
                continue
            key = keys[i]
            path = self._path(key)
            try:
                fd = self._dir.open(*self._loc(key))
            except OSError as exc:
                self._miss(key, path, miss_reason(exc), exc)
                continue
            try:
                n = os.preadv(fd, [hmv, views[i], emv], 0)
            except OSError:
                n = -1
            finally:
                os.close(fd)
            ok = (n == fsize and head[0:12] == fixed_a and head[24:80] == fixed_b
                  and from_bytes(head[16:24], "little") == key
                  and crc32(hmv[:124]) == from_bytes(head[124:128], "little"))
            if ok:
                algo = head[12]
                created, ttl, _, digest = unpack_tail(head, 80)
                if algo == record.XXH3 and xxh3 is not None:
                    ok = xxh3(views[i]) == digest
                else:
                    try:
                        ok = record.checksum(algo, views[i]) == digest
                    except RecordError:
                        ok = False
            if ok:
                hits.append((key, created, ttl))
                result[i] = tensors[i]
            else:  # re-read carefully: a miss with its reason (or, after a racing rewrite, a hit)
                result[i] = self._read(key, ttl_class, tensors[i])
        if hits:
            self._hits(hits, fsize, ttl_class, time.perf_counter() - t0)

    def _hits(self, hits, fsize: int, ttl_class: str | None, seconds: float) -> None:
        now = time.time()
        cls_ttl = self.ttl_seconds(ttl_class) if ttl_class else None
        touch = []
        with self._lock:
            for key, created, ttl in hits:
                if cls_ttl is not None:
                    ttl = _longer(ttl, cls_ttl)
                e = self._index.get(key)
                if e is None:
                    self._index[key] = e = Entry(fsize, created, now, ttl, now)
                    self._usage += fsize
                e.atime, e.ttl = now, _longer(e.ttl, ttl)
                if now - e.touched > self.opts.touch_interval:
                    e.touched = now
                    touch.append(key)
            self._stats.hits += len(hits)
            self._stats.read_bytes += len(hits) * fsize
            self._read_time += seconds
        for key in touch:
            self._dir.touch(*self._loc(key))  # last access survives restarts and is seen by other processes

    def evict(self, key: int) -> bool:
        with self._lock:
            held = self._drop_locked(key)
        removed = self._dir.unlink(*self._loc(key))
        return held or removed

    def stats(self) -> KVStoreStats:
        with self._lock:
            s = self._stats
            return KVStoreStats(
                hits=s.hits, misses=s.misses, puts=s.puts, evictions=s.evictions, read_bytes=s.read_bytes,
                write_bytes=s.write_bytes, errors=s.errors + sum(self._write_failures.values()),
                extra={
                    "usage_bytes": self._usage, "capacity_bytes": self.opts.capacity_bytes,
                    "blocks": len(self._index),
                    "high_watermark": self.opts.high_watermark, "low_watermark": self.opts.low_watermark,
                    "gc_runs": self._gc_runs, "expired": self._expired, "corrupt": dict(self._corrupt),
                    "write_failures": dict(self._write_failures), "read_time_s": self._read_time,
                    "write_time_s": self._write_time, "usrbio": self.usrbio, "path": self.root,
                    "checksum": "xxh3" if self.opts.checksum_algo == record.XXH3 else "crc32",
                    "symlinks_refused": len(self._dir.refused),
                },
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.save_index()
        if self._reader is not None:
            self._reader.close()
        self._dir.close()

    # ---- retention ----------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int | None:
        """The store's capacity (the conformance kit's ``capacity_bytes``; None: unbounded)."""
        return self.opts.capacity_bytes

    @property
    def usage_bytes(self) -> int:
        with self._lock:
            return self._usage

    def _make_room(self, incoming: int) -> None:
        now = time.time()
        cap = self.opts.capacity_bytes
        over = cap is not None and self._usage + incoming > self.opts.high_watermark * cap
        if not over and now - self._last_sweep < self.opts.gc_interval:
            return
        with self._gc_lock:
            over = cap is not None and self._usage + incoming > self.opts.high_watermark * cap
            if over:
                self.gc(target=min(self.opts.low_watermark * cap, self.opts.high_watermark * cap - incoming))
            elif now - self._last_sweep >= self.opts.gc_interval:
                self.gc()

    def gc(self, target: float | None = None) -> int:
        """Remove expired records, then least recently used ones until usage <= ``target`` bytes.
        Returns how many records were removed."""
        now = time.time()
        victims: list[int] = []
        with self._lock:
            for key in [k for k, e in self._index.items() if e.expired(now)]:
                self._drop_locked(key)
                victims.append(key)
            self._expired += len(victims)
            if target is not None and self._usage > target:
                for key, _ in sorted(self._index.items(), key=lambda kv: kv[1].atime):
                    if self._usage <= target:
                        break
                    self._drop_locked(key)
                    victims.append(key)
                    self._stats.evictions += 1
            self._gc_runs += 1
            self._last_sweep = now
        for key in victims:
            self._dir.unlink(*self._loc(key))
        if victims and now - self._last_index_save > 60:
            self.save_index()
        return len(victims)

    def _drop_locked(self, key: int) -> bool:
        e = self._index.pop(key, None)
        if e is None:
            return False
        self._usage -= e.size
        return True

    # ---- writing ------------------------------------------------------------------------
    def _write(self, key: int, block: torch.Tensor, cls: str, ttl: float, now: float) -> bool:
        payload = record.payload_view(block)
        digest = record.checksum(self.opts.checksum_algo, payload)
        header = record.pack_header(key, block, digest, self.opts.checksum_algo, self.fingerprint, now, ttl, cls)
        shard, final = self._loc(key)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident():x}.{secrets.token_hex(4)}.tmp"
        try:
            if self._dir.dir_fd(shard, create=True) is None:  # the shard is a link (refused) or a file
                self._count_write_failure("unsafe_shard_directory")
                return False
            fd = self._dir.open(shard, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                write_all(fd, [header, payload])
                if self.opts.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._dir.replace(shard, tmp, final)
            return True
        except OSError as exc:
            self._dir.unlink(shard, tmp)
            self._count_write_failure(errname(exc), exc)
            return False

    def _count_write_failure(self, reason: str, exc: BaseException | None = None) -> None:
        with self._lock:
            n = self._write_failures.get(reason, 0) + 1
            self._write_failures[reason] = n
        if n == 1 or n % 1000 == 0:
            logger.warning("KV store %s: write failed (%s, %d so far): %s; requests recompute instead",
                           self.root, reason, n, exc)

    # ---- reading ------------------------------------------------------------------------
    def _check(self, hdr: record.Header, key: int, file_size: int | None) -> None:
        if hdr.key != key:
            raise RecordError("corrupt", f"record holds key {hdr.key:#x}, expected {key:#x}")
        if hdr.fingerprint != self.fingerprint:
            raise RecordError("wrong_model",
                              f"record of model {hdr.fingerprint!r}, expected {self.fingerprint!r}")
        lay = self.layout
        if lay is not None and (hdr.shape != lay.block_shape or hdr.dtype != lay.dtype):
            raise RecordError("wrong_layout",
                              f"record is {hdr.dtype} {hdr.shape}, expected {lay.dtype} {lay.block_shape}")
        if file_size is not None and file_size != hdr.file_size:
            raise RecordError("truncated", f"file has {file_size} bytes, header says {hdr.file_size}")

    def _miss(self, key: int, path: str, reason: str | None, detail: object = None) -> None:
        """Count a miss; a bad record is removed (and logged)."""
        with self._lock:
            self._stats.misses += 1
            self._drop_locked(key)
            if reason is not None:
                n = self._corrupt.get(reason, 0) + 1
                self._corrupt[reason] = n
        if reason is None:
            return
        if reason not in ("io_error", "unsupported_checksum"):
            self._dir.unlink(*self._loc(key))
        if n == 1 or n % 1000 == 0:
            logger.warning("KV store: %s is unusable (%s: %s; %d so far); treated as a miss", path, reason,
                           detail, n)

    def _hit(self, key: int, hdr: record.Header, path: str, ttl_class: str | None, seconds: float) -> None:
        now = time.time()
        ttl = _longer(hdr.ttl_seconds, self.ttl_seconds(ttl_class)) if ttl_class else hdr.ttl_seconds
        with self._lock:
            e = self._index.get(key)
            if e is None:
                self._index[key] = e = Entry(hdr.file_size, hdr.created, now, ttl)
                self._usage += hdr.file_size
            e.atime, e.ttl = now, _longer(e.ttl, ttl)
            touch = now - e.touched > self.opts.touch_interval
            if touch:
                e.touched = now
            self._stats.hits += 1
            self._stats.read_bytes += hdr.file_size
            self._read_time += seconds
        if touch:
            self._dir.touch(*self._loc(key))  # last access survives restarts and is seen by other processes

    def _take_expired(self, key: int, path: str) -> bool:
        """True (and the record is removed, counted as a miss) when ``key`` outlived its TTL."""
        with self._lock:
            e = self._index.get(key)
            if e is None or not e.expired(time.time()):
                return False
            self._expired += 1
        self._miss(key, path, None)
        self._dir.unlink(*self._loc(key))
        return True

    def _dest(self, hdr_shape, dtype, out: torch.Tensor | None) -> torch.Tensor:
        if (out is not None and tuple(out.shape) == tuple(hdr_shape) and out.dtype == dtype
                and out.is_contiguous()):
            return out
        return torch.empty(hdr_shape, dtype=dtype, pin_memory=self.opts.pin_memory)

    def _read(self, key: int, ttl_class: str | None = None, out: torch.Tensor | None = None):
        path = self._path(key)
        if self._take_expired(key, path):
            return None
        t0 = time.perf_counter()
        try:
            fd = self._dir.open(*self._loc(key))
        except OSError as exc:
            self._miss(key, path, miss_reason(exc), exc)
            return None
        try:
            if self.layout is not None:  # the record's size is known: one read for header and payload
                block = self._dest(self.layout.block_shape, self.layout.dtype, out)
                head, view, extra = bytearray(HEADER_SIZE), record.payload_view(block), bytearray(1)
                n = pread_full(fd, [memoryview(head), view, memoryview(extra)], 0)
                hdr = record.unpack_header(head)
                self._check(hdr, key, n if n <= hdr.file_size else None)
                if n > hdr.file_size:
                    raise RecordError("corrupt", f"file is longer than its header's {hdr.file_size} bytes")
            else:
                size = os.fstat(fd).st_size
                hdr = record.unpack_header(os.pread(fd, HEADER_SIZE, 0))
                self._check(hdr, key, size)
                block = self._dest(hdr.shape, hdr.dtype, out)
                view = record.payload_view(block)
                if pread_full(fd, [view], HEADER_SIZE) != hdr.payload_len:
                    raise RecordError("truncated", "file ended early")
            if record.checksum(hdr.checksum_algo, view) != hdr.checksum:
                raise RecordError("corrupt", "payload checksum mismatch")
        except RecordError as exc:
            self._miss(key, path, exc.reason, exc)
            return None
        except OSError as exc:
            self._miss(key, path, "io_error", exc)
            return None
        finally:
            os.close(fd)
        self._hit(key, hdr, path, ttl_class, time.perf_counter() - t0)
        return block

    def _read_usrbio(self, keys: list[int], ttl_class: str | None, outs: list) -> list[torch.Tensor | None]:
        result: list[torch.Tensor | None] = [None] * len(keys)
        items, where = [], []
        for i, key in enumerate(keys):
            path = self._path(key)
            if self._take_expired(key, path):
                continue
            try:  # USRBIO opens by path: check here that neither the record nor its shard is a link
                size = self._dir.lstat(*self._loc(key)).st_size
            except OSError:
                self._miss(key, path, None)
                continue
            items.append((path, size))
            where.append(i)
        t0 = time.perf_counter()

        def consume(j: int, data) -> None:
            i = where[j]
            key, path = keys[i], items[j][0]
            if isinstance(data, BaseException):
                self._miss(key, path, None if isinstance(data, FileNotFoundError) else "io_error", data)
                return
            try:
                hdr = record.unpack_header(data[:HEADER_SIZE])
                self._check(hdr, key, len(data))
                block = self._dest(hdr.shape, hdr.dtype, outs[i])
                view = record.payload_view(block)
                view[:] = data[HEADER_SIZE:]
                if record.checksum(hdr.checksum_algo, view) != hdr.checksum:
                    raise RecordError("corrupt", "payload checksum mismatch")
            except RecordError as exc:
                self._miss(key, path, exc.reason, exc)
                return
            self._hit(key, hdr, path, ttl_class, 0.0)
            result[i] = block

        self._reader.read_files(items, consume)
        with self._lock:
            self._read_time += time.perf_counter() - t0
        return result

    # ---- the index ----------------------------------------------------------------------
    def save_index(self) -> bool:
        """Write the index snapshot (atomically); False when it cannot be written."""
        now = time.time()
        with self._lock:
            snapshot = index.encode(self._index, now)
        if self._dir.dir_fd() is None:
            return False
        try:
            index.write_snapshot(self._dir, snapshot)
        except OSError as exc:
            self._count_write_failure("index_" + errname(exc), exc)
            return False
        self._last_index_save = now
        return True

    def _load_index(self) -> None:
        t0 = time.perf_counter()
        snap = index.read_snapshot(self._dir, self.root)
        entries, scanned = index.rebuild(self._dir, self.root, snap, self._check, self._corrupt)
        with self._lock:
            self._index = entries
            self._usage = sum(e.size for e in entries.values())
        removed = self.gc()
        logger.info("KV store %s: %d blocks, %.1f MiB (snapshot %s, %d shard dirs scanned, %d expired) "
                    "in %.2fs",
                    self.root, len(self._index), self._usage / 2**20, "used" if snap else "absent", scanned,
                    removed, time.perf_counter() - t0)
