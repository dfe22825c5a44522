"""``ConfinedDir``: a directory tree that the store's file operations never leave.

The store lives in a directory that other processes, and people, can write to. A symbolic link
planted inside it must never make the store read, write, delete or touch a file elsewhere. So no
path below the root is ever resolved by the OS: the root and each shard directory are opened once
(``O_DIRECTORY | O_NOFOLLOW``) and every file operation is relative to those descriptors (``openat``,
``unlinkat``, ``renameat``, ``utimensat``), files being opened with ``O_NOFOLLOW``. A link found where
a directory or file should be is refused: never followed, logged once and counted (``refused``).
Renaming over a link or unlinking one acts on the link itself, inside the tree.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import weakref

logger = logging.getLogger("deepinfer.kv_store.3fs")

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # where the OS has them
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ConfinedDir:
    """``root`` (an absolute path without links, checked by the caller) and its subdirectories one
    level down; ``sub=""`` is the root itself. Thread-safe."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.refused: set[str] = set()  # paths of the links found (refused)
        self._fds: dict[str, int] = {}  # sub -> open directory descriptor
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        try:
            self._fds[""] = os.open(root, os.O_RDONLY | _DIRECTORY | NOFOLLOW | _CLOEXEC)
        except OSError:
            pass  # not there (a read-only store never written): everything is absent

    def dir_fd(self, sub: str = "", create: bool = False) -> int | None:
        """A descriptor of directory ``sub`` (made first with ``create``); None when it is missing, not
        a directory, or a link (refused)."""
        fd = self._fds.get(sub)
        if fd is not None or not sub:
            return fd
        root = self._fds.get("")
        if root is None:
            if create:
                raise FileNotFoundError(errno.ENOENT, "the store directory is missing", self.root)
            return None
        if create:
            try:
                os.mkdir(sub, dir_fd=root)
            except FileExistsError:
                pass
        try:
            fd = os.open(sub, os.O_RDONLY | _DIRECTORY | NOFOLLOW | _CLOEXEC, dir_fd=root)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(sub, root):
                self.refuse(sub, "directory")
            elif exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
            return None
        with self._lock:
            kept = self._fds.setdefault(sub, fd)
        if kept != fd:
            os.close(fd)
        return kept

    def refuse(self, rel: str, what: str) -> None:
        """Note the link at ``rel`` (relative to the root): logged the first time, counted."""
        path = f"{self.root}/{rel}"
        with self._lock:
            new = path not in self.refused
            self.refused.add(path)
        if new:
            logger.warning("KV store: %s (a %s) is a symbolic link; refused: the store never leaves %s", path,
                           what, self.root)

    def _fd(self, sub: str, name: str) -> int:
        fd = self.dir_fd(sub)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", f"{self.root}/{sub}/{name}")
        return fd

    def open(self, sub: str, name: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """``os.open`` of ``sub/name``, never through a link (OSError; a link is refused, ELOOP)."""
        try:
            return os.open(name, flags | NOFOLLOW | _CLOEXEC, mode, dir_fd=self._fd(sub, name))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.refuse(f"{sub}/{name}" if sub else name, "file")
            raise

    def lstat(self, sub: str, name: str) -> os.stat_result:
        """The entry's own metadata; a link is refused and reported absent (FileNotFoundError)."""
        st = os.stat(name, dir_fd=self._fd(sub, name), follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            self.refuse(f"{sub}/{name}" if sub else name, "file")
            raise FileNotFoundError(errno.ENOENT, "a symbolic link, refused", f"{self.root}/{sub}/{name}")
        return st

    def unlink(self, sub: str, name: str) -> bool:
        """Remove ``sub/name`` (a link is removed itself, never its target); False when it cannot."""
        fd = self.dir_fd(sub)
        if fd is None:
            return False
        try:
            os.unlink(name, dir_fd=fd)
            return True
        except OSError:
            return False

    def replace(self, sub: str, src: str, dst: str) -> None:
        fd = self._fd(sub, dst)
        os.replace(src, dst, src_dir_fd=fd, dst_dir_fd=fd)

    def touch(self, sub: str, name: str) -> None:
        """Set the mtime of ``sub/name`` to now (of a link itself, if it became one); errors ignored."""
        fd = self.dir_fd(sub)
        if fd is not None:
            try:
                os.utime(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                pass

    def scandir(self, sub: str = "") -> list[os.DirEntry]:
        """The entries of ``sub`` ([] when it is not there); check ``is_symlink()`` before use."""
        fd = self.dir_fd(sub)
        try:
            return list(os.scandir(fd)) if fd is not None else []
        except OSError:
            return []

    def close(self) -> None:
        self._finalizer()


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
