"""Fitting and checking DSpark's confidence head from logged outcomes (``DSpark.outcome_log``, a
fixed-k run): the logistic regression, its temperature, decile calibration, and the offline replay
of a cut on the cumulative confidence (what a threshold policy would have verified and accepted).
Used by ``examples/train_dspark_draft.py`` and the tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plugins.dspark.confidence import EXTRA_FEATURES, ConfidenceHead, extra_features


@dataclass
class Outcomes:
    """Per verified draft position: the head's inputs and whether the target accepted it.
    ``decided``: the position was reached (every earlier draft accepted), so its outcome says
    something about the conditional confidence; ``step``/``depth``/``accepted``: the verification
    it belongs to, its index there, and that step's accepted count (for the replay)."""

    hidden: torch.Tensor  # [N, C]
    raw: torch.Tensor  # [N, 4]: log q(d), H(q), greedy, log q(top-2)
    target: torch.Tensor | None  # [N, len(TARGET_FEATURES)] or None (no target features logged)
    lookup: torch.Tensor | None  # [N, len(lookup.FEATURES)] or None (no lookup features logged)
    y: torch.Tensor  # [N] 1.0 accepted
    decided: torch.Tensor  # [N] bool
    step: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    accepted: torch.Tensor  # [N]

    def subset(self, mask: torch.Tensor) -> Outcomes:
        return Outcomes(*(None if v is None else v[mask] for v in vars(self).values()))


def outcomes(records: list) -> Outcomes:
    """Every verified position of the logged records (the record layout: ``DSpark.verified``)."""
    hs, raw, tf, lks, ys, dec, step, depth, acc = [], [], [], [], [], [], [], [], []
    for i, rec in enumerate(records):
        h, lq, ent, greedy, _, _, _, cum, a, lq2, t = rec[:11]
        lk = rec[11] if len(rec) > 11 else None
        m = len(cum)
        lks.append(None if lk is None else lk[:m].float())
        hs.append(h[:m].float())
        raw.append(torch.stack((lq[:m].float(), ent[:m].float(), torch.full((m,), float(greedy)), lq2[:m].float()), -1))
        tf.append(None if t is None else t.float()[None].expand(m, -1))
        j = torch.arange(m)
        ys.append((j < a).float())
        dec.append(j <= a)
        step.append(torch.full((m,), i))
        depth.append(j)
        acc.append(torch.full((m,), a))
    target = torch.cat(tf) if tf and all(t is not None for t in tf) else None
    lookup = torch.cat(lks) if lks and all(x is not None for x in lks) else None
    return Outcomes(torch.cat(hs), torch.cat(raw), target, lookup, torch.cat(ys), torch.cat(dec), torch.cat(step),
                    torch.cat(depth), torch.cat(acc))


def _inputs(o: Outcomes, use_target: bool, use_lookup: bool, names: tuple[str, ...] = EXTRA_FEATURES) -> torch.Tensor:
    x = [o.hidden, extra_features(names, o.raw[:, 0], o.raw[:, 1], o.raw[:, 2] > 0.5, o.raw[:, 3])]
    if use_target:
        x.append(o.target)
    if use_lookup:
        x.append(o.lookup)
    return torch.cat(x, dim=-1).double()


def fit_head(o: Outcomes, l2: float, use_target: bool, use_lookup: bool = False,
             names: tuple[str, ...] = EXTRA_FEATURES) -> ConfidenceHead:
    """Logistic regression (standardised inputs, L2 ``l2``) on the decided positions; ``use_target``,
    ``use_lookup``: also on the logged target and lookup features; ``names``: the draft scalars
    (``EXTRA_FEATURES``, or the six ``LEGACY_FEATURES``: fewer ops per draft step)."""
    d = o.subset(o.decided)
    X = _inputs(d, use_target, use_lookup, names)
    mu, sd = X.mean(0), X.std(0).clamp(min=1e-6)
    Z = (X - mu) / sd
    w = torch.zeros(X.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=300, line_search_fn="strong_wolfe")
    yd = d.y.double()

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(Z @ w + b, yd) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w_raw = w.detach() / sd
    b_raw = float(b.detach() - (w.detach() * mu / sd).sum())
    C, E = d.hidden.shape[1], len(names)
    T = d.target.shape[1] if use_target else 0
    wt = w_raw[C + E : C + E + T].float() if use_target else None
    wl = w_raw[C + E + T :].float() if use_lookup else None
    return ConfidenceHead(w_raw[:C].float(), w_raw[C : C + E].float(), b_raw, w_target=wt, names=names, w_lookup=wl)


