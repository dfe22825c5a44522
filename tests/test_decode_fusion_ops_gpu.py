"""The fused decode ops on an H200 at real shapes: ``add_rms_norm_linear`` (the layer's input norm in the
prologue of the q + kv_a GEMV, ``kernels_cuda/norm_gemv.py``) against the float32 reference, with the new
residual bit-exact (the bf16 sum), and against the two kernels it replaces; ``add_rms_norm_moe_gate`` (the
post-attention norm in the prologue of the router, ``kernels_cuda/moe_gate.py``) likewise; ``mla_q_absorb_kv_write``
(the decode query and the cache write in one launch, ``kernels_cuda/gemv_rows.py``) against the two launches;
``mla_decode_uv`` (the key splits' merge and W_UV in one kernel, ``kernels_cuda/mla_decode_uv.py``) against
``mla_decode`` + ``head_linear`` and the float32 reference, over bf16 and FP8 latent rows, and under graph replay.

With ``DEEPINFER_TL_DRYRUN=1`` and no GPU the same calls only compile the kernels."""

import pytest
import torch
from gpu_marks import DRY, GPU_OR_DRY
from test_kernels_cuda_gpu import DEV, GATE_CASES, _check_gate, _gate_inputs, close, gen, randn, up

from kernels_cpu import ops as ref

pytestmark = GPU_OR_DRY

