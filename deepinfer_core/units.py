"""Sizes and durations as config values: one parser each, shared by the core and the plugins.

``parse_size("4GiB")`` (1024-based: K/M/G/T with or without ``iB``), ``parse_size("500MB")`` (1000-based),
``parse_duration("72h")`` (s, m, h, d, w). Plain non-negative numbers pass through. Anything else raises
:class:`~deepinfer_core.config.ConfigError` naming the table and field.
"""

from __future__ import annotations

import math
import re

from deepinfer_core.config import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(value, what: str, table: str = "kv_store") -> int:
    """Bytes from an int >= 0 or a string like "512MiB", "64GB", "1.5GiB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"[{table}] {what} must be >= 0, got {value}")
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or (m.group(3) and not m.group(2)):  # "5iB": binary without a prefix
        raise ConfigError(f"[{table}] {what}: cannot parse the size {value!r}; expected bytes (int >= 0) or "
                          "a size like '512MiB', '64GiB', '500MB'")
    number, prefix, binary, b = m.groups()
    power = " kmgt".index(prefix.lower() or " ")
    return int(float(number) * (1000 if b and not binary else 1024) ** power)


def parse_duration(value, what: str, table: str = "kv_store") -> float:
    """Seconds from 3600, 3600.0, "3600s", "30m", "72h", "3d" or "1w"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    else:
        raise ConfigError(f"[{table}] {what}: cannot parse the duration {value!r}; "
                          "use seconds or a string like '3600s', '30m', '72h', '3d', '1w'")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"[{table}] {what} must be a finite duration >= 0, got {value!r}")
    return seconds
