"""The wall time of each async speculative step, for a proposer's step-time curve
(``Proposer.step_timed``).

With async scheduling the host never times a step's forward alone: it launches step N+1, then waits
for step N's results. One cycle of the pipeline, from one completion to the next, is what a step
costs. Which step that cycle belongs to depends on the platform:

* where launches return before the work is done (``Platform.supports_async_overlap``), the host
  waits at complete(N) for the device to finish N, so the cycle ending there is step N's device time
  (the device never idles while the next step is queued behind it);
* where the forward runs inline at launch (a CPU with async scheduling forced on), the cycle ending
  at complete(N) is launch(N+1)'s work: step N+1's.

The rows a step verifies are fixed on the host at its launch (the decodes plus the verify budget the
device lays them out in), so the sample is keyed by that step's rows and reported at complete(N):
one step late. Only cycles between two overlapped completions of consecutive speculative steps are
timed (no drain, idle gap or plain step inside), and not steps with prefill chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine
    from deepinfer_core.engine.spec_async import SpecFlight


@dataclass(frozen=True)
class StepShape:
    """What a launched speculative step ran: its launch index, decodes and forward rows."""

    launch: int  # the engine's launched-step count when it was launched
    requests: int  # decode requests
    tokens: int  # rows of its forward (prefill tokens, decodes and the verify budget's rows)
    prefill: bool  # it carried prefill chunks (not timed: its rows are not a verify size)


class StepClock:
    """Pairs the completions of consecutive async speculative steps into per-step wall times."""

    def __init__(self, inline: bool) -> None:
        self.inline = inline  # the forward runs at launch: a cycle is the launched step's
        self._last: tuple[int, float, bool] | None = None  # (launch index, time, overlapped) of the last completion

    def completed(self, engine: LLMEngine, flight: SpecFlight) -> tuple[int, int, float] | None:
        """At a speculative step's completion: (tokens, requests, seconds) of the step the cycle
        since the last completion timed, or None when that cycle is not one step's."""
        now = time.perf_counter()
        nxt = engine.pipeline.inflight  # launched just before this completion (None: a drain)
        nxt_spec = nxt.spec if nxt is not None else None
        shape = flight.shape
        overlapped = (shape is not None and nxt_spec is not None and nxt_spec.shape is not None
                      and nxt_spec.shape.launch == shape.launch + 1)
        last, self._last = self._last, ((shape.launch if shape is not None else -2), now, overlapped)
        if last is None or not overlapped or not last[2] or last[0] != shape.launch - 1:
            return None
        timed = nxt_spec.shape if self.inline else shape
        if timed.prefill:
            return None
        return timed.tokens, timed.requests, now - last[1]
