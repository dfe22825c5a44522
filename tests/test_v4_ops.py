"""The DeepSeek-V4 reference ops (``kernels_cpu/v4_ops.py``) against transformers' modules and
independent formulas, op by op (the model-level comparison is ``test_deepseek_v4.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_v4 import hf_config

from deepinfer_core.models.deepseek_v4 import rope_table
from kernels_cpu import ops, v4_ops


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0))
    return module


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_v4_compress_matches_transformers_compressor(kind):
    """Stateless transformers compressor over 40 tokens vs v4_compress over a shuffled paged state."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    cfg = hf_config("mixed")
    comp = _randomize((mod.DeepseekV4CSACompressor if kind == "csa" else mod.DeepseekV4HCACompressor)(cfg), 0)
    comp.position_bias.data = torch.randn(comp.position_bias.shape, generator=torch.Generator().manual_seed(1))
    S, C = 40, cfg.hidden_size
    x = torch.randn(1, S, C, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(S)[None]
    with torch.no_grad():
        ref = comp(x, torch.randn(1, S, cfg.q_lora_rank), pos, None, 0)[0][0, 0]  # [N, D]
        rows = torch.cat((comp.kv_proj(x[0]), comp.gate_proj(x[0])), dim=-1)  # [S, 2w]
    m = comp.compress_rate
    bs = 8
    order = torch.randperm(S // bs, generator=torch.Generator().manual_seed(3))
    state = torch.full((S // bs, bs, rows.shape[1] + 3), float("nan"))
    for j in range(S // bs):
        state[order[j], :, 3:] = rows[j * bs:(j + 1) * bs]
    close = torch.arange(m - 1, S, m)
    table = rope_table(cfg.qk_rope_head_dim, cfg.rope_parameters["compress"]["rope_theta"], 64,
                       cfg.rope_parameters["compress"])
    out = v4_ops.v4_compress(state, order[None].to(torch.int32), torch.zeros_like(close), close,
                             comp.position_bias.data, comp.kv_norm.weight.data, cfg.rms_norm_eps, table, 3)
    assert out.shape == ref.shape == (S // m, cfg.head_dim)
    assert (out - ref).abs().max() < 1e-5


def test_moe_route_v4_matches_transformers_routers():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    for scoring in ("sqrtsoftplus", "sigmoid"):
        cfg = hf_config("mixed", scoring_func=scoring)
        x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        learned = _randomize(mod.DeepseekV4TopKRouter(cfg), 1)
        learned.e_score_correction_bias = torch.randn(cfg.n_routed_experts) * 0.1
        hashed = _randomize(mod.DeepseekV4HashRouter(cfg), 2)
        hashed.tid2eid = torch.stack([torch.randperm(cfg.n_routed_experts)[:2] for _ in range(cfg.vocab_size)])
        ids = torch.randint(0, cfg.vocab_size, (12,))
        with torch.no_grad():
            _, w_ref, i_ref = learned(x)
            w, i = v4_ops.moe_route_v4(F.linear(x, learned.weight), learned.e_score_correction_bias, None, 2, scoring,
                                       cfg.routed_scaling_factor)
            assert torch.equal(i.sort(-1).values, i_ref.sort(-1).values)
            assert torch.allclose(w.gather(1, i.argsort(-1)), w_ref.gather(1, i_ref.argsort(-1)), atol=1e-6)
            _, w_ref, i_ref = hashed(x, ids)
            w, i = v4_ops.moe_route_v4(F.linear(x, hashed.weight), None, hashed.tid2eid[ids], 2, scoring,
                                       cfg.routed_scaling_factor)
            assert torch.equal(i, i_ref) and torch.allclose(w, w_ref, atol=1e-6)
    with pytest.raises(ValueError, match="scoring must be 'sqrtsoftplus' or 'sigmoid'"):
        v4_ops.moe_route_v4(torch.zeros(1, 4), None, None, 2, "softmax", 1.0)


def test_rope_inverse_undoes_rope():
    table = rope_table(16, 10000.0, 64)
    x = torch.randn(5, 3, 16)
    pos = torch.tensor([0, 3, 17, 40, 63])
    assert torch.allclose(v4_ops.rope_inverse(ops.rope(x, pos, table), pos, table), x, atol=1e-6)
    assert not torch.allclose(ops.rope(x, pos, table), x, atol=1e-3)


def test_swiglu_clamp():
    x = torch.tensor([[20.0, -3.0, 20.0, -20.0]])  # gate [20, -3], up [20, -20]
    out = v4_ops.silu_and_mul_clamped(x, 5.0)
    assert torch.allclose(out, torch.tensor([[F.silu(torch.tensor(5.0)) * 5.0, F.silu(torch.tensor(-3.0)) * -5.0]]))
    assert torch.equal(v4_ops.silu_and_mul_clamped(x, None), ops.silu_and_mul(x))
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(6, 8, generator=g), torch.randn(3, 10, 8, generator=g), torch.randn(3, 8, 5, generator=g),
            torch.rand(6, 2, generator=g), torch.randint(0, 3, (6, 2), generator=g))
    assert torch.allclose(v4_ops.fused_moe_clamped(*args, None), ops.fused_moe(*args))
    assert not torch.allclose(v4_ops.fused_moe_clamped(*args, 0.1), ops.fused_moe(*args))


def test_sparse_attention_sink_and_window():
    """One head, keys known: the sink takes its softmax share; keys outside the window are ignored."""
    D, W = 4, 2
    swa = torch.zeros(1, 8, D)
    swa[0, :, 0] = torch.arange(8.0)  # key of position p: [p, 0, 0, 0]
    q = torch.tensor([[[1.0, 0, 0, 0]]])
    out = v4_ops.v4_sparse_attention(q, swa, torch.zeros(1, 1, dtype=torch.int32), None, None, None,
                                     torch.tensor([0]), torch.tensor([5]), W, torch.tensor([0.5]), 1.0)
    logits = torch.tensor([4.0, 5.0, 0.5])  # positions 4 and 5, then the sink
    p = logits.softmax(0)
    assert torch.allclose(out[0, 0, 0], p[0] * 4 + p[1] * 5)


def test_mhc_comb_is_doubly_stochastic():
    n, C = 4, 8
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, n, C, generator=g)
    x, post, comb = v4_ops.mhc_pre(h, torch.randn((2 + n) * n, n * C, generator=g), torch.randn((2 + n) * n,
                                   generator=g), torch.ones(3), 20, 1e-6, 1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(5, n), atol=0.05)  # rows: 20 iterations, not converged
    assert torch.allclose(comb.sum(-2), torch.ones(5, n), atol=1e-5)
    assert ((post > 0) & (post < 2)).all() and x.shape == (5, C)


def test_token_chunking_does_not_change_results(monkeypatch):
    from deepinfer_core.testing.kernel_cases import _cases_v4_indexer_topk, _cases_v4_sparse_attention

    g = torch.Generator().manual_seed(0)
    cases = [(v4_ops.v4_sparse_attention, c) for c in _cases_v4_sparse_attention(g, torch.float32, 16)]
    cases += [(v4_ops.v4_indexer_topk, c) for c in _cases_v4_indexer_topk(g, torch.float32, 16)]
    for fn, case in cases:
        whole = fn(*case.args)
        monkeypatch.setattr(v4_ops, "TOKEN_CHUNK", 2)
        assert torch.equal(fn(*case.args), whole), case.label
        monkeypatch.setattr(v4_ops, "TOKEN_CHUNK", 10**9)
