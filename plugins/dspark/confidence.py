"""The confidence head: per draft position, the probability that the target accepts the draft
token given that every earlier draft token was accepted.

    logit = w_h . h + w_x . x(q, d, greedy) + w_t . f_T + w_l . f_L + b
    confidence = sigmoid(logit / confidence_temperature)

``h`` is the draft's final normalised hidden state at the position that proposed d (the input of
its LM head). ``x`` are scalars of the draft's raw (temperature 1) next-token distribution q there
(``EXTRA_FEATURES``): log q(d), q(d), the entropy H(q), ``greedy`` (1 for temperature-0 requests),
greedy * log q(d), greedy * q(d) (acceptance is a sharper function of q(d) for greedy requests, whose
drafts are q's argmax, than for sampled ones), then the margin q(top-1) - q(top-2), log q(top-2),
greedy * margin, and ten greedy-only bins of q(d) (a piecewise calibration of the greedy case).
Heads saved before the margin and bins (``LEGACY_FEATURES``, the shipped draft model's) still load.

``f_T`` (``TARGET_FEATURES``, optional: MTP drafts, which are fed the target's hidden states) is
the target's own state at the request's last verified position, the same for every draft depth of
a step: log p_T(top-1), p_T(top-1), H(p_T), the margin p_T(top-1) - p_T(top-2) of the target's
next-token distribution there (its logits, recomputed from its final hidden state by the shared LM
head), and the fraction of the request's drafts the target accepted at its last verification (with a
flag for "none yet"). How predictable the text is just before the drafts is something the draft's
own distribution sees only in part.

``f_L`` (``plugins.dspark.lookup.FEATURES``, optional) says whether the draft agrees with what the
request's own text predicts (the tokens that followed the latest earlier occurrence of its last 1-4
tokens): per draft position, per n, whether that continuation reaches it, agrees there, and agrees
all the way to it; and whether the draft there is a run token that replaced the draft's argmax
(``lookup_drafts``).

A single linear layer, trained by ``examples/train_dspark_draft.py`` (logistic regression on logged
accept/reject outcomes of the target, temperature fitted on other prompts) and stored as
safetensors next to the draft (``confidence_head.safetensors``; the feature names in its metadata).

Without trained weights (e.g. a checkpoint's own MTP layer), the confidence is the draft's own
probability of its token, ``q(d)``, with the same temperature applied to its log-odds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from plugins.dspark import lookup as lookup_mod

FILENAME = "confidence_head.safetensors"
LEGACY_FEATURES = ("draft_logprob", "draft_prob", "draft_entropy", "greedy", "greedy_x_logprob", "greedy_x_prob")
Q_BINS = 10
EXTRA_FEATURES = (*LEGACY_FEATURES, "draft_margin", "draft_logprob_2nd", "greedy_x_margin",
                  *(f"greedy_q_bin{i}" for i in range(Q_BINS)))
TARGET_FEATURES = ("target_top1_logprob", "target_top1_prob", "target_entropy", "target_margin", "prev_accept_frac",
                   "no_prev")


def draft_stats(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log q(token), entropy of q, log q of q's top-2 token) of the raw draft distribution, per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, tokens[:, None])[:, 0], ent, logp.topk(2, dim=-1).values[:, 1]


def extra_features(names: tuple[str, ...], logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor,
                   logq2: torch.Tensor | None = None) -> torch.Tensor:
    """[N, len(names)] draft features (``names``: ``EXTRA_FEATURES`` or ``LEGACY_FEATURES``).
    ``logq2``: log q of the top-2 token (needed by ``EXTRA_FEATURES``). For greedy rows d is q's
    argmax, so the margin is q(d) - q(top-2); for sampled rows it is q(top-1) - q(top-2) only when d
    is the top-1, which the sampled rows' weights absorb."""
    q, g = logq.float().exp(), greedy.float()
    lq = logq.float().clamp(min=-30.0)
    cols = [lq, q, entropy.float(), g, g * lq, g * q]
    if names == LEGACY_FEATURES:
        return torch.stack(cols, dim=-1)
    lq2 = logq2.float().clamp(min=-30.0)
    margin = (q - lq2.exp()).clamp(min=0.0)
    bins = torch.nn.functional.one_hot((q * Q_BINS).long().clamp(0, Q_BINS - 1), Q_BINS).float() * g[:, None]
    return torch.cat((torch.stack((*cols, margin, lq2, g * margin), dim=-1), bins), dim=-1)


