"""The draft proposer interface: speculative decoding as scheduled tokens.

A proposer guesses the next tokens of running requests; the engine schedules them as lookahead
tokens after each request's last token, verifies them in the step's normal forward, keeps the
longest prefix the target agrees with (rejection sampling: outputs follow the target's
distribution exactly; greedy outputs equal plain decoding) and rolls back the rest (KV slots, block
registration). Proposers are plugins in the ``deepinfer.proposers`` entry-point group, enabled by
the engine config's ``speculative`` table:

    [speculative]
    proposer = "ngram"     # the entry-point name
    k = 4                  # most drafts per request and step (1..16)
    floor = true           # measure speculative against plain steps per batch size, run the faster
    ...                    # any other key goes to the proposer's constructor

Contract (checked by the engine; a violation, or ``propose`` raising, drops the drafts concerned for
that step with an error logged naming the proposer and ``spec_proposer_errors`` counted: the
requests decode on, one token per step, as without speculation):
``propose`` returns one :class:`Draft` (or None) per request, at most ``max_drafts[i]`` tokens,
each in the vocabulary, and ``probs`` (where given) the distributions the tokens were drawn from:
finite, non-negative rows summing to 1, positive at their token. Every decoding request is offered,
penalties and feature options (``so_args``: their masks reach the verify rows through
``process_logits``) included. Any other method that raises, or answers out of its contract (a
``verify_budget`` that is not a number, malformed ``DeviceDraft`` confidences), is logged the same
way and its default stands in (``active``: dormant for the step; ``relayout_pays``: True). A
proposer that fails to construct or ``start`` is a ``PluginError`` naming it.

Async scheduling (``engine/spec_async.py``): a proposer that sets ``proposes_on_device`` also
implements :meth:`Proposer.propose_on_device`, which drafts from device tensors (the tokens the
step in flight emits, the requests' true lengths) without waiting for the host, so speculative steps
overlap like plain ones: the host fixes each request's draft slots, the device fills them. Steps
with a request that needs its tokens on the host (penalties, grammar masks) still run synchronously
through :meth:`Proposer.propose`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.engine.model_runner import StepBatch
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.engine_view import EngineView

GROUP = "deepinfer.proposers"
MAX_K = 16


@dataclass
class Draft:
    """Proposed next tokens of one request.

    ``probs``: the draft distributions the tokens were drawn from, ``[len(tokens), vocab]``, for
    requests that sample (temperature > 0); None for a deterministic guess (a point mass on each
    token, verified by coupling: a seeded request then emits the tokens plain decoding emits with its
    seed; ``engine/rejection.py``). ``confidences``: optional
    per-position estimates of P(token j accepted | tokens before it accepted), for length policies."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidences: list[float] | None = None


@dataclass
class DeviceDraft:
    """Drafts proposed on the device (``Proposer.propose_on_device``) for R requests.

    ``tokens`` [R, K] int64: row i's first ``max_drafts[i]`` entries are its drafts (ids outside the
    vocabulary end a row's drafts there). ``confidences`` [R, K] float32 (optional): per-position
    estimates of P(accepted | drafts before accepted); with them the engine cuts each row's length on
    the device with the ``draft_lengths`` op (cumulative confidence >= ``min_confidence``, best first
    under the step's verify budget). Drafts are point masses (no draft distributions)."""

    tokens: torch.Tensor
    confidences: torch.Tensor | None = None
    min_confidence: float = 0.0


@dataclass
class StepHidden:
    """The target's final hidden states of the step in flight, for a proposer that reads them
    (``Proposer.needs_hidden``, e.g. an MTP head) and proposes on the device. Request i's rows are
    ``hidden[rows[i] + t]`` for t < ``counts[i]``, at token positions ``first[i] + t`` (``rows`` and
    ``first`` are on the device: that step's rows may have been laid out, and its positions shifted
    back by the rejected drafts of the step before it, on the device); ``counts[i] == 0``: the request
    was not in that step. Rows past what the step keeps (rejected drafts) hold states of tokens that
    were not accepted: a row at position p is valid when p + 1 < the request's true length."""

    hidden: torch.Tensor
    rows: torch.Tensor
    first: torch.Tensor
    counts: list[int]
    first_bound: list[int]  # ``first`` as the host knows it: an upper bound, exact for a prefill chunk


