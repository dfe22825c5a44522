"""The ``3fs`` persistent KV store: records, index, retention, faults, concurrency, USRBIO path."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import types
import zlib
from pathlib import Path

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.config import ConfigError
from deepinfer_core.kv_store import KVLayout
from deepinfer_core.testing import check_kv_store
from deepinfer_core.units import parse_duration, parse_size
from plugins.kv_3fs import record
from plugins.kv_3fs.store import ThreeFSStore

LAYOUT = KVLayout("feedfacecafebeef", 2, 4, 24, torch.float32)
OTHER = KVLayout("0123456789abcdef", 2, 4, 24, torch.float32)
BLOCK_BYTES = 2 * 4 * 24 * 4
REPO = Path(__file__).resolve().parent.parent


def block(seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    return torch.randn(*layout.block_shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


def store_at(path, **kw) -> ThreeFSStore:
    kw.setdefault("layout", LAYOUT)
    return ThreeFSStore(path=str(path), **kw)


def record_path(store: ThreeFSStore, key: int) -> Path:
    return Path(store._path(key))


# ---- interface ---------------------------------------------------------------------------------

def test_entry_point_and_conformance(tmp_path):
    assert plugins.load("deepinfer.kv_stores", "3fs", what="KV store") is ThreeFSStore
    dirs = iter(range(100))
    done = check_kv_store(lambda: ThreeFSStore(path=str(tmp_path / f"s{next(dirs)}")),
                          lambda n: ThreeFSStore(path=str(tmp_path / f"c{next(dirs)}"), capacity_bytes=n))
    assert done == ["basics", "match_prefix", "stats", "threads", "capacity"]


def test_record_is_self_describing_and_never_pickled(tmp_path):
    s = store_at(tmp_path, ttl={"agent": "72h"})
    b = block(1)
    assert s.put(0x1234, b, ttl_class="agent")
    raw = record_path(s, 0x1234).read_bytes()
    assert raw[:8] == record.MAGIC and len(raw) == record.HEADER_SIZE + BLOCK_BYTES
    hdr = record.unpack_header(raw[: record.HEADER_SIZE])
    assert (hdr.key, hdr.fingerprint) == (0x1234, LAYOUT.model_fingerprint)
    assert (hdr.dtype, hdr.shape) == (torch.float32, LAYOUT.block_shape)
    assert (hdr.ttl_class, hdr.ttl_seconds, hdr.payload_len) == ("agent", 72 * 3600, BLOCK_BYTES)
    assert abs(hdr.created - time.time()) < 60
    assert raw[record.HEADER_SIZE:] == b.numpy().tobytes()  # raw tensor bytes
    assert record.checksum(hdr.checksum_algo, raw[record.HEADER_SIZE:]) == hdr.checksum
    for src in (REPO / "plugins" / "kv_3fs").glob("*.py"):
        text = src.read_text()
        for banned in ("import pickle", "torch.save", "torch.load", "allow_pickle=True"):
            assert banned not in text, f"{src.name} uses {banned}"
    # sharded by hash prefix, under the format version and the model fingerprint
    assert record_path(s, 0x1234).parent.name == f"{0x1234:016x}"[:2]
    assert record_path(s, 0x1234).parent.parent.name == LAYOUT.model_fingerprint
    s.close()


def test_get_many_and_bf16(tmp_path):
    lay = KVLayout("ab", 3, 8, 40, torch.bfloat16)
    s = ThreeFSStore(path=str(tmp_path), layout=lay, io_threads=3)
    keys = list(range(100, 120))
    for k in keys:
        assert s.put(k, block(k, lay))
    got = s.get_many(keys + [999])
    assert got[-1] is None
    assert all(torch.equal(g, block(k, lay)) for g, k in zip(got, keys))
    assert not s.put(5, block(5))  # a block of another layout is refused
    s.close()


def test_get_many_reads_into_the_callers_buffers(tmp_path):
    """``out`` as a 4-D tensor or a list of block tensors: blocks land in that memory (no copy);
    a buffer of the wrong shape is replaced by fresh memory, a missing key leaves its buffer alone."""
    s = ThreeFSStore(path=str(tmp_path), layout=LAYOUT, io_threads=2)
    keys = [7, 8, 9]
    for k in keys:
        assert s.put(k, block(k))
    slab = torch.full((4, *LAYOUT.block_shape), -1.0)
    got = s.get_many(keys, out=slab)
    assert all(g.data_ptr() == slab[i].data_ptr() and torch.equal(g, block(k)) for i, (g, k) in
               enumerate(zip(got, keys)))
    bufs = [torch.full(LAYOUT.block_shape, -1.0), torch.zeros(3), torch.full(LAYOUT.block_shape, -1.0)]
    got = s.get_many([8, 9, 404], out=bufs)
    assert got[0] is bufs[0] and torch.equal(got[0], block(8))
    assert got[1] is not bufs[1] and torch.equal(got[1], block(9))
    assert got[2] is None and bool((bufs[2] == -1).all())
    with pytest.raises(ValueError, match="2 output tensors for 3 keys"):
        s.get_many(keys, out=bufs[:2])
    s.close()


# ---- faults --------------------------------------------------------------------------------------

def _rewrite_header(path: Path, **changes) -> None:
    raw = bytearray(path.read_bytes())
    fields = list(record._HEADER.unpack(bytes(raw[: record.HEADER_SIZE])))
    names = ["magic", "version", "header_size", "algo", "key", "fingerprint"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    head = record._HEADER.pack(*fields)
    raw[: record.HEADER_SIZE] = head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]) & 0xFFFFFFFF)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty", "wrong_model",
                                    "wrong_version", "wrong_key"])
def test_damaged_record_is_a_counted_miss(tmp_path, damage):
    s = store_at(tmp_path / "a")
    s.put(7, block(7))
    path = record_path(s, 7)
    if damage == "flip_payload":
        raw = bytearray(path.read_bytes())
        raw[record.HEADER_SIZE + 100] ^= 0x01
        path.write_bytes(bytes(raw))
    elif damage == "flip_header":
        raw = bytearray(path.read_bytes())
        raw[30] ^= 0x40
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size - 10)
    elif damage == "empty":
        os.truncate(path, 0)
    elif damage == "wrong_model":  # a record another model's store wrote, under this key's name
        other = store_at(tmp_path / "b", layout=OTHER)
        other.put(7, block(7, OTHER))
        path.write_bytes(record_path(other, 7).read_bytes())
    elif damage == "wrong_version":
        _rewrite_header(path, version=record.FORMAT_VERSION + 1)
    elif damage == "wrong_key":
        path.write_bytes(b"")
        s2 = store_at(tmp_path / "c")
        s2.put(8, block(8))
        path.write_bytes(record_path(s2, 8).read_bytes())
    assert s.get(7) is None  # a miss, not an exception, not wrong data
    st = s.stats()
    assert st.misses == 1 and sum(st.extra["corrupt"].values()) == 1, st.extra["corrupt"]
    assert not path.exists() and not s.contains(7)  # removed, so it is written afresh later
    assert s.put(7, block(7)) and torch.equal(s.get(7), block(7))
    s.close()


def test_damaged_records_found_at_startup_are_removed(tmp_path):
    s = store_at(tmp_path)
    for k in range(1, 5):
        s.put(k, block(k))
    s.close()
    os.unlink(tmp_path / "v1" / LAYOUT.model_fingerprint / "index.v1")
    _rewrite_header(record_path(s, 1), version=99)
    os.truncate(record_path(s, 2), 3)
    s2 = store_at(tmp_path)
    assert [s2.contains(k) for k in range(1, 5)] == [False, False, True, True]
    assert s2.stats().extra["corrupt"] == {"wrong_version": 1, "truncated": 1}
    s2.close()


def test_unwritable_store_fails_quietly(tmp_path, monkeypatch):
    s = store_at(tmp_path)
    assert s.put(1, block(1))
    # a directory where the shard should be: creating the record fails with a real OSError
    key = 0xAB00000000000001
    shard_parent = Path(s.root)
    (shard_parent / "ab").write_text("not a directory")
    assert s.put(key, block(2)) is False
    assert not s.contains(key) and s.get(key) is None
    st = s.stats()
    assert st.extra["write_failures"] and st.errors >= 1
    assert torch.equal(s.get(1), block(1))  # reading goes on
    assert not list(Path(s.root).rglob("*.tmp"))
    s.close()


# ---- retention --------------------------------------------------------------------------------

def test_parsers_and_bad_config(tmp_path):
    assert parse_duration("72h", "x") == parse_duration("3d", "x") == 259200
    assert parse_duration("3600s", "x") == parse_duration(3600, "x") == 3600
    assert parse_size("2GiB", "x") == 2 << 30 and parse_size("500MB", "x") == 500_000_000
    bad = [
        (dict(high_watermark=0.5, low_watermark=0.8), "high_watermark"),
        (dict(ttl={"agent": "three days"}), "ttl.agent"),
        (dict(ttl={"agent": "-1h"}), "ttl.agent"),
        (dict(usrbio="sometimes"), "usrbio"),
        (dict(usrbio="on"), "hf3fs_py_usrbio"),
        (dict(default_class="batch"), "default_class"),
        (dict(capacity_bytes="lots"), "capacity_bytes"),
        (dict(io_threads=0), "io_threads"),
        (dict(checksum="md5"), "checksum"),
        (dict(colour="blue"), "colour"),
    ]
    for kw, needle in bad:
        with pytest.raises(ConfigError, match=needle):
            store_at(tmp_path / "ok", **kw)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=str(blocker / "kv")):
        store_at(blocker / "kv")


@pytest.mark.parametrize("kw, needle", [
    (dict(high_watermark=float("nan")), "high_watermark"),
    (dict(low_watermark=float("inf")), "low_watermark"),
    (dict(high_watermark=True), "high_watermark"),
    (dict(low_watermark=-0.1), "low_watermark"),
    (dict(high_watermark=0), "high_watermark"),
    (dict(io_threads=2.5), "io_threads"),
    (dict(io_threads=True), "io_threads"),
    (dict(fsync="yes"), "fsync"),
    (dict(negative_cache="-1s"), "negative_cache"),
    (dict(gc_interval=float("nan")), "gc_interval"),
    (dict(usrbio_buffer="-5MiB"), "usrbio_buffer"),
    (dict(ttl=["3d"]), "ttl"),
    (dict(ttl={"a" * 17: "1d"}), "traffic class"),
    (dict(capacity_bytes=float("inf")), "capacity_bytes"),
])
def test_a_refused_option_opens_nothing(tmp_path, kw, needle):
    """Every option is checked before the store touches its path (``options.StoreOptions.parse``): a NaN,
    an infinity, a bool, a negative or a wrong type is refused naming its key, and no directory is created."""
    path = tmp_path / "store"
    with pytest.raises(ConfigError, match=needle):
        store_at(path, **kw)
    assert not path.exists()


def test_ttl_by_traffic_class(tmp_path):
    s = store_at(tmp_path, ttl={"agent": "0.4s", "chatbot": "1h"}, gc_interval="0s")
    s.put(1, block(1), ttl_class="agent")
    s.put(2, block(2), ttl_class="chatbot")
    s.put(3, block(3))  # default class: chatbot
    s.put(4, block(4), ttl_class="unknown-class")  # default class too
    assert [s.contains(k) for k in (1, 2, 3, 4)] == [True] * 4
    time.sleep(0.6)
    assert s.get(1) is None and not s.contains(1)
    assert all(s.contains(k) for k in (2, 3, 4))
    assert s.stats().extra["expired"] >= 1
    assert not record_path(s, 1).exists()
    s.close()


def test_last_access_and_ttl_survive_restart(tmp_path):
    s = store_at(tmp_path, ttl={"agent": "1h"})
    for k in (1, 2, 3):
        s.put(k, block(k), ttl_class="agent" if k < 3 else "chatbot")
    usage = s.usage_bytes
    s.close()
    s = store_at(tmp_path)  # the defaults now: agent = 3d; the record says 1h
    assert s.usage_bytes == usage and s.stats().extra["blocks"] == 3
    s.close()
    # last access two hours ago (as the record's mtime): the 1h records expire at start, the 7d one stays
    old = time.time() - 7200
    for k in (1, 2, 3):
        os.utime(record_path(s, k), (old, old))
    os.unlink(Path(s.root) / "index.v1")  # rebuilt from a directory scan
    s = store_at(tmp_path)
    assert [s.contains(k) for k in (1, 2, 3)] == [False, False, True]
    assert s.usage_bytes == usage // 3
    s.close()


def test_gc_keeps_usage_under_the_high_watermark(tmp_path):
    size = record.HEADER_SIZE + BLOCK_BYTES
    s = store_at(tmp_path, capacity_bytes=20 * size, high_watermark=0.9, low_watermark=0.5)
    peak = 0
    for k in range(1, 201):
        assert s.put(k, block(k % 7))
        if k > 5:
            s.get(3)  # recently used: survives every GC
        peak = max(peak, s.usage_bytes)
    st = s.stats().extra
    assert peak <= 0.9 * 20 * size and st["gc_runs"] >= 10 and s.stats().evictions >= 180
    assert s.contains(3) and s.contains(200) and not s.contains(150)
    on_disk = sum(p.stat().st_size for p in Path(s.root).rglob("*.kvb"))
    assert on_disk == s.usage_bytes
    s.close()


# ---- concurrency -------------------------------------------------------------------------------

WRITER = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_kv_3fs import hammer
from plugins.kv_3fs.store import ThreeFSStore
s = ThreeFSStore(path=sys.argv[1], capacity_bytes="1GiB")
print("ready", flush=True)
go = Path(sys.argv[1]) / "go"
while not go.exists():
    time.sleep(0.001)
print(json.dumps(hammer(s, int(sys.argv[2]))))
"""


