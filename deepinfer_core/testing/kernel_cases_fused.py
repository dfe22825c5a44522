"""The conformance kit's cases for the decode-fusion ops (``kernels_cpu.fused``, ``kernels_cpu.FUSED_OPS``): the
router's float32 GEMV (``linear_f32``), MLA's cache write (``mla_kv_write``) and absorbed query (``mla_q_absorb``),
the router with the shared experts' slots (``moe_gate``), a norm in the prologue of the projection after it
(``add_rms_norm_linear``) and of the router (``add_rms_norm_moe_gate``), the cache write in the decode query's
launch (``mla_q_absorb_kv_write``), and MLA's decode attention with W_UV after it (``mla_decode_uv``).
``kernel_cases.CASES`` includes them."""

from __future__ import annotations

import math

import torch

from deepinfer_core.testing.kernel_cases import (
    Case,
    _cu,
    _fp8_kv_cache,
    _paged_layout,
    _randn,
    _rope_table,
    _route_margin,
)


def _cases_linear_f32(g, dtype, bs):
    K, N = 256, 64
    w = _randn(g, N, K, dtype=dtype, scale=K**-0.5)
    w32 = _randn(g, N, K, scale=K**-0.5)  # the router's gate is kept in float32 whatever the model dtype
    return [Case("1 row", (_randn(g, 1, K, dtype=dtype), w)), Case("5 rows", (_randn(g, 5, K, dtype=dtype), w)),
            Case("12 rows", (_randn(g, 12, K, dtype=dtype), w)),
            Case("1 row, float32 weight", (_randn(g, 1, K, dtype=dtype), w32)),
            Case("8 rows, float32 weight", (_randn(g, 8, K, dtype=dtype), w32))]


def _cases_mla_kv_write(g, dtype, bs):
    L, R, T, P = 128, 16, 11, 64
    NB = max(4, math.ceil(2 * T / bs))
    slots = torch.randperm(NB * bs, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[:3]] = -1
    wide = _randn(g, T, 40 + L + R, dtype=dtype, scale=2.0)  # kv_a: the last columns of the fused projection
    norm_w = (1 + _randn(g, L, scale=0.1)).to(dtype)
    pos = torch.randint(0, P, (T,), generator=g)
    return [Case("strided kv_a, -1 slots", (wide[:, 40:], norm_w, 1e-6, pos, _rope_table(P, R),
                                             _randn(g, NB, bs, L + R, dtype=dtype), slots))]


def _cases_mla_q_absorb(g, dtype, bs):
    H, N, R, L, T, P = 3, 32, 16, 48, 5, 64
    q = _randn(g, T, H, N + R + 8, dtype=dtype)[..., : N + R]  # a strided view, as the projection's output
    w_uk = _randn(g, H, L, N, dtype=dtype, scale=N**-0.5)
    pos = torch.randint(0, P, (T,), generator=g)
    return [Case("strided q", (q, w_uk, pos, _rope_table(P, R))),
            Case("one token", (q[:1].contiguous(), w_uk, pos[:1], _rope_table(P, R)))]


#: ``moe_gate``'s variants (and ``add_rms_norm_moe_gate``'s): label, E, top_k, scoring, bias?, n_group, topk_group,
#: group_score, renormalize, scale, n_shared, float32 gate
MOE_GATE_VARIANTS = (
    ("V2 softmax groups, 2 shared, float32 gate", 16, 4, "softmax", False, 4, 2, "max", False, 16.0, 2, True),
    ("V3 sigmoid bias top2sum, 1 shared", 32, 8, "sigmoid", True, 8, 4, "top2sum", True, 2.5, 1, True),
    ("softmax renorm, no shared, gate in the model dtype", 16, 4, "softmax", False, 1, 1, "max", True, 1.0, 0, False),
)