class Proposer(ABC):
    """A draft proposer (see the module docstring)."""

    name: str = ""
    core_api_version: str = ""
    #: True: the engine keeps every row's final hidden state of each step in ``batch.hidden``
    #: (a draft head reading the target's hidden states, e.g. MTP)
    needs_hidden: bool = False
    #: True: drafting writes KV at the request's last token and draft positions (a draft model with
    #: a cache group of its own): before ``propose`` the engine reserves the blocks for the last
    #: token and ``max_drafts[i]`` drafts (cutting ``max_drafts`` to what memory allows; a request
    #: whose last token gets no slot is not offered), and afterwards gives back what the kept drafts
    #: do not use. Requests with no room for drafts are offered too (``max_drafts`` 0: catch up only).
    writes_draft_kv: bool = False
    #: True: :meth:`propose_on_device` is implemented; with async scheduling on, speculative steps
    #: then overlap (their drafts are proposed on the device when the next step is launched)
    proposes_on_device: bool = False
    #: True: the proposer decides itself, from its own measurements, when drafting pays
    #: (:meth:`active`, :meth:`draft_slots`). False: the engine also keeps speculation no slower than
    #: plain decoding by measuring both per batch size (``engine/spec_floor.py``; ``[speculative]
    #: floor = false`` turns that off)
    paces_itself: bool = False

    def __init__(self, section: dict) -> None:
        """``section``: the ``[speculative]`` keys other than ``proposer`` and ``k``; raise
        ``ConfigError`` on bad ones."""
        if section:
            from deepinfer_core.config import ConfigError

            raise ConfigError(f"proposer {self.name!r} takes no settings, got keys {sorted(section)}")

    def start(self, engine: EngineView) -> None:
        """The engine is built (load a draft model here)."""

    def active(self, engine: EngineView) -> bool:
        """Whether the coming step should be a speculative one (asked before every step, only with
        async scheduling on; keep it cheap). While False the engine runs plain asynchronous steps
        and neither proposes nor verifies: a proposer whose drafts do not pay at this load (its
        measured step-time curve) goes dormant and costs nothing, and says True now and then to
        look again (that step runs synchronously and gets ``propose``)."""
        return True

    @abstractmethod
    def propose(self, engine: EngineView, requests: list[Sequence], max_drafts: list[int],
                batch: StepBatch) -> list[Draft | None]:
        """Drafts for requests whose next step is a decode, after a completed step.

        :param engine: the engine.
        :param requests: requests ready to decode (every token known, all but the last computed).
        :param max_drafts: the most tokens each may get (>= 1: within ``k``, ``max_tokens`` and the
            model's length; with ``writes_draft_kv`` also within the reserved slots, and 0 possible).
        :param batch: the step just completed (``batch.hidden`` when ``needs_hidden``).
        :return: one Draft or None per request.
        """

    def propose_on_device(self, engine: EngineView, requests: list[Sequence], max_drafts: list[int],
                          last_tokens: torch.Tensor, num_tokens: torch.Tensor, pending: torch.Tensor,
                          hidden: StepHidden | None = None) -> DeviceDraft:
        """Drafts for the step being launched while the previous one is still on the device (async
        scheduling; only when ``proposes_on_device``). Never read device values on the host here.

        :param engine: the engine.
        :param requests: the step's decodes given draft slots (their host ``token_ids`` may end in
            placeholders: tokens the step in flight is still sampling).
        :param max_drafts: draft slots of each (>= 1), fixed by the host.
        :param last_tokens: [R] int64 on the device: each request's last token (its query token).
        :param num_tokens: [R] int64 on the device: each request's true length, that last token included.
        :param pending: [R, P] int64 on the device: each request's tokens after its host-known ones
            (``token_ids[:num_known_tokens]``), still in flight, padded with -1 (a row of -1: none).
        :param hidden: only for a proposer with ``needs_hidden``: the step in flight's hidden states
            (:class:`StepHidden`; None when it kept none, e.g. a synchronous step).
        :return: a :class:`DeviceDraft` of ``R`` rows and at least ``max(max_drafts)`` columns.
        """
        raise NotImplementedError(f"proposer {self.name!r} does not propose on the device")

    def draft_slots(self, engine: EngineView, requests: list[Sequence], slots: list[int]) -> list[int]:
        """Async speculative steps, before scheduling: how many draft slots each decode-ready request
        is offered for the coming step (``slots``: ``k`` within its length limits; fewer, 0 for none).
        A request without slots decodes as in a plain step, and a step that offers none is a plain
        step: nothing is proposed, laid out or verified beyond it. Decide here, not in
        :meth:`propose_on_device`, which requests draft: slots offered and left empty still cost
        their verify rows. Default: every slot."""
        return slots

    def verify_budget(self, engine: EngineView, num_requests: int, num_slots: int) -> int | None:
        """Async speculative steps: how many draft rows (of ``num_slots`` reserved for
        ``num_requests`` decodes) the coming step verifies, fixed on the host before the drafts exist
        (e.g. from a measured step-time curve); the device then picks each request's length within
        it. None (the default): the engine's estimate, the share of slots recent steps filled."""
        return None

    def relayout_pays(self, engine: EngineView, num_requests: int, num_slots: int, budget: int) -> bool:
        """Async speculative steps whose verify budget is below the slots: whether laying the decode
        rows out anew within it (``spec_layout.compact_rows``: ``num_requests + budget`` forward rows
        instead of ``num_requests + num_slots``, for a few extra device operations) is cheaper than
        computing every slot's row (the lengths stay within the budget either way). Default: True."""
        return True

    def step_timed(self, engine: EngineView, tokens: int, requests: int, seconds: float) -> None:
        """Async speculative steps: one step's wall time, reported one step late (the pipeline's
        cycle from the previous completion to this one, ``engine/spec_timing.py``), with the rows its
        verify forward ran (``tokens``: the decodes plus the verify budget's rows) and its decode
        ``requests``; for a proposer's measured step-time curve. Steps with prefill chunks, and
        cycles that are not one step's (a drain, an idle gap, a plain step between), are not reported."""

    def step_drained(self, engine: EngineView, batch: StepBatch) -> None:
        """An overlapped step without drafts was just completed because the coming step is a
        synchronous speculative one (host drafting: :meth:`propose` after it sees only that step's
        rows). A proposer that reads the target's hidden states keeps what it needs of this one here.

        :param engine: the engine.
        :param batch: the drained step: its ``scheduled`` requests, ``row_starts``, ``computed_before``
            and, with ``needs_hidden``, every row's final hidden state in ``batch.hidden``.
        """

    def step_passed_dormant(self, engine: EngineView, batch: StepBatch) -> None:
        """Async scheduling, the proposer dormant: a plain overlapped step is still in flight while the next plain
        step launches, so no catch-up will read its hidden states (a speculative launch reads only the step in
        flight's, a drain hands its step to :meth:`step_drained`). A proposer that reads the target's hidden states
        keeps what it needs of this one here; they are device tensors, valid in stream order.

        :param engine: the engine.
        :param batch: the step in flight: its ``scheduled`` requests (``num_new_tokens`` rows each),
            ``row_starts``, ``computed_before`` (upper bounds only where ``first_dev`` is set: a step launched
            right after a speculative one) and, with ``needs_hidden``, every row's final hidden state in
            ``batch.hidden``.
        """

    def verified(self, engine: EngineView, requests: list[Sequence], num_drafts: list[int],
                 num_accepted: list[int]) -> None:
        """Feedback after verification: how many of each request's drafts were checked and kept."""

    def request_finished(self, engine: EngineView, request: Sequence) -> None:
        """Drop per-request state."""
