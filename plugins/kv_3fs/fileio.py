"""Whole-buffer file IO for the store: vectored writes and reads that survive short transfers, and how
an ``OSError`` counts (a miss, or an IO error named by its errno)."""

from __future__ import annotations

import errno
import os


def write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def pread_full(fd: int, views: list, offset: int) -> int:
    """Fill ``views`` from ``offset`` on (fewer bytes only at the end of the file); bytes read."""
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views = views[1:]
            else:
                views = [views[0][n:], *views[1:]]
                n = 0
    return total


def errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, "OSError") if exc.errno else "OSError"


def miss_reason(exc: OSError) -> str | None:
    """How a failed open counts: absent (or a refused link) is a plain miss, anything else an IO error."""
    return None if isinstance(exc, FileNotFoundError) or exc.errno == errno.ELOOP else "io_error"
