"""The KV hand-off transport interface (``deepinfer.kv_transports`` entry points).

A transport moves one opaque, self-verifying payload (``engine/handoff_format.py``) from the engine
that computed a request's KV (a prefill engine, or a decode engine draining) to the engine that
continues it. The sender publishes under a key and gets back a *locator*; the receiver is given
(key, locator) by whoever routes the request (``SamplingParams.kv_transfer_params``) and takes the
payload. Transports never interpret the bytes: the receiving engine verifies them (hashes, the
model/cache-layout fingerprint, the request's tokens) and recomputes on any mismatch, so a lost,
stale or corrupt payload can cost time but never a wrong token.

A transport is configured by the ``[kv_transfer]`` table; ``backend`` names the entry point, every
other key is the transport's own (it rejects unknown keys with a ``ConfigError``).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

from deepinfer_core import plugins
from deepinfer_core.config import ConfigError

GROUP = "deepinfer.kv_transports"
_KEY = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{16,32}$")


def check_key(key: object) -> str:
    """``key`` if it is a hand-off key (hex chain hash, '-', hex nonce), else ValueError: keys name
    files and shared-memory segments, so nothing else may reach a transport."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"kv_transfer_params['key'] must be a hand-off key (hex '-' hex), got {key!r}")
    return key


class KVTransport(ABC):
    """Moves hand-off payloads between engines. Thread-safe; one instance per engine."""

    name: str = ""
    core_api_version: str = "1.0"
    #: True when the section names one endpoint of its own (e.g. a rank in a group of engines), which
    #: the dp/ep ranks of one engine cannot share: such a transport serves single-rank engines only.
    one_endpoint_per_engine: bool = False

    def __init__(self, section: dict) -> None:
        if section:
            raise ConfigError(f"[kv_transfer] backend {self.name!r} takes no settings, got keys {sorted(section)}")

    @abstractmethod
    def send(self, key: str, payload: bytes) -> str:
        """Publish ``payload`` under ``key``; returns the locator a receiver passes to :meth:`recv`."""

    @abstractmethod
    def recv(self, key: str, locator: str, max_bytes: int) -> bytes | None:
        """Take the payload of ``key`` (consumed: a second recv finds nothing). None when it is not
        there or larger than ``max_bytes``; raises only for transport faults (the caller recomputes)."""

    def close(self) -> None:
        """Release the transport's resources (unconsumed payloads of this sender may be dropped)."""


def transport_class(section: dict | None) -> type:
    """The class of the transport a ``[kv_transfer]`` table names (``backend``), not yet built."""
    backend = (section or {}).get("backend")
    if not isinstance(backend, str):
        raise ConfigError(f"[kv_transfer] needs backend = one of {plugins.installed_names(GROUP)}, got {backend!r}")
    if backend not in plugins.installed_names(GROUP):
        raise ConfigError(f"[kv_transfer] backend {backend!r} is not installed; installed: "
                          f"{', '.join(plugins.installed_names(GROUP)) or 'none'}")
    return plugins.load(GROUP, backend, what="KV transport")


def load_transport(section: dict | None) -> KVTransport:
    """The transport a ``[kv_transfer]`` table names (``backend``), built with its other keys."""
    cls = transport_class(section)
    transport = cls({k: v for k, v in section.items() if k != "backend"})
    if not isinstance(transport, KVTransport):
        raise ConfigError(f"KV transport {section['backend']!r} is not a deepinfer_core.kv_transfer.KVTransport")
    return transport


def check_parallel_transport(section: dict | None, dp: int, ep: int) -> None:
    """ConfigError when an engine of ``dp``/``ep`` ranks cannot use the transport (each rank sends
    and receives its own requests' hand-offs, so they must share the transport's configuration)."""
    cls = transport_class(section)
    if getattr(cls, "one_endpoint_per_engine", False):
        raise ConfigError(f"[kv_transfer] backend {section['backend']!r} names one endpoint per engine, which the "
                          f"dp={dp}, ep={ep} ranks of this engine cannot share; use a transport every rank can "
                          f"use ({', '.join(n for n in plugins.installed_names(GROUP) if n != section['backend'])}) "
                          "or a single-rank engine")