def target_features(target_logits: torch.Tensor, prev_frac: torch.Tensor) -> torch.Tensor:
    """[R, len(TARGET_FEATURES)] from the target's logits at each request's last verified position
    and the fraction of its drafts accepted at its last verification (NaN: none yet)."""
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    top = logp.topk(2, dim=-1).values
    p = top.exp()
    ent = -(logp.exp() * logp).sum(-1)
    none = torch.isnan(prev_frac)
    return torch.stack((top[:, 0].clamp(min=-30.0), p[:, 0], ent, p[:, 0] - p[:, 1],
                        torch.where(none, torch.zeros_like(prev_frac), prev_frac), none.float()), dim=-1)


def _optional_weights(path: Path, meta: dict, tensors: dict, kind: str, expected: tuple[str, ...],
                      device) -> torch.Tensor | None:
    """``w_<kind>`` of a head whose metadata lists ``<kind>_features`` (None when it lists none),
    checked against the feature names this code computes."""
    listed = meta.get(f"{kind}_features")
    if not listed:
        return None
    names = tuple(listed.split(","))
    if names != expected:
        raise ValueError(f"{path}: confidence head {kind} features {names} != {expected}")
    w = tensors.get(f"w_{kind}")
    if w is None:
        raise ValueError(f"{path}: the metadata lists {kind}_features, the file has no w_{kind}")
    if w.shape != (len(names),):
        raise ValueError(f"{path}: w_{kind} has shape {tuple(w.shape)}, expected ({len(names)},)")
    return w.float().to(device)


