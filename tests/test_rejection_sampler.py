"""The rejection sampler (``deepinfer_core/engine/rejection.py``) that verifies drafts: sampled
tokens follow the target's distribution (chi-square, the first token and the second given the
first), the same seeds give the same tokens, and greedy verification keeps the target's argmax."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.engine.rejection import STREAM_DRAFT, SamplingRows, draw, filtered_probs, stream, verify


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("filtering", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.95)])
def test_rejection_sampler_matches_target_distribution(filtering):
    V, m, N = 8, 3, 20000
    g = torch.Generator().manual_seed(3)
    # a tiny random "model" and "draft": logits of the target for rows p_0..p_m, of the draft for q_1..q_m
    t_logits = torch.randn(m + 1, V, generator=g) * 1.5
    d_logits = t_logits[:m] + torch.randn(m, V, generator=g) * 1.0
    params = SamplingParams(**filtering)
    p = filtered_probs(t_logits, SamplingRows.from_params([params] * (m + 1), "cpu"))
    q = filtered_probs(d_logits, SamplingRows.from_params([params] * m, "cpu"))
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 11
    first = 100
    # draft tokens drawn from q with the draft stream, exactly as the feature does
    drafts = torch.stack([draw(q[j].expand(N, V), stream(seeds, STREAM_DRAFT), torch.full((N,), first + j))
                          for j in range(m)], dim=1).tolist()
    tokens, accepted = verify(p.repeat(N, 1), q.repeat(N, 1), drafts, seeds, [first] * N, [False] * N)
    first_tok = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).float()
    assert _chi2_pvalue(first_tok, p[0]) > 1e-3
    # the second token, given that the first was d_1 = x, follows p_1 (rows built for that prefix)
    x = max(range(V), key=lambda t: sum(1 for d in drafts if d[0] == t))
    second = [t[1] for t, d in zip(tokens, drafts) if d[0] == x and t[0] == x and len(t) > 1]
    assert len(second) > 1000
    assert _chi2_pvalue(torch.bincount(torch.tensor(second), minlength=V).float(), p[1]) > 1e-3
    acc = sum(accepted) / (N * m)
    assert 0.05 < acc < 1.0
    # deterministic: the same seeds give the same tokens
    again, _ = verify(p.repeat(N, 1), q.repeat(N, 1), drafts, seeds, [first] * N, [False] * N)
    assert again == tokens


def test_rejection_sampler_greedy():
    out, acc = verify(None, None, [[1, 0], [1, 2], [2, 2]], torch.zeros(3, dtype=torch.long), [5, 5, 5],
                      [True] * 3, target_argmax=[1, 0, 2] + [1, 0, 2] + [1, 0, 2])
    assert out == [[1, 0, 2], [1, 0], [1]] and acc == [2, 1, 0]