def _writer_block(k: int) -> torch.Tensor:
    return torch.randn(2, 4, 24, generator=torch.Generator().manual_seed(k))


def hammer(s: ThreeFSStore, seed: int, rounds: int = 15) -> dict:
    """Put, read back and evict 40 shared keys in random order (run by two processes at once)."""
    import random

    rng = random.Random(seed)
    keys = list(range(1, 41))
    bad = wrote = 0
    for _ in range(rounds):
        rng.shuffle(keys)
        for k in keys:
            wrote += s.put(k, _writer_block(k))
            g = s.get(k)
            if g is not None and not torch.equal(g, _writer_block(k)):
                bad += 1
            if rng.random() < 0.3:
                s.evict(k)
    s.close()
    return {"bad": bad, "wrote": wrote, "corrupt": s.stats().extra["corrupt"]}


def test_concurrent_writers_of_the_same_keys(tmp_path):
    """This process and a subprocess write, read and evict the same keys at the same time."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "1", str(Path(__file__).parent)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        mine = ThreeFSStore(path=str(tmp_path), capacity_bytes="1GiB")
        (tmp_path / "go").touch()
        results = [hammer(mine, 0)]
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["bad"] == 0 and r["wrote"] > 0 and not r["corrupt"] for r in results), results
    s = ThreeFSStore(path=str(tmp_path))
    assert not list(Path(s.root).rglob("*.tmp"))
    for k in range(1, 41):
        g = s.get(k)
        assert g is None or torch.equal(g, _writer_block(k))
    assert s.stats().extra["corrupt"] == {}
    s.close()


# ---- USRBIO -----------------------------------------------------------------------------------

def _fake_usrbio(mount: str) -> types.ModuleType:
    """A stand-in for hf3fs_py_usrbio that serves the ring with pread (the API shape only)."""
    mod = types.ModuleType("hf3fs_py_usrbio")
    registered: set[int] = set()

    class Iov:
        def __init__(self, shm):
            self.buf = shm.buf

        def __getitem__(self, sl):
            return (self, sl.start, sl.stop)

    class Ring:
        def __init__(self):
            self.queue, self.done = [], []

        def prepare(self, iov, read, fd, off, userdata=None):
            assert read and fd in registered
            self.queue.append((iov, fd, off, userdata))

        def submit(self):
            for (owner, a, b), fd, off, ud in self.queue:
                data = os.pread(fd, b - a, off)
                owner.buf[a : a + len(data)] = data
                self.done.append(types.SimpleNamespace(result=len(data), userdata=ud))
            self.queue = []
            return self

        def wait(self, min_results=1):
            out, self.done = self.done, []
            return out

    mod.make_iovec = lambda shm, mp, block_size=0, numa=-1: Iov(shm)
    mod.make_ioring = lambda mp, entries, for_read=True, *a, **k: Ring()
    mod.register_fd = lambda fd, *a: registered.add(fd)
    mod.deregister_fd = lambda fd: registered.discard(fd)
    mod.extract_mount_point = lambda p: mount if str(p).startswith(mount) else None
    return mod


def test_usrbio_reads_through_the_binding(tmp_path, monkeypatch):
    mount = tmp_path / "mnt"
    monkeypatch.setitem(sys.modules, "hf3fs_py_usrbio", _fake_usrbio(str(mount)))
    s = store_at(mount / "kv", usrbio="on", usrbio_buffer="64KiB")
    assert s.usrbio
    keys = list(range(1, 120))  # more than one buffer's worth
    for k in keys:
        s.put(k, block(k))
    raw = bytearray(record_path(s, 5).read_bytes())
    raw[-1] ^= 0xFF
    record_path(s, 5).write_bytes(bytes(raw))
    got = s.get_many(keys)
    assert got[4] is None and s.stats().extra["corrupt"] == {"corrupt": 1}
    assert all(torch.equal(g, block(k)) for g, k in zip(got, keys) if k != 5)
    s.close()
    # "auto" with the binding but a path that is not on a 3FS mount uses POSIX reads; "on" is an error
    other = tmp_path / "posix"
    assert not store_at(other, usrbio="auto").usrbio
    with pytest.raises(ConfigError, match="not on a 3FS mount"):
        store_at(other, usrbio="on")


# ---- symbolic links: the store never leaves its directory (issue 14) --------------------------------

def _files(d: Path) -> dict[str, tuple[bytes, int]]:
    """Content and mtime of every file under ``d`` (links not followed)."""
    return {str(p.relative_to(d)): (p.read_bytes(), p.lstat().st_mtime_ns) for p in sorted(d.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _outside(tmp_path: Path) -> Path:
    """A directory outside the store with files the store must never touch: an old temporary file and
    a record-named file."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "a.tmp").write_bytes(b"precious tmp")
    (out / f"{0x77:016x}.kvb").write_bytes(b"precious record")
    old = time.time() - 7200  # older than the GC's 1-hour threshold for temporary files
    for p in out.iterdir():
        os.utime(p, (old, old))
    return out


