"""The conformance kit's cases: for every registry op, deterministic inputs (small shapes, odd
lengths, block boundaries, saturation and tie cases) that ``testing.kernels.check_op`` runs through a
backend and the reference. Adding an op means adding its ``_cases_<op>`` here and a row in ``CASES``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Case:
    label: str
    args: tuple
    #: the ``kv_cache_dtype`` whose cache the case's latent cache is ("fp8": FP8 latent rows, uint8); the
    #: kit runs it only for platforms that list it (``check_op(kv_cache_dtypes=...)``)
    kv: str = "auto"


# ---- input generation -----------------------------------------------------------------------
def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _paged_layout(g: torch.Generator, seq_lens: Sequence[int], block_size: int, extra_cols: int = 2):
    """Block tables with blocks handed out in shuffled order, unused columns full of valid but
    unrelated block ids (a kernel must not read past seq_len), and spare blocks nobody owns."""
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    width = max(per_seq) + extra_cols
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    return tables.to(torch.int32), num_blocks


def _cu(lens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)


def _cases_linear(g, dtype, bs):
    K, N = 64, 48
    w = _randn(g, N, K, dtype=dtype, scale=K**-0.5)
    return [
        Case("2d+bias", (_randn(g, 7, K, dtype=dtype), w, _randn(g, N, dtype=dtype))),
        Case("3d,no bias", (_randn(g, 2, 3, K, dtype=dtype), w, None)),
        # one row and eight rows (a backend's small-M GEMV), K not a multiple of 32 vectors
        Case("1 row, K 200", (_randn(g, 1, 200, dtype=dtype), _randn(g, 37, 200, dtype=dtype, scale=200**-0.5),
                              None)),
        Case("8 rows", (_randn(g, 8, K, dtype=dtype), w, None)),
    ]


def _cases_head_linear(g, dtype, bs):
    H, K, N = 3, 40, 24
    w = _randn(g, H, N, K, dtype=dtype, scale=K**-0.5)
    return [Case("3 heads", (_randn(g, 7, H, K, dtype=dtype), w)),
            Case("one token", (_randn(g, 1, H, K, dtype=dtype), w))]


def _cases_rms_norm(g, dtype, bs):
    C = 128
    x = _randn(g, 9, C, dtype=dtype, scale=3.0)
    x[0] = 0  # an all-zero row: eps keeps it finite
    return [Case("basic", (x, (1 + _randn(g, C, scale=0.1)).to(dtype), 1e-6))]


def _cases_add_rms_norm(g, dtype, bs):
    C = 128
    return [Case("basic", (_randn(g, 9, C, dtype=dtype), _randn(g, 9, C, dtype=dtype, scale=4.0),
                           (1 + _randn(g, C, scale=0.1)).to(dtype), 1e-6))]


def _cases_silu_and_mul(g, dtype, bs):
    return [Case("basic", (_randn(g, 9, 2 * 96, dtype=dtype, scale=2.0),)),
            Case("one token", (_randn(g, 1, 2 * 32, dtype=dtype, scale=2.0),))]


def _rope_table(positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _cases_rope(g, dtype, bs):
    D, P, T = 16, 64, 10
    table = _rope_table(P, D)
    pos = torch.randint(0, P, (T,), generator=g)
    wide = _randn(g, T, 3, 8 + D, dtype=dtype)  # q = [nope | rope]: the model passes the rope slice
    return [
        Case("3 heads", (_randn(g, T, 3, D, dtype=dtype), pos, table)),
        Case("1 head (k_pe)", (_randn(g, T, 1, D, dtype=dtype), pos, table)),
        Case("strided slice", (wide[..., 8:], pos, table)),
    ]


def _cases_paged_kv_write(g, dtype, bs):
    D, T = 72, 20
    NB = max(10, math.ceil(2 * T / bs))
    cases = []
    for label, n_pad in (("all slots", 0), ("with -1 slots", 4)):
        slots = torch.randperm(NB * bs, generator=g)[:T]
        if n_pad:
            slots[torch.randperm(T, generator=g)[:n_pad]] = -1
        cases.append(Case(label, (_randn(g, NB, bs, D, dtype=dtype), slots, _randn(g, T, D, dtype=dtype))))
    return cases + _cases_paged_kv_write_fp8(g, dtype, bs)


def _fp8_kv_inputs(g, T: int, L: int, R: int, dtype) -> torch.Tensor:
    """kv[T, L + R] exercising the FP8 row rules (kernels_cpu/kv_fp8.py): magnitudes from 1e-6 to 2e3, an
    all-zero row, +-inf and NaN latents (rope stays finite), a value exactly 448 * 2**k."""
    kv = torch.cat([_randn(g, 1, L + R, scale=s) for s in (1e-6, 1e-2, 1.0, 3.0, 2e3)] +
                   [_randn(g, T - 5, L + R)])
    kv[1] = 0
    kv[2, 3], kv[2, L - 1] = float("inf"), -float("inf")
    kv[3, 5] = float("nan")
    kv[4, 0] = 448.0 * 4
    return kv.to(dtype)


def _fp8_kv_cache(g, NB: int, bs: int, L: int, R: int) -> torch.Tensor:
    """A cache of FP8 latent rows holding random earlier entries."""
    from kernels_cpu.kv_fp8 import quantize_latent_rows, row_bytes

    W = row_bytes(L, R)
    return quantize_latent_rows(_randn(g, NB * bs, L + R, scale=2.0), W).view(NB, bs, W)


def _cases_paged_kv_write_fp8(g, dtype, bs):
    cases = []
    for L, R, T in ((512, 64, 12), (64, 16, 20)):
        NB = max(10, math.ceil(2 * T / bs))
        slots = torch.randperm(NB * bs, generator=g)[:T]
        slots[torch.randperm(T, generator=g)[:3]] = -1
        cases.append(Case(f"fp8 rows L{L} R{R}", (_fp8_kv_cache(g, NB, bs, L, R), slots,
                                                  _fp8_kv_inputs(g, T, L, R, dtype)), kv="fp8"))
    return cases


def _cases_latent_kv_dequant(g, dtype, bs):
    return [Case(f"fp8 rows L{L} R{R}", (_fp8_kv_cache(g, 3, bs, L, R).flatten(0, 1), L + R, dtype), kv="fp8")
            for L, R in ((512, 64), (64, 16))]


def _cases_paged_kv_gather(g, dtype, bs):
    D = 72
    seq_lens = [1, bs, bs + 1, 2 * bs + bs // 2 + 1]
    tables, NB = _paged_layout(g, seq_lens, bs)
    return [Case("ragged", (_randn(g, NB, bs, D, dtype=dtype), tables, torch.tensor(seq_lens)))]


def _cases_mla_decode(g, dtype, bs):
    H, L, R = 4, 64, 8
    D = L + R
    cases = []
    for label, q_lens, seq_lens in (
        ("q_len 1", [1, 1, 1, 1], [1, bs, bs + 1, 2 * bs + 5]),
        ("ragged q_len", [1, 3, 2, 1], [4, 3, 2 * bs + 1, bs + 2]),
    ):
        tables, NB = _paged_layout(g, seq_lens, bs)
        T = sum(q_lens)
        cases.append(Case(label, (
            _randn(g, T, H, D, dtype=dtype), _randn(g, NB, bs, D, dtype=dtype), tables, _cu(q_lens),
            torch.tensor(seq_lens), D**-0.5, L,
        )))
    # FP8 latent rows: V2-Lite's 16 heads over 656-byte rows, and the tiny model's shape (100-byte rows)
    for label, H, L, R, q_lens, seq_lens in (
        ("fp8 rows H16 L512 q_len 1", 16, 512, 64, [1, 1, 1], [1, bs + 1, 3 * bs + 5]),
        ("fp8 rows H4 L64 ragged q_len", 4, 64, 16, [1, 3, 2, 1], [4, 3, 2 * bs + 1, bs + 2]),
    ):
        tables, NB = _paged_layout(g, seq_lens, bs)
        cases.append(Case(label, (
            _randn(g, sum(q_lens), H, L + R, dtype=dtype), _fp8_kv_cache(g, NB, bs, L, R), tables, _cu(q_lens),
            torch.tensor(seq_lens), (L + R) ** -0.5, L), kv="fp8"))
    return cases


def _cases_mla_prefill(g, dtype, bs):
    H, Dqk, Dv = 4, 24, 16
    cases = []
    for label, q_lens, k_lens in (
        ("no prefix", [5, 1, 7], [5, 1, 7]),
        ("cached prefix", [5, 3, 7], [5, 3 + bs, 2 * bs + 4]),
    ):
        T, S = sum(q_lens), sum(k_lens)
        cases.append(Case(label, (
            _randn(g, T, H, Dqk, dtype=dtype), _randn(g, S, H, Dqk, dtype=dtype),
            _randn(g, S, H, Dv, dtype=dtype), _cu(q_lens), _cu(k_lens), Dqk**-0.5,
        )))
    return cases


def _route_margin(logits, bias, top_k, scoring, n_group, topk_group, group_score) -> torch.Tensor:
    """Per token, the smallest gap (relative to the largest score) at a selection boundary."""
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    T, E = choice.shape
    margin = torch.full((T,), float("inf"))
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(T, n_group, E // n_group)
        gscore = grouped.amax(-1) if group_score == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        s = gscore.sort(-1, descending=True).values
        margin = torch.minimum(margin, s[:, topk_group - 1] - s[:, topk_group])
        top = gscore.topk(topk_group, -1).indices
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, top, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    s = choice.sort(-1, descending=True).values
    if top_k < s.shape[1] and bool(torch.isfinite(s[:, top_k]).all()):
        margin = torch.minimum(margin, s[:, top_k - 1] - s[:, top_k])
    return margin / scores.abs().amax(-1).clamp_min(1e-12)


def _cases_moe_route(g, dtype, bs):
    T = 16
    variants = [
        # label, E, top_k, scoring, bias?, n_group, topk_group, group_score, renormalize, scale
        ("softmax greedy", 16, 4, "softmax", False, 1, 1, "max", False, 1.0),
        ("softmax greedy renorm", 16, 4, "softmax", False, 1, 1, "max", True, 1.0),
        ("softmax group max", 16, 4, "softmax", False, 4, 2, "max", False, 16.0),
        ("sigmoid bias top2sum", 32, 8, "sigmoid", True, 8, 4, "top2sum", True, 2.5),
        ("sigmoid bias no groups", 16, 4, "sigmoid", True, 1, 1, "top2sum", True, 1.5),
    ]
    cases = []
    for label, E, k, scoring, has_bias, ng, tg, gs, renorm, scale in variants:
        bias = _randn(g, E, scale=0.05) if has_bias else None
        rows: list[torch.Tensor] = []
        for _ in range(20):  # keep tokens whose selection is unambiguous (no near-ties)
            cand = _randn(g, 4 * T, E, scale=2.0)
            ok = _route_margin(cand, bias, k, scoring, ng, tg, gs) >= 1e-3
            rows.extend(cand[ok])
            if len(rows) >= T:
                break
        logits = torch.stack(rows[:T]).to(dtype)
        cases.append(Case(label, (logits, bias, k, scoring, ng, tg, gs, renorm, scale)))
    return cases


def _cases_fused_moe(g, dtype, bs):
    T, C, I, E, k = 9, 32, 24, 6, 3
    ids = torch.randint(-2, E + 3, (T, k), generator=g)  # < 0 or >= E: experts on other ranks
    ids[ids == 4] = 3  # expert 4 gets no token
    ids[2] = torch.tensor([-1, E, E + 2])  # a token whose experts are all remote
    ids[5] = torch.tensor([0, 1, 2])
    weights = torch.rand(T, k, generator=g).to(dtype)
    x = _randn(g, T, C, dtype=dtype)
    w13, w2 = _randn(g, E, 2 * I, C, dtype=dtype, scale=C**-0.5), _randn(g, E, C, I, dtype=dtype, scale=I**-0.5)
    # decode sizes (a backend may stream weights for few tokens): an expert twice in one token, a remote id;
    # four tokens sharing experts, expert 4 unpicked (their own generator: g's stream feeds other ops' cases)
    d = torch.Generator().manual_seed(19)
    one, four = torch.tensor([[2, -1, 2]]), torch.tensor([[0, 1, 5], [5, 1, 3], [3, E, 0], [1, 5, 2]])
    return [Case("with remote experts", (x, w13, w2, weights, ids)),
            Case("one token, repeated and remote ids", (_randn(d, 1, C, dtype=dtype), w13, w2,
                                                        torch.rand(1, k, generator=d).to(dtype), one)),
            Case("four tokens", (_randn(d, 4, C, dtype=dtype), w13, w2, torch.rand(4, k, generator=d).to(dtype),
                                 four))]


def _fp8_weight(g, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights [..., N, K] and float32 scales per 128x128 tile (partial tiles included)."""
    *lead, n, k = shape
    w = (torch.randn(*shape, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = (torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) + 0.5) * (k**-0.5 / 64)
    return w, s


def _cases_fp8_linear(g, dtype, bs):
    w, s = _fp8_weight(g, 200, 320)  # 2 x 3 tiles, the last of each partial
    w2, s2 = _fp8_weight(g, 256, 512)
    x = _randn(g, 7, 320, dtype=dtype)
    x[3, 128:256] = 0  # an all-zero activation group (its scale takes the 1e-4 floor)
    x[5, :128] *= 300  # groups of very different ranges in one row
    return [Case("partial tiles", (x, w, s)), Case("one token", (_randn(g, 1, 512, dtype=dtype), w2, s2)),
            Case("3d, 70 tokens", (_randn(g, 2, 35, 512, dtype=dtype), w2, s2))]


def _cases_fused_moe_fp8(g, dtype, bs):
    C, I, E, k = 256, 128, 6, 3
    w13, s13 = _fp8_weight(g, E, 2 * I, C)
    w2, s2 = _fp8_weight(g, E, C, I)
    base = _cases_fused_moe(g, dtype, bs)[0].args
    T = base[0].shape[0]
    one = torch.tensor([[1, 4, 5]])
    many = torch.randint(0, E, (120, k), generator=g)  # 360 slots: the large-batch tiles
    return [Case("with remote experts", (_randn(g, T, C, dtype=dtype), w13, s13, w2, s2, base[3], base[4])),
            Case("120 tokens", (_randn(g, 120, C, dtype=dtype), w13, s13, w2, s2,
                                torch.rand(120, k, generator=g).to(dtype), many)),
            Case("one token", (_randn(g, 1, C, dtype=dtype), w13, s13, w2, s2, torch.rand(1, k, generator=g).to(dtype),
                               one))]


def _cases_apply_penalties(g, dtype, bs):
    B, V = 4, 50
    counts = torch.randint(0, 3, (B, V), generator=g) * (torch.rand(B, V, generator=g) < 0.3)
    return [Case("mixed", (
        _randn(g, B, V, dtype=dtype, scale=3.0), torch.rand(B, V, generator=g) < 0.2, counts.to(torch.int32),
        torch.tensor([1.0, 1.2, 0.9, 2.0]), torch.tensor([0.0, 0.5, -0.3, 1.0]),
        torch.tensor([0.0, 0.2, 0.1, -0.5]),
    ))]


def _cases_logsumexp(g, dtype, bs):
    x = _randn(g, 6, 300, scale=4.0)
    x[1, ::3] = float("-inf")  # masked tokens (grammars)
    return [Case("rows", (x,)), Case("one row", (x[2:3].clone(),))]


def _cases_greedy_sample(g, dtype, bs):
    """Vocabularies of one partial chunk, several chunks with a partial last one, and V2's; ties of the row max
    in different chunks (the first wins), masked (-inf) tokens and a whole masked chunk, large magnitudes."""
    small = _randn(g, 3, 300, scale=4.0)
    small[1, ::3] = float("-inf")
    mid = _randn(g, 5, 5000, scale=3.0)
    mid[0, [2100, 4500]] = 50.0  # a tie across chunks: the lower index
    mid[1, [4999, 17]] = 40.0  # a tie in the last (partial) chunk and the first
    mid[2, :2048] = float("-inf")  # a whole chunk masked
    mid[3] *= 3000.0  # logits of magnitude 1e4: the chunk sums must not overflow
    mid[4, 4097] = 1e-3 + mid[4].max()  # a max in the last chunk
    big = _randn(g, 2, 102400, scale=4.0)
    big[1, [50000, 70000, 100001]] = 30.0
    return [Case("one chunk", (small,)), Case("chunks", (mid,)), Case("V2 vocabulary", (big,)),
            Case("one row", (big[1:2].clone(),))]


def _cases_draft_lengths(g, dtype, bs):
    B, K = 37, 6
    conf = torch.rand(B, K, generator=g)
    conf[3] = 1.0  # certain drafts: ties of equal products across positions and requests
    conf[4] = 1.0
    conf[5, 2:] = 0.0
    conf[6] = conf[7]  # two requests with the same confidences: ties broken by request
    maxd = torch.randint(0, K + 1, (B,), generator=g)
    maxd[3], maxd[4], maxd[6], maxd[7] = K, 2, K, K
    few = torch.rand(3, 16, generator=g).sqrt()
    return [Case("budget binds", (conf, maxd, 40, 0.05)), Case("threshold binds", (conf, maxd, 10**6, 0.3)),
            Case("budget 0", (conf, maxd, 0, 0.0)), Case("tight budget, no threshold", (conf, maxd, 7, 0.0)),
            Case("k 16", (few, torch.tensor([16, 9, 0]), 20, 0.2))]


def _sampling_rows():
    # temperature, top_k, top_p, min_p, seed, offset
    return [
        (0.0, 0, 1.0, 0.0, 1, 0), (0.0, 5, 0.5, 0.1, 2, 7), (0.0, 0, 1.0, 0.0, 3, 0),
        (0.0, 1, 1.0, 0.0, 4, 1),
        (1.0, 0, 1.0, 0.0, 11, 0), (0.7, 5, 1.0, 0.0, 12, 3), (1.3, 0, 0.8, 0.0, 13, 9),
        (1.0, 0, 1.0, 0.1, 14, 2), (0.5, 10, 0.9, 0.05, 15, 100), (1.0, 1, 1.0, 0.0, 16, 4),
        (1.0, 1000, 1.0, 0.0, 17, 5), (1e-3, 0, 1.0, 0.0, 18, 6),
        (1.0, 0, 1.0, 0.0, (1 << 40) + 5, 0), (1.0, 0, 1.0, 0.0, (1 << 40) + 5, 1),
        (1.0, 0, 1.0, 0.0, 2**62 + 12345, 1 << 33), (0.9, 8, 0.95, 0.02, 0, 123456),
    ]


def _sampling_args(rows, logits):
    t, k, p, m, s, o = zip(*rows, strict=True)
    return (logits, torch.tensor(t), torch.tensor(k, dtype=torch.int64), torch.tensor(p), torch.tensor(m),
            torch.tensor(s, dtype=torch.int64), torch.tensor(o, dtype=torch.int64))


def _cases_sample(g, dtype, bs):
    rows = _sampling_rows()
    B, V = len(rows), 64
    logits = _randn(g, B, V, scale=2.0)
    logits[13] = logits[12]  # same row, next offset
    greedy = [r for r in rows if r[0] == 0.0]
    return [
        Case("mixed greedy and seeded", _sampling_args(rows, logits)),
        Case("all greedy", _sampling_args(greedy, logits[: len(greedy)])),
        Case("all seeded", _sampling_args(rows[len(greedy):], logits[len(greedy):])),
    ]


# ---- DeepSeek-V4 ops ----------------------------------------------------------------------------
def _cases_rope_inverse(g, dtype, bs):
    return _cases_rope(g, dtype, bs)


def _cases_v4_compress(g, dtype, bs):
    """Overlapped (CSA, m=4) and plain (HCA, m=bs) windows read from a paged float32 state with a column
    offset; closing positions include window 0 (absent Ca slots) and windows across block edges."""
    Dc, R = 16, 8
    table = _rope_table(8 * bs + 64, R)
    cases = []
    for label, m, overlap, col in (("overlapped", 4, True, 8), ("plain", bs if bs > 1 else 4, False, 0)):
        w = 2 * Dc if overlap else Dc
        seq_lens = [2 * m, 3 * m + bs, m + 1]
        tables, NB = _paged_layout(g, seq_lens, bs)
        state = _randn(g, NB, bs, col + 2 * w + 4)
        seq_idx, close = [], []
        for b, n in enumerate(seq_lens):
            for p in range(m - 1, n, m):
                seq_idx.append(b)
                close.append(p)
        ape = _randn(g, m, w, scale=0.5)
        cases.append(Case(label, (state, tables, torch.tensor(seq_idx), torch.tensor(close), ape,
                                  (1 + _randn(g, Dc, scale=0.1)).to(dtype), 1e-6, table, col)))
    return cases


def _indexer_gap(q, weights, keys, tables, seq_idx, positions, ratio, top_k, scale) -> float:
    from kernels_cpu.v4_ops import _paged_rows

    visible = (positions + 1) // ratio
    n = int(visible.max())
    ent = torch.arange(n).expand(q.shape[0], n)
    vis = ent < visible[:, None]
    k = _paged_rows(keys.float(), tables, seq_idx, ent, vis)
    sc = (torch.einsum("thd,tnd->thn", q.float(), k).relu() * scale * weights.float()[:, :, None]).sum(1)
    s = sc.masked_fill(~vis, float("-inf")).sort(-1, descending=True).values
    gaps = [float(s[t, top_k - 1] - s[t, top_k]) / float(s[t].abs()[vis[t]].max())
            for t in range(q.shape[0]) if int(visible[t]) > top_k]
    return min(gaps, default=float("inf"))


def _cases_v4_indexer_topk(g, dtype, bs):
    HI, DI, ratio, top_k = 8, 16, 4, 3
    seq_lens = [5 * ratio + 2, 2 * ratio, 9 * ratio + 1]
    tables, NB = _paged_layout(g, [-(-n // ratio) for n in seq_lens], bs)
    seq_idx, positions = [], []
    for b, n in enumerate(seq_lens):  # a few query tokens per sequence, early ones see < top_k entries
        for p in sorted({0, ratio, n - 3, n - 1}):
            seq_idx.append(b)
            positions.append(p)
    seq_idx, positions = torch.tensor(seq_idx), torch.tensor(positions)
    for _ in range(50):  # well-separated top-k boundaries (the ids must match exactly)
        args = (_randn(g, len(positions), HI, DI, dtype=dtype), _randn(g, len(positions), HI).abs(),
                _randn(g, NB, bs, DI, dtype=dtype), tables, seq_idx, positions, ratio, top_k, DI**-0.5)
        if _indexer_gap(*args) >= 1e-3:
            return [Case("ragged", args)]
    raise RuntimeError("v4_indexer_topk: no well-separated inputs drawn")


def _cases_v4_sparse_attention(g, dtype, bs):
    H, D, W = 4, 32, 6
    seq_lens = [3, 2 * bs + 5, bs + 1]
    tables, NB = _paged_layout(g, seq_lens, bs)
    seq_idx = torch.tensor([0, 0, 1, 1, 1, 2])
    positions = torch.tensor([1, 2, 0, 7, 2 * bs + 4, bs])
    T = len(positions)
    swa = _randn(g, NB, bs, D, dtype=dtype)
    ctables, CNB = _paged_layout(g, [4, 9, 5], 2)
    comp = _randn(g, CNB, 2, D + 8, dtype=dtype)  # rows wider than D (CSA: [entry | indexer key])
    ids = torch.randint(0, 4, (T, 3), generator=g)
    ids[0] = -1  # nothing visible yet
    ids[3, 2] = -1
    sinks = _randn(g, H)
    q = _randn(g, T, H, D, dtype=dtype)
    common = (seq_idx, positions, W, sinks, D**-0.5)
    return [
        Case("window only", (q, swa, tables, None, None, None, *common)),
        Case("window + entries", (q, swa, tables, comp, ctables, ids, *common)),
    ]


def _hc_args(g, dtype, n, C, rows):
    return (_randn(g, 9, n, C, dtype=dtype), _randn(g, rows, n * C, scale=0.3), _randn(g, rows, scale=0.3))


def _cases_mhc_pre(g, dtype, bs):
    cases = []
    for n in (2, 4):
        h, fn, base = _hc_args(g, dtype, n, 16, (2 + n) * n)
        cases.append(Case(f"{n} streams", (h, fn, base, 1 + _randn(g, 3, scale=0.1), 20, 1e-6, 1e-6)))
    return cases


def _cases_mhc_post(g, dtype, bs):
    cases = []
    for n in (2, 4):
        comb = torch.rand(9, n, n, generator=g)
        cases.append(Case(f"{n} streams", (_randn(g, 9, 16, dtype=dtype), _randn(g, 9, n, 16, dtype=dtype),
                                           2 * torch.rand(9, n, generator=g), comb / comb.sum(-2, keepdim=True))))
    return cases


def _cases_mhc_head(g, dtype, bs):
    h, fn, base = _hc_args(g, dtype, 4, 16, 4)
    return [Case("4 streams", (h, fn, base, 1 + _randn(g, 1, scale=0.1), 1e-6, 1e-6))]


def _v4_route_margin(logits, bias, top_k, scoring) -> torch.Tensor:
    scores = torch.nn.functional.softplus(logits).sqrt() if scoring == "sqrtsoftplus" else logits.sigmoid()
    s = (scores if bias is None else scores + bias).sort(-1, descending=True).values
    return (s[:, top_k - 1] - s[:, top_k]) / scores.abs().amax(-1).clamp_min(1e-12)


def _cases_moe_route_v4(g, dtype, bs):
    T, E, k = 16, 16, 4
    cases = []
    for label, scoring, has_bias, hashed in (("sqrtsoftplus bias", "sqrtsoftplus", True, False),
                                             ("sigmoid", "sigmoid", False, False),
                                             ("sqrtsoftplus hash", "sqrtsoftplus", False, True)):
        bias = _randn(g, E, scale=0.05) if has_bias else None
        rows: list[torch.Tensor] = []
        for _ in range(20):
            cand = _randn(g, 4 * T, E, scale=2.0)
            rows.extend(cand[_v4_route_margin(cand, bias, k, scoring) >= 1e-3])
            if len(rows) >= T:
                break
        hash_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if hashed else None
        cases.append(Case(label, (torch.stack(rows[:T]), bias, hash_ids, k, scoring, 1.5)))
    return cases


def _cases_silu_and_mul_clamped(g, dtype, bs):
    x = _randn(g, 9, 2 * 48, dtype=dtype, scale=3.0)
    return [Case("limit 1.5", (x, 1.5)), Case("no limit", (x, None))]


def _cases_fused_moe_clamped(g, dtype, bs):
    return [Case(c.label + ", limit 0.5", (*c.args, 0.5)) for c in _cases_fused_moe(g, dtype, bs)]


def _mxfp8_rows(g, dtype) -> torch.Tensor:
    """Rows exercising MXFP8's rules (kernels_cpu/mxfp8.py), one 32-value block per purpose, in ``dtype``."""
    D = 64
    rows = [_randn(g, D, scale=s) for s in (1e-3, 0.5, 3.0, 2e3)]
    ties = torch.zeros(D)  # element halfway between e4m3 neighbours (1.0625 = 1 + 2**-4), block scale 1
    ties[:8] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.125, 0.0068359375, 0.0029296875, -0.0])
    rows.append(ties)
    edge = torch.zeros(D)  # a zero block (scale floor) and saturation: +-inf, amax exactly 448 * 2**k
    edge[32:36] = torch.tensor([float("inf"), -float("inf"), 896.0, -3.0])
    rows.append(edge)
    nan = _randn(g, D)
    nan[3], nan[40] = float("nan"), -float("nan")
    rows.append(nan)
    tiny = _randn(g, D, scale=1e-6)  # below the amax floor: e4m3 subnormals
    rows.append(tiny)
    return torch.stack(rows).to(dtype)


def _cases_mxfp8_quant(g, dtype, bs):
    x = _mxfp8_rows(g, dtype)
    return [Case("rounding, saturation, zero, nan, tiny", (x,)), Case("one 512-wide row", (_randn(g, 3, 512,
                                                                                                 dtype=dtype),))]


def _cases_mxfp8_dequant(g, dtype, bs):
    from kernels_cpu.mxfp8 import mxfp8_quant

    packed = mxfp8_quant(torch.nan_to_num(_mxfp8_rows(g, torch.float32), nan=0.0))
    return [Case("packed rows", (packed, dtype))]


def _cases_ue8m0_scale(g, dtype, bs):
    exact = torch.tensor([0.0, 1e-5, 1e-4, 448.0, 448.0 * 2, 448.0 * 2 ** -20, 449.0, 1.0, 3e38, 447.99])
    return [Case("powers of two, floor, ceil", (torch.cat((exact, _randn(g, 64, scale=100.0).abs())),))]


CASES: dict[str, Callable[[torch.Generator, torch.dtype, int], list[Case]]] = {
    "linear": _cases_linear,
    "head_linear": _cases_head_linear,
    "rms_norm": _cases_rms_norm,
    "add_rms_norm": _cases_add_rms_norm,
    "silu_and_mul": _cases_silu_and_mul,
    "rope": _cases_rope,
    "paged_kv_write": _cases_paged_kv_write,
    "paged_kv_gather": _cases_paged_kv_gather,
    "mla_decode": _cases_mla_decode,
    "latent_kv_dequant": _cases_latent_kv_dequant,
    "mla_prefill": _cases_mla_prefill,
    "moe_route": _cases_moe_route,
    "fused_moe": _cases_fused_moe,
    "fp8_linear": _cases_fp8_linear,
    "fused_moe_fp8": _cases_fused_moe_fp8,
    "apply_penalties": _cases_apply_penalties,
    "logsumexp": _cases_logsumexp,
    "greedy_sample": _cases_greedy_sample,
    "draft_lengths": _cases_draft_lengths,
    "sample": _cases_sample,
    "rope_inverse": _cases_rope_inverse,
    "v4_compress": _cases_v4_compress,
    "v4_indexer_topk": _cases_v4_indexer_topk,
    "v4_sparse_attention": _cases_v4_sparse_attention,
    "mhc_pre": _cases_mhc_pre,
    "mhc_post": _cases_mhc_post,
    "mhc_head": _cases_mhc_head,
    "moe_route_v4": _cases_moe_route_v4,
    "silu_and_mul_clamped": _cases_silu_and_mul_clamped,
    "fused_moe_clamped": _cases_fused_moe_clamped,
    "ue8m0_scale": _cases_ue8m0_scale,
    "mxfp8_quant": _cases_mxfp8_quant,
    "mxfp8_dequant": _cases_mxfp8_dequant,
}

from deepinfer_core.testing.kernel_cases_fused import FUSED_CASES  # noqa: E402  (its cases use the helpers above)

CASES.update(FUSED_CASES)
