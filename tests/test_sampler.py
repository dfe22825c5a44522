"""Statistical checks of temperature, top-k, top-p and min-p (the ``sample`` op and the engine's
``Sampler``) and of the repetition/presence/frequency penalties, on an 8-token vocabulary with known
probabilities. Every draw is keyed by fixed (seed, offset) pairs, so the tests are deterministic."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.engine.sampler import Sampler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.kernels import Kernels
from deepinfer_core.sampling_params import SamplingParams
from kernels_cpu import ReferenceKernels, ops

K = Kernels(ReferenceKernels, ReferenceKernels)
# Probabilities by rank, placed at shuffled vocabulary positions.
P_SORTED = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02], dtype=torch.float64)
ORDER = [5, 2, 7, 0, 3, 6, 1, 4]  # token id of rank r
V = 8
P = torch.zeros(V, dtype=torch.float64)
P[ORDER] = P_SORTED
LOGITS = (P.log() + 1.7).float()  # an offset: logits are not log-probabilities
N = 20000


def expected(keep_ranks: list[int], temperature: float = 1.0) -> torch.Tensor:
    w = torch.zeros(V, dtype=torch.float64)
    idx = [ORDER[r] for r in keep_ranks]
    w[idx] = P[idx] ** (1.0 / temperature)
    return w / w.sum()


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, n=N, vary="seed", logits=LOGITS) -> torch.Tensor:
    """n draws with distinct (seed, offset) keys; returns per-token counts."""
    f = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    ar = torch.arange(n, dtype=torch.long)
    seeds, offsets = (ar * 7919 + 11, f(5, torch.long)) if vary == "seed" else (f(424242, torch.long), ar)
    tokens = ops.sample(logits.expand(n, V).contiguous(), f(temperature, torch.float32), f(top_k, torch.long),
                        f(top_p, torch.float32), f(min_p, torch.float32), seeds, offsets)
    return torch.bincount(tokens, minlength=V).double()


def assert_distribution(counts: torch.Tensor, want: torch.Tensor) -> None:
    assert counts[want == 0].sum() == 0, f"filtered tokens were sampled: {counts.tolist()} vs {want.tolist()}"
    n = counts.sum()
    keep = want > 0
    chi2 = (((counts[keep] - n * want[keep]) ** 2) / (n * want[keep])).sum().item()
    df = int(keep.sum()) - 1
    # generous: the 1e-6 tail of chi2(df) is below df + 8 sqrt(2 df) + 12 for df <= 7
    assert chi2 < df + 8 * math.sqrt(2 * max(df, 1)) + 12, (chi2, (counts / n).tolist(), want.tolist())


CASES = {
    "plain": (dict(), list(range(8))),
    "top_k=3": (dict(top_k=3), [0, 1, 2]),
    "top_k=-1 (off)": (dict(top_k=-1), list(range(8))),
    "top_k=100 (> vocab)": (dict(top_k=100), list(range(8))),
    # smallest prefix whose mass reaches p: 0.30 + 0.20 + 0.15 = 0.65 >= 0.6
    "top_p=0.6": (dict(top_p=0.6), [0, 1, 2]),
    "top_p=0.1 (top token only)": (dict(top_p=0.1), [0]),
    # p >= 0.3 * 0.30 = 0.09
    "min_p=0.3": (dict(min_p=0.3), [0, 1, 2, 3, 4]),
    # top-p applies to the top-k distribution: top-4 renormalised is .39/.26/.19/.16 -> 2 tokens reach .6
    "top_k=4,top_p=0.6": (dict(top_k=4, top_p=0.6), [0, 1]),
    "top_k=6,min_p=0.3": (dict(top_k=6, min_p=0.3), [0, 1, 2, 3, 4]),
    "temperature=0.5": (dict(temperature=0.5), list(range(8))),
    "temperature=2,top_k=5": (dict(temperature=2.0, top_k=5), [0, 1, 2, 3, 4]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("vary", ["seed", "offset"])
def test_sample_op_distribution(case, vary):
    kw, keep = CASES[case]
    assert_distribution(draw(vary=vary, **kw), expected(keep, kw.get("temperature", 1.0)))


def test_distribution_check_is_sharp():
    """The check above rejects a near miss: top-3 draws judged against the unfiltered top-4 law,
    and plain draws judged against a slightly wrong distribution."""
    with pytest.raises(AssertionError):
        assert_distribution(draw(top_k=3), expected([0, 1, 2, 3]))
    wrong = expected(list(range(8))).clone()
    wrong[ORDER[0]] += 0.02
    wrong[ORDER[1]] -= 0.02
    with pytest.raises(AssertionError):
        assert_distribution(draw(), wrong)


def test_sample_op_deterministic_and_row_independent():
    B = 64
    logits = torch.randn(B, 50, generator=torch.Generator().manual_seed(0)) * 2
    args = (torch.full((B,), 1.0), torch.full((B,), 10, dtype=torch.long), torch.full((B,), 0.9),
            torch.full((B,), 0.01), torch.arange(B) * 31 + 1, torch.arange(B) % 5)
    a = ops.sample(logits, *args)
    assert torch.equal(a, ops.sample(logits.clone(), *args))
    # each row alone (or in a shuffled batch) draws the same token
    for i in range(0, B, 9):
        assert ops.sample(logits[i : i + 1], *(x[i : i + 1] for x in args)).item() == a[i].item()
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.sample(logits[perm], *(x[perm] for x in args)), a[perm])
    # a different offset (the next position) gives different draws for many rows
    moved = ops.sample(logits, *args[:5], args[5] + 1)
    assert (moved != a).sum() > B // 4


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    one = torch.ones(6)
    out = ops.sample(logits, temperature, torch.zeros(6, dtype=torch.long), one, one * 0, torch.arange(6),
                     torch.zeros(6, dtype=torch.long))
    assert torch.equal(out[::2], logits[::2].argmax(-1))


# ---- the engine's Sampler -------------------------------------------------------------------------

def make_seq(params: SamplingParams, prompt=(0,), output=(), seed=0) -> Sequence:
    seq = Sequence("r", None, list(prompt), params, seed, [])
    seq.token_ids.extend(output)
    return seq


@pytest.mark.parametrize("kw,keep", [(dict(top_k=2), [0, 1]), (dict(top_p=0.45), [0, 1]),
                                     (dict(min_p=0.5), [0, 1, 2])])
def test_sampler_filters_per_request(kw, keep):
    """Through the engine's Sampler: one request per row, seeds from the requests, offsets from
    positions; a plain request in the same batch is unaffected by its neighbours' filters."""
    n = 4000
    sampler = Sampler(K, V, torch.device("cpu"))
    filtered = [make_seq(SamplingParams(**kw), seed=1000 + i) for i in range(n)]
    plain = [make_seq(SamplingParams(), seed=5000 + i) for i in range(n)]
    seqs = [s for pair in zip(filtered, plain) for s in pair]
    res = sampler(LOGITS.expand(2 * n, V).contiguous(), seqs, [3] * (2 * n))
    tokens = torch.tensor(res.tokens)
    assert_distribution(torch.bincount(tokens[0::2], minlength=V).double(), expected(keep))
    assert_distribution(torch.bincount(tokens[1::2], minlength=V).double(), expected(list(range(8))))
    # logprobs are those of the unfiltered model distribution
    lp = torch.log_softmax(LOGITS, -1)
    assert torch.allclose(torch.tensor(res.logprobs), lp[tokens], atol=1e-6)