def test_symlinked_shard_directory_is_refused(tmp_path):
    store, out = tmp_path / "store", _outside(tmp_path)
    s = store_at(store)
    key, other = 0xAB00000000000001, 0xCD00000000000001
    assert s.put(key, block(1)) and s.put(other, block(2))
    shard = record_path(s, key).parent
    (out / record_path(s, key).name).write_bytes(record_path(s, key).read_bytes())  # a valid record outside
    s.close()
    before = _files(out)
    for keep_index in (True, False):
        if shard.is_symlink():
            shard.unlink()
        else:
            for p in shard.iterdir():
                p.unlink()
            shard.rmdir()
        shard.symlink_to(out, target_is_directory=True)
        if not keep_index:
            (Path(s.root) / "index.v1").unlink()
        s = store_at(store, gc_interval=0)  # start-up scan and GC
        assert not s.contains(key) and s.get(key) is None and s.get_many([key]) == [None]
        assert not s.put(key + 1, block(3))  # nothing is written through the link
        s.evict(key)
        s.gc(target=0)
        assert s.stats().extra["symlinks_refused"] >= 1
        assert s.stats().extra["write_failures"].get("unsafe_shard_directory") == 1
        s.close()
        assert _files(out) == before  # no file outside deleted, written or touched
        assert sorted(p.name for p in out.iterdir()) == sorted(before)
    s = store_at(store)
    assert s.put(other, block(2)) and torch.equal(s.get(other), block(2))  # the rest of the store works
    s.close()


