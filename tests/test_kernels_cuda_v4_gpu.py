"""GPU conformance of the DeepSeek-V4 TileLang kernels (``kernels_cuda/v4_*.py``) against the reference
ops (``kernels_cpu/v4_ops.py``) at V4-Flash shapes, which the conformance kit's small cases (mostly
taken by the reference fallbacks) do not reach: 64 heads of 512, window 128, CSA rows [512 | 128],
HCA entries per 128 tokens, indexer 64 x 128, hidden 4096 with 4 mHC streams, 256 experts top-6.

Every layer kind of the V4 configs (window-only, CSA, HCA), odd lengths, windows and pages crossing
block boundaries, window blocks freed (-1) behind the window, decode and prefill-chunk token layouts,
and capture in a CUDA graph (the decode path must not synchronise with the host). Skipped without a
GPU; with ``DEEPINFER_TL_DRYRUN=1`` the calls only compile their kernels (``examples/kernel_warm.py``).
"""

import math

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY, HAS_CUDA

from kernels_cpu import v4_ops as ref

pytestmark = GPU_OR_DRY
DEV = "cuda" if HAS_CUDA else "cpu"
D, W, DI, HI = 512, 128, 128, 64
RATIO = {"swa": None, "csa": 4, "hca": 128}


def close(out, truth, what, rtol=2e-2):
    """|out - ref| <= rtol * (|ref| + rms(ref)) (the kit's rule; bf16 operands: 2e-2)."""
    if DRY:
        return
    o, r = out.detach().double().cpu(), truth.detach().double().cpu()
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    bound = rtol * (r.abs() + r.pow(2).mean().sqrt().clamp_min(1e-12))
    worst = ((o - r).abs() / bound).max().item()
    assert worst <= 1.0, f"{what}: max error {(o - r).abs().max().item():.3e}, {worst:.2f}x the tolerance"


def randn(g, *shape, dtype=torch.bfloat16, scale=1.0):
    if DRY:
        return torch.zeros(*shape, dtype=dtype, device=DEV)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def up(t):
    return t.float() if t is not None and t.is_floating_point() else t