def _gate_weights(g, E: int, C: int, has_bias: bool, f32: bool, dtype):
    """A router's (bias or None, gate [E, C]): the gate in float32 or the model dtype."""
    bias = _randn(g, E, scale=0.05) if has_bias else None
    gate = _randn(g, E, C, scale=2.0 * C**-0.5)
    return bias, (gate if f32 else gate.to(dtype))


def _cases_moe_gate(g, dtype, bs):
    T, C = 8, 64
    cases = []
    for label, E, k, scoring, has_bias, ng, tg, gs, renorm, scale, S, f32 in MOE_GATE_VARIANTS:
        bias, gate = _gate_weights(g, E, C, has_bias, f32, dtype)
        rows: list[torch.Tensor] = []
        for _ in range(20):  # tokens whose selection is unambiguous (no near-ties)
            cand = _randn(g, 4 * T, C, dtype=dtype)
            ok = _route_margin(cand.float() @ gate.float().T, bias, k, scoring, ng, tg, gs) >= 1e-3
            rows.extend(cand[ok])
            if len(rows) >= T:
                break
        x = torch.stack(rows[:T])
        cases.append(Case(label, (x, gate, bias, k, scoring, ng, tg, gs, renorm, scale, S, dtype)))
    return cases


def _cases_add_rms_norm_linear(g, dtype, bs):
    def case(label, T, C, N, residual=True):
        x = _randn(g, T, C, dtype=dtype, scale=2.0)
        res = _randn(g, T, C, dtype=dtype, scale=4.0) if residual else None
        norm_w = (1 + _randn(g, C, scale=0.1)).to(dtype)
        return Case(label, (x, res, norm_w, 1e-6, _randn(g, N, C, dtype=dtype, scale=C**-0.5)))

    return [case("1 row", 1, 256, 40), case("1 row, no residual", 1, 256, 40, residual=False),
            # K 1000: the last 16-byte vectors of the row leave threads idle; N 2200: 8 weight rows per CTA
            case("1 row, K 1000", 1, 1000, 24), case("1 row, wide N", 1, 256, 2200),
            case("5 rows", 5, 256, 40), case("3 rows, no residual", 3, 128, 16, residual=False)]


def _cases_add_rms_norm_moe_gate(g, dtype, bs):
    """``moe_gate``'s variants behind the norm, tokens drawn with a clear routing margin on the normed row (the
    float32 truth does not round it to the activation dtype: the margin covers that)."""
    from kernels_cpu.ops import add_rms_norm

    T, C = 8, 64
    cases = []
    for label, E, k, scoring, has_bias, ng, tg, gs, renorm, scale, S, f32 in MOE_GATE_VARIANTS:
        bias, gate = _gate_weights(g, E, C, has_bias, f32, dtype)
        norm_w = (1 + _randn(g, C, scale=0.1)).to(dtype)
        xs, rs = [], []
        for _ in range(40):
            x, r = _randn(g, 4 * T, C, dtype=dtype), _randn(g, 4 * T, C, dtype=dtype, scale=2.0)
            normed = add_rms_norm(x, r, norm_w, 1e-6)[0]
            ok = _route_margin(normed.float() @ gate.float().T, bias, k, scoring, ng, tg, gs) >= 2e-2
            xs.extend(x[ok])
            rs.extend(r[ok])
            if len(xs) >= T:
                break
        args = (gate, bias, k, scoring, ng, tg, gs, renorm, scale, S, dtype)
        cases.append(Case(label, (torch.stack(xs[:T]), torch.stack(rs[:T]), norm_w, 1e-6, *args)))
        if len(cases) == 1:  # one token (the decode step of batch 1)
            cases.append(Case(label + ", one token", (xs[0][None], rs[0][None], norm_w, 1e-6, *args)))
    return cases


