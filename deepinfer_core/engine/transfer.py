"""Host <-> device copies that never stall the host on queued device work.

``torch.tensor(data, device=cuda)`` copies from pageable memory and then synchronises the stream,
so the host waits for every kernel queued before it. With async scheduling the host prepares step
N+1 while step N runs, so every copy on that path goes through these helpers instead: a host tensor
(pinned where the platform supports it) copied with ``non_blocking=True``, and device results copied
back into pinned buffers behind an event that the host waits on only when it needs the values.

A step's many small metadata tensors (token ids, positions, slots, lengths, index maps) go through
one :class:`Upload`: packed into one host buffer and copied with one transfer, since each separate
copy costs the host a pinned allocation and a copy launch (tens of microseconds on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
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


class Upload:
    """Small host lists bound for the device, packed and sent at once.

    ``add`` takes a flat list (or a list of equal-length rows) and returns a handle; ``send`` packs
    every part into one (pinned) host buffer, copies it to the device with one non-blocking
    transfer and returns the parts as device tensors, indexed by handle (views into one buffer:
    parts never overlap, so each may be edited in place)."""

    _ALIGN = 8

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self._parts: list[tuple[torch.dtype, int, int, tuple[int, ...]]] = []  # dtype, start, count, shape
        self._data: dict[torch.dtype, list] = {}
        self.tensors: list[torch.Tensor] | None = None  # the parts on the device, once sent

    def add(self, data: Sequence, dtype: torch.dtype = torch.long) -> int:
        """Queue ``data`` (flat, or rows of equal length: a 2-D tensor) as ``dtype``; returns its handle."""
        rows = bool(data) and isinstance(data[0], (list, tuple))
        shape = (len(data), len(data[0])) if rows else (len(data),)
        flat = self._data.setdefault(dtype, [])
        start = len(flat)
        flat.extend(chain.from_iterable(data) if rows else data)
        self._parts.append((dtype, start, len(flat) - start, shape))
        return len(self._parts) - 1

    def send(self) -> list[torch.Tensor]:
        """Copy every queued part to the device at once; returns them in handle order."""
        host = {dt: torch.tensor(v, dtype=dt) for dt, v in self._data.items()}
        if self.device.type == "cpu":
            base = host
        else:
            offsets, total = {}, 0
            for dt, t in host.items():
                offsets[dt] = total
                total += -(-t.numel() * t.element_size() // self._ALIGN) * self._ALIGN
            buf = torch.empty(max(total, self._ALIGN), dtype=torch.uint8, pin_memory=self.pin)
            for dt, t in host.items():
                buf[offsets[dt] : offsets[dt] + t.numel() * t.element_size()] = t.view(torch.uint8)
            dev = buf.to(self.device, non_blocking=True)
            base = {dt: dev[offsets[dt] : offsets[dt] + t.numel() * t.element_size()].view(dt)
                    for dt, t in host.items()}
        self.tensors = [base[dt][start : start + n].view(shape) for dt, start, n, shape in self._parts]
        return self.tensors


class HostCopy:
    """Asynchronous device -> host copy of some tensors (None entries pass through).

    ``wait()`` blocks until the copies have landed and returns the host tensors. Host tensors of a
    CPU device are returned as they are (nothing to copy). Device tensors of one dtype travel in one
    copy (concatenated on the device; the host tensors are views of one pinned buffer)."""

    def __init__(self, tensors: list[torch.Tensor | None], platform: Any, pin: bool, copy_cpu: bool = False) -> None:
        """``copy_cpu``: copy CPU tensors too (tests of the packing)."""
        self._host: list[torch.Tensor | None] = list(tensors)
        self._event = None
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            if t is not None and (copy_cpu or t.device.type != "cpu"):
                groups.setdefault(t.dtype, []).append(i)
        for dtype, idx in groups.items():
            parts = [tensors[i].reshape(-1) for i in idx]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            h = torch.empty(flat.shape, dtype=dtype, device="cpu", pin_memory=pin)
            h.copy_(flat, non_blocking=True)
            off = 0
            for i, part in zip(idx, parts):
                self._host[i] = h[off : off + part.numel()].view(tensors[i].shape)
                off += part.numel()
        if groups:
            self._event = platform.event()
            self._event.record()

    def ready(self) -> bool:
        """Whether the copies have landed (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
