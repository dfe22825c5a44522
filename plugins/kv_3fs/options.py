"""The ``[kv_store]`` options of the ``3fs`` backend, parsed and checked before the store opens anything.

Every bad value is a ``ConfigError`` naming its key and what was expected; an unknown key is refused with
the list of known ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from deepinfer_core.config import ConfigError
from deepinfer_core.engine.transfer import can_pin_memory
from deepinfer_core.units import parse_duration, parse_size
from plugins.kv_3fs import record

DEFAULT_TTL = {"agent": "3d", "chatbot": "7d"}
KNOWN_KEYS = ("path, capacity_bytes, high_watermark, low_watermark, ttl, default_class, usrbio, io_threads, "
              "gc_interval, checksum, fsync, touch_interval, negative_cache, usrbio_buffer")


def default_path() -> str:
    base = os.environ.get("DEEPINFER_CACHE_DIR")
    return os.path.join(base, "kv") if base else os.path.join("~", ".cache", "deepinfer", "kv")


@dataclass(frozen=True)
class StoreOptions:
    path: Path  # the store directory, created if absent, resolved (it may be reached through links)
    capacity_bytes: int | None  # None: unbounded
    high_watermark: float
    low_watermark: float
    ttl: dict[str, float]  # traffic class -> seconds after the last access (0: no expiry)
    default_class: str
    io_threads: int
    gc_interval: float
    touch_interval: float
    negative_cache: float
    checksum_algo: int  # record.CRC32 or record.XXH3
    fsync: bool
    pin_memory: bool
    usrbio: str  # "auto", "on" or "off"
    usrbio_buffer: int

    @classmethod
    def parse(cls, path: str | None = None, capacity_bytes="64GiB", high_watermark: float = 0.9,
              low_watermark: float = 0.7, ttl: dict | None = None, default_class: str = "chatbot",
              usrbio: str = "auto", io_threads: int | str = "auto", gc_interval="60s", checksum: str = "auto",
              fsync: bool = False, pin_memory: bool = False, touch_interval="60s", negative_cache="2s",
              usrbio_buffer="64MiB", **unknown) -> StoreOptions:
        if unknown:
            raise ConfigError(f"[kv_store] unknown key(s) {sorted(unknown)} for backend '3fs'; known keys: "
                              f"{KNOWN_KEYS}")
        capacity = parse_size(capacity_bytes, "capacity_bytes") or None
        for name, v in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"[kv_store] {name} must be a number in [0, 1], got {v!r}")
        if high_watermark < low_watermark:
            raise ConfigError(f"[kv_store] high_watermark ({high_watermark}) must not be below low_watermark "
                              f"({low_watermark})")
        if high_watermark == 0:
            raise ConfigError("[kv_store] high_watermark must be > 0")
        if ttl is not None and not isinstance(ttl, dict):
            raise ConfigError(f"[kv_store] ttl must be a table of traffic class = duration, got {ttl!r}")
        ttls = {c: parse_duration(v, f"ttl.{c}") for c, v in {**DEFAULT_TTL, **(ttl or {})}.items()}
        for c in ttls:
            if not isinstance(c, str) or not c or len(c.encode()) > 16 or not c.isascii():
                raise ConfigError(f"[kv_store] traffic class names are 1-16 ASCII characters, got {c!r}")
        if default_class not in ttls:
            raise ConfigError(f"[kv_store] default_class {default_class!r} has no ttl; classes: {sorted(ttls)}")
        if io_threads == "auto":  # reading from page cache is memory-bound: threads pay off with spare cores
            io_threads = min(8, max(1, (os.cpu_count() or 1) // 4))
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"[kv_store] io_threads must be 'auto' or an int >= 1, got {io_threads!r}")
        if checksum == "auto":
            algo = record.default_checksum()
        elif checksum in ("crc32", "xxh3"):
            algo = record.CRC32 if checksum == "crc32" else record.XXH3
            if algo not in record.available_checksums():
                raise ConfigError("[kv_store] checksum = 'xxh3' needs the 'xxhash' package (pip install xxhash)")
        else:
            raise ConfigError(f"[kv_store] checksum must be 'auto', 'crc32' or 'xxh3', got {checksum!r}")
        if not isinstance(fsync, bool):
            raise ConfigError(f"[kv_store] fsync must be true or false, got {fsync!r}")
        if usrbio not in ("auto", "on", "off"):
            raise ConfigError(f"[kv_store] usrbio must be 'auto', 'on' or 'off', got {usrbio!r}")
        gc_s, touch_s = parse_duration(gc_interval, "gc_interval"), parse_duration(touch_interval, "touch_interval")
        negative_s = parse_duration(negative_cache, "negative_cache")
        buffer = parse_size(usrbio_buffer, "usrbio_buffer")
        return cls(_store_dir(path), capacity, float(high_watermark), float(low_watermark), ttls, default_class,
                   io_threads, gc_s, touch_s, negative_s, algo, fsync, bool(pin_memory) and can_pin_memory(), usrbio,
                   buffer)


def _store_dir(path) -> Path:
    raw = default_path() if path is None else path
    if not isinstance(raw, (str, os.PathLike)) or not str(raw):
        raise ConfigError(f"[kv_store] path must be a directory path, got {path!r}")
    p = Path(raw).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"[kv_store] path {str(p)!r} does not exist and cannot be created: "
                          f"{exc.strerror or exc}") from exc
    if not p.is_dir():
        raise ConfigError(f"[kv_store] path {str(p)!r} is not a directory")
    return p.resolve()  # the store may be reached through links; nothing below it may be one