def tables_for(g, n_entries: list[int], per_block: int, free_before: list[int] | None = None):
    """Shuffled block tables for sequences of n_entries rows; 2 junk columns past each sequence (valid ids
    of other blocks); entries below free_before[b] sit in freed blocks (-1), as a window group's do."""
    per = [max(1, math.ceil(n / per_block)) for n in n_entries]
    nb = sum(per) + 3
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(nb))
    tab = torch.randint(0, nb, (len(per), max(per) + 2), generator=torch.Generator().manual_seed(len(per)))
    used = 0
    for b, n in enumerate(per):
        tab[b, :n] = order[used:used + n]
        used += n
        if free_before is not None:
            tab[b, : max(0, free_before[b]) // per_block] = -1
    return tab.to(torch.int32).to(DEV), nb


# ---- sparse attention ----------------------------------------------------------------------------
ATTN_CASES = [
    # label, layer kind, heads, page size, sequence lengths, prefill chunk (tokens of sequence 0) or None
    ("SWA decode, odd lengths", "swa", 64, 256, [1, 77, 129, 300, 1025], None),
    ("CSA decode, 512 picks, page 64", "csa", 64, 64, [3, 64, 4097, 2049, 9000], None),
    ("HCA decode, page 256", "hca", 64, 256, [127, 128, 129, 5000, 33000], None),
    ("CSA prefill chunk across pages", "csa", 64, 256, [2301, 700], 333),
    ("HCA prefill chunk from 0", "hca", 64, 64, [300, 40], 300),
    ("SWA prefill, 8 heads (a padded 16-head tile)", "swa", 8, 64, [200], 200),
]


def _attention_inputs(g, kind, H, bs, seq_lens, chunk):
    seq_idx, pos = [], []
    for b, n in enumerate(seq_lens):
        first = n - (chunk if (chunk and b == 0) else 1)
        seq_idx += [b] * (n - first)
        pos += list(range(first, n))
    seq_idx, pos = torch.tensor(seq_idx, device=DEV), torch.tensor(pos, device=DEV)
    earliest = [min(p for s, p in zip(seq_idx.tolist(), pos.tolist()) if s == b) for b in range(len(seq_lens))]
    swa_tab, nb = tables_for(g, seq_lens, bs, [e - W + 1 for e in earliest])
    swa = randn(g, nb, bs, D)
    T_ = len(pos)
    q = randn(g, T_, H, D)
    sinks = randn(g, H, dtype=torch.float32)
    if kind == "swa":
        return q, swa, swa_tab, None, None, None, seq_idx, pos, sinks
    m = RATIO[kind]
    epb = max(1, bs // m)
    width = D + DI if kind == "csa" else D
    comp_tab, nb2 = tables_for(g, [n // m for n in seq_lens], epb)
    comp = randn(g, nb2, epb, width)
    visible = ((pos + 1) // m).tolist()
    if kind == "csa":  # distinct random picks among the visible entries, -1 padded (as the indexer's top-k)
        ids = torch.full((T_, 512), -1, dtype=torch.int64)
        for t, v in enumerate(visible):
            k = min(512, v)
            ids[t, :k] = torch.randperm(v, generator=torch.Generator().manual_seed(t))[:k]
    else:  # every visible entry, up to the table capacity (the decode path's shape-only bound)
        cap = comp_tab.shape[1] * epb
        ids = torch.arange(cap).expand(T_, cap).clone()
        ids[ids >= torch.tensor(visible)[:, None]] = -1
    return q, swa, swa_tab, comp, comp_tab, ids.to(DEV), seq_idx, pos, sinks


@pytest.mark.parametrize("case", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_sparse_attention_real_shapes(case):
    from kernels_cuda.v4_attention import v4_sparse_attention

    label, kind, H, bs, seq_lens, chunk = case
    g = torch.Generator(device=DEV).manual_seed(11)
    args = _attention_inputs(g, kind, H, bs, seq_lens, chunk)
    q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, sinks = args
    out = v4_sparse_attention(q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, W, sinks, D**-0.5)
    if not DRY:
        truth = ref.v4_sparse_attention(up(q), up(swa), swa_tab, up(comp), comp_tab, ids, seq_idx, pos, W, sinks,
                                        D**-0.5)
        close(out, truth, f"v4_sparse_attention {label}")


SPLIT_CASES = [
    # label, layer kind, heads, page size, sequence lengths, prefill chunk, forced splits (None: the default)
    ("SWA decode, all-masked splits (position 0) with sinks", "swa", 64, 256, [1, 2, 77, 129, 300], None, 3),
    ("CSA decode, one split per key tile, no entry visible yet", "csa", 64, 64, [3, 64, 4097, 2049, 9000], None,
     10),
    ("CSA decode, 4 uneven splits", "csa", 64, 256, [5, 511, 2048, 2049, 9001], None, 4),
    ("CSA decode batch 1, the default split", "csa", 64, 256, [8191], None, None),
    ("HCA decode, 2 splits, entries across pages", "hca", 64, 64, [127, 128, 129, 5000, 33000], None, 2),
    ("CSA prefill chunk, split", "csa", 64, 256, [2301, 700], 333, 3),
    ("SWA, 8 heads (a padded tile), split", "swa", 8, 64, [200, 1], None, 2),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_sparse_attention_split_kv(case):
    """The split-KV (flash-decoding) path against the reference, and against the unsplit kernel."""
    from kernels_cuda.v4_attention import BH, BN, choose_splits, v4_sparse_attention

    label, kind, H, bs, seq_lens, chunk, splits = case
    g = torch.Generator(device=DEV).manual_seed(23)
    q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, sinks = _attention_inputs(g, kind, H, bs, seq_lens, chunk)
    if splits is None:  # batch 1 must take the split path by itself
        key_tiles = W // BN + -(-ids.shape[1] // BN)
        assert choose_splits(q.shape[0], max(H, BH), key_tiles, 132) > 1
    out = v4_sparse_attention(q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, W, sinks, D**-0.5, splits=splits)
    if DRY:
        return
    one = v4_sparse_attention(q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, W, sinks, D**-0.5, splits=1)
    truth = ref.v4_sparse_attention(up(q), up(swa), swa_tab, up(comp), comp_tab, ids, seq_idx, pos, W, sinks,
                                    D**-0.5)
    close(out, truth, f"v4_sparse_attention split {label}")
    close(out, one.float(), f"v4_sparse_attention split vs unsplit {label}")


@pytest.mark.parametrize("T_,S,H", [(1, 10, 64), (5, 3, 64), (3, 2, 16)])
def test_split_combine_kernel_matches_its_specification(T_, S, H):
    """The one-launch combine against ``combine_splits`` (float64), with an all-masked split (running
    max at the sink, sum 0, output 0) and a token whose every split is masked."""
    from kernels_cuda import _tl
    from kernels_cuda.v4_attention import LOG2E, _combine_kernel, combine_splits

    g = torch.Generator(device=DEV).manual_seed(T_ * 100 + S)
    scale = D**-0.5
    sinks = randn(g, H, dtype=torch.float32)
    m = torch.maximum(randn(g, T_, S, H, dtype=torch.float32, scale=30.0), sinks / scale)
    l_ = randn(g, T_, S, H, dtype=torch.float32).abs() * 20
    o = randn(g, T_, S, H, D, dtype=torch.float32, scale=5.0)
    m[:, 0], l_[:, 0], o[:, 0] = sinks / scale, 0.0, 0.0  # split 0 saw masked keys only
    m[-1], l_[-1], o[-1] = sinks / scale, 0.0, 0.0  # the last token: nothing but the sink
    out = torch.empty(T_, H, D, dtype=torch.bfloat16, device=DEV)
    _combine_kernel(H, D, _tl.tl_dtype(out.dtype))(o, m, l_, sinks, out, float(scale * LOG2E))
    if DRY:
        return
    truth = combine_splits(o.double(), m.double(), l_.double(), sinks.double(), scale)
    close(out, truth, f"split combine T={T_} S={S} H={H}")
    assert out[-1].abs().max() == 0


# ---- compressor ----------------------------------------------------------------------------------
COMPRESS_CASES = [
    # label, entry width Dc, projection width w, ratio m, state row width, column, page size, lengths
    ("CSA main (overlapped), page 64", 512, 1024, 4, 2560, 0, 64, [4, 8, 61, 2051]),
    ("CSA indexer (overlapped, col 2048), page 256", 128, 256, 4, 2560, 2048, 256, [4, 257, 1003]),
    ("HCA (plain), page 256", 512, 512, 128, 1024, 0, 256, [128, 256, 1300]),
    ("HCA (plain), page 64: a window spans pages", 512, 512, 128, 1024, 0, 64, [128, 640]),
]


@pytest.mark.parametrize("case", COMPRESS_CASES, ids=[c[0] for c in COMPRESS_CASES])
def test_compress_real_shapes(case):
    from kernels_cuda.v4_compress import v4_compress

    label, Dc, w, m, E, col, bs, lens = case
    g = torch.Generator(device=DEV).manual_seed(12)
    tab, nb = tables_for(g, lens, bs)
    state = randn(g, nb, bs, E, dtype=torch.float32)
    seq_idx, close_pos = [], []
    for b, n in enumerate(lens):  # every closing position, plus one that closes nothing (a decode row)
        for p in list(range(m - 1, n, m)) + [n - 2]:
            seq_idx.append(b)
            close_pos.append(p)
    seq_idx, close_pos = torch.tensor(seq_idx, device=DEV), torch.tensor(close_pos, device=DEV)
    ape = randn(g, m, w, dtype=torch.float32, scale=0.5)
    norm_w = 1 + randn(g, Dc, dtype=torch.float32, scale=0.1)
    from deepinfer_core.models.deepseek_v4 import rope_table

    cos_sin = rope_table(64, 160000.0, 4096).to(DEV)
    out = v4_compress(state, tab, seq_idx, close_pos, ape, norm_w, 1e-6, cos_sin, col)
    if not DRY:
        closing = (close_pos + 1) % m == 0
        truth = ref.v4_compress(state, tab, seq_idx[closing], close_pos[closing], ape, norm_w, 1e-6, cos_sin, col)
        close(out[closing], truth, f"v4_compress {label}", rtol=1e-4)


# ---- indexer -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs,lens,chunk", [(256, [17, 2049, 9001, 600], None), (64, [4100, 30], 257)],
                         ids=["decode page 256", "prefill chunk page 64"])
def test_indexer_topk_real_shapes(bs, lens, chunk):
    from kernels_cuda.v4_indexer import v4_indexer_scores, v4_indexer_topk

    g = torch.Generator(device=DEV).manual_seed(13)
    epb = bs // 4
    tab, nb = tables_for(g, [n // 4 for n in lens], epb)
    cache = randn(g, nb, epb, D + DI)  # CSA rows [entry | indexer key]: the keys are a column view
    keys = cache[..., D:]
    seq_idx, pos = [], []
    for b, n in enumerate(lens):
        first = n - (chunk if (chunk and b == 0) else 1)
        seq_idx += [b] * (n - first)
        pos += list(range(first, n))
    seq_idx, pos = torch.tensor(seq_idx, device=DEV), torch.tensor(pos, device=DEV)
    q = randn(g, len(pos), HI, DI)
    wts = randn(g, len(pos), HI, dtype=torch.float32) * HI**-0.5
    ids = v4_indexer_topk(q, wts, keys, tab, seq_idx, pos, 4, 512, DI**-0.5)
    if DRY:
        return
    truth = ref.v4_indexer_topk(up(q), wts, up(keys), tab, seq_idx, pos, 4, 512, DI**-0.5)
    assert ((ids >= 0).sum(1) == (truth >= 0).sum(1)).all(), "a different number of picks"
    full = v4_indexer_scores(q, wts, keys, tab, seq_idx, pos, 4, DI**-0.5)  # [T, table capacity]
    visible = (pos + 1) // 4
    ent = torch.arange(full.shape[1], device=DEV).expand(len(pos), -1)
    vis = ent < visible[:, None]
    assert torch.isinf(full[~vis]).all() and (full[~vis] < 0).all(), "invisible entries must score -inf"
    k = ref._paged_rows(up(keys), tab, seq_idx, ent, vis)
    rs = (torch.einsum("thd,tnd->thn", up(q), k).relu() * DI**-0.5 * wts[:, :, None]).sum(1)  # reference scores
    close(full[vis], rs[vis], "v4_indexer scores", rtol=1e-4)
    # the picks' reference scores equal the reference top-k's (ties may pick other ids of equal score)
    rs = rs.masked_fill(~vis, float("-inf"))
    mine = rs.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, 0).sort(-1).values
    theirs = rs.gather(1, truth.clamp(min=0)).masked_fill(truth < 0, 0).sort(-1).values
    close(mine, theirs, "v4_indexer_topk picked scores", rtol=1e-4)


# ---- mHC -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("T_", [1, 37, 1024])
def test_mhc_real_shapes(T_):
    from kernels_cuda.v4_mhc import mhc_post, mhc_pre

    g = torch.Generator(device=DEV).manual_seed(14)
    n, C = 4, 4096
    h = randn(g, T_, n, C)
    fn = randn(g, (2 + n) * n, n * C, dtype=torch.float32, scale=0.02)
    base = randn(g, (2 + n) * n, dtype=torch.float32, scale=0.3)
    scale = 1 + randn(g, 3, dtype=torch.float32, scale=0.1)
    x, post, comb = mhc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
    y = randn(g, T_, C)
    new_h = mhc_post(y, h, post, comb)
    if DRY:
        return
    rx, rpost, rcomb = ref.mhc_pre(h, fn, base, scale, 20, 1e-6, 1e-6)
    close(post, rpost, "mhc_pre post", rtol=1e-4)
    close(comb, rcomb, "mhc_pre comb (Sinkhorn)", rtol=1e-4)
    close(x, rx, "mhc_pre x")
    close(new_h, ref.mhc_post(up(y), up(h), post, comb), "mhc_post")


# ---- MoE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring,kind", [("sqrtsoftplus", "learned"), ("sqrtsoftplus", "hash"),
                                          ("sigmoid", "learned")])
def test_moe_route_v4_real_shapes(scoring, kind):
    from kernels_cuda.v4_moe import moe_route_v4

    g = torch.Generator(device=DEV).manual_seed(15)
    E, k, T_ = 256, 6, 300
    logits = randn(g, T_, E, dtype=torch.float32, scale=2.0)
    bias = randn(g, E, dtype=torch.float32, scale=0.05) if kind == "learned" else None
    hash_ids = torch.stack([torch.randperm(E)[:k] for _ in range(T_)]).to(DEV) if kind == "hash" else None
    w, ids = moe_route_v4(logits, bias, hash_ids, k, scoring, 1.5)
    if DRY:
        return
    rw, rids = ref.moe_route_v4(logits, bias, hash_ids, k, scoring, 1.5)
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean().item() > 0.99, f"{int((~same).sum())} tokens routed differently"
    close(w.gather(1, ids.sort(-1).indices)[same], rw.gather(1, rids.sort(-1).indices)[same], "moe_route_v4",
          rtol=1e-4)


@pytest.mark.parametrize("T_", [1, 37, 1500])
def test_fused_moe_clamped_flash_widths(T_):
    from kernels_cuda.v4_moe import fused_moe_clamped

    g = torch.Generator(device=DEV).manual_seed(16)
    E, C, I, k = 16, 4096, 2048, 6
    x = randn(g, T_, C, scale=4.0)  # large activations: the clamp at 10 engages
    w13 = randn(g, E, 2 * I, C, scale=C**-0.5 * 4)
    w2 = randn(g, E, C, I, scale=I**-0.5)
    ids = torch.stack([torch.randperm(E + 2)[:k] - 1 for _ in range(T_)]).to(DEV)  # some other-rank experts
    weights = torch.rand(T_, k, generator=g, device=DEV).to(torch.bfloat16)
    out = fused_moe_clamped(x, w13, w2, weights, ids, 10.0)
    if not DRY:
        h = torch.nn.functional.linear(up(x), up(w13[0]))
        assert (h[:, :I] > 10).any(), "test inputs should reach the clamp"
        close(out, ref.fused_moe_clamped(up(x), up(w13), up(w2), up(weights), ids, 10.0), "fused_moe_clamped")


# ---- CUDA graphs -----------------------------------------------------------------------------------
def test_v4_decode_ops_capture_in_a_graph():
    """Attention, compressor and indexer take no host decision from values: capture, replay on new inputs."""
    if DRY:
        pytest.skip("needs a GPU")
    from kernels_cuda.v4_attention import v4_sparse_attention
    from kernels_cuda.v4_indexer import v4_indexer_topk

    g = torch.Generator(device=DEV).manual_seed(17)
    q, swa, swa_tab, comp, comp_tab, ids, seq_idx, pos, sinks = _attention_inputs(g, "csa", 64, 256,
                                                                                   [9, 3000, 700], None)
    qi = randn(g, 3, HI, DI)
    wi = randn(g, 3, HI, dtype=torch.float32)

    def run():  # 3 tokens: the split-KV path with its combine
        picks = v4_indexer_topk(qi, wi, comp[..., D:], comp_tab, seq_idx, pos, 4, 512, DI**-0.5)
        return v4_sparse_attention(q, swa, swa_tab, comp, comp_tab, picks, seq_idx, pos, W, sinks, D**-0.5)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = run()
    q.copy_(randn(g, *q.shape))
    qi.copy_(randn(g, *qi.shape))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, run())