def predict(head: ConfidenceHead, o: Outcomes) -> torch.Tensor:
    """The head's confidence at every position of ``o``."""
    term = head.target_term(o.target) if head.uses_target else None
    if head.uses_lookup and o.lookup is None:
        raise ValueError("the confidence head reads lookup features, the outcomes logged none")
    return head(o.hidden, o.raw[:, 0], o.raw[:, 1], o.raw[:, 2] > 0.5, o.raw[:, 3], term, head.lookup_term(o.lookup))


def log_loss(head: ConfidenceHead, o: Outcomes) -> float:
    d = o.subset(o.decided)
    return float(F.binary_cross_entropy(predict(head, d).double().clamp(1e-6, 1 - 1e-6), d.y.double()))


def fit_temperature(head: ConfidenceHead, o: Outcomes) -> float:
    """The temperature minimising log-loss on the decided positions of ``o`` (other prompts than the fit's)."""
    d = o.subset(o.decided)
    saved, head.temperature = head.temperature, 1.0
    logit = torch.logit(predict(head, d).double().clamp(1e-9, 1 - 1e-9))
    head.temperature = saved
    grid = [0.5 + 0.02 * i for i in range(126)]  # 0.5 .. 3.0
    losses = [float(F.binary_cross_entropy_with_logits(logit / t, d.y.double())) for t in grid]
    return grid[min(range(len(grid)), key=losses.__getitem__)]


def fold_temperature(head: ConfidenceHead, temp: float) -> ConfidenceHead:
    """The same head with ``temp`` folded into its weights (temperature 1)."""
    wt = None if head.w_target is None else head.w_target / temp
    wl = None if head.w_lookup is None else head.w_lookup / temp
    return ConfidenceHead(head.w_hidden / temp, head.w_extra / temp, head.bias / temp, 1.0, wt, head.names, wl)


def calibration(head: ConfidenceHead, o: Outcomes, bins: int = 10) -> dict:
    """Predicted against observed acceptance by decile of the prediction (decided positions)."""
    d = o.subset(o.decided)
    pred = predict(head, d)
    rows = []
    for chunk in pred.argsort().chunk(bins):
        rows.append((float(pred[chunk].mean()), float(d.y[chunk].mean()), len(chunk)))
    worst = max(abs(p - q) for p, q, _ in rows)
    ece = sum(abs(p - q) * n for p, q, n in rows) / max(len(d.y), 1)
    return {"deciles": [{"predicted": round(p, 4), "observed": round(q, 4), "n": n} for p, q, n in rows],
            "max_decile_gap": round(worst, 4), "ece": round(ece, 4),
            "brier": round(float(((pred - d.y) ** 2).mean()), 4), "positions": len(d.y),
            "observed_accept_rate": round(float(d.y.mean()), 4)}


def cut_trade(conf: torch.Tensor, o: Outcomes, verified_cut: float = 0.25) -> dict:
    """Offline replay of the fixed-k steps in ``o`` cut at a cumulative confidence threshold
    (P_j = c_1 ... c_j >= t keeps a prefix; greedy verification of a kept prefix accepts exactly
    min(accepted, kept)): the accepted-draft drop at the threshold that verifies ``verified_cut``
    fewer drafts (interpolated), and the sweep."""
    cum = torch.empty_like(conf, dtype=torch.float64)
    run = 1.0
    for i, (c, j) in enumerate(zip(conf.tolist(), o.depth.tolist())):
        run = c if j == 0 else run * c
        cum[i] = run
    hit = o.depth < o.accepted
    full_v, full_a = len(conf), float(hit.sum())
    sweep = []
    for t in torch.linspace(0.0, 1.0, 401).tolist():
        kept = cum >= t
        sweep.append((1 - float(kept.sum()) / max(full_v, 1), 1 - float((kept & hit).sum()) / max(full_a, 1), t))
    sweep.sort()
    drop = thr = None
    for (v0, a0, t0), (v1, a1, t1) in zip(sweep, sweep[1:]):
        if v0 <= verified_cut <= v1:
            f = (verified_cut - v0) / max(v1 - v0, 1e-12)
            drop, thr = a0 + (a1 - a0) * f, t0 + (t1 - t0) * f
            break
    return {"verified_cut": verified_cut, "accepted_drop": None if drop is None else round(drop, 4),
            "threshold": None if thr is None else round(thr, 4), "verified": full_v, "accepted": int(full_a)}
