"""``shm`` KV transport: hand-offs between engines of one machine through host shared memory.

A payload is a POSIX shared-memory object (on Linux a file of the ``/dev/shm`` tmpfs, which is what
``shm_open`` creates): written once by the sender, read and removed by the receiver. The files live
in ``/dev/shm/<namespace>`` (mode 0700), reached only through a confined directory (no link is
followed), and the bytes are verified, never unpickled, by the receiving engine.

    [kv_transfer]
    backend = "shm"
    namespace = "deepinfer-kv"   # engines that hand off to each other use the same namespace
"""

from __future__ import annotations

import os
import re

from deepinfer_core.config import ConfigError
from plugins.kv_3fs.handoff import DirectoryTransport

SHM_ROOT = "/dev/shm"


class ShmTransport(DirectoryTransport):
    name = "shm"

    def __init__(self, section: dict) -> None:
        section = dict(section)
        namespace = section.pop("namespace", "deepinfer-kv")
        if section:
            raise ConfigError(f"[kv_transfer] backend 'shm' knows only 'namespace', got keys {sorted(section)}")
        if not isinstance(namespace, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace) \
                or namespace.startswith("."):
            raise ConfigError(f"[kv_transfer] namespace must be 1-64 characters of [A-Za-z0-9_.-], got {namespace!r}")
        if not os.path.isdir(SHM_ROOT):
            raise ConfigError(f"[kv_transfer] backend 'shm' needs {SHM_ROOT} (POSIX shared memory); not found here")
        super().__init__(os.path.join(SHM_ROOT, namespace))
