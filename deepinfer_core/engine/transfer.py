"""Host <-> device copies that never stall the host on queued device work.

``torch.tensor(data, device=cuda)`` copies from pageable memory and then synchronises the stream,
so the host waits for every kernel queued before it. With async scheduling the host prepares step
N+1 while step N runs, so every copy on that path goes through these helpers instead: a host tensor
(pinned where the platform supports it) copied with ``non_blocking=True``, and device results copied
back into pinned buffers behind an event that the host waits on only when it needs the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def can_pin_memory() -> bool:
    """Whether this process can allocate page-locked host memory (a CUDA/NPU runtime is present)."""
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


def to_device(data: Sequence, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """``data`` (a list, possibly nested) as a tensor on ``device``, without synchronising."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)


class HostCopy:
    """Asynchronous device -> host copy of some tensors (None entries pass through).

    ``wait()`` blocks until the copies have landed and returns the host tensors. Host tensors of a
    CPU device are returned as they are (nothing to copy)."""

    def __init__(self, tensors: list[torch.Tensor | None], platform: Any, pin: bool) -> None:
        self._host: list[torch.Tensor | None] = []
        self._event = None
        for t in tensors:
            if t is None or t.device.type == "cpu":
                self._host.append(t)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            h.copy_(t, non_blocking=True)
            self._host.append(h)
            if self._event is None:
                self._event = platform.event()
        if self._event is not None:
            self._event.record()

    def ready(self) -> bool:
        """Whether the copies have landed (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
