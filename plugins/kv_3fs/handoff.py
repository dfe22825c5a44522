"""``3fs`` KV transport: a hand-off is one file in the store's ``handoff/`` directory.

The prefill engine writes the payload under its key (the prompt's chain hash, then a nonce), the
decode engine reads it by that key and deletes it. Every file operation goes through
:class:`~plugins.kv_3fs.confined.ConfinedDir` (no link is ever followed), a file is written under a
temporary name and renamed into place (a reader never sees half a payload), and the bytes are
never unpickled: the engine verifies them (``deepinfer_core/engine/handoff_format.py``). On a 3FS
mount any engine of the cluster can read what another wrote; the same code runs on a local disk.
"""

from __future__ import annotations

import os
import secrets

from deepinfer_core.config import ConfigError
from deepinfer_core.kv_transfer import KVTransport, check_key
from plugins.kv_3fs.confined import ConfinedDir
from plugins.kv_3fs.options import default_path

SUB = "handoff"


class DirectoryTransport(KVTransport):
    """Payload files in a confined directory ``root/handoff`` (shared by the ``3fs`` and ``shm`` backends)."""

    sync = False  # fsync each payload before it is published

    def __init__(self, root: str) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        if os.path.realpath(root) != root:
            raise ConfigError(f"[kv_transfer] path {root!r} goes through a symbolic link; give the real path")
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.root = root
        self.dir = ConfinedDir(root)
        self.dir.dir_fd(SUB, create=True)

    def send(self, key: str, payload: bytes) -> str:
        check_key(key)
        tmp = f".{key}.{secrets.token_hex(4)}.tmp"
        fd = self.dir.open(SUB, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.dir.replace(SUB, tmp, key)
        return ""

    def recv(self, key: str, locator: str, max_bytes: int) -> bytes | None:
        check_key(key)
        try:
            fd = self.dir.open(SUB, key)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                return None
            out = bytearray(size)
            view, at = memoryview(out), 0
            while at < size:
                n = os.readv(fd, [view[at:]])
                if n == 0:
                    break
                at += n
        finally:
            os.close(fd)
        self.dir.unlink(SUB, key)
        return bytes(out[:at])

    def close(self) -> None:
        self.dir.close()


class ThreeFSTransport(DirectoryTransport):
    name = "3fs"
    sync = True

    def __init__(self, section: dict) -> None:
        section = dict(section)
        path = section.pop("path", default_path())
        if section:
            raise ConfigError(f"[kv_transfer] backend '3fs' knows only 'path', got keys {sorted(section)}")
        if not isinstance(path, str):
            raise ConfigError(f"[kv_transfer] path must be a string, got {path!r}")
        super().__init__(path)
