"""Request outputs, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token; the sampled token's true rank even outside the top N
    decoded_token: str | None = None  # the token's own text


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (raw distribution)
    kv_transfer_params: dict | None = None  # finish_reason "forwarded" (a drain): where this completion continues


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_computed_prompt_tokens: int = 0
    num_preemptions: int = 0
    decode_ppl: float | None = None  # exp(-mean logprob of the generated tokens)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request (any proposer)
    num_accepted_draft_tokens: int = 0  # ... and kept
    extra: dict = field(default_factory=dict)  # features' per-request metrics (accept_rate, ...)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over verified drafts; None when none were verified."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: BaseException | None = None  # set when this request alone failed (finish_reason "error")
    kv_transfer_params: dict | None = None  # a prefill engine's hand-off: pass it in SamplingParams to continue