def _cases_mla_q_absorb_kv_write(g, dtype, bs):
    """The decode query (a strided q, as the projection's output) and the cache write of the same tokens (kv_a a
    strided column slice; -1 slots are not written)."""
    H, N, R, L, Lkv, P = 3, 32, 16, 48, 128, 64
    cases = []
    for label, T in (("5 tokens, -1 slots", 5), ("one token", 1)):
        q = _randn(g, T, H, N + R + 8, dtype=dtype)[..., : N + R]
        w_uk = _randn(g, H, L, N, dtype=dtype, scale=N**-0.5)
        pos = torch.randint(0, P, (T,), generator=g)
        NB = max(4, math.ceil(2 * T / bs))
        slots = torch.randperm(NB * bs, generator=g)[:T]
        if T > 1:
            slots[1] = -1
        kv_a = _randn(g, T, 40 + Lkv + R, dtype=dtype, scale=2.0)[:, 40:]
        norm_w = (1 + _randn(g, Lkv, scale=0.1)).to(dtype)
        cases.append(Case(label, (q, w_uk, pos, _rope_table(P, R), kv_a, norm_w, 1e-6,
                                  _randn(g, NB, bs, Lkv + R, dtype=dtype), slots)))
    return cases


def _cases_mla_decode_uv(g, dtype, bs):
    """``mla_decode``'s layouts with W_UV [H, V, L] after it: small shapes (one query row a sequence, and ragged
    query blocks), and V2-Lite's (16 heads, L 512, rope 64, V 128) at one and three sequences (a backend's fused
    launch: key splits at small batches, one live split at a short context, a context of many splits), over a cache
    of the model dtype and over FP8 latent rows."""
    cases = []
    for label, H, L, R, V, q_lens, seq_lens in (
        ("q_len 1", 4, 64, 8, 16, [1, 1, 1, 1], [1, bs, bs + 1, 2 * bs + 5]),
        ("ragged q_len", 4, 64, 8, 16, [1, 3, 2, 1], [4, 3, 2 * bs + 1, bs + 2]),
        ("H16 L512 one sequence", 16, 512, 64, 128, [1], [40 * bs + 3]),
        ("H16 L512 q_len 1", 16, 512, 64, 128, [1, 1, 1], [1, bs + 1, 9 * bs + 5]),
    ):
        tables, NB = _paged_layout(g, seq_lens, bs)
        D = L + R
        cases.append(Case(label, (
            _randn(g, sum(q_lens), H, D, dtype=dtype), _randn(g, NB, bs, D, dtype=dtype), tables, _cu(q_lens),
            torch.tensor(seq_lens), D**-0.5, L, _randn(g, H, V, L, dtype=dtype, scale=L**-0.5))))
    for label, H, L, R, V, q_lens, seq_lens in (
        ("fp8 rows H16 L512 q_len 1", 16, 512, 64, 128, [1, 1], [bs + 1, 20 * bs + 5]),
        ("fp8 rows H4 L64 ragged q_len", 4, 64, 16, 16, [1, 3, 2, 1], [4, 3, 2 * bs + 1, bs + 2]),
    ):
        tables, NB = _paged_layout(g, seq_lens, bs)
        cases.append(Case(label, (
            _randn(g, sum(q_lens), H, L + R, dtype=dtype), _fp8_kv_cache(g, NB, bs, L, R), tables, _cu(q_lens),
            torch.tensor(seq_lens), (L + R) ** -0.5, L, _randn(g, H, V, L, dtype=dtype, scale=L**-0.5)), kv="fp8"))
    return cases


FUSED_CASES = {"linear_f32": _cases_linear_f32, "mla_kv_write": _cases_mla_kv_write,
               "mla_q_absorb": _cases_mla_q_absorb, "moe_gate": _cases_moe_gate,
               "add_rms_norm_linear": _cases_add_rms_norm_linear,
               "add_rms_norm_moe_gate": _cases_add_rms_norm_moe_gate,
               "mla_q_absorb_kv_write": _cases_mla_q_absorb_kv_write, "mla_decode_uv": _cases_mla_decode_uv}