class ConfidenceHead:
    def __init__(self, w_hidden: torch.Tensor | None, w_extra: torch.Tensor | None, bias: float,
                 temperature: float = 1.0, w_target: torch.Tensor | None = None,
                 names: tuple[str, ...] = EXTRA_FEATURES, w_lookup: torch.Tensor | None = None) -> None:
        self.w_hidden = w_hidden  # [C] float32, or None for the fallback
        self.w_extra = w_extra  # [len(names)] float32
        self.bias = float(bias)
        self.temperature = float(temperature)
        self.w_target = w_target  # [len(TARGET_FEATURES)] float32, or None: no target features
        self.names = names
        self.w_lookup = w_lookup  # [len(lookup.FEATURES)] float32, or None: no lookup features

    @property
    def trained(self) -> bool:
        return self.w_hidden is not None

    @property
    def uses_target(self) -> bool:
        """The head reads the target's features (only an MTP draft is fed them)."""
        return self.w_target is not None

    @property
    def uses_lookup(self) -> bool:
        """The head reads the lookup features (``plugins.dspark.lookup``)."""
        return self.w_lookup is not None

    @classmethod
    def fallback(cls, temperature: float = 1.0) -> ConfidenceHead:
        return cls(None, None, 0.0, temperature)

    @classmethod
    def load(cls, path: Path, hidden_size: int, temperature: float, device=None) -> ConfidenceHead:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        names = tuple(meta.get("extra_features", "").split(",")) if meta.get("extra_features") else ()
        if names not in (EXTRA_FEATURES, LEGACY_FEATURES):
            raise ValueError(f"{path}: confidence head features {names} != {EXTRA_FEATURES}")
        t = load_file(str(path))
        w = t["w_hidden"].float()
        if w.shape != (hidden_size,):
            raise ValueError(f"{path}: w_hidden has shape {tuple(w.shape)}, the draft's hidden size is "
                             f"{hidden_size}")
        we = t["w_extra"].float()
        if we.shape != (len(names),):
            raise ValueError(f"{path}: w_extra has shape {tuple(we.shape)}, expected ({len(names)},)")
        dev = device or "cpu"
        wt = _optional_weights(path, meta, t, "target", TARGET_FEATURES, dev)
        wl = _optional_weights(path, meta, t, "lookup", lookup_mod.FEATURES, dev)
        return cls(w.to(dev), we.to(dev), float(t["bias"].item()), temperature, wt, names, wl)

    def save(self, path: Path, **meta: str) -> None:
        tensors = {"w_hidden": self.w_hidden.float().contiguous().cpu(),
                   "w_extra": self.w_extra.float().contiguous().cpu(),
                   "bias": torch.tensor([self.bias], dtype=torch.float32)}
        info = {"extra_features": ",".join(self.names), "format": "pt"}
        if self.uses_target:
            tensors["w_target"] = self.w_target.float().contiguous().cpu()
            info["target_features"] = ",".join(TARGET_FEATURES)
        if self.uses_lookup:
            tensors["w_lookup"] = self.w_lookup.float().contiguous().cpu()
            info["lookup_features"] = ",".join(lookup_mod.FEATURES)
        save_file(tensors, str(path), metadata={**info, **{k: str(v) for k, v in meta.items()}})

    def target_term(self, target_feats: torch.Tensor) -> torch.Tensor | None:
        """The per-row logit term of the target features ([R]); None when the head reads none."""
        return None if self.w_target is None else target_feats.float() @ self.w_target

    def lookup_term(self, feats: torch.Tensor | None) -> torch.Tensor | None:
        """The per-row logit term of the lookup features ([..., len(lookup.FEATURES)] -> [...]); None
        when the head reads none."""
        return None if self.w_lookup is None or feats is None else feats.float() @ self.w_lookup

    def logit(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor,
              logq2: torch.Tensor | None = None, target: torch.Tensor | None = None,
              lookup: torch.Tensor | None = None) -> torch.Tensor:
        """``target``, ``lookup``: the per-row ``target_term`` and ``lookup_term`` (None: not read)."""
        if self.w_hidden is None:
            q = logq.exp().clamp(1e-6, 1 - 1e-6)
            return torch.log(q) - torch.log1p(-q)
        extra = extra_features(self.names, logq, entropy, greedy, logq2)
        z = hidden.float() @ self.w_hidden + extra @ self.w_extra + self.bias
        z = z if target is None else z + target
        return z if lookup is None else z + lookup

    def __call__(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor,
                 logq2: torch.Tensor | None = None, target: torch.Tensor | None = None,
                 lookup: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logit(hidden, logq, entropy, greedy, logq2, target, lookup) / self.temperature)

    def per_row(self, greedy: torch.Tensor, target: torch.Tensor | None = None) -> tuple | None:
        """The greedy flag and the target term folded into per-row coefficients, computed once per
        step for ``fast`` (None for the fallback head)."""
        if self.w_hidden is None:
            return None
        g, w = greedy.float(), self.w_extra
        c = g * w[3] + self.bias
        if target is not None:
            c = c + target
        if self.names == LEGACY_FEATURES:
            return w[0] + g * w[4], w[1] + g * w[5], c
        # per row: coefficients of (log q(d), q(d), H, margin, log q(top-2)), and its greedy q-bin weights
        coef = torch.stack((w[0] + g * w[4], w[1] + g * w[5], w[2].expand_as(g), w[6] + g * w[8], w[7].expand_as(g)),
                           dim=-1)
        return coef, c, g[:, None] * w[9:][None, :]

    def fast(self, hidden: torch.Tensor, logq: torch.Tensor, entropy: torch.Tensor, greedy: torch.Tensor,
             rows: tuple | None, logq2: torch.Tensor | None = None, lookup: torch.Tensor | None = None
             ) -> torch.Tensor:
        """``self(...)`` in fewer ops, with ``rows = self.per_row(greedy, target)`` computed once per step
        (``lookup``: this depth's ``lookup_term``, None: not read)."""
        if rows is None:
            return self(hidden, logq, entropy, greedy, logq2)
        logq = logq.float()
        q = logq.exp()
        if self.names == LEGACY_FEATURES:
            a_lq, a_q, c = rows
            z = torch.addmv(c, hidden.float(), self.w_hidden)
            z = z + logq.clamp(min=-30.0) * a_lq + q * a_q + entropy.float() * self.w_extra[2]
            return torch.sigmoid((z if lookup is None else z + lookup) / self.temperature)
        coef, c, bins = rows
        lq2 = logq2.float().clamp(min=-30.0)
        x = torch.stack((logq.clamp(min=-30.0), q, entropy.float(), (q - lq2.exp()).clamp(min=0.0), lq2), -1)
        z = torch.addmv(c, hidden.float(), self.w_hidden) + (x * coef).sum(-1)
        z = z + bins.gather(1, (q * Q_BINS).long().clamp(0, Q_BINS - 1)[:, None])[:, 0]
        return torch.sigmoid((z if lookup is None else z + lookup) / self.temperature)