def test_sampler_seed_and_position_reproducible():
    sampler = Sampler(K, V, torch.device("cpu"))
    logits = LOGITS.expand(3, V).contiguous()
    seqs = [make_seq(SamplingParams(), seed=s) for s in (1, 2, 1)]
    toks = [sampler(logits, seqs, [p, p, p]).tokens for p in range(40)]
    assert all(t[0] == t[2] for t in toks)  # same seed and position -> same token
    assert any(t[0] != t[1] for t in toks)  # another seed differs somewhere
    assert len({t[0] for t in toks}) > 2  # positions advance the stream


# ---- penalties ------------------------------------------------------------------------------------

PEN_LOGITS = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0, -2.0])


def test_apply_penalties_vllm_semantics():
    """Repetition divides positive / multiplies negative logits of every token seen in the prompt
    or the output; frequency subtracts count * f and presence subtracts p, for output tokens only."""
    prompt_mask = torch.zeros(1, 8, dtype=torch.bool)
    prompt_mask[0, [0, 1, 6]] = True
    counts = torch.zeros(1, 8)
    counts[0, 2], counts[0, 3], counts[0, 6] = 2, 1, 1
    out = ops.apply_penalties(PEN_LOGITS[None].clone(), prompt_mask, counts, torch.tensor([2.0]),
                              torch.tensor([0.3]), torch.tensor([0.5]))[0]
    want = torch.tensor([
        2.0 / 2,  # prompt token, positive logit: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 2 * 0.5 - 0.3,  # output twice
        -0.5 * 2 - 1 * 0.5 - 0.3,  # output once, negative
        3.0,  # unseen
        0.0,  # unseen
        1.0 / 2 - 0.5 - 0.3,  # in prompt and output: repetition applied once
        -2.0,  # unseen
    ])
    assert torch.allclose(out, want, atol=1e-6), (out, want)
    # neutral values change nothing
    same = ops.apply_penalties(PEN_LOGITS[None].clone(), prompt_mask, counts, torch.tensor([1.0]),
                               torch.tensor([0.0]), torch.tensor([0.0]))[0]
    assert torch.equal(same, PEN_LOGITS)


