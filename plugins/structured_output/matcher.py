"""Per-request grammar state: trigger watching, the xgrammar matcher, the bound token, rollback."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Executor, Future

import torch
import xgrammar as xgr

from plugins.structured_output.bitmask import CpuMask, prepare_cpu_mask
from plugins.structured_output.grammar import GrammarSpec

WATCH, ACTIVE, DONE = "watch", "active", "done"
MAX_ROLLBACK = 1024  # tokens of history kept for rollback


class GrammarState:
    """Constrained decoding of one request.

    Phases: ``watch`` (free output, waiting for ``trigger_token_ids``), ``active`` (every token must
    follow the grammar) and ``done`` (free output after the grammar ended). The grammar ends when the
    matcher accepts one of its stop tokens: ``bound_token_id`` if set, else the request's EOS tokens.
    With a trigger, the end of a span re-arms the watch for the next one.

    Every accepted token is recorded, so :meth:`rollback` can undo tokens across phase changes
    (speculative decoding). Methods must be called from one thread; a mask fill scheduled on a worker
    (:meth:`schedule_fill`) is waited for before any state change.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec, eos_token_ids: list[int],
                 vocab_size: int, cpu_masks: bool = False) -> None:
        self.compiled, self.spec = compiled, spec
        self.vocab_size = vocab_size
        self.cpu_masks = cpu_masks  # also prepare each filled mask for CPU logits (bitmask.CpuMask)
        self.cpu_mask: CpuMask | None = None
        self.stop_token_ids = [spec.bound_token_id] if spec.bound_token_id is not None else list(eos_token_ids)
        info = compiled.tokenizer_info
        # tokens without text (BOS, the tokenizer's EOS when a bound token replaces it, padding ids):
        # xgrammar would take an empty token as a no-op, so they are rejected here
        self.textless = frozenset(info.special_token_ids) | (frozenset(info.stop_token_ids)
                                                              - set(self.stop_token_ids))
        self.trigger = list(spec.trigger_token_ids)
        self.phase = WATCH if self.trigger else ACTIVE
        self.matcher: xgr.GrammarMatcher | None = None if self.trigger else self._new_matcher()
        self.window: list[int] = []  # last output tokens while watching (at most len(trigger))
        self.history: deque[tuple] = deque(maxlen=MAX_ROLLBACK)
        self.spans = 0  # constrained spans completed
        self.mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._words = self.mask.numpy()[0]  # a view of the same memory
        self.mask_valid = False
        self.fill_seconds = 0.0
        self.fills = 0
        self._fill: Future | None = None

    def _new_matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return self.phase == ACTIVE

    @property
    def is_finished(self) -> bool:
        """Whether nothing may follow: the grammar ended at an EOS token (no ``bound_token_id``) and no
        trigger can start another span. The request ends there, even with ``ignore_eos``."""
        return self.phase == DONE and self.spec.bound_token_id is None

    @property
    def is_terminated(self) -> bool:
        """Whether the last constrained span has ended (its stop or bound token was accepted)."""
        return self.spans > 0 and self.phase != ACTIVE

    # ---- masks -----------------------------------------------------------------------------------
    def fill_mask(self) -> None:
        """Fill ``self.mask`` for the next token (only meaningful while active)."""
        t0 = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self.mask)
        if self.cpu_masks:
            self.cpu_mask = prepare_cpu_mask(self._words, self.vocab_size)
        self.fill_seconds += time.perf_counter() - t0
        self.fills += 1
        self.mask_valid = True

    def schedule_fill(self, fut: Future) -> None:
        """Note that a worker is filling the mask (``fut`` completes when it has)."""
        self._fill = fut

    def sync(self) -> None:
        """Wait for a scheduled fill."""
        fut, self._fill = self._fill, None
        if fut is not None:
            fut.result()

    def next_mask(self) -> torch.Tensor:
        """The [1, ceil(V/32)] int32 bitmask for the next token (filled now if no worker did)."""
        self.sync()
        if not self.mask_valid:
            self.fill_mask()
        return self.mask

    def next_cpu_mask(self) -> CpuMask:
        """The next-token mask prepared for CPU logits (``cpu_masks`` states)."""
        self.next_mask()
        return self.cpu_mask

    # ---- advancing and undoing -------------------------------------------------------------------
    def accept_token(self, token: int) -> bool:
        """Advance by one output token. False (state unchanged) if the grammar rejects it."""
        self.sync()
        if self.phase == ACTIVE:
            if token in self.textless or not self.matcher.accept_token(token):
                return False
            self.mask_valid = False
            if self.matcher.is_terminated():
                self.spans += 1
                self.history.append(("end",))
                self.phase, self.window = (WATCH if self.trigger else DONE), []
            else:
                self.history.append(("tok",))
            return True
        self.mask_valid = False
        if self.phase == WATCH:
            old = self.window
            self.window = (old + [token])[-len(self.trigger):]
            if self.window == self.trigger:
                self.history.append(("start", old, self.matcher))
                self.phase, self.window, self.matcher = ACTIVE, [], self._new_matcher()
            else:
                self.history.append(("watch", old))
            return True
        self.history.append(("free",))
        return True

    def accept_tokens(self, tokens: list[int]) -> int:
        """Accept tokens in order until one is rejected; returns how many were accepted."""
        for i, t in enumerate(tokens):
            if not self.accept_token(t):
                return i
        return len(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (phase changes included)."""
        self.sync()
        if n < 0 or n > len(self.history):
            raise ValueError(f"cannot roll back {n} tokens; {len(self.history)} can be undone")
        for _ in range(n):
            entry = self.history.pop()
            kind = entry[0]
            if kind == "tok":
                self.matcher.rollback(1)
            elif kind == "end":
                self.matcher.rollback(1)
                self.spans -= 1
                self.phase, self.window = ACTIVE, []
            elif kind == "start":
                self.phase, self.window, self.matcher = WATCH, entry[1], entry[2]
            elif kind == "watch":
                self.window = entry[1]
        self.mask_valid = False

    # ---- speculative decoding helpers ------------------------------------------------------------
    def validate_draft(self, tokens: list[int]) -> int:
        """How many leading draft tokens the grammar accepts; the state is left unchanged."""
        n = self.accept_tokens(tokens)
        self.rollback(n)
        return n

    def fill_draft_bitmasks(self, tokens: list[int], bitmask: torch.Tensor, offset: int = 0) -> int:
        """Fill ``bitmask[offset + i]`` with the mask for the token that follows ``tokens[:i]``, for
        i = 0..len(tokens), stopping after the first draft token the grammar rejects (rows with no
        constraint are all ones). Returns the number of rows filled; the state is left unchanged."""
        accepted = 0
        rows = 0
        for i in range(len(tokens) + 1):
            if self.phase == ACTIVE:
                self.matcher.fill_next_token_bitmask(bitmask, offset + i)
            else:
                bitmask[offset + i] = -1
            rows += 1
            if i == len(tokens) or not self.accept_token(tokens[i]):
                break
            accepted += 1
        self.rollback(accepted)
        return rows


def fill_masks(states: list[GrammarState]) -> None:
    """Worker job: fill the next-token masks of ``states``."""
    for st in states:
        st.fill_mask()


def schedule_fills(executor: Executor, states: list[GrammarState]) -> None:
    """Fill the masks of ``states`` on ``executor``; each state waits for it before changing."""
    if states:
        fut = executor.submit(fill_masks, states)
        for st in states:
            st.schedule_fill(fut)
