"""Prometheus metrics of a server (``/metrics``), named like vLLM's with a ``deepinfer:`` prefix.

Latencies are measured from the moment the server received the request, so they include the HTTP
layer and the admission queue: what a client sees. Each server owns its registry (no process-wide
state). The engine core ships what they count with its output frames (``serving/engine_core.py``);
the event loop records it on arrival.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("deepinfer:request_success", "Finished requests by finish reason",
                                lab + ["finished_reason"], registry=r)
        self.rejected = Counter("deepinfer:request_rejected", "Requests refused (status code)",
                                lab + ["code"], registry=r)
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prompt tokens of finished requests", lab,
                                     registry=r)
        self.generation_tokens = Counter("deepinfer:generation_tokens", "Generated tokens", lab, registry=r)
        self.cache_hits = Counter("deepinfer:prefix_cache_hit_tokens", "Prompt tokens whose KV was reused, by tier",
                                  lab + ["tier"], registry=r)
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time to first token (from receipt)", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds", "Time between output tokens", lab,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "Receipt to last token", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("deepinfer:num_requests_running", "Requests in the running batch", lab, registry=r)
        self.waiting = Gauge("deepinfer:num_requests_waiting", "Requests waiting for the batch", lab, registry=r)
        self.kv_usage = Gauge("deepinfer:kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1)", lab,
                              registry=r)
        self.spec_accept = Histogram("deepinfer:spec_decode_acceptance_rate", "Per request draft acceptance",
                                     lab, buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        self.spec_drafts = Counter("deepinfer:spec_decode_num_draft_tokens", "Draft tokens verified", lab,
                                   registry=r)
        self.spec_accepted = Counter("deepinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted", lab,
                                     registry=r)

        # the per-token series, bound once (labels() costs a locked lookup per call)
        m = model_name
        self._running, self._waiting, self._kv = self.running.labels(m), self.waiting.labels(m), self.kv_usage.labels(m)
        self._gen, self._ttft, self._itl = self.generation_tokens.labels(m), self.ttft.labels(m), self.itl.labels(m)

    def engine_load(self, load: dict) -> None:
        self._running.set(load["running"])
        self._waiting.set(load["waiting"])
        self._kv.set(load["kv_usage"])

    def tokens_emitted(self, n: int, now: float, arrival: float, first: float | None, last: float | None) -> None:
        """``n`` tokens of one completion became visible at ``now``."""
        self._gen.inc(n)
        if first is None:
            self._ttft.observe(now - arrival)
            n -= 1
        if last is not None and n > 0:  # tokens that arrived together share the gap
            gap = (now - last) / n
            for _ in range(n):
                self._itl.observe(gap)

    def request_finished(self, reason: str | None, prompt_tokens: int, cached_by_tier: dict[str, int],
                         drafts: int, accepted: int, e2e: float) -> None:
        """One completion finished (``reason``), whose ``drafts`` verified drafts kept ``accepted``
        (speculative decoding); ``e2e``: seconds since the server received it."""
        m = self.model_name
        self.requests.labels(m, reason or "unknown").inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            self.cache_hits.labels(m, tier).inc(n)
        if drafts:
            self.spec_accept.labels(m).observe(accepted / drafts)
            self.spec_drafts.labels(m).inc(drafts)
            self.spec_accepted.labels(m).inc(accepted)
        self.e2e.labels(m).observe(max(0.0, e2e))

    def reject(self, code: int) -> None:
        self.rejected.labels(self.model_name, str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
