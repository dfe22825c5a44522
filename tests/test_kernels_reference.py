"""The reference ops mean what OP_SPECS says: each is compared with a naive, loop-based version."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels_cpu import ops
from kernels_cpu.rng import uniform_from_counter

pytestmark = pytest.mark.usefixtures("one_thread")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- elementwise and linear ---------------------------------------------------------------
def test_linear_head_linear_rms_norm_silu_and_mul():
    g = gen()
    x, w = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)
    b = torch.randn(3, generator=g)
    want = torch.tensor([[sum(x[t, k] * w[n, k] for k in range(8)) + b[n] for n in range(3)]
                         for t in range(5)])
    torch.testing.assert_close(ops.linear(x, w, b), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.linear(x, w), want - b, rtol=1e-5, atol=1e-5)

    xh, wh = torch.randn(4, 2, 8, generator=g), torch.randn(2, 3, 8, generator=g)  # [T, H, K], [H, N, K]
    want = torch.tensor([[[sum(xh[t, h, k] * wh[h, n, k] for k in range(8)) for n in range(3)]
                          for h in range(2)] for t in range(4)])
    torch.testing.assert_close(ops.head_linear(xh, wh), want, rtol=1e-5, atol=1e-5)

    gamma = torch.randn(8, generator=g)
    want = torch.stack([x[t] / math.sqrt(float((x[t] ** 2).mean()) + 1e-6) * gamma for t in range(5)])
    torch.testing.assert_close(ops.rms_norm(x, gamma, 1e-6), want, rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    assert ops.rms_norm(xb, gamma.bfloat16(), 1e-6).dtype == torch.bfloat16

    res = torch.randn(5, 8, generator=g)
    normed, new_res = ops.add_rms_norm(x, res, gamma, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, ops.rms_norm(x + res, gamma, 1e-6))

    both = torch.randn(4, 6, generator=g)
    want = torch.tensor([[both[t, i] / (1 + math.exp(-both[t, i])) * both[t, 3 + i] for i in range(3)]
                         for t in range(4)])
    torch.testing.assert_close(ops.silu_and_mul(both), want, rtol=1e-5, atol=1e-6)


# ---- rope ---------------------------------------------------------------------------------
def test_rope_is_complex_multiplication():
    D, P, T, N = 8, 32, 6, 3
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.cat((angles.cos(), angles.sin()), -1).float()
    g = gen(1)
    x = torch.randn(T, N, D, generator=g)
    pos = torch.randint(0, P, (T,), generator=g)
    out = ops.rope(x, pos, table)
    for t in range(T):
        for n in range(N):
            for i in range(D // 2):
                z = complex(x[t, n, 2 * i], x[t, n, 2 * i + 1]) * complex(
                    math.cos(pos[t] * inv_freq[i]), math.sin(pos[t] * inv_freq[i]))
                assert out[t, n, 2 * i].item() == pytest.approx(z.real, abs=1e-5)
                assert out[t, n, 2 * i + 1].item() == pytest.approx(z.imag, abs=1e-5)
    torch.testing.assert_close(ops.rope(x, torch.zeros(T, dtype=torch.long), table), x)  # position 0


# ---- paged cache --------------------------------------------------------------------------
def paged(seed: int, seq_lens: list[int], bs: int, D: int):
    g = gen(seed)
    per = [math.ceil(n / bs) for n in seq_lens]
    nb = sum(per) + 2
    order = torch.randperm(nb, generator=g).tolist()
    tables = torch.randint(0, nb, (len(seq_lens), max(per) + 1), generator=g)  # garbage past the end
    i = 0
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor(order[i : i + n])
        i += n
    return torch.randn(nb, bs, D, generator=g), tables.int()


def token_kv(cache, tables, b, p):
    bs = cache.shape[1]
    return cache[int(tables[b, p // bs]), p % bs]


def test_paged_kv_write_and_gather():
    bs, D = 4, 5
    cache, tables = paged(2, [3, 9], bs, D)
    before = cache.clone()
    slots = torch.tensor([5, -1, 0, 17, -1])
    kv = torch.randn(5, D, generator=gen(3))
    ops.paged_kv_write(cache, slots, kv)
    want = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // bs, s % bs] = kv[t]
    assert torch.equal(cache, want)

    seq_lens = torch.tensor([3, 9])
    got = ops.paged_kv_gather(cache, tables, seq_lens)
    rows = [token_kv(cache, tables, b, p) for b in range(2) for p in range(int(seq_lens[b]))]
    assert torch.equal(got, torch.stack(rows))


# ---- attention ----------------------------------------------------------------------------
def naive_attention(q, keys, values, scale):
    """q[H, D], keys[L, D or H,D], values[L, Dv or H,Dv] -> [H, Dv], float64."""
    out = []
    for h in range(q.shape[0]):
        k = keys if keys.dim() == 2 else keys[:, h]
        v = values if values.dim() == 2 else values[:, h]
        scores = [float(q[h].double() @ k[i].double()) * scale for i in range(k.shape[0])]
        m = max(scores)
        p = [math.exp(s - m) for s in scores]
        z = sum(p)
        out.append(sum(pi / z * v[i].double() for i, pi in enumerate(p)))
    return torch.stack(out)


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [1, 4, 9]), ([1, 3, 2, 1], [5, 3, 7, 1])])
def test_mla_decode_is_per_sequence_causal_attention(q_lens, seq_lens):
    bs, H, D, dv = 4, 2, 6, 4
    cache, tables = paged(4, seq_lens, bs, D)
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=gen(5))
    cu = torch.tensor([0, *q_lens]).cumsum(0)
    scale = 0.7
    out = ops.mla_decode(q, cache, tables, cu, torch.tensor(seq_lens), scale, dv)
    assert out.shape == (T, H, dv)
    for b, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        keys = torch.stack([token_kv(cache, tables, b, p) for p in range(sl)])
        for j in range(ql):
            pos = sl - ql + j  # this query's position; it sees keys 0..pos
            want = naive_attention(q[int(cu[b]) + j], keys[: pos + 1], keys[: pos + 1, :dv], scale)
            torch.testing.assert_close(out[int(cu[b]) + j].double(), want, rtol=1e-5, atol=1e-6)


def test_mla_prefill_is_dense_causal_attention_with_cached_prefix():
    H, Dqk, Dv = 2, 5, 3
    q_lens, k_lens = [3, 1, 4], [3, 6, 9]
    g = gen(6)
    q = torch.randn(sum(q_lens), H, Dqk, generator=g)
    k = torch.randn(sum(k_lens), H, Dqk, generator=g)
    v = torch.randn(sum(k_lens), H, Dv, generator=g)
    cq, ck = torch.tensor([0, *q_lens]).cumsum(0), torch.tensor([0, *k_lens]).cumsum(0)
    out = ops.mla_prefill(q, k, v, cq, ck, 0.4)
    for b in range(3):
        for i in range(q_lens[b]):
            pos = k_lens[b] - q_lens[b] + i
            ks, vs = k[int(ck[b]) : int(ck[b]) + pos + 1], v[int(ck[b]) : int(ck[b]) + pos + 1]
            want = naive_attention(q[int(cq[b]) + i], ks, vs, 0.4)
            torch.testing.assert_close(out[int(cq[b]) + i].double(), want, rtol=1e-5, atol=1e-6)


# ---- MoE ----------------------------------------------------------------------------------
def naive_route(logits, bias, top_k, scoring, n_group, topk_group, group_score, renormalize, scale):
    T, E = logits.shape
    ws, ids = [], []
    for t in range(T):
        row = logits[t].double().tolist()
        if scoring == "softmax":
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            s = [math.exp(v - m) / z for v in row]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = list(range(E))
        if n_group > 1 and topk_group < n_group:
            size = E // n_group
            gscore = []
            for gi in range(n_group):
                vals = sorted(c[gi * size : (gi + 1) * size], reverse=True)
                gscore.append(vals[0] if group_score == "max" else vals[0] + vals[1])
            groups = sorted(range(n_group), key=lambda gi: -gscore[gi])[:topk_group]
            allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:top_k]
        w = [s[e] for e in chosen]
        if renormalize:
            w = [x / sum(w) for x in w]
        ws.append([x * scale for x in w])
        ids.append(chosen)
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("variant", [
    dict(E=8, top_k=2, scoring="softmax", bias=False, n_group=1, topk_group=1, group_score="max",
         renormalize=False, scale=1.0),
    dict(E=8, top_k=2, scoring="softmax", bias=False, n_group=1, topk_group=1, group_score="max",
         renormalize=True, scale=1.0),
    dict(E=16, top_k=4, scoring="softmax", bias=False, n_group=4, topk_group=2, group_score="max",
         renormalize=False, scale=16.0),
    dict(E=32, top_k=8, scoring="sigmoid", bias=True, n_group=8, topk_group=4, group_score="top2sum",
         renormalize=True, scale=2.5),
], ids=["softmax-greedy", "softmax-renorm", "softmax-group-max", "sigmoid-bias-top2sum"])
def test_moe_route_matches_straightforward_gate(variant):
    v = dict(variant)
    E = v.pop("E")
    g = gen(7)
    logits = torch.randn(12, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.1 if v.pop("bias") else None
    args = (v["top_k"], v["scoring"], v["n_group"], v["topk_group"], v["group_score"], v["renormalize"],
            v["scale"])
    w, ids = ops.moe_route(logits, bias, *args)
    nw, nids = naive_route(logits, bias, *args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    ids_s, order = ids.sort(-1)
    nids_s, norder = nids.sort(-1)
    assert torch.equal(ids_s, nids_s)
    torch.testing.assert_close(w.gather(1, order).double(), nw.gather(1, norder), rtol=1e-5, atol=1e-6)
    if v["renormalize"]:
        torch.testing.assert_close(w.sum(-1), torch.full((12,), v["scale"]))


def test_moe_route_group_limit_really_limits():
    # every token's best single expert sits in a group whose other experts are poor
    E, n_group = 8, 4
    logits = torch.full((1, E), -3.0)
    logits[0, 0] = 5.0  # group 0: one great, one poor -> top2sum lower than groups 2 and 3
    logits[0, 4:] = 2.0
    w, ids = ops.moe_route(logits, torch.zeros(E), 2, "sigmoid", n_group, 2, "top2sum", False, 1.0)
    assert sorted(ids[0].tolist()) != [0, 4] and 0 not in ids[0].tolist()
    _, ids_max = ops.moe_route(logits, None, 2, "sigmoid", n_group, 2, "max", False, 1.0)
    assert 0 in ids_max[0].tolist()  # by group max, group 0 qualifies


def test_moe_route_rejects_unknown_modes():
    with pytest.raises(ValueError, match="scoring must be 'softmax' or 'sigmoid', got 'relu'"):
        ops.moe_route(torch.zeros(1, 4), None, 1, "relu", 1, 1, "max", False, 1.0)
    with pytest.raises(ValueError, match="group_score must be 'max' or 'top2sum', got 'mean'"):
        ops.moe_route(torch.zeros(1, 4), None, 1, "softmax", 2, 1, "mean", False, 1.0)


def test_fused_moe_is_a_per_token_loop_and_skips_remote_experts():
    T, C, I, E, k = 6, 5, 3, 4, 3
    g = gen(8)
    x = torch.randn(T, C, generator=g)
    w13, w2 = torch.randn(E, 2 * I, C, generator=g), torch.randn(E, C, I, generator=g)
    weights = torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1, 2], [3, -1, 4], [7, -2, 5], [1, 1, 0], [2, 0, 3], [-1, 3, 3]])
    out = ops.fused_moe(x, w13, w2, weights, ids)
    want = torch.zeros(T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            h = w13[e].double() @ x[t].double()
            a = F.silu(h[:I]) * h[I:]
            want[t] += float(weights[t, j]) * (w2[e].double() @ a)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2], torch.zeros(C))  # every expert of token 2 lives on another rank


# ---- penalties ----------------------------------------------------------------------------
def test_apply_penalties_matches_loop():
    B, V = 3, 7
    g = gen(9)
    logits = torch.randn(B, V, generator=g) * 2
    prompt = torch.rand(B, V, generator=g) < 0.3
    counts = torch.randint(0, 3, (B, V), generator=g)
    rep, pres = torch.tensor([1.0, 1.5, 2.0]), torch.tensor([0.0, 0.5, 1.0])
    freq = torch.tensor([0.3, 0.0, 0.2])
    out = ops.apply_penalties(logits, prompt, counts, rep, pres, freq)
    for b in range(B):
        for v in range(V):
            x = float(logits[b, v])
            if prompt[b, v] or counts[b, v] > 0:
                x = x / float(rep[b]) if x > 0 else x * float(rep[b])
            x -= float(freq[b]) * int(counts[b, v])
            x -= float(pres[b]) * (int(counts[b, v]) > 0)
            assert out[b, v].item() == pytest.approx(x, abs=1e-5)


# ---- sampling -----------------------------------------------------------------------------
def sample_rows(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, offsets=None):
    B = logits.shape[0]

    def col(v, dtype=torch.float32):
        return v if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dtype)

    seeds = torch.arange(B) if seeds is None else col(seeds, torch.int64)
    offsets = torch.zeros(B, dtype=torch.int64) if offsets is None else col(offsets, torch.int64)
    return ops.sample(logits, col(temperature), col(top_k, torch.int64), col(top_p), col(min_p), seeds,
                      offsets)


def test_greedy_rows_and_top_k_one():
    logits = torch.randn(6, 20, generator=gen(10))
    argmax = logits.argmax(-1)
    assert torch.equal(sample_rows(logits, temperature=0.0), argmax)
    assert torch.equal(sample_rows(logits, temperature=1.0, top_k=1), argmax)
    mixed_t = torch.tensor([0.0, 1.0, 0.0, 0.8, 0.0, 2.0])
    mixed = sample_rows(logits, temperature=mixed_t, seeds=torch.arange(6) + 100)
    assert torch.equal(mixed[mixed_t == 0], argmax[mixed_t == 0])


def test_seeded_sampling_is_reproducible_and_batch_independent():
    B, V = 8, 30
    logits = torch.randn(B, V, generator=gen(11)) * 2
    t = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.9, 1.1, 0.0])
    k = torch.tensor([0, 5, 0, 0, 3, 0, 50, 2])
    p = torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 1.0])
    m = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6, 1 << 40, 2**62 + 3])
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 1 << 33])
    a = ops.sample(logits, t, k, p, m, seeds, offsets)
    assert torch.equal(a, ops.sample(logits, t, k, p, m, seeds, offsets))
    for b in range(B):
        alone = ops.sample(logits[b : b + 1], t[b : b + 1], k[b : b + 1], p[b : b + 1], m[b : b + 1],
                           seeds[b : b + 1], offsets[b : b + 1])
        assert int(alone) == int(a[b]), f"row {b} alone sampled {int(alone)}, in the batch {int(a[b])}"
    # reversing the batch permutes the result and nothing else
    r = torch.arange(B - 1, -1, -1)
    assert torch.equal(ops.sample(logits[r], t[r], k[r], p[r], m[r], seeds[r], offsets[r]), a[r])


def test_seed_and_offset_change_the_draw():
    logits = torch.zeros(64, 50)  # uniform: every draw is the RNG's choice
    base = sample_rows(logits, seeds=7, offsets=torch.arange(64))
    assert len(set(base.tolist())) > 20  # successive offsets give different tokens
    other_seed = sample_rows(logits, seeds=8, offsets=torch.arange(64))
    assert (other_seed != base).sum() > 40


def test_uniform_from_counter():
    seeds, offsets = torch.tensor([0, 1, 1 << 40, -5]), torch.tensor([0, 0, 3, 1 << 35])
    u = uniform_from_counter(seeds, offsets, 1000)
    assert u.dtype == torch.float32 and u.shape == (4, 1000)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_from_counter(seeds, offsets, 1000))
    assert torch.equal(u[:, :10], uniform_from_counter(seeds, offsets, 10))  # columns are independent of n
    assert torch.equal(u[2:3], uniform_from_counter(seeds[2:3], offsets[2:3], 1000))
    assert abs(u.mean().item() - 0.5) < 0.02
    assert len({tuple(row[:4].tolist()) for row in u}) == 4


def expected_probs(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered distribution, computed naively in float64."""
    z = [float(v) / temperature for v in logits_row]
    m = max(z)
    p = [math.exp(v - m) for v in z]
    s = sum(p)
    p = [v / s for v in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if 0 < top_k < len(p):  # top-k first; top-p then sees the renormalised top-k distribution
        order = order[:top_k]
        s = sum(p[i] for i in order)
        p = [v / s if i in order else 0.0 for i, v in enumerate(p)]
    keep, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank == 0 or (mass < top_p and p[i] >= min_p * p[order[0]]):
            keep.append(i)
        mass += p[i]
    z = sum(p[i] for i in keep)
    return torch.tensor([p[i] / z if i in keep else 0.0 for i in range(len(p))], dtype=torch.float64)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    support = probs > 0
    exp = probs[support] * n
    return float(((counts[support].double() - exp) ** 2 / exp).sum())


LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0])
N = 20000


