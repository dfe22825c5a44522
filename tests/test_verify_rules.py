"""The verify rules on given rows (engine/rejection.py): the device verify of point-mass drafts on a fixed
grid equals the host's bit for bit, with the engine's sample op or the reference's draw, and keeps the
target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams


def _grid_case(seed: int, R: int = 24, K: int = 4, V: int = 12):
    from deepinfer_core.engine.rejection import SamplingRows

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, K + 1, V, generator=g) * 2
    lengths = torch.randint(0, K + 1, (R,), generator=g)
    greedy = [bool(i % 3 == 0) for i in range(R)]
    params = [SamplingParams(temperature=0.0) if gr else
              SamplingParams(temperature=0.7 + 0.1 * (i % 4), top_k=(0, 5)[i % 2], top_p=(1.0, 0.9)[i % 3 == 1])
              for i, gr in enumerate(greedy)]
    rows = SamplingRows.from_params(params, "cpu")
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(R, K, generator=g) < 0.6, argmax[:, :K], torch.randint(0, V, (R, K), generator=g))
    seeds = torch.randint(0, 2**40, (R,), generator=g)
    first = torch.randint(5, 50, (R,), generator=g)
    return logits, drafts, lengths, rows, seeds, first, greedy, params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_verify_equals_host_verify(seed):
    from deepinfer_core.engine.rejection import filtered_probs, verify, verify_on_device

    logits, drafts, lengths, rows, seeds, first, greedy, params = _grid_case(seed)
    R, K1, V = logits.shape
    toks, acc = verify_on_device(logits, drafts, lengths, rows, seeds, first)
    with_flags = verify_on_device(logits, drafts, lengths, rows, seeds, first, params)  # filters decided on the host
    assert torch.equal(with_flags[0], toks) and torch.equal(with_flags[1], acc)
    from kernels_cpu.ops import sample

    with_op = verify_on_device(logits, drafts, lengths, rows, seeds, first, params, sample)  # the engine's op
    assert torch.equal(with_op[0], toks) and torch.equal(with_op[1], acc)
    dl = [drafts[i, : lengths[i]].tolist() for i in range(R)]
    flat = torch.cat([logits[i, : lengths[i] + 1] for i in range(R)])
    row_idx = torch.cat([torch.full((int(lengths[i]) + 1,), i) for i in range(R)])
    p = filtered_probs(flat, rows.index(row_idx))
    q = torch.zeros(sum(len(d) for d in dl), V)
    q[torch.arange(q.shape[0]), torch.tensor([t for d in dl for t in d], dtype=torch.long)] = 1.0
    want, want_acc = verify(p, q, dl, seeds, first.tolist(), greedy, point_mass=[True] * R)
    assert acc.tolist() == want_acc
    assert [toks[i, : acc[i] + 1].tolist() for i in range(R)] == want
    gtoks, gacc = verify_on_device(logits[greedy], drafts[greedy], lengths[greedy], None, seeds[greedy],
                                   first[greedy])  # the all-greedy path
    assert gacc.tolist() == [a for a, g in zip(want_acc, greedy) if g]


def test_device_verify_keeps_the_target_distribution():
    """Chi-square: the first emitted token of point-mass drafts verified on the device follows the
    target's filtered distribution."""
    from deepinfer_core.engine.rejection import SamplingRows, filtered_probs, verify_on_device

    V, N = 8, 20000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5)) * 1.5
    rows = SamplingRows.from_params([SamplingParams(temperature=0.9)] * N, "cpu")
    p = filtered_probs(logits, rows.index(torch.tensor([0])))[0]
    draft = int(p.argmax())
    seeds = torch.arange(N, dtype=torch.long) * 7919 + 3
    toks, acc = verify_on_device(logits.expand(N, 2, V), torch.full((N, 1), draft), torch.ones(N, dtype=torch.long),
                                 rows, seeds, torch.full((N,), 50))
    counts = torch.bincount(toks[:, 0], minlength=V).float()
    exp = p * N
    stat = float(((counts - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((V - 1) / 2.0, dtype=torch.float64),
                                           torch.tensor(stat / 2.0, dtype=torch.float64)))
    assert pvalue > 1e-3 and 0.2 < float(acc.float().mean()) < 0.99
