"""Reads through 3FS's USRBIO (user-space ring-based IO) Python binding, ``hf3fs_py_usrbio``.

USRBIO moves data through a shared-memory buffer (an *iovec*) that the 3FS FUSE daemon reads into
directly, with requests queued on an *ioring*: ``prepare`` one read per record, ``submit().wait``
for the completions. Files must be registered with ``register_fd`` first. Writes keep using POSIX
(a temporary file and ``os.replace``), which is what makes them atomic.

The binding is looked up in ``hf3fs_py_usrbio`` (and its ``hf3fs_fuse.io`` wrapper, which holds
``make_iovec`` / ``make_ioring`` in some releases).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from multiprocessing import shared_memory

logger = logging.getLogger("deepinfer.kv_store.3fs")

_NAMES = ("make_iovec", "make_ioring", "register_fd", "deregister_fd")


class UsrbioUnavailable(RuntimeError):
    pass


def open_reader(mode: str, path: str, buffer_bytes: int) -> UsrbioReader | None:
    """The store's ``usrbio`` setting: a reader for ``path`` when it is on a 3FS mount with the binding
    installed (``auto``: None otherwise, POSIX reads; ``on``: a ``ConfigError`` saying what is missing;
    ``off``: None)."""
    from deepinfer_core.config import ConfigError

    if mode == "off":
        return None
    try:
        binding = load_binding()
    except UsrbioUnavailable as exc:
        if mode == "on":
            raise ConfigError(f"[kv_store] usrbio = 'on' but {exc}") from exc
        return None
    mount = mount_point(path, binding)
    if mount is None:
        if mode == "on":
            raise ConfigError(f"[kv_store] usrbio = 'on' but path {path!r} is not on a 3FS mount")
        return None
    try:
        reader = UsrbioReader(binding, mount, buffer_bytes)
    except Exception as exc:
        if mode == "on":
            raise ConfigError(f"[kv_store] usrbio = 'on' but setting up USRBIO on {mount} failed: {exc}") from exc
        logger.warning("KV store: USRBIO setup on %s failed (%s); using POSIX reads", mount, exc)
        return None
    logger.info("KV store %s: USRBIO reads through the 3FS mount %s", path, mount)
    return reader


def load_binding():
    """A namespace with make_iovec, make_ioring, register_fd, deregister_fd (and maybe
    extract_mount_point); raises UsrbioUnavailable saying why not."""
    found: dict[str, object] = {}
    errors = []
    for module in ("hf3fs_py_usrbio", "hf3fs_fuse.io"):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
            continue
        for name in (*_NAMES, "extract_mount_point"):
            if name not in found and hasattr(mod, name):
                found[name] = getattr(mod, name)
    missing = [n for n in _NAMES if n not in found]
    if missing:
        why = "; ".join(errors) or f"it lacks {', '.join(missing)}"
        raise UsrbioUnavailable(f"the 3FS USRBIO binding (hf3fs_py_usrbio) is not usable: {why}")
    return type("Usrbio", (), found)


def mount_point(path: str, binding=None) -> str | None:
    """The 3FS mount point holding ``path``, or None when it is not on 3FS."""
    extract = getattr(binding, "extract_mount_point", None)
    if extract is not None:
        try:
            mp = extract(path)
            if mp:
                return str(mp)
        except Exception:  # not on a 3FS mount
            pass
    best = None
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3 or "3fs" not in parts[2]:
                    continue
                mp = parts[1].replace("\\040", " ")
                inside = real == mp or real.startswith(mp.rstrip("/") + "/")
                if inside and (best is None or len(mp) > len(best)):
                    best = mp
    except OSError:
        return None
    return best


class UsrbioReader:
    """Reads whole files into a registered shared-memory buffer, many per ring submission.

    One ring and buffer per reader; ``read_files`` is serialised with a lock (the ring is not
    thread-safe). Files larger than the buffer are not handled here (the caller reads them with
    POSIX IO)."""

    def __init__(self, binding, mount: str, buffer_bytes: int = 64 << 20, entries: int = 256) -> None:
        self.b, self.mount, self.capacity, self.entries = binding, mount, buffer_bytes, entries
        self._shm = shared_memory.SharedMemory(create=True, size=buffer_bytes)
        self._iov = binding.make_iovec(self._shm, mount)
        self._ring = binding.make_ioring(mount, entries, True)
        self._lock = threading.Lock()

    def read_files(self, items: list[tuple[str, int]], consume) -> None:
        """Read each (path, size) whole and call ``consume(index, data)`` with a memoryview of the
        bytes read (valid only during the call) or the OSError."""
        with self._lock:
            start = 0
            while start < len(items):
                batch, used = [], 0
                for i in range(start, len(items)):
                    size = items[i][1]
                    if batch and (used + size > self.capacity or len(batch) >= self.entries):
                        break
                    batch.append((i, used))
                    used += size
                start = batch[-1][0] + 1
                self._read_batch(items, batch, consume)

    def _read_batch(self, items, batch, consume) -> None:
        fds: dict[int, int] = {}
        try:
            pending = 0
            for i, off in batch:
                path, size = items[i]
                if size > self.capacity:
                    consume(i, OSError(f"{path}: {size} bytes exceed the USRBIO buffer"))
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # never a link (store.py)
                except OSError as exc:
                    consume(i, exc)
                    continue
                fds[i] = fd
                self.b.register_fd(fd)
                self._ring.prepare(self._iov[off : off + size], True, fd, 0, userdata=i)
                pending += 1
            if not pending:
                return
            offsets = dict(batch)
            for done in self._ring.submit().wait(min_results=pending):
                i = int(done.userdata)
                if done.result < 0:
                    consume(i, OSError(-done.result, os.strerror(-done.result), items[i][0]))
                else:
                    off = offsets[i]
                    consume(i, self._shm.buf[off : off + done.result])
        finally:
            for fd in fds.values():
                try:
                    self.b.deregister_fd(fd)
                finally:
                    os.close(fd)

    def close(self) -> None:
        self._ring = self._iov = None
        try:
            self._shm.close()
            self._shm.unlink()
        except (OSError, BufferError):
            pass
