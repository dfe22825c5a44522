"""Batch-invariant mode (``batch_invariant=True``): a request's logprobs, prompt logprobs and tokens
are bitwise the same alone, in shuffled batches of any size, next to long prefills, under any
chunked-prefill split and arrival order; seeded sampling is then deterministic."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.testing import check_kernel_backend
from kernels_cpu import batch_invariant as bi

RNG = random.Random(1234)
PROMPT_LENS = (3, 17, 40, 75, 130, 9)
PROMPTS = [{"prompt_token_ids": [RNG.randrange(2, 4000) for _ in range(n)]} for n in PROMPT_LENS]
LONG = {"prompt_token_ids": [RNG.randrange(2, 4000) for _ in range(400)]}


def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=5, ignore_eos=True, logprobs=2,
                          prompt_logprobs=1, seq_seed=1000 + i)


def signature(out):
    comp = out.outputs[0]
    lps = [sorted((t, lp.logprob) for t, lp in d.items()) for d in comp.logprobs]
    plps = [sorted((t, lp.logprob) for t, lp in d.items()) for d in out.prompt_logprobs[1:]]
    return comp.token_ids, lps, plps


@pytest.fixture(scope="module")
def llm():
    engine = LLM(batch_invariant=True, kv_cache_memory=128 << 20, max_num_batched_tokens=2048)
    yield engine
    engine.shutdown()


def run(llm, idx: list[int], make=greedy, extra=(), chunk: int = 2048) -> dict[int, tuple]:
    """Generate PROMPTS[idx] (plus ``extra`` unrelated requests) in one batch; signatures by index."""
    llm.engine.scheduler.budget.max_num_batched_tokens = chunk
    prompts = [PROMPTS[i] for i in idx] + [p for p, _ in extra]
    params = [make(i) for i in idx] + [sp for _, sp in extra]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    return {i: signature(o) for i, o in zip(idx, outs)}


@pytest.fixture(scope="module")
def alone(llm):
    return {make.__name__: {i: run(llm, [i], make)[i] for i in range(len(PROMPTS))} for make in (greedy, seeded)}


@pytest.mark.parametrize("make", [greedy, seeded])
def test_shuffled_batches_of_any_size(llm, alone, make):
    order = list(range(len(PROMPTS)))
    for size in (len(PROMPTS), 4, 2):
        RNG.shuffle(order)
        for start in range(0, len(order), size):
            got = run(llm, order[start : start + size], make)
            for i, sig in got.items():
                assert sig == alone[make.__name__][i], f"request {i} differs in a batch of {size}"


def test_mixed_with_long_prefills(llm, alone):
    extra = [(LONG, SamplingParams(temperature=0.0, max_tokens=3)),
             (PROMPTS[4], SamplingParams(temperature=0.7, max_tokens=4, seq_seed=5))]
    for make in (greedy, seeded):
        got = run(llm, [5, 1, 3], make, extra=extra)
        assert all(sig == alone[make.__name__][i] for i, sig in got.items())


@pytest.mark.parametrize("chunk", [64, 23])
def test_chunked_prefill_at_different_chunk_sizes(llm, alone, chunk):
    for make in (greedy, seeded):
        got = run(llm, [4, 0, 2, 3], make, extra=[(LONG, SamplingParams(max_tokens=2))], chunk=chunk)
        for i, sig in got.items():
            assert sig == alone[make.__name__][i], f"request {i} differs with {chunk}-token chunks"


def test_deterministic_sampling_across_runs_and_arrival_orders(llm, alone):
    want = alone["seeded"]
    for _ in range(2):
        order = list(range(len(PROMPTS)))
        RNG.shuffle(order)
        assert run(llm, order, seeded) == {i: want[i] for i in order}
    fresh = LLM(batch_invariant=True, kv_cache_memory=64 << 20, max_num_seqs=3, enable_prefix_caching=False)
    try:
        assert run(fresh, [2, 5, 0, 1], seeded) == {i: want[i] for i in (2, 5, 0, 1)}
    finally:
        fresh.shutdown()


def test_kernel_backend_conforms_to_the_reference():
    assert check_kernel_backend(bi.BatchInvariantKernels, dtypes=(torch.float32,))


def test_ops_are_row_invariant():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    x = torch.randn(90, 64, generator=g)
    full = bi.linear(x, w)
    for a, b in ((0, 1), (7, 8), (3, 19), (40, 90), (1, 66)):
        assert torch.equal(bi.linear(x[a:b], w), full[a:b])
    hw = torch.randn(3, 20, 64, generator=g)
    hx = torch.randn(50, 3, 64, generator=g)
    hfull = bi.head_linear(hx, hw)
    assert torch.equal(bi.head_linear(hx[5:6], hw), hfull[5:6])
    e = torch.randn(70, 48, generator=g) * 4
    assert torch.equal(bi.rms_norm(e[2:3], torch.ones(48), 1e-6), bi.rms_norm(e, torch.ones(48), 1e-6)[2:3])
    assert torch.equal(bi.silu_and_mul(e[9:11]), bi.silu_and_mul(e)[9:11])


def test_attention_is_invariant_to_chunking_and_neighbours():
    g = torch.Generator().manual_seed(1)
    H, D, dv, bs, nb = 4, 40, 32, 16, 64
    cache = torch.randn(nb, bs, D, generator=g)
    tables = torch.randperm(nb, generator=g).view(4, 16).int()

    def attend(rows):  # rows: (sequence, context length, queries)
        q = torch.cat([r[2] for r in rows])
        cu = torch.tensor([0] + [r[2].shape[0] for r in rows]).cumsum(0)
        return bi.mla_decode(q, cache, tables[[r[0] for r in rows]], cu, torch.tensor([r[1] for r in rows]),
                             0.1, dv)

    q = torch.randn(150, H, D, generator=g)
    whole = attend([(0, 150, q)])
    assert torch.equal(attend([(0, 70, q[:70])]), whole[:70])  # first chunk
    assert torch.equal(attend([(1, 33, q[:1]), (0, 150, q[70:]), (2, 200, q[:5])])[1:81], whole[70:])
    assert torch.equal(attend([(3, 150, q[149:]), (0, 150, q[149:])])[1:], whole[149:])  # as a decode
