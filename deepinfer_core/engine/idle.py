"""How long the device sits idle between consecutive steps (``measure_device_idle``).

Each step's device work is bracketed by two timed platform events, recorded in stream order: one
before any of the step's device work is queued (its inputs' copy, a proposer's drafting on the
device, the input correction), one after its results' copy back to the host is queued. The
device reaches an event when everything queued before it is done, so ``end(N) -> start(N+1)`` is
the time the device had nothing of this engine's to run between the
steps: host work that the step loop did not overlap (scheduling, preparing, post-processing), and
``start -> end`` is the step's device work. With async scheduling the host queues step N+1 before
step N finishes, so the gap shrinks to the few microseconds the device needs to pass one event.

Only gaps between back-to-back steps count: a step that launched nothing, or the engine running out
of work (between ``generate`` calls), starts a new chain. Events are read when they have completed
(``query()``) or, in :meth:`metrics`, after waiting for them, so measuring adds two event records per
step and no synchronisation. On a synchronous device (the CPU's :class:`HostEvent`) the same code runs
on wall-clock times.
"""

from __future__ import annotations

from typing import Any


class DeviceIdleMeter:
    def __init__(self, platform: Any) -> None:
        self.platform = platform
        self.reset()

    def reset(self) -> None:
        """Forget every step measured so far (a benchmark's warm-up)."""
        self._queue: list[tuple[Any, Any] | None] = []  # (start, end) per step; None breaks the chain
        self._prev_end: Any = None
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self.gaps = 0
        self.max_gap_ms = 0.0

    def start(self) -> Any:
        ev = self.platform.event(enable_timing=True)
        ev.record()
        return ev

    def end(self, start: Any) -> None:
        ev = self.platform.event(enable_timing=True)
        ev.record()
        self._queue.append((start, ev))
        self._collect(block=False)

    def break_chain(self) -> None:
        """The next step follows no device work of ours: do not count the time before it."""
        if self._queue and self._queue[-1] is None:
            return
        self._queue.append(None)

    def _collect(self, block: bool) -> None:
        done = 0
        for item in self._queue:
            if item is None:
                self._prev_end = None
                done += 1
                continue
            start, end = item
            if block:
                end.synchronize()
            elif not end.query():
                break
            if self._prev_end is not None:
                gap = max(0.0, self._prev_end.elapsed_time(start))
                self.idle_ms += gap
                self.max_gap_ms = max(self.max_gap_ms, gap)
                self.gaps += 1
            self.busy_ms += start.elapsed_time(end)
            self._prev_end = end
            done += 1
        del self._queue[:done]

    def metrics(self) -> dict:
        self._collect(block=True)
        total = self.busy_ms + self.idle_ms
        return {
            "device_idle_share": self.idle_ms / total if total else 0.0,
            "device_idle_us_mean": 1000.0 * self.idle_ms / self.gaps if self.gaps else 0.0,
            "device_idle_us_max": 1000.0 * self.max_gap_ms,
            "device_idle_gaps": self.gaps,
            "device_idle_ms": self.idle_ms,
            "device_busy_ms": self.busy_ms,
        }
