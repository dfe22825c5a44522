"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time

from deepinfer_core.outputs import Logprob, RequestMetrics
from deepinfer_core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, KV blocks and progress of one request.

    ``num_computed_tokens`` tokens have KV in the cache. A step computes ``num_new_tokens`` more;
    when that reaches ``num_tokens`` the step samples the next token.

    With async scheduling the token a step samples is appended as a placeholder (a negative id, see
    ``LLMEngine``) as soon as the step is launched, so the next step is scheduled with the right
    length; the engine replaces it with the real token once it is on the host. ``token_ids`` and
    ``num_tokens`` include these ``num_pending_tokens`` trailing placeholders; ``num_known_tokens``,
    ``num_output_tokens`` and ``output_token_ids`` count real tokens only.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, eos_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.status = Status.WAITING
        #: one block table per KV cache pool (``KVCacheManager``), the first group's pool first; -1
        #: marks a window block already freed
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: list[int] = []  # hash chain of the full blocks computed so far
        self.num_computed_tokens = 0
        #: window models (engine/window_prefix.py): tokens before this recompute window state only (a
        #: replay after a prefix hit whose window KV was not cached); the last snapshotted boundary
        self.replay_until = 0
        self.window_snapshot_at = 0
        self.arrival_index = 0  # FCFS order, set by the scheduler
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: BaseException | None = None
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.prompt_logprobs: list[dict[int, Logprob] | None] = [None] if params.prompt_logprobs is not None else []
        self.sum_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.feature_state: dict = {}  # per-request state owned by feature plugins
        self.detokenizer = None  # IncrementalDetokenizer, created when stop strings are checked
        self.num_pending_tokens = 0  # trailing placeholders in token_ids (sampled, not yet on the host)
        self.last_token_pending = False  # a placeholder is its last token (max_tokens/max_model_len): not scheduled
        self.kv_transfer_out: dict | None = None  # where its KV was handed off (engine/handoff.py)
        #: speculative decoding: tokens proposed to follow ``token_ids`` (verified in its next decode
        #: step), and their draft distributions [len, vocab] (None: point masses)
        self.spec_tokens: list[int] = []
        self.spec_probs = None
        #: async speculative steps: drafts of the step in flight whose outcome the host does not know
        #: yet (its placeholders count them as accepted); not readmitted after a preemption until known
        self.pending_drafts = 0

    @property
    def block_table(self) -> list[int]:
        """The block table of the first cache group's pool (the only one of single-group models)."""
        return next(iter(self.block_tables.values()), [])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens known on the host (``num_tokens`` less the pending placeholders)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    def drop_pending(self) -> None:
        """Forget the placeholders (the request finished: their tokens are discarded)."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
        self.num_pending_tokens = 0
        self.last_token_pending = False
        self.pending_drafts = 0

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV (a prompt, or a resumed request being recomputed)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")
