"""``p2p`` KV transport: hand-offs over ``torch.distributed`` point-to-point messages.

Engines that hand off to each other form one process group of their own (``rank``, ``world_size``,
a rendezvous at ``master_addr:master_port``; gloo here, NCCL/HCCL would be the same protocol with
device tensors). A sender keeps each payload in host memory and serves it on request from a
background thread; a receiver pulls it (the decode side asks, as NIXL-style connectors do, so the
prefill engine never blocks on a slow receiver):

    receiver -> sender   [key bytes | max_bytes]        tag 1  (recv from any source on the sender)
    sender -> receiver   [length or -1]                 tag 2
    sender -> receiver   payload bytes (if length >= 0) tag 3

The locator a sender returns is its rank. Payloads not fetched within ``ttl_s`` are dropped (the
receiver then recomputes). The bytes are verified by the receiving engine and never unpickled.

    [kv_transfer]
    backend = "p2p"
    rank = 0
    world_size = 2
    master_addr = "127.0.0.1"
    master_port = 29611
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_core.config import ConfigError
from deepinfer_core.features import Feature
from deepinfer_core.kv_transfer import KVTransport, check_key

logger = logging.getLogger("deepinfer.kv_transfer.p2p")
KEY_BYTES = 64
TAG_REQ, TAG_LEN, TAG_DATA = 1, 2, 3
DEFAULTS = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": 29611, "timeout_s": 120.0,
            "ttl_s": 300.0}


class P2PTransport(KVTransport):
    name = "p2p"
    one_endpoint_per_engine = True  # the section's rank is this engine's place in the group

    def __init__(self, section: dict) -> None:
        s = Feature.check_keys("kv_transfer", section, DEFAULTS)
        if not 0 <= s["rank"] < s["world_size"] or s["world_size"] < 2:
            raise ConfigError(f"[kv_transfer] needs 0 <= rank < world_size and world_size >= 2, got rank={s['rank']} "
                              f"world_size={s['world_size']}")
        self.rank, self.world_size, self.ttl_s = s["rank"], s["world_size"], s["ttl_s"]
        timeout = timedelta(seconds=s["timeout_s"])
        store = dist.TCPStore(s["master_addr"], s["master_port"], s["world_size"], s["rank"] == 0, timeout)
        self.pg = dist.ProcessGroupGloo(store, s["rank"], s["world_size"], timeout)
        self._store = store
        self._payloads: dict[str, tuple[float, bytes]] = {}
        self._lock = threading.Lock()  # the payload table
        self._pull = threading.Lock()  # one pull at a time from this rank (the message sequence)
        self._server: threading.Thread | None = None

    # ---- sender -------------------------------------------------------------------------
    def send(self, key: str, payload: bytes) -> str:
        check_key(key)
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (t, _) in self._payloads.items() if now - t > self.ttl_s]:
                del self._payloads[k]
            self._payloads[key] = (now, payload)
            if self._server is None:
                self._server = threading.Thread(target=self._serve, name="kv-p2p-serve", daemon=True)
                self._server.start()
        return str(self.rank)

    def _serve(self) -> None:
        req = torch.zeros(KEY_BYTES + 8, dtype=torch.uint8)
        while True:
            try:
                work = self.pg.recv_anysource([req], TAG_REQ)
                work.wait()
                src = work._source_rank()
                key = bytes(req[:KEY_BYTES].tolist()).rstrip(b"\0").decode("ascii", "replace")
                limit = int(req[KEY_BYTES:].view(torch.int64).item())
                with self._lock:
                    entry = self._payloads.pop(key, None)
                payload = entry[1] if entry is not None and len(entry[1]) <= limit else None
                length = torch.tensor([len(payload) if payload is not None else -1], dtype=torch.int64)
                self.pg.send([length], src, TAG_LEN).wait()
                if payload:
                    self.pg.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], src, TAG_DATA).wait()
            except Exception as exc:  # the group is gone (shutdown) or a peer died: stop serving
                logger.info("p2p KV transport: serving stopped (%s: %s)", type(exc).__name__, exc)
                return

    # ---- receiver -----------------------------------------------------------------------
    def recv(self, key: str, locator: str, max_bytes: int) -> bytes | None:
        check_key(key)
        try:
            src = int(locator)
        except ValueError:
            raise ValueError(f"p2p locator must be a rank, got {locator!r}") from None
        if not 0 <= src < self.world_size or src == self.rank:
            raise ValueError(f"p2p locator {src} is not another rank of the group of {self.world_size}")
        req = torch.zeros(KEY_BYTES + 8, dtype=torch.uint8)
        kb = key.encode("ascii")
        req[: len(kb)] = torch.tensor(list(kb), dtype=torch.uint8)
        req[KEY_BYTES:] = torch.tensor([max_bytes], dtype=torch.int64).view(torch.uint8)
        with self._pull:
            self.pg.send([req], src, TAG_REQ).wait()
            length = torch.zeros(1, dtype=torch.int64)
            self.pg.recv([length], src, TAG_LEN).wait()
            n = int(length.item())
            if n < 0:
                return None
            buf = torch.empty(n, dtype=torch.uint8)
            if n:
                self.pg.recv([buf], src, TAG_DATA).wait()
        return buf.numpy().tobytes()

    def close(self) -> None:
        with self._lock:
            self._payloads.clear()
