"""DSpark's per-request draft state and the tensors of the requests drafting in a step."""

from __future__ import annotations

import torch

from deepinfer_core.engine.rejection import SamplingRows
from deepinfer_core.engine.sequence import Sequence
from plugins.dspark.lean import context_slot_table
from plugins.dspark.lookup import LookupRows

KEY = "dspark"  # seq.feature_state key


class _State:
    """Per-request draft state (``seq.feature_state['dspark']``)."""

    __slots__ = ("epoch", "done", "drafts", "cum", "conf", "q", "base_len", "fed", "feats",
                 "verified", "accepted", "decode_steps", "recent_conf", "kept_hidden", "kept_rows", "prev_frac",
                 "dev_launch", "dev_pending")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.done = 0  # positions whose draft KV is valid
        self.drafts: list[int] = []  # proposed tokens for token indices base_len, base_len + 1, ...
        self.cum: list[float] = []  # P(d_1..d_j all accepted)
        self.conf: list[float] = []
        self.q: torch.Tensor | None = None  # draft distributions [n, V] (sampled requests)
        self.base_len = -1
        self.fed = 0  # drafts whose draft KV was written (valid when accepted)
        self.feats = None  # (hidden, logq, entropy, logq top-2, target features, lookup features) when logged
        self.verified = self.accepted = self.decode_steps = 0
        self.recent_conf: float | None = None  # its last first-draft confidence (is its text predictable now?)
        # MTP: the target's hidden states of positions done, done + 1, ... computed in steps without
        # drafting, kept for the catch-up when drafting resumes
        self.kept_hidden: list[torch.Tensor] = []
        self.kept_rows = 0
        self.prev_frac = float("nan")  # fraction of its drafts accepted at its last verification (NaN: none yet)
        self.dev_launch = -2  # the engine's launched-step count at its last draft on the device (plugins.dspark.device)
        self.dev_pending = False  # drafted on the device, not yet verified


class _Rows:
    """The requests drafting this step, as tensors for the autoregressive draft loop."""

    def __init__(self, seqs: list[Sequence], caps: list[int], block_size: int, device) -> None:
        self.seqs, self.caps = seqs, caps
        R = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        self.block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                         dtype=torch.int32, device=device)
        self.bt_long = self.block_tables.long()
        self.base = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long, device=device)
        self.cap_t = torch.tensor(caps, dtype=torch.long, device=device)
        self.cu = torch.arange(R + 1, dtype=torch.long, device=device)
        self.greedy_list = [s.params.temperature <= 0 for s in seqs]
        self.all_greedy = all(self.greedy_list)
        self.greedy = torch.tensor(self.greedy_list, dtype=torch.bool, device=device)
        self.seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=device)
        self.params = None if self.all_greedy else SamplingRows.from_params([s.params for s in seqs], device)
        self.block_size = block_size
        self.row_idx = torch.arange(R, device=device)
        self.base_max = max(s.num_tokens for s in seqs)
        self.head_rows: tuple | None = None  # the confidence head's per-row coefficients, once computed
        self.lookup: LookupRows | None = None  # the host draft loop's lookup features (plugins.dspark.lookup)
        self._ctx: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, seqs: list[Sequence], caps: list[int], block_size: int, block_tables: torch.Tensor,
                     base: torch.Tensor, cap_t: torch.Tensor, greedy: torch.Tensor) -> _Rows:
        """The same from device tensors already made (one upload; ``base``: the true lengths), for
        greedy drafting only (no sampling parameters)."""
        rows = cls.__new__(cls)
        rows.seqs, rows.caps, rows.block_size = seqs, caps, block_size
        rows.block_tables, rows.bt_long = block_tables, block_tables.long()
        rows.base, rows.cap_t, rows.greedy = base, cap_t, greedy
        rows.cu = rows.row_idx = torch.arange(len(seqs) + 1, device=base.device)
        rows.row_idx = rows.cu[:-1]
        rows.greedy_list = [s.params.temperature <= 0 for s in seqs]
        rows.all_greedy, rows.seeds, rows.params = True, None, None
        rows.base_max = max(s.num_tokens for s in seqs)  # the host's lengths: upper bounds
        rows.head_rows, rows._ctx, rows.lookup = None, None, None
        return rows

    @property
    def ctx(self) -> torch.Tensor:
        """[R, W * block_size] cache slot of every position of each row (the lean draft path)."""
        if self._ctx is None:
            self._ctx = context_slot_table(self.block_tables, self.block_size)
        return self._ctx
