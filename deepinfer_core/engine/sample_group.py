"""Parallel sampling: the ``n`` (or ``best_of``) completions of one prompt, and the request output.

Each completion is its own engine request (a child). Child 0 is queued at once; its siblings are
queued when child 0's first token is on the host: its prompt's full KV blocks are then registered in
the prefix cache, so the siblings reuse them and compute only the prompt's last partial block (one
prefill for the n samples instead of n). Without prefix caching, or with prompt logprobs (which need
every prompt position computed), all children are queued at once.

Child ``i`` samples with seed ``seed + i`` when the request has a seed (reproducible), else its own
random seed. With ``best_of`` the ``n`` children with the highest cumulative logprob are returned.

A request handed off by a prefill engine (``kv_transfer_params``) carries child 0's state: child 0
receives it (its prompt's KV and first token), so the siblings, queued at once, share its prompt
blocks through the prefix cache and compute only the prompt's last partial block, exactly as they
would after a local prefill. A child forwarded by a draining engine keeps its own
``kv_transfer_params`` (``CompletionOutput``); best_of then returns every child, unranked, since the
forwarded ones finish elsewhere (the router ranks them).
"""

from __future__ import annotations

import dataclasses

from deepinfer_core.engine.detokenizer import TokenTexts, truncate_at_stop
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_core.sampling_params import SamplingParams


def as_params(params: SamplingParams | dict | None, defaults: dict | None = None) -> SamplingParams:
    """``params`` as a SamplingParams (``None``: the model's defaults from generation_config.json)."""
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if params is None:
        return SamplingParams(**(defaults or {}))
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    return params


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Child ``i``'s params: one sample, seed ``seed + i``; a hand-off is child 0's alone."""
    if params.num_samples == 1:
        return params
    seed = None if params.seq_seed is None else params.seq_seed + i
    transfer = params.kv_transfer_params if i == 0 else None
    return dataclasses.replace(params, n=1, best_of=None, seq_seed=seed, seed=seed, kv_transfer_params=transfer)


class SampleGroup:
    """The children of one request; ``release`` queues the siblings once child 0 allows it."""

    def __init__(self, engine, prompt, params: SamplingParams, request_id: str | None = None) -> None:
        params.validate(engine.model_config.vocab_size)  # n / best_of must be sound before the fan-out
        self.params = params
        self.request_id = request_id
        k = params.num_samples
        self._child_params = [child_params(params, i) for i in range(k)]
        self._child_ids = [request_id if k == 1 or request_id is None else f"{request_id}-{i}" for i in range(k)]
        first = engine.add_request(prompt, self._child_params[0], self._child_ids[0])  # raises on bad input
        if self.request_id is None:
            self.request_id = first.request_id
        self.prompt = {"prompt_token_ids": first.prompt_token_ids}  # the siblings skip re-tokenizing
        self.seqs: list[Sequence] = [first]
        cfg = engine.cfg
        self._share = cfg.enable_prefix_caching and params.prompt_logprobs is None
        self.release(engine)

    @property
    def pending(self) -> int:
        """Children not yet queued."""
        return len(self._child_params) - len(self.seqs)

    def release(self, engine) -> list[Sequence]:
        """Queue the siblings if child 0's prompt is computed (or sharing is off); returns them."""
        first = self.seqs[0]
        if not self.pending or (self._share and not (first.num_output_tokens or first.is_finished)):
            return []
        # siblings of an admitted request join it even on a draining engine (they are forwarded with it)
        kw = {"sibling": True} if getattr(engine, "draining", False) else {}
        added = [engine.add_request(self.prompt, p, rid, **kw)
                 for p, rid in zip(self._child_params[1:], self._child_ids[1:])]
        for s in added:
            s.prompt = first.prompt
        self.seqs += added
        return added

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.is_finished for s in self.seqs)

    def output(self, tokenizer, texts: TokenTexts | None = None) -> RequestOutput:
        """The request's output (final once ``finished``)."""
        completions = [completion_output(s, tokenizer, i, texts) for i, s in enumerate(self.seqs)]
        forwarded = any(c.finish_reason == "forwarded" for c in completions)
        if self.params.best_of is not None and self.params.best_of > self.params.n and not forwarded:
            completions.sort(key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
            completions = completions[: self.params.n]
            for i, c in enumerate(completions):
                c.index = i
        return request_output(self.seqs[0], completions, self.finished, texts, self.request_id)


def completion_output(seq: Sequence, tokenizer, index: int = 0, texts: TokenTexts | None = None) -> CompletionOutput:
    p = seq.params
    out_ids = seq.output_token_ids
    # a stop token (EOS, stop_token_ids) ends the text without appearing in it, as in vLLM
    stopped_by_id = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and out_ids
    text = tokenizer.decode(out_ids[:-1] if stopped_by_id else out_ids, skip_special_tokens=p.skip_special_tokens)
    if isinstance(seq.stop_reason, str):
        text = truncate_at_stop(text, seq.stop_reason, p.include_stop_str_in_output)
    logprobs = seq.output_logprobs if p.logprobs is not None else None
    if texts is not None:
        texts.fill(logprobs)
    transfer = seq.kv_transfer_out if seq.finish_reason == "forwarded" else None
    return CompletionOutput(index, text, out_ids, logprobs, seq.finish_reason, seq.stop_reason,
                            cumulative_logprob=seq.sum_logprob, kv_transfer_params=transfer)


def request_output(seq: Sequence, completions: list[CompletionOutput], finished: bool,
                   texts: TokenTexts | None = None, request_id: str | None = None) -> RequestOutput:
    prompt_lps = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
    if texts is not None:
        texts.fill(prompt_lps)
    return RequestOutput(request_id or seq.request_id, seq.prompt, seq.prompt_token_ids, prompt_lps, completions,
                         finished, seq.metrics, seq.error, seq.kv_transfer_out)


def error_output(prompt, exc: BaseException, request_id: str = "") -> RequestOutput:
    """The output of a request rejected before it was queued."""
    text = prompt if isinstance(prompt, str) else None
    ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else []
    return RequestOutput(request_id, text, list(ids) if isinstance(ids, list) else [], None,
                         [CompletionOutput(0, "", [], None, "error")], True, RequestMetrics(), exc)