def test_symlinked_record_is_refused(tmp_path):
    store, out = tmp_path / "store", _outside(tmp_path)
    s = store_at(store, touch_interval=0)
    assert s.put(5, block(5)) and s.put(6, block(6))
    rec = record_path(s, 5)
    target = out / rec.name
    target.write_bytes(rec.read_bytes())  # a perfectly valid record, outside the store
    old = time.time() - 7200
    os.utime(target, (old, old))
    before = _files(out)
    rec.unlink()
    rec.symlink_to(target)
    # the running store (its index holds the key) and a restarted one (rescan, then GC) refuse it
    assert s.get(5) is None and s.get_many([5, 6])[0] is None
    s.close()
    (Path(s.root) / "index.v1").unlink()
    s = store_at(store, touch_interval=0)
    assert not s.contains(5) and s.get(5) is None
    assert torch.equal(s.get(6), block(6))
    s.evict(5)
    assert s.stats().extra["symlinks_refused"] >= 1
    s.close()
    assert _files(out) == before  # content and mtime of the outside file unchanged


def test_symlinked_index_is_refused(tmp_path):
    store, out = tmp_path / "store", _outside(tmp_path)
    s = store_at(store)
    assert s.put(9, block(9))
    s.close()
    index = Path(s.root) / "index.v1"
    (out / "index.v1").write_bytes(index.read_bytes())
    index.unlink()
    index.symlink_to(out / "index.v1")
    before = _files(out)
    s = store_at(store)
    assert s.stats().extra["symlinks_refused"] == 1
    assert s.contains(9) and torch.equal(s.get(9), block(9))  # found by the directory scan instead
    s.close()  # saves the index: replaces the link itself, never writes through it
    assert _files(out) == before
    assert index.is_file() and not index.is_symlink()


def test_store_reached_through_a_symlinked_parent(tmp_path):
    real, out = tmp_path / "real", _outside(tmp_path)
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    s = store_at(tmp_path / "link" / "kv")  # resolved once, at open
    assert s.root.startswith(str(real.resolve()))
    assert s.put(3, block(3)) and torch.equal(s.get(3), block(3))
    s.close()
    assert list((real / "kv").rglob("*.kvb"))
    # but a link below the store's directory (here its format directory) is refused at open
    before = _files(out)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / f"v{record.FORMAT_VERSION}").symlink_to(out, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        store_at(bad)
    assert _files(out) == before