@pytest.mark.parametrize("params", [
    dict(), dict(temperature=0.7), dict(temperature=1.5, top_k=3), dict(top_p=0.8), dict(min_p=0.3),
    dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1),
], ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined"])
def test_sampling_frequencies_match_the_filtered_distribution(params):
    probs = expected_probs(LOGITS, **params)
    logits = LOGITS.expand(N, -1).contiguous()
    # independent draws: distinct seeds at one offset, and one seed at successive offsets
    for seeds, offsets in ((torch.arange(N) + 12345, 0), (99, torch.arange(N))):
        tokens = sample_rows(logits, seeds=seeds, offsets=offsets, **params)
        counts = torch.bincount(tokens, minlength=len(LOGITS))
        filtered = (probs == 0).nonzero().flatten().tolist()
        assert counts[filtered].sum() == 0, f"filtered tokens {filtered} were sampled: {counts.tolist()}"
        df = int((probs > 0).sum()) - 1
        # 99.9th percentile of chi-square with df degrees of freedom is below 10 + 2.5 df for df <= 7
        stat = chi_square(counts, probs)
        assert stat < 10 + 2.5 * df, f"chi-square {stat:.1f} (df {df}) for counts {counts.tolist()}"
        if df >= 1:  # the test has power: the unfiltered softmax is clearly rejected
            wrong = expected_probs(LOGITS)
            if not torch.allclose(wrong, probs, atol=1e-3):
                assert chi_square(counts, (wrong + 1e-12) / (wrong + 1e-12).sum()) > 100


