"""Tiered KV cache: device blocks -> host memory -> a persistent store plugin (3FS, ...).

Registered by the engine when ``[kv_store]`` is configured::

    [kv_store]
    backend = "3fs"                  # a name in the deepinfer.kv_stores entry-point group
    path = "/mnt/3fs/deepinfer-kv"    # ...and the rest of the table goes to that store
    host_capacity_bytes = "4GiB"      # the host-memory tier (the ``host`` store plugin)
    offload_on_finish = true          # also write a request's blocks when it ends

Data moves down when full device blocks are about to be reused (``blocks_evicted``: copied to host
memory, and queued for the persistent store) and, with ``offload_on_finish``, when a request ends.
Persistent writes run on a writer thread; a full queue drops blocks (counted), never blocks a step.

Data moves up in two stages. ``request_ready`` looks the request's prefix hash chain up in the
tiers (metadata only) and, when the persistent store holds blocks beyond what device and host
memory hold, starts fetching them into host memory on a background thread; the request waits
(``request_ready`` returns False) until they are resident. ``match_external_prefix`` then reports
the leading blocks host memory holds, and ``load_external_blocks`` copies them into the request's
device blocks, layer by layer, as non-blocking copies on a side stream where the platform has one;
the next step's layer i waits only for layer i's copies (``ModelRunner.swap_in_events``).
``RequestMetrics.num_cached_tokens_by_tier`` says which tier each reused token came from.

Every failure below the device tier (a missing, corrupt or unreadable record, a full or read-only
store) is a miss: the request recomputes those tokens.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import inspect
import logging
import math
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from deepinfer_core import plugins
from deepinfer_core.config import ConfigError, check_number
from deepinfer_core.engine.hashing import chain
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv_cache_spec import cache_planes
from deepinfer_core.kv_store import KVLayout, KVStore, KVStoreStats
from deepinfer_core.units import parse_size

logger = logging.getLogger("deepinfer.kv_tiers")

STATE_KEY = "kv_tiers"
#: Keys of the [kv_store] table read by the tiers; every other key goes to the backend store.
TIER_KEYS = {
    "backend": None, "host_capacity_bytes": "2GiB", "offload_on_finish": False, "max_pending_writes": 4096,
    "fetch_threads": 2, "flush_timeout": 30.0, "fetch_buffer_bytes": "64MiB",
}


class _BoundedSet:
    """A set that forgets its oldest members beyond ``limit`` (thread-safe enough under the GIL)."""

    def __init__(self, limit: int) -> None:
        self.limit, self._d = limit, OrderedDict()

    def add(self, key) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)

    def __contains__(self, key) -> bool:
        return key in self._d


@dataclass
class _RequestState:
    planned: bool = False  # the fetch for this request was decided (started or not needed)
    jobs: list = field(default_factory=list)  # fetch futures it waits for
    held: dict = field(default_factory=dict)  # key -> host tensor fetched for it (kept until loaded)
    pending: tuple | None = None  # (keys, tensors, tiers) matched, awaiting load_external_blocks


@dataclass
class _Counters:
    fetch_jobs: int = 0
    fetch_blocks: int = 0
    fetch_bytes: int = 0
    fetch_seconds: float = 0.0  # wall time of fetch jobs (store reads plus host-tier inserts)
    store_read_seconds: float = 0.0  # wall time inside the store's reads
    offload_host: int = 0
    offload_queued: int = 0
    offload_written: int = 0
    offload_failed: int = 0
    offload_dropped: int = 0
    loaded_blocks: int = 0


class TieredKVCache:
    """The host-memory and persistent tiers below the engine's device cache (a pluggy plugin)."""

    core_api_version = "1.0"

    def __init__(self, engine, section: dict) -> None:
        cfg = {**TIER_KEYS, **section}
        backend = cfg.pop("backend")
        if not isinstance(backend, str) or not backend:
            names = ", ".join(plugins.installed_names("deepinfer.kv_stores")) or "none"
            raise ConfigError(f"[kv_store] needs backend = '<store name>' (installed: {names}), "
                              f"got {backend!r}")
        host_capacity = parse_size(cfg.pop("host_capacity_bytes"), "host_capacity_bytes")
        self.offload_on_finish = cfg.pop("offload_on_finish")
        if not isinstance(self.offload_on_finish, bool):
            raise ConfigError("[kv_store] offload_on_finish must be true or false, "
                              f"got {self.offload_on_finish!r}")
        max_pending = cfg.pop("max_pending_writes")
        fetch_threads = cfg.pop("fetch_threads")
        for name, v in (("max_pending_writes", max_pending), ("fetch_threads", fetch_threads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"[kv_store] {name} must be an int >= 1, got {v!r}")
        fetch_buffer = parse_size(cfg.pop("fetch_buffer_bytes"), "fetch_buffer_bytes")
        self.flush_timeout = cfg.pop("flush_timeout")
        check_number("[kv_store] flush_timeout (seconds)", self.flush_timeout, 0)

        self.block_size = engine.block_size
        self.layout = record_layout(engine)
        self.platform = engine.platform
        self.pinned = bool(engine.platform.supports_pinned_memory())
        host_cls = plugins.load("deepinfer.kv_stores", "host", what="KV store")
        self.host: KVStore = host_cls(capacity_bytes=host_capacity, pin_memory=self.pinned,
                                      block_shape=self.layout.block_shape, dtype=self.layout.dtype)
        store_cls = plugins.load("deepinfer.kv_stores", backend, what="KV store")
        kwargs = dict(cfg, layout=self.layout)
        if self.pinned and "pin_memory" in inspect.signature(store_cls).parameters:
            kwargs.setdefault("pin_memory", True)
        try:
            self.store: KVStore = store_cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"[kv_store] backend {backend!r} rejected its settings: {exc}") from exc
        self.backend = backend
        # Fetches read straight into the host tier's pooled buffers (no staging copy). Part of the
        # pool is allocated and faulted in now: filling fresh pages during a fetch costs more than
        # the read itself.
        block_bytes = math.prod(self.layout.block_shape) * self.layout.dtype.itemsize
        self._chunk = max(1, min(256, fetch_buffer // fetch_threads // block_bytes))
        self.host.prefault(min(fetch_buffer, block_bytes * min(engine.blocks.num_blocks, 1 << 14)))

        self._lock = threading.Lock()
        self._inflight: dict[int, Future] = {}
        self._queued: set[int] = set()
        self._known = _BoundedSet(1 << 18)  # keys known to be in the persistent store
        self._class_of: OrderedDict[int, str | None] = OrderedDict()
        self._class_limit = max(1 << 16, 4 * engine.blocks.num_blocks)
        self.counters = _Counters()
        self._tier_tokens = {"device": 0, "host": 0, "persistent": 0}
        self._rates: dict[str, tuple[float, int, int]] = {}
        self._stream = engine.platform.stream(engine.device) if self.pinned else None
        self._loading: list[tuple[object, list]] = []  # (event, host tensors) of copies maybe in flight
        self._fetch_pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="kv-fetch")
        self._writes: queue.Queue = queue.Queue(maxsize=max_pending)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._writer.start()
        self._closed = False
        self._atexit = functools.partial(_flush_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        logger.info("KV tiers: host %.1f MiB%s, persistent %r; block %s %s", host_capacity / 2**20,
                    " pinned" if self.pinned else "", backend, self.layout.block_shape, self.layout.dtype)

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _eligible(engine, request) -> bool:
        return engine.cfg.enable_prefix_caching and request.params.prompt_logprobs is None

    @staticmethod
    def _state(request) -> _RequestState:
        st = request.feature_state.get(STATE_KEY)
        if st is None:
            st = request.feature_state[STATE_KEY] = _RequestState()
        return st

    def _valid(self, block) -> bool:
        return (isinstance(block, torch.Tensor) and tuple(block.shape) == self.layout.block_shape
                and block.dtype == self.layout.dtype)

    def _note_class(self, hashes: list[int], cls: str | None) -> None:
        """Remember the traffic class of blocks (the longest-lived class wins) for later offloads."""
        for h in hashes:
            prev = self._class_of.get(h, False)
            if prev is False or (prev != cls and _longer(self.store.ttl_seconds(cls), self.store.ttl_seconds(prev))):
                self._class_of[h] = cls
            self._class_of.move_to_end(h)
        while len(self._class_of) > self._class_limit:
            self._class_of.popitem(last=False)

    def _to_host(self, block: torch.Tensor) -> torch.Tensor:
        return block if block.device.type == "cpu" else block.to("cpu")

    # ---- fetching (persistent -> host) --------------------------------------------------
    @hookimpl
    def request_ready(self, engine, request):
        if request.block_table or request.num_computed_tokens or not self._eligible(engine, request):
            return None
        if not engine.blocks.external_hits:  # a window group must hold the hit: lower tiers cannot serve it
            return None
        st = self._state(request)
        if st.jobs:
            if not all(f.done() for f in st.jobs):
                if engine.load_stats()["running"] == 0:  # the step loop is idle: let the fetch run
                    wait_futures(st.jobs, timeout=0.005)
                if not all(f.done() for f in st.jobs):
                    return False
            for f in st.jobs:
                try:
                    st.held.update(f.result())
                except Exception as exc:  # a failed fetch is a miss
                    logger.warning("KV fetch failed: %s", exc)
            st.jobs = []
            return None
        if st.planned:
            return None
        st.planned = True
        hashes = engine.blocks.prefix_hashes(request)
        self._note_class(hashes, request.params.traffic_class)
        n = 0
        for h in hashes:  # resident in device or host memory already
            if not (engine.blocks.contains(h) or self.host.contains(h)):
                break
            n += 1
        with self._lock:
            inflight = dict(self._inflight)
        want = []
        for h in hashes[n:]:
            if h not in inflight and not self.store.contains(h):
                break
            want.append(h)
        if not want:
            return None
        new = [h for h in want if h not in inflight]
        jobs = {id(f): f for f in (inflight[h] for h in want if h in inflight)}
        if new:
            fut = self._start_fetch(new, request.params.traffic_class)
            jobs[id(fut)] = fut
        st.jobs = list(jobs.values())
        return False

    def _start_fetch(self, keys: list[int], cls: str | None) -> Future:
        with self._lock:  # registered before the job can finish and unregister its keys
            fut = self._fetch_pool.submit(self._fetch, keys, cls)
            for k in keys:
                self._inflight[k] = fut
            self.counters.fetch_jobs += 1
        return fut

    def _fetch(self, keys: list[int], cls: str | None) -> dict[int, torch.Tensor]:
        t0 = time.perf_counter()
        got: dict[int, torch.Tensor] = {}
        c = self.counters
        try:
            for start in range(0, len(keys), self._chunk):
                if not self._fetch_part(keys[start : start + self._chunk], cls, got):
                    break  # the chain stops at the first block the store (or host memory) could not supply
        except Exception as exc:  # a store failure is a miss, never a crash
            logger.warning("KV fetch of %d blocks from %r failed: %s", len(keys), self.backend, exc)
        finally:
            with self._lock:
                fut = self._inflight.get(keys[0])
                for k in keys:
                    if fut is not None and self._inflight.get(k) is fut:
                        del self._inflight[k]
                c.fetch_blocks += len(got)
                c.fetch_bytes += sum(b.numel() * b.element_size() for b in got.values())
                c.fetch_seconds += time.perf_counter() - t0
        return got

    def _fetch_part(self, part: list[int], cls: str | None, got: dict) -> bool:
        """Read ``part`` into host memory (into the host tier's own buffers where it has a pool);
        False when the chain broke in it."""
        bufs: list[torch.Tensor] = []
        while len(bufs) < len(part) and (buf := self.host.allocate()) is not None:
            bufs.append(buf)  # where the host tier has no room left, the store allocates
        t1 = time.perf_counter()
        try:
            out = bufs + [None] * (len(part) - len(bufs)) if bufs else None
            blocks = self.store.get_many(part, ttl_class=cls, out=out)
            self.counters.store_read_seconds += time.perf_counter() - t1
            for i, (k, block) in enumerate(zip(part, blocks)):
                if not self._valid(block):
                    return False
                if i < len(bufs) and block is bufs[i]:
                    self.host.adopt(k, block)  # the buffer now belongs to the host tier
                    bufs[i] = None
                else:
                    self.host.put(k, block)
                self._known.add(k)
                got[k] = block
            return True
        finally:
            for buf in bufs:
                if buf is not None:
                    self.host.recycle(buf)

    # ---- admission (host -> device) -----------------------------------------------------
    @hookimpl
    def match_external_prefix(self, engine, request, block_hashes, num_device_blocks):
        st = self._state(request)
        st.pending = None
        keys, tensors, tiers = [], [], []
        for h in block_hashes[num_device_blocks:]:
            block, tier = st.held.get(h), "persistent"
            if block is None:
                block, tier = self.host.get(h), "host"
            if not self._valid(block):
                break
            keys.append(h)
            tensors.append(block)
            tiers.append(tier)
        if not keys:
            return None
        st.pending = (keys, tensors, tiers)
        return num_device_blocks + len(keys)

    @hookimpl
    def load_external_blocks(self, engine, request, block_ids, block_hashes):
        st = self._state(request)
        keys, tensors, tiers = st.pending or ([], [], [])
        st.pending = None
        if list(block_hashes) != keys[: len(block_hashes)] or len(block_ids) != len(block_hashes):
            raise RuntimeError("kv_tiers: load_external_blocks does not match the prefix it matched")
        events = []
        if self._stream is not None:
            # the copies start after the work already queued: a step still in flight (async
            # scheduling) may write the KV of a finished request into blocks reused here
            queued = self.platform.event()
            queued.record()
        with self.platform.stream_context(self._stream):
            if self._stream is not None:
                queued.wait()
            for layer, parts in _copies_by_layer(engine.blocks):
                for cache, part in parts:
                    for b, block in zip(block_ids, tensors):
                        cache[b].copy_(block[part].view(cache[b].shape), non_blocking=True)
                if self._stream is not None:  # layer by layer: the forward's layer i waits for these only
                    while len(events) < layer:  # layers the record does not carry have nothing to wait for
                        events.append(None)
                    events.append(self.platform.event())
                    events[-1].record(self._stream)
        if events:
            last = events[-1]
            events = [e if e is not None else last for e in events]
            if all(hasattr(e, "wait") for e in events):
                engine.runner.swap_in_events(events)
            else:
                events[-1].synchronize()
            # the host buffers stay referenced until the copies are done, so the host tier cannot
            # recycle them under an in-flight copy
            self._loading = [(e, t) for e, t in self._loading if not e.query()]
            self._loading.append((events[-1], tensors))
        by_tier = request.metrics.num_cached_tokens_by_tier
        for tier in tiers[: len(block_ids)]:
            by_tier[tier] = by_tier.get(tier, 0) + self.block_size
            self._tier_tokens[tier] += self.block_size
        self.counters.loaded_blocks += len(block_ids)
        st.held.clear()

    # ---- offloading (device -> host -> persistent) --------------------------------------
    @hookimpl
    def blocks_evicted(self, engine, block_hashes, block_ids):
        for h, b in zip(block_hashes, block_ids):
            to_host = not self.host.contains(h)
            to_store = h not in self._known and h not in self._queued
            if not (to_host or to_store):
                continue
            block = self._to_host(engine.blocks.read_block(b))
            if to_host and self.host.put(h, block):
                self.counters.offload_host += 1
            if to_store:
                self._enqueue(h, block)

    @hookimpl
    def request_finished(self, engine, request):
        request.feature_state.pop(STATE_KEY, None)
        if not self._eligible(engine, request):
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if full == 0:
            return
        hashes = chain(request.token_ids, self.block_size, full)
        self._note_class(hashes, request.params.traffic_class)
        if not self.offload_on_finish:
            return
        for h in hashes:
            if h in self._known or h in self._queued:
                continue
            block = engine.blocks.get(h)  # a copy of the device block, if it is still there
            if block is None:
                break
            self._enqueue(h, self._to_host(block))

    def _enqueue(self, key: int, block: torch.Tensor) -> None:
        with self._lock:
            if key in self._queued:
                return
            self._queued.add(key)
        try:
            self._writes.put_nowait((key, block, self._class_of.get(key)))
            self.counters.offload_queued += 1
        except queue.Full:
            with self._lock:
                self._queued.discard(key)
            self.counters.offload_dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                key, block, cls = item
                if self.store.contains(key) or self.store.put(key, block, ttl_class=cls):
                    self._known.add(key)
                    self.counters.offload_written += 1
                else:
                    self.counters.offload_failed += 1
            except Exception as exc:  # never let a store failure kill the writer
                self.counters.offload_failed += 1
                logger.warning("KV offload to %r failed: %s", self.backend, exc)
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.discard(item[0])
                self._writes.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued persistent writes are done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._writes.all_tasks_done:
            while self._writes.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._writes.all_tasks_done.wait(left)
        return True

    # ---- metrics and shutdown -----------------------------------------------------------
    def _store_metrics(self, name: str, s: KVStoreStats) -> dict:
        now = time.monotonic()
        t, r, w = self._rates.get(name, (now, s.read_bytes, s.write_bytes))
        dt = now - t
        self._rates[name] = (now, s.read_bytes, s.write_bytes)
        lookups = s.hits + s.misses
        out = {
            "hits": s.hits, "misses": s.misses, "hit_rate": s.hits / lookups if lookups else 0.0,
            "puts": s.puts, "evictions": s.evictions, "errors": s.errors, "read_bytes": s.read_bytes,
            "write_bytes": s.write_bytes,
            "read_bytes_per_s": (s.read_bytes - r) / dt if dt > 0 else 0.0,
            "write_bytes_per_s": (s.write_bytes - w) / dt if dt > 0 else 0.0,
        }
        out.update(s.extra)
        out.setdefault("gc_runs", 0)
        return out

    @hookimpl
    def collect_metrics(self, engine):
        c = self.counters
        return {"kv_tiers": {
            "host": self._store_metrics("host", self.host.stats()),
            "persistent": {"backend": self.backend, **self._store_metrics("persistent", self.store.stats())},
            "fetch": {"jobs": c.fetch_jobs, "blocks": c.fetch_blocks, "bytes": c.fetch_bytes,
                      "seconds": c.fetch_seconds, "store_read_seconds": c.store_read_seconds,
                      "in_flight": len(self._inflight),
                      "bytes_per_s": c.fetch_bytes / c.fetch_seconds if c.fetch_seconds else 0.0,
                      "store_read_bytes_per_s": (c.fetch_bytes / c.store_read_seconds
                                                 if c.store_read_seconds else 0.0)},
            "offload": {"to_host": c.offload_host, "queued": c.offload_queued, "written": c.offload_written,
                        "failed": c.offload_failed, "dropped": c.offload_dropped,
                        "pending": self._writes.unfinished_tasks},
            "loaded_blocks": c.loaded_blocks,
            "cached_tokens": dict(self._tier_tokens),
        }}

    @hookimpl
    def engine_shutdown(self, engine):
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if not self.flush(self.flush_timeout):
            logger.warning("KV tiers: %d persistent writes still pending at shutdown were dropped",
                           self._writes.unfinished_tasks)
            while True:  # make room for the stop marker
                try:
                    self._writes.get_nowait()
                except queue.Empty:
                    break
                self._writes.task_done()
        self._writes.put(None)
        self._writer.join(timeout=5)
        self._fetch_pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        self.host.close()


def record_layout(engine) -> KVLayout:
    """What a stored block holds: the rows of the record pool's groups (``KVCacheManager``). A
    single group keeps the ``[layers, entries, entry_dim]`` shape; several are one flat record whose
    fingerprint also covers the group layout, so a store never mixes layouts."""
    blocks = engine.blocks
    groups = blocks.record_groups
    if not groups:
        raise ConfigError("[kv_store] the model declares no full-history prefix-cacheable cache group to store")
    dtypes = {t.dtype for _, t, _ in blocks.record_parts()}
    if len(dtypes) != 1:
        raise ConfigError(f"[kv_store] the stored cache groups {[g.name for g in groups]} mix dtypes {dtypes}")
    dtype = dtypes.pop()
    if len(groups) == 1:
        g = groups[0]
        return KVLayout.for_model(engine.fingerprint, len(g.layers), g.entries_per_block(engine.block_size),
                                  g.entry_dim, dtype, g.encoding)
    desc = ";".join(f"{g.name}:{len(g.layers)}x{g.entries_per_block(engine.block_size)}x{g.signature}"
                    + _planes_tag(engine.kv_caches[g.name][0]) for g in groups)
    fingerprint = hashlib.sha256(f"{engine.fingerprint}|{desc}|{dtype}".encode()).hexdigest()[:16]
    numel = sum(t[0].numel() for _, t, _ in blocks.record_parts())
    return KVLayout(fingerprint, sum(len(g.layers) for g in groups), engine.block_size, 0, dtype, shape=(numel,))


def _planes_tag(cache) -> str:
    """How a flat multi-group record lays out a split entry (its planes' widths); "" for one plane."""
    planes = cache_planes(cache)
    return "" if len(planes) == 1 else "/" + "+".join(str(t.shape[-1]) for t in planes)


def _copies_by_layer(blocks) -> list[tuple[int, list[tuple[torch.Tensor, object]]]]:
    """(model layer, [(cache tensor or plane, index of its rows in a record)]) in layer order."""
    by_layer: dict[int, list] = {}
    for layer, t, index in blocks.record_parts():
        by_layer.setdefault(layer, []).append((t, index))
    return sorted(by_layer.items())


def _longer(a: float | None, b: float | None) -> bool:
    """Whether TTL ``a`` outlives ``b`` (0 means no expiry; None: the store has no classes)."""
    if a is None or b is None:
        return False
    return a != b and (a == 0 or (b != 0 and a > b))


def _flush_at_exit(ref) -> None:
    tiers = ref()
    if tiers is not None and not tiers._closed:
        tiers.close()
