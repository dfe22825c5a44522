"""The Prefill and Decode load balancers of the router.

Both track load the router itself created (every request passes through it, so its counts are
exact and need no polling), pick the least loaded engine, and break ties by the load assigned so
far, so a stream of requests that finish quickly still spreads evenly.

* Prefill LB: the uncached prompt tokens (prompt minus the store's prefix hit) of the requests an
  engine is prefilling: the work that costs prefill time. Each prefill engine then runs its
  requests first-come-first-served in time-budgeted chunks (``compute_quota_limit``).
* Decode LB: running requests, then the KV tokens they hold (prompt + tokens to generate).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def max_mean(loads: list[float]) -> float:
    """max/mean of per-engine loads (1.0 is perfect balance; 1.0 when there is no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


@dataclass
class _Engine:
    url: str
    active: float = 0.0  # load in flight
    kv_tokens: int = 0
    running: int = 0
    assigned: float = 0.0  # load ever given
    draining: bool = False


@dataclass
class Balancer:
    """Least-loaded choice over ``urls``; ``load`` is what one request weighs."""

    urls: list[str]
    engines: list[_Engine] = field(init=False)
    samples: list[list[float]] = field(default_factory=list)  # in-flight loads at each pick

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a balancer needs at least one engine URL")
        self.engines = [_Engine(u) for u in self.urls]

    def _key(self, e: _Engine):
        return (e.active, e.assigned)

    def pick(self, load: float, kv_tokens: int = 0, exclude: str | None = None) -> str:
        live = [e for e in self.engines if not e.draining and e.url != exclude]
        if not live:
            raise RuntimeError("no engine accepts requests (all draining)")
        e = min(live, key=self._key)
        e.active += load
        e.assigned += load
        e.running += 1
        e.kv_tokens += kv_tokens
        self.samples.append([x.active for x in self.engines])
        return e.url

    def done(self, url: str, load: float, kv_tokens: int = 0) -> None:
        e = self.engine(url)
        e.active -= load
        e.running -= 1
        e.kv_tokens -= kv_tokens

    def engine(self, url: str) -> _Engine:
        return next(e for e in self.engines if e.url == url)

    def ratios(self) -> dict:
        """max/mean of the load assigned in total, and of the mean in-flight load over the picks."""
        n = len(self.samples)
        mean_active = [sum(s[i] for s in self.samples) / n if n else 0.0 for i in range(len(self.engines))]
        return {"assigned": max_mean([e.assigned for e in self.engines]), "in_flight": max_mean(mean_active),
                "assigned_per_engine": [e.assigned for e in self.engines],
                "running_per_engine": [e.running for e in self.engines]}


class PrefillBalancer(Balancer):
    """Load: uncached prompt tokens."""


class DecodeBalancer(Balancer):
    """Load: one running request; ties broken by KV tokens held, then requests given so far."""

    def _key(self, e: _Engine):
        return (e.running, e.kv_tokens, e.assigned)