def test_top_k_larger_than_vocab_or_zero_means_no_limit():
    logits = torch.randn(4, 10, generator=gen(12))
    a = sample_rows(logits, top_k=0, seeds=torch.arange(4))
    assert torch.equal(a, sample_rows(logits, top_k=1000, seeds=torch.arange(4)))
    assert torch.equal(a, sample_rows(logits, top_k=-1, seeds=torch.arange(4)))


def _draft_lengths_by_rank(conf, max_drafts, budget, min_conf):
    """The op's meaning written as a loop: a slot wins when it passes the threshold and fewer than
    ``budget`` valid slots beat it (larger product, or equal and earlier position, then request)."""
    B, K = conf.shape
    c = [[math.prod(conf[b, : j + 1].tolist()) for j in range(K)] for b in range(B)]
    slots = [(b, j) for b in range(B) for j in range(int(max_drafts[b]))]
    out = [0] * B
    for b, j in slots:
        rank = sum(1 for b2, j2 in slots if (-c[b2][j2], j2, b2) < (-c[b][j], j, b))
        out[b] += c[b][j] >= min_conf and rank < budget
    return out


def test_draft_lengths_hand_worked():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.9, 0.9], [1.0, 1.0, 0.1]])
    # products: [.9 .81 .729], [.5 .45 .405], [1 1 .1]
    maxd = torch.tensor([3, 3, 3])
    assert ops.draft_lengths(conf, maxd, 4, 0.0).tolist() == [2, 0, 2]  # 1, 1, .9, .81
    assert ops.draft_lengths(conf, maxd, 100, 0.45).tolist() == [3, 2, 2]
    assert ops.draft_lengths(conf, torch.tensor([1, 3, 0]), 3, 0.0).tolist() == [1, 2, 0]
    assert ops.draft_lengths(conf, maxd, 0, 0.0).tolist() == [0, 0, 0]
    # equal products: the earlier position first, then the lower request
    ones = torch.ones(3, 2)
    assert ops.draft_lengths(ones, torch.tensor([2, 2, 2]), 4, 0.0).tolist() == [2, 1, 1]


@pytest.mark.parametrize("seed", range(4))
def test_draft_lengths_is_the_rank_rule_and_wins_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    B, K = 9, 5
    conf = torch.rand(B, K, generator=g).sqrt()
    conf[1] = conf[2]
    maxd = torch.randint(0, K + 1, (B,), generator=g)
    for budget, thr in ((0, 0.0), (5, 0.0), (12, 0.3), (100, 0.5), (100, 0.0)):
        got = ops.draft_lengths(conf, maxd, budget, thr)
        assert got.dtype == torch.int64
        assert got.tolist() == _draft_lengths_by_rank(conf.double(), maxd, budget, thr)
        assert int(got.sum()) <= budget and bool((got <= maxd).all())