def test_sampler_applies_penalties_from_the_request():
    sampler = Sampler(K, 8, torch.device("cpu"))
    logits = PEN_LOGITS.expand(4, 8).contiguous()
    seqs = [
        # token 4 (the argmax, 3.0) in the prompt, repetition 4 -> 0.75; token 0 (2.0) now wins
        make_seq(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=[4, 7]),
        # presence/frequency ignore the prompt: token 4 stays the argmax
        make_seq(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0), prompt=[4]),
        # generated once: 3.0 - 0.6 - 0.5 = 1.9 < 2.0
        make_seq(SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.5), prompt=[1],
                 output=[4]),
        # no penalty in a batch with penalised rows: untouched
        make_seq(SamplingParams(temperature=0), prompt=[4], output=[4, 4]),
    ]
    res = sampler(logits, seqs, [2, 1, 2, 3])
    assert res.tokens == [0, 4, 0, 4]
    # reported logprobs stay those of the raw model distribution
    lp = torch.log_softmax(PEN_LOGITS, -1)
    assert torch.allclose(torch.tensor(res.logprobs), lp[res.tokens], atol=1e-6)
    # the frequency penalty grows with the count: 3.0 - 2 * 0.4 = 2.2 > 2.0, 3.0 - 3 * 0.4 = 1.8 < 2.0
    for output, want in (([4, 4], 4), ([4, 4, 4], 0)):
        seq = make_seq(SamplingParams(temperature=0, frequency_penalty=0.4), prompt=[1], output=output)
        assert sampler(PEN_LOGITS[None].clone(), [seq], [len(output) + 1]).tokens == [want]


def test_greedy_batches_draw_through_greedy_sample_once():
    """An all-greedy batch without penalties takes its tokens, logprobs and (for top-N logprobs) normaliser from
    one ``greedy_sample`` call, and gets what argmax + logsumexp give; a penalised greedy batch does not use it
    (its draw reads the penalised logits, its logprob the raw ones)."""
    calls = []
    k = Kernels(ReferenceKernels, ReferenceKernels)
    k.override("greedy_sample", lambda x: calls.append(x.shape) or ops.greedy_sample(x))
    sampler = Sampler(k, 30, torch.device("cpu"))
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4)) * 3
    logits[1, [4, 9]] = 20.0  # a tie: the first
    seqs = [make_seq(SamplingParams(temperature=0, logprobs=2 if i == 2 else None)) for i in range(3)]
    res = sampler(logits, seqs, [0, 0, 0])
    assert calls == [(3, 30)]
    lp = torch.log_softmax(logits, -1)
    assert res.tokens == logits.argmax(-1).tolist() and res.tokens[1] == 4
    assert torch.allclose(torch.tensor(res.logprobs), lp[range(3), res.tokens], atol=1e-6)
    top = lp[2].topk(2)
    assert [t for t, _ in res.top[2]] == top.indices.tolist()
    assert [v for _, v in res.top[2]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert res.ranks[2] == 1 and res.top[0] is None
    penalised = [make_seq(SamplingParams(temperature=0, repetition_penalty=50.0), prompt=[4])]
    res = sampler(logits[1:2].clone(), penalised, [0])
    assert calls == [(3, 30)] and res.tokens == [9]  # token 4 penalised away
    assert res.logprobs == pytest.approx([lp[1, 9].item()], abs=1e-6)
