"""The fused decode ops on an H200 at real shapes: ``add_rms_norm_linear`` (the layer's input norm in the
prologue of the q + kv_a GEMV, ``kernels_cuda/norm_gemv.py``) against the float32 reference, with the new
residual bit-exact (the bf16 sum), and against the two kernels it replaces; ``add_rms_norm_moe_gate`` (the
post-attention norm in the prologue of the router, ``kernels_cuda/moe_gate.py``) likewise; ``mla_q_absorb_kv_write``
(the decode query and the cache write in one launch, ``kernels_cuda/gemv_rows.py``) against the two launches.

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


@pytest.mark.parametrize("T", [1, 3, 8, 20])  # 20: the two-launch path (add_rms_norm, then moe_gate)
@pytest.mark.parametrize("case", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_add_rms_norm_moe_gate_real_shapes(case, T):
    """The post-attention norm in the router's launch (V2-Lite, V3, V2-group gates): the new residual is the bf16
    sum, the normed row is the norm kernel's within a last bit, and the routing of that normed row is the
    reference's (the rows are drawn with a clear margin on the normed row); twice in a row (the counters)."""
    from deepinfer_core.testing.kernel_cases import _route_margin
    from kernels_cuda.moe_gate import add_rms_norm_moe_gate
    from kernels_cuda.norm import add_rms_norm

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
