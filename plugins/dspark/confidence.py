"""The confidence head: per draft position, the probability that the target accepts the draft
token given that every earlier draft token was accepted.

    logit = w_h . h + w_x . x(q, d, greedy) + b
    confidence = sigmoid(logit / confidence_temperature)

``h`` is the draft's final normalised hidden state at the position that proposed d (the input of
its LM head); ``x`` are six scalars of the draft's raw (temperature 1) next-token distribution q
there: log q(d), q(d), the entropy H(q), ``greedy`` (1 for temperature-0 requests), greedy * log q(d)
and greedy * q(d) (acceptance is a sharper function of q(d) for greedy requests, whose drafts are
q's argmax, than for sampled ones). It is a single linear layer, trained by
``examples/train_dspark_draft.py`` (logistic regression on logged accept/reject outcomes of the
target) and stored as safetensors next to the draft (``confidence_head.safetensors``).

Without trained weights (e.g. an MTP draft), the confidence is the draft's own probability of its
token, ``q(d)``, with the same temperature applied to its log-odds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FILENAME = "confidence_head.safetensors"
EXTRA_FEATURES = ("draft_logprob", "draft_prob", "draft_entropy", "greedy", "greedy_x_logprob", "greedy_x_prob")


class ConfidenceHead:
    def __init__(self, w_hidden: torch.Tensor | None, w_extra: torch.Tensor | None, bias: float,
                 temperature: float = 1.0) -> None:
        self.w_hidden = w_hidden  # [C] float32, or None for the fallback
        self.w_extra = w_extra  # [len(EXTRA_FEATURES)] float32
        self.bias = float(bias)
        self.temperature = float(temperature)

    @property
    def trained(self) -> bool:
        return self.w_hidden is not None

    @classmethod
    def fallback(cls, temperature: float = 1.0) -> ConfidenceHead:
        return cls(None, None, 0.0, temperature)

    @classmethod
    def load(cls, path: Path, hidden_size: int, temperature: float, device=None) -> ConfidenceHead:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        names = tuple(meta.get("extra_features", "").split(",")) if meta.get("extra_features") else ()
        if names != EXTRA_FEATURES:
            raise ValueError(f"{path}: confidence head features {names} != {EXTRA_FEATURES}")
        t = load_file(str(path))
        w = t["w_hidden"].float()
        if w.shape != (hidden_size,):
            raise ValueError(f"{path}: w_hidden has shape {tuple(w.shape)}, the draft's hidden size is "
                             f"{hidden_size}")
        dev = device or "cpu"
        return cls(w.to(dev), t["w_extra"].float().to(dev), float(t["bias"].item()), temperature)

    def save(self, path: Path, **meta: str) -> None:
        save_file({"w_hidden": self.w_hidden.float().contiguous().cpu(),
                   "w_extra": self.w_extra.float().contiguous().cpu(),
                   "bias": torch.tensor([self.bias], dtype=torch.float32)},
                  str(path), metadata={"extra_features": ",".join(EXTRA_FEATURES), "format": "pt",
                                       **{k: str(v) for k, v in meta.items()}})

    @staticmethod
    def features(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log q(token), entropy of q) of the raw draft distribution, per row."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return logp.gather(1, tokens[:, None])[:, 0], ent

    @staticmethod
    def extra_features(logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """[N, len(EXTRA_FEATURES)] from log q(d), H(q) and the greedy flag."""
        q, g = logq.float().exp(), greedy.float()
        logq = logq.float().clamp(min=-30.0)
        return torch.stack((logq, q, entropy.float(), g, g * logq, g * q), dim=-1)

    def logit(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor,
              greedy: torch.Tensor) -> torch.Tensor:
        if self.w_hidden is None:
            q = logq.exp().clamp(1e-6, 1 - 1e-6)
            return torch.log(q) - torch.log1p(-q)
        extra = self.extra_features(logq, entropy, greedy)
        return hidden.float() @ self.w_hidden + extra @ self.w_extra + self.bias

    def __call__(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor,
                 greedy: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(hidden, logq, entropy, greedy) / self.temperature)

    def per_row(self, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The greedy flag folded into per-row coefficients of log q(d), q(d) and the bias, for
        ``fast`` (None for the fallback head)."""
        if self.w_hidden is None:
            return None
        g, w = greedy.float(), self.w_extra
        return w[0] + g * w[4], w[1] + g * w[5], g * w[3] + self.bias

    def fast(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor,
             rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``self(hidden, logq, entropy, greedy)`` in fewer ops, with ``rows = self.per_row(greedy)``."""
        if rows is None:
            return self(hidden, logq, entropy, greedy)
        a_lq, a_q, c = rows
        logq = logq.float()
        z = torch.addmv(c, hidden.float(), self.w_hidden)
        z = z + logq.clamp(min=-30.0) * a_lq + logq.exp() * a_q + entropy.float() * self.w_extra[2]
        return torch.sigmoid(z / self.temperature)
