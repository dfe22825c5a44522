"""The engine's answers to a scheduler admitting a request (``scheduler.Admission``): feature
readiness hooks, and the prefix cache over every KV tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_core.engine.sequence import Sequence

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.engine import LLMEngine


class EngineAdmission:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def is_ready(self, seq: Sequence) -> bool:
        eng = self.engine
        if seq.is_finished:  # failed by a feature (e.g. in _fail_stuck) and not yet dropped: never schedule it
            return False
        if seq.last_token_pending:  # preempted while its last token is sampled: it finishes when that lands
            return False
        if seq.pending_drafts:  # preempted while its drafts are verified: its length is known when they land
            return False
        try:
            ready = eng.pm.hook.request_ready(engine=eng, request=seq)
        except Exception as exc:  # a feature failed this request alone
            eng._finish(seq, "error", error=exc, remove_from_scheduler=False)
            return False
        return ready is not False

    def admit_prefix(self, seq: Sequence) -> int:
        eng = self.engine
        loaded = eng.pm.hook.load_request_state(engine=eng, request=seq)  # a handed-off request's KV
        if loaded is not None:
            return loaded
        if not eng.cfg.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        blocks, bs = eng.blocks, eng.block_size
        hashes = blocks.prefix_hashes(seq)
        tiers = seq.metrics.num_cached_tokens_by_tier
        tiers.clear()  # re-admitted after a preemption: count this admission only
        if eng.window_cache is not None:  # window groups: swa_prefix_policy completes the hit
            seq.metrics.num_cached_tokens = eng.window_cache.admit(seq, hashes)
            return seq.metrics.num_cached_tokens
        n_dev = blocks.acquire_cached(seq, hashes)
        n_total = n_dev
        ext = None
        if blocks.external_hits:  # lower tiers hold record-pool blocks only
            ext = eng.pm.hook.match_external_prefix(engine=eng, request=seq, block_hashes=hashes,
                                                    num_device_blocks=n_dev)
        if ext and ext > n_dev and blocks.can_allocate(seq, ext * bs):
            blocks.allocate(seq, ext * bs)
            new_ids = blocks.tables(seq)[blocks.record_pool.name][n_dev:ext]
            eng.pm.hook.load_external_blocks(engine=eng, request=seq, block_ids=new_ids,
                                             block_hashes=hashes[n_dev:ext])
            seq.block_hashes = []  # re-registered below, now that the blocks hold the data
            seq.num_computed_tokens = ext * bs
            blocks.register_full_blocks(seq)
            n_total = ext
            if not tiers:  # load_external_blocks may have split them by tier (host, persistent)
                tiers["external"] = (ext - n_dev) * bs
        cached = n_total * bs
        if n_dev:
            seq.metrics.num_cached_tokens_by_tier["device"] = n_dev * bs
        seq.metrics.num_cached_tokens = cached
        return cached
