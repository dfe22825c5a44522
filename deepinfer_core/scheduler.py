"""The scheduling-policy interface.

A scheduler decides, every step, which requests run and how many new tokens each gets, under the
step's token budget, its time budget and the KV memory the block manager has. Schedulers are
plugins in the ``deepinfer.schedulers`` group; the engine owns the mechanism (block allocation,
model execution), the scheduler only the policy.

The engine gives the scheduler an :class:`Admission` (feature hooks the scheduler consults while
admitting a request); the scheduler reports its queue through ``num_running``/``num_waiting``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.cost_model import CostModel
    from deepinfer_core.engine.kv_cache_manager import KVCacheManager
    from deepinfer_core.engine.sequence import Sequence


@dataclass
class SchedulerBudget:
    max_num_seqs: int
    max_num_batched_tokens: int
    compute_quota_limit: float | None = None  # seconds of prefill compute per step
    max_model_len: int = 4096


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose KV this step computes (a prefill chunk, or 1 for decode)
    #: speculative decoding: a decode's lookahead tokens (a prefix of ``seq.spec_tokens``), verified
    #: in this step; their KV slots are reserved with the step's blocks and count in its token budget
    spec_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # laid out first
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return (sum(s.num_new_tokens for s in self.prefills)
                + sum(s.num_new_tokens + len(s.spec_tokens) for s in self.decodes))

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Admission(Protocol):
    """What the engine answers while a scheduler admits a waiting request."""

    def is_ready(self, seq: Sequence) -> bool:
        """May this waiting request be scheduled now (feature hooks: a grammar still compiling, KV
        blocks still being fetched, a request already failed)?"""

    def admit_prefix(self, seq: Sequence) -> int:
        """Take the cached blocks of a request being admitted (every KV tier); returns the number of
        its tokens they cover (a multiple of the block size, 0 without prefix caching)."""


class AdmitAll:
    """The :class:`Admission` of a scheduler used without an engine: every request is ready, no cache."""

    def is_ready(self, seq: Sequence) -> bool:
        return True

    def admit_prefix(self, seq: Sequence) -> int:
        return 0


class Scheduler(ABC):
    """Scheduling policy. Constructed by the engine with the budget, the block manager, the
    (possibly None) prefill cost model and the engine's :class:`Admission`."""

    name: str = ""
    core_api_version: str = ""

    def __init__(self, budget: SchedulerBudget, blocks: KVCacheManager, cost_model: CostModel | None,
                 admission: Admission | None = None) -> None:
        self.budget, self.blocks, self.cost_model = budget, blocks, cost_model
        self.admission: Admission = admission if admission is not None else AdmitAll()

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work, allocating KV blocks through ``self.blocks``; preempt when short."""

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Remove a finished or failed request and release its blocks."""

    @abstractmethod
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""

    @abstractmethod
    def num_running(self) -> int:
        """Requests holding KV blocks now (used by the DP load balancer)."""

    def running_requests(self) -> list[Sequence]:
        """The requests holding KV blocks now (what ``num_running`` counts); a dp rank sums their
        fitted decode cost to split the prefill budget. Default: none known (that rank reserves
        nothing for decodes); a scheduler that keeps running requests returns them."""
        return []

    @abstractmethod
    def num_waiting(self) -> int:
        """Requests queued and not yet admitted (load gauges, the DP load balancer)."""

    @abstractmethod
    def remove_waiting(self, seq: Sequence) -> None:
        """Drop a queued request that will never run (failed before admission); no-op when absent."""
