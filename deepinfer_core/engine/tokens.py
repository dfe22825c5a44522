"""How an engine takes in real tokens: append (several per request with speculation), log-probs,
stop checks, and finishing the requests that stopped, in the documented hook order (``tokens_sampled``
for the tokens placed, then ``request_finished``). A mixin of ``LLMEngine``; the step pipeline
(``engine.pipeline``) and the speculative path (``engine.speculative``) call it."""

from __future__ import annotations

import time

from deepinfer_core.engine.detokenizer import stop_string_hit
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.outputs import Logprob


class TokenAccounting:
    """Token bookkeeping of :class:`~deepinfer_core.engine.engine.LLMEngine` (uses its ``stats``,
    ``tokenizer``, ``max_model_len`` and ``_finish``)."""

    def append_tokens(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list[float]],
                      tops: list[list] | None = None) -> list[tuple[Sequence, tuple]]:
        """Append accepted tokens to requests (speculation: several per request), up to the first
        that stops each. Returns the stops, ``(request, (reason, stop_reason))``: call
        ``tokens_sampled`` for the appended tokens, then ``finish_stopped`` with them."""
        now = time.perf_counter()
        stops = []
        for i, seq in enumerate(seqs):
            if seq.num_pending_tokens:
                raise RuntimeError(f"append_tokens: request {seq.request_id} has tokens still being sampled "
                                   "(async scheduling); such steps must run synchronously")
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            for j, tok in enumerate(tokens[i]):
                seq.token_ids.append(tok)
                reason = self._accept_token(seq, tok, logprobs[i][j], tops[i][j] if tops else None)
                if reason is not None:
                    stops.append((seq, reason))
                    break
        return stops

    def finish_stopped(self, stops: list[tuple[Sequence, tuple]]) -> None:
        """Finish the requests that stopped on tokens just placed (after their ``tokens_sampled``);
        one a hook finished meanwhile (e.g. aborted by a grammar) is left as it is."""
        for seq, reason in stops:
            if not seq.is_finished:
                self._finish(seq, *reason)

    def _accept_token(self, seq: Sequence, tok: int, logprob: float, top: list | None,
                      rank: int | None = None) -> tuple | None:
        """Account for a real token just placed in ``seq.token_ids``; returns ``(reason, stop_reason)``
        if the request stops there (the caller finishes it after ``tokens_sampled``). ``rank``: the
        token's rank in the full distribution, where known."""
        seq.sum_logprob += logprob
        self.stats.decode_tokens += 1
        if seq.params.logprobs is not None:
            entry = {tok: Logprob(logprob, rank)}
            for r, (t, lp) in enumerate(top or [], start=1):
                entry.setdefault(t, Logprob(lp)).rank = r  # the sampled token too
            seq.output_logprobs.append(entry)
        return self._stop_reason(seq, tok)

    def _stop_reason(self, seq: Sequence, tok: int):
        p = seq.params
        if tok in seq.eos_token_ids:
            return "stop", None
        if tok in p.stop_token_ids:
            return "stop", tok
        if p.stop:
            hit = stop_string_hit(seq, self.tokenizer)  # incremental: only the new text is searched
            if hit is not None:
                return "stop", hit
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_known_tokens >= self.max_model_len:
            return "length", None
        return None