#: (N, K) of the fused input projection: V2-Lite q + kv_a, V3 q_a + kv_a, the tiny V2-Lite of the random tests
SHAPES = [(16 * 192 + 576, 2048), (1536 + 576, 7168), (4 * 48 + 40, 64)]


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("N,K", SHAPES)
def test_add_rms_norm_linear_real_shapes(N, K, residual):
    from kernels_cuda import gemv, norm, norm_gemv

    g = gen(11)
    x = randn(g, 1, K, scale=3.0)
    r = randn(g, 1, K, scale=3.0) if residual else None
    nw = (1 + randn(g, K, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    w = randn(g, N, K, scale=K**-0.5)
    assert norm_gemv.applies(x, r, nw, w)
    y, res = norm_gemv.add_rms_norm_linear(x, r, nw, 1e-6, w)
    y2, res2 = norm_gemv.add_rms_norm_linear(x, r, nw, 1e-6, w)
    if DRY:
        return
    assert torch.equal(y, y2) and torch.equal(res, res2), "not deterministic"
    if residual:
        assert torch.equal(res, x + r), "the new residual must be the bf16 sum"
        normed, _ = norm.add_rms_norm(x, r, nw, 1e-6)
    else:
        assert res is x
        normed = norm.rms_norm(x, nw, 1e-6)
    close(y, ref.linear(ref.rms_norm(res.float(), nw.float(), 1e-6), w.float()), torch.bfloat16, "fused vs float32")
    # against the two launches it replaces: the same normed row up to a last-bit difference of the rsqrt
    close(y, gemv.linear(normed, w).float(), torch.bfloat16, "fused vs norm kernel + GEMV")


def test_add_rms_norm_linear_other_rows_take_two_launches():
    """Several rows (and a float32 activation) are the backend's norm and ``linear``, same results as the op."""
    from kernels_cuda import norm_gemv

    g = gen(12)
    x, r = randn(g, 3, 2048), randn(g, 3, 2048)
    nw = (1 + randn(g, 2048, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    w = randn(g, 3648, 2048, scale=2048**-0.5)
    assert not norm_gemv.applies(x, r, nw, w)
    y, res = norm_gemv.add_rms_norm_linear(x, r, nw, 1e-6, w)
    if DRY:
        return
    assert torch.equal(res, x + r)
    close(y, ref.linear(ref.rms_norm(res.float(), nw.float(), 1e-6), w.float()), torch.bfloat16, "3 rows")
    xf = x.float()
    y32, _ = norm_gemv.add_rms_norm_linear(xf, r.float(), nw.float(), 1e-6, w.float())
    close(y32, ref.linear(*up(ref.rms_norm(xf + r.float(), nw.float(), 1e-6), w)), torch.float32, "float32")


@pytest.mark.parametrize("T", [1, 3, 8, 20, 256])  # 20, 256: two launches (add_rms_norm, then moe_gate)
@pytest.mark.parametrize("case", GATE_CASES, ids=[c[0] for c in GATE_CASES])
@pytest.mark.parametrize("no_cast", ["0", "1"], ids=["default", "no_cast_launches"])
def test_add_rms_norm_moe_gate_real_shapes(case, T, no_cast, monkeypatch):
    """The post-attention norm in the router's launch (V2-Lite, V3, V2-group gates): the new residual is the bf16
    sum, the normed row is the norm kernel's within a last bit, and the routing of that normed row is the
    reference's (the rows are drawn with a clear margin on the normed row); twice in a row (the counters).
    ``no_cast_launches``: past 8 tokens the router reads the norm launch's float32 copy
    (``DEEPINFER_NO_CAST_LAUNCHES``)."""
    from deepinfer_core.testing.kernel_cases import _route_margin
    from kernels_cuda import gemv_rows
    from kernels_cuda.moe_gate import add_rms_norm_moe_gate
    from kernels_cuda.norm import add_rms_norm

    if no_cast == "1" and T <= 8:
        pytest.skip("one fused launch: no cast either way")
    monkeypatch.setenv(gemv_rows.NO_CAST_ENV, no_cast)

    _, C, (_, E, k, scoring, has_bias, ng, tg, gs, *_rest), _S = case
    x0, gate, bias, args = _gate_inputs(case, T, T)  # x0 only for its shape; the gate and the routing args
    g = torch.Generator().manual_seed(100 + T)
    nw = (1 + torch.randn(C, generator=g) * 0.1).to(torch.bfloat16)
    xs, rs = [], []
    while len(xs) < T:
        x, r = torch.randn(4 * T, C, generator=g).to(torch.bfloat16), torch.randn(4 * T, C, generator=g).to(
            torch.bfloat16)
        s = (x.float() + r.float()).to(torch.bfloat16).float()
        normed = (nw.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))).to(torch.bfloat16)
        ok = _route_margin(normed.float() @ gate.cpu().T, None if bias is None else bias.cpu(), k, scoring, ng, tg,
                           gs) >= 1e-3
        xs.extend(x[ok])
        rs.extend(r[ok])
    x, r, nw = torch.stack(xs[:T]).to(DEV), torch.stack(rs[:T]).to(DEV), nw.to(DEV)
    for rep in range(2):
        normed, res, w, ids = add_rms_norm_moe_gate(x, r, nw, 1e-6, gate, bias, *args)
        if DRY:
            continue
        want_n, want_r = add_rms_norm(x, r, nw, 1e-6)
        assert torch.equal(res, want_r), "the new residual must be the bf16 sum"
        close(normed, want_n.float(), torch.bfloat16, f"normed T={T}")
        _check_gate((w, ids), normed, gate, bias, args, f"add_rms_norm_moe_gate {case[0]} T={T} call {rep}")


@pytest.mark.parametrize("C", [2048, 7168])
@pytest.mark.parametrize("T", [9, 256])
def test_add_rms_norm_f32_copy_is_the_normed_rows(T, C):
    """``norm.add_rms_norm_f32`` (the router's input past 8 tokens): its bf16 rows and residual are bit-equal to
    ``add_rms_norm``'s, and its float32 copy is exactly those rows widened."""
    from kernels_cuda.norm import add_rms_norm, add_rms_norm_f32

    g = gen(17)
    x, r = randn(g, T, C, scale=3.0), randn(g, T, C, scale=3.0)
    nw = (1 + randn(g, C, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    y, res, y32 = add_rms_norm_f32(x, r, nw, 1e-6)
    if DRY:
        return
    want_y, want_r = add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(y, want_y) and torch.equal(res, want_r)
    assert y32.dtype == torch.float32 and torch.equal(y32, want_y.float())


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_mla_q_absorb_kv_write_real_shapes(T, bs):
    """V2-Lite: q and kv_a are column slices of the fused projection's output; the query is bit-identical to
    ``mla_q_absorb``'s launch, the written entries match ``mla_kv_write``'s and the float32 reference, -1 slots and
    every other cache row are left alone."""
    from kernels_cpu.fused import mla_kv_write as ref_kv_write
    from kernels_cuda.gemv_rows import mla_q_absorb, mla_q_absorb_kv_write
    from kernels_cuda.mla_kv_write import mla_kv_write

    H, NN, R, L, P = 16, 128, 64, 512, 4096
    g = gen(13)
    xa = randn(g, T, H * (NN + R) + L + R, scale=2.0)
    q, kv_a = xa[:, : H * (NN + R)].view(T, H, NN + R), xa[:, H * (NN + R):]
    w_uk = randn(g, H, L, NN, scale=NN**-0.5)
    norm_w = (1 + randn(g, L, dtype=torch.float32, scale=0.1)).to(torch.bfloat16)
    NB = 8
    pos = torch.randint(0, P, (T,), generator=torch.Generator().manual_seed(T)).to(DEV)
    slots = torch.randperm(NB * bs, generator=torch.Generator().manual_seed(bs))[:T].to(DEV)
    if T > 1:
        slots[1] = -1
    cs = torch.cat((torch.rand(P, R // 2), torch.rand(P, R // 2)), -1).to(DEV) if not DRY else torch.zeros(P, R)
    cache = randn(g, NB, bs, L + R)
    before = cache.clone()
    out = mla_q_absorb_kv_write(q, w_uk, pos, cs, kv_a, norm_w, 1e-6, cache, slots)
    if DRY:
        return
    assert torch.equal(out, mla_q_absorb(q, w_uk, pos, cs)), "the query must be mla_q_absorb's, bit for bit"
    want = before.clone()
    entry = mla_kv_write(kv_a, norm_w, 1e-6, pos, cs, want, slots)
    truth = before.float().cpu()
    ref_kv_write(*up(kv_a.cpu(), norm_w.cpu()), 1e-6, pos.cpu(), cs.cpu(), truth, slots.cpu())
    keep = slots >= 0
    flat, flat_want = cache.view(-1, L + R), want.view(-1, L + R)
    close(flat[slots[keep]], entry[keep].float(), torch.bfloat16, "entries vs mla_kv_write")
    close(flat[slots[keep]], truth.view(-1, L + R)[slots[keep].cpu()], torch.bfloat16, "entries vs float32")
    untouched = torch.ones(NB * bs, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(flat[untouched], flat_want[untouched]), "rows other than the tokens' slots changed"


# ---- mla_decode_uv: the key splits' merge and W_UV in one kernel ---------------------------------------------------
#: label, heads, block size, q_lens, seq_lens. Batch 1 at V2-Lite's and V3's heads (key splits: the fused kernel, one
#: live split at <= 64 keys: the attention wrote the row), a few rows (V2-Lite: fused up to 4; V3's W_UV of 16 MB
#: only at one row), a ragged batch, and larger batches (the combine and head_linear: the op's two-launch paths)
UV_CASES = [
    ("V2-Lite b1 1 key", 16, 64, [1], [1]),
    ("V2-Lite b1 63 keys", 16, 64, [1], [63]),
    ("V2-Lite b1 65 keys", 16, 64, [1], [65]),
    ("V2-Lite b1 2049 keys", 16, 64, [1], [2049]),
    ("V2-Lite b1 4100 keys bs16", 16, 16, [1], [4100]),
    ("V2-Lite b1 40000 keys (64 splits)", 16, 64, [1], [40000]),
    ("V2-Lite b4", 16, 64, [1] * 4, [1, 65, 2049, 4100]),
    ("V2-Lite ragged 3 rows", 16, 64, [2, 1], [65, 4096]),
    ("V2-Lite b8 (combine + GEMV)", 16, 64, [1] * 8, [1, 63, 65, 300, 1000, 2049, 3000, 4100]),
    ("V2-Lite b130 (no split)", 16, 64, [1] * 130, [1 + 29 * i for i in range(130)]),
    ("V3 b1 1 key", 128, 64, [1], [1]),
    ("V3 b1 63 keys", 128, 64, [1], [63]),
    ("V3 b1 65 keys", 128, 64, [1], [65]),
    ("V3 b1 2049 keys", 128, 64, [1], [2049]),
    ("V3 b1 4100 keys bs16", 128, 16, [1], [4100]),
    ("V3 ragged 3 rows (two launches: W_UV on cuBLAS)", 128, 64, [2, 1], [65, 4096]),
]


def _uv_inputs(H, bs, q_lens, seq_lens, kv, seed=21):
    from test_kernels_cuda_gpu import paged
    from test_kv_fp8_gpu import fp8_paged

    g = gen(seed)
    L, R, V = 512, 64, 128
    cache, tables = fp8_paged(seq_lens, bs, seed) if kv == "fp8" else paged(g, seq_lens, bs, L + R)
    q = randn(g, sum(q_lens), H, L + R)
    w_uv = randn(g, H, V, L, scale=L**-0.5)
    cu = torch.tensor([0, *q_lens], device=DEV).cumsum(0)
    return q, cache, tables, cu, torch.tensor(seq_lens, device=DEV), 192**-0.5, L, w_uv


def _fused_expected(H: int, T: int) -> bool:
    """Whether the op runs its merge + W_UV kernel (the attention splits the keys, ``head_linear`` takes the GEMV)."""
    return T <= (4 if H == 16 else 1)


def _launch_recorder(monkeypatch):
    """Counts the combine's and the fused kernel's launches (the kernels still run)."""
    from kernels_cuda import mla_decode as md
    from kernels_cuda import mla_decode_uv as muv

    launched = {"combine": 0, "uv": 0}
    for mod, attr, key in ((md, "_combine_kernel", "combine"), (muv, "_kernel", "uv")):
        real = getattr(mod, attr)

        def get(*cfg, _real=real, _key=key):
            kernel = _real(*cfg)

            def run(*a):
                launched[_key] += 1
                return kernel(*a)

            return run

        monkeypatch.setattr(mod, attr, get)
    return launched


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("case", UV_CASES, ids=[c[0] for c in UV_CASES])
def test_mla_decode_uv_real_shapes(case, kv, monkeypatch):
    """The fused op against the two ops it replaces on the GPU (the merged row rounded to bf16 as the combine's
    output is, so within about a bf16 ulp: only W_UV's summation order differs) and against the float32 reference
    (the kit's bf16 rule), deterministic; the fused kernel runs exactly where expected, and the combine then not."""
    from kernels_cpu.fused import mla_decode_uv as ref_uv
    from kernels_cuda.gemv_rows import head_linear
    from kernels_cuda.mla_decode import mla_decode
    from kernels_cuda.mla_decode_uv import mla_decode_uv

    _, H, bs, q_lens, seq_lens = case
    args = _uv_inputs(H, bs, q_lens, seq_lens, kv)
    q, cache, tables, cu, sl, scale, L, w_uv = args
    launched = _launch_recorder(monkeypatch)
    out = mla_decode_uv(*args)
    if DRY:
        return
    fused = _fused_expected(H, sum(q_lens))
    assert (launched == {"combine": 0, "uv": 1}) if fused else (launched["uv"] == 0), launched
    assert out.shape == (sum(q_lens), H, 128) and out.dtype == torch.bfloat16
    assert torch.equal(out, mla_decode_uv(*args)), "not deterministic"
    two = head_linear(mla_decode(q, cache, tables, cu, sl, scale, L), w_uv)
    o, r = out.double().cpu(), two.double().cpu()
    worst = ((o - r).abs() / (4e-3 * (r.abs() + r.pow(2).mean().sqrt()))).max().item()
    assert worst <= 1.0, f"fused vs mla_decode + head_linear: {worst:.2f}x a bf16 ulp"
    cache_ref = cache if kv == "fp8" else cache.float()
    truth = ref_uv(q.float(), cache_ref, tables.clamp_min(0), cu, sl, scale, L, w_uv.float())
    close(out, truth, torch.bfloat16, f"mla_decode_uv {case[0]} {kv} vs float32")


def test_mla_decode_uv_switch_off(monkeypatch):
    """``DEEPINFER_UV_FUSION=0`` (a benchmark's before): the combine and ``head_linear``, bit for bit."""
    from kernels_cuda import mla_decode_uv as muv
    from kernels_cuda.gemv_rows import head_linear
    from kernels_cuda.mla_decode import mla_decode

    args = _uv_inputs(16, 64, [1], [2049], "bf16")
    monkeypatch.setenv(muv.ENV, "0")
    launched = _launch_recorder(monkeypatch)
    out = muv.mla_decode_uv(*args)
    if DRY:
        return
    assert launched == {"combine": 1, "uv": 0}
    assert torch.equal(out, head_linear(mla_decode(*args[:-1]), args[-1]))


@pytest.mark.parametrize("H", [16, 128])
def test_mla_decode_uv_graph_replay(H):
    """No host synchronisation: captured once at batch 1 (2049 keys), replayed with other queries and other context
    lengths (many live splits, two, and one: the attention's own row), each replay equal to an eager call."""
    if DRY:
        pytest.skip("needs a GPU")
    from kernels_cuda.mla_decode_uv import mla_decode_uv

    q, cache, tables, cu, sl, scale, L, w_uv = _uv_inputs(H, 64, [1], [5000], "bf16")
    sl.fill_(2049)
    mla_decode_uv(q, cache, tables, cu, sl, scale, L, w_uv)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = mla_decode_uv(q, cache, tables, cu, sl, scale, L, w_uv)
    g = gen(5)
    for n in (2049, 4999, 65, 64, 1):
        q.copy_(randn(g, *q.shape))
        sl.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, mla_decode_uv(q, cache, tables, cu, sl, scale, L, w_uv)), f"replay at {n} keys"
