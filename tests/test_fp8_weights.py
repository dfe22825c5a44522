"""Block-scaled FP8 weights: the reference ops' exact rules (kernels_cpu/fp8_ops.py), and FP8 checkpoints
loaded with ``weight_dtype = "bf16"`` (dequantised at load) and ``"fp8"`` (kept e4m3, run by the fp8 ops)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, write_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.models.loader import CheckpointError, dequantize_fp8, quantize_fp8, quantize_model_fp8
from kernels_cpu.fp8_ops import FP8, dequantize_blocks, fp8_linear, fused_moe_fp8, quantize_act_fp8

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from random_checkpoint import FP8_QUANTIZATION, fp8_copy, is_fp8_weight  # noqa: E402


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- the reference ops ------------------------------------------------------------------------------

def test_activation_quantisation_rule():
    x = _rand(5, 300, seed=1) * torch.logspace(-3, 2, 300)  # groups of very different ranges; 300 = 2 groups + 44
    x[2, 128:256] = 0  # an all-zero group
    q, s = quantize_act_fp8(x)
    assert q.dtype == FP8 and q.shape == (5, 300) and s.shape == (5, 3) and s.dtype == torch.float32
    amax = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    assert torch.equal(s, (amax.clamp(min=1e-4).double() / 448).float())  # correctly rounded division
    back = dequantize_blocks(q, s, 1, 128)
    assert not back.isnan().any() and bool((back[2, 128:256] == 0).all())
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, or under the group's subnormal step
    err = (back - x).abs()
    assert bool((err <= x.abs() / 16 + s.repeat_interleave(128, 1)[:, :300] * 2.0**-9).all())
    _, s8 = quantize_act_fp8(x, ue8m0=True)
    assert torch.equal(s8, torch.exp2(torch.ceil(torch.log2(s))))


def test_activation_scale_ties_are_device_independent():
    """bf16 groups whose amax mantissa is a multiple of 7 get exact scales (amax / 448) and inputs sitting
    exactly on e4m3 rounding ties; the scale must be the correctly rounded quotient (a reciprocal multiply,
    what CUDA torch does for a Python-scalar divisor, is 1 ulp off and moves those ties by a whole step)."""
    x = torch.full((1, 128), 1.3125, dtype=torch.bfloat16)  # amax 1.3125 = 21/16: scale 3 * 2^-10 exactly
    x[0, 1] = 0.890625  # x / s = 304: the tie between 288 and 320 (to even: 320)
    q, s = quantize_act_fp8(x)
    assert s.item() == 3 * 2.0**-10 and q.float()[0, 1].item() == 320.0
    rcp = torch.tensor(1.3125) * torch.tensor(1 / 448.0)  # what the reciprocal multiply gives: 1 ulp off
    assert rcp.item() != s.item() and (x.float()[0, 1] / rcp).to(FP8).float().item() == 288.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_block_formula(dtype):
    x = _rand(7, 320, seed=2).to(dtype)
    w, ws = quantize_fp8(_rand(200, 320, seed=3, scale=0.05))  # 2 x 3 tiles, both partial
    got = fp8_linear(x, w, ws)
    assert got.dtype == dtype and got.shape == (7, 200)
    q, s = quantize_act_fp8(x)
    want = torch.zeros(7, 200, dtype=torch.float64)
    for kb in range(3):
        ks = slice(kb * 128, (kb + 1) * 128)
        part = q[:, ks].double() @ w[:, ks].double().t()
        want += part * s[:, kb, None].double() * ws[:, kb].repeat_interleave(128)[:200][None].double()
    rel = (got.double() - want).norm() / want.norm()
    assert rel < (1e-6 if dtype == torch.float32 else 4e-3)
    # against the unquantised activations, the error is the activation rounding: a few percent at most
    exact = x.float() @ dequantize_fp8(w, ws).t()
    assert 1e-3 < ((got.float() - exact).norm() / exact.norm()).item() < 0.05


def test_fused_moe_fp8_is_per_token_fp8_linears():
    E, C, I, T, k = 4, 256, 128, 6, 2
    w13 = [quantize_fp8(_rand(2 * I, C, seed=10 + e, scale=0.05)) for e in range(E)]
    w2 = [quantize_fp8(_rand(C, I, seed=20 + e, scale=0.05)) for e in range(E)]
    W13, S13 = torch.stack([a for a, _ in w13]), torch.stack([b for _, b in w13])
    W2, S2 = torch.stack([a for a, _ in w2]), torch.stack([b for _, b in w2])
    x = _rand(T, C, seed=4)
    ids = torch.tensor([[0, 1], [1, 3], [2, 2 + E], [3, 0], [-1, 1], [2, 3]])  # ids outside [0, E) skipped
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(5))
    got = fused_moe_fp8(x, W13, S13, W2, S2, weights, ids)
    want = torch.zeros(T, C)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if 0 <= e < E:
                g, u = fp8_linear(x[t : t + 1], W13[e], S13[e]).chunk(2, -1)
                h = torch.nn.functional.silu(g) * u
                want[t] += weights[t, j] * fp8_linear(h, W2[e], S2[e])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- FP8 checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Path:
    """A tiny V3 checkpoint in V3's FP8 format, with widths that make every kind of weight stay FP8
    (expert width 128: w13's halves fill whole tiles) and partial tiles (q_lora 192, kv_a 24 rows)."""
    root = tmp_path_factory.mktemp("fp8w")
    src, _ = write_checkpoint(root / "src", "v3", seed=7, hidden_size=256, q_lora_rank=192, intermediate_size=256,
                              moe_intermediate_size=128, n_group=2, topk_group=1, norm_topk_prob=True)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if is_fp8_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t * 0.2)
        else:
            tensors[name] = t
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_QUANTIZATION}))
    return src


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, max_num_seqs=4, kv_cache_memory=1 << 20, **kw)


PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 40)]


def _generate(llm: LLM):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    assert all(o.error is None for o in outs)
    lps = [torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i])
           for o in outs]
    return [o.outputs[0].token_ids for o in outs], torch.cat(lps)


def test_fp8_checkpoint_kept_fp8_equals_dequantised_within_the_activation_bound(fp8_ckpt):
    bf16 = make_llm(fp8_ckpt, weight_dtype="bf16")
    fp8 = make_llm(fp8_ckpt, weight_dtype="fp8")
    assert make_llm(fp8_ckpt).engine.fp8_weights is False  # auto on CPU: no fast FP8 GEMM, dequantised
    mb, mf = bf16.engine.model, fp8.engine.model
    kept = {"q_a_proj": (mb.layers[0].self_attn, mf.layers[0].self_attn, "q_a_proj"),
            "q_b_proj": (mb.layers[1].self_attn, mf.layers[1].self_attn, "q_b_proj"),
            "kv_a": (mb.layers[1].self_attn, mf.layers[1].self_attn, "kv_a_proj_with_mqa"),
            "o_proj": (mb.layers[0].self_attn, mf.layers[0].self_attn, "o_proj"),
            "dense w13": (mb.layers[0].mlp, mf.layers[0].mlp, "w13"),
            "expert w13": (mb.layers[1].mlp, mf.layers[1].mlp, "w13"),
            "expert w2": (mb.layers[1].mlp, mf.layers[1].mlp, "w2"),
            "shared w2": (mb.layers[1].mlp.shared, mf.layers[1].mlp.shared, "w2")}
    for what, (b, f, attr) in kept.items():
        wb, wf, scale = getattr(b, attr), getattr(f, attr), getattr(f, attr + "_scale_inv")
        assert wb.dtype == torch.float32 and getattr(b, attr + "_scale_inv") is None, what
        assert wf.dtype == FP8 and scale is not None and scale.dtype == torch.float32, what
        assert torch.equal(dequantize_blocks(wf, scale, 128, 128), wb), what  # same weights, other storage
    assert mf.layers[1].self_attn.kv_b_proj.dtype == torch.float32  # the absorbed W_UK/W_UV come from it
    assert mf.layers[1].self_attn.w_xa is None and mb.layers[1].self_attn.w_xa is not None  # q_lora 192
    (tok_b, lp_b), (tok_f, lp_f) = _generate(bf16), _generate(fp8)
    assert len(tok_f) == len(tok_b) and not lp_f.isnan().any()
    assert (lp_f - lp_b).abs().max() > 0  # the activations really were quantised


def test_fp8_shared_expert_folds_into_the_fp8_moe(fp8_ckpt):
    """FP8 experts and shared MLP of whole-tile width are stacked (weights and tile scales) into one
    ``fused_moe_fp8`` call, the routed and shared parameters views of the stacks: the scales stacked per tile
    dequantise to the same weights, and the folded and unfolded paths give the same tokens and logprobs up to
    float32 summation order."""
    llm = make_llm(fp8_ckpt, weight_dtype="fp8")
    model = llm.engine.model
    moe = model.layers[1].mlp
    E = moe.num_local
    assert moe._folded() and moe.s13_all.shape[0] == moe.w13_all.shape[0] == E + 1
    assert moe.w13_scale_inv.data_ptr() == moe.s13_all.data_ptr()
    assert moe.shared.w2_scale_inv.data_ptr() == moe.s2_all[E].data_ptr()  # V3's single shared expert: a view
    assert torch.equal(dequantize_blocks(moe.w2_all[E], moe.s2_all[E], 128, 128),
                       dequantize_blocks(moe.shared.w2, moe.shared.w2_scale_inv, 128, 128))
    tok_f, lp_f = _generate(llm)
    model.set_decode_fusion(False)
    assert not moe._folded()
    tok_u, lp_u = _generate(llm)
    model.set_decode_fusion(True)
    assert tok_f == tok_u
    torch.testing.assert_close(lp_f, lp_u, rtol=0, atol=2e-3)
    # a route hook (EPLB's) takes the router apart from moe_gate: the shared slots appended to the routed
    # ones in the activation dtype (not the FP8 experts' dtype), the same stacked call
    llm.engine.runner.set_route_hook(lambda layer, weights, ids: (weights, ids))
    assert moe._folded() and not moe.fused_gate()
    tok_h, lp_h = _generate(llm)
    assert tok_h == tok_f
    torch.testing.assert_close(lp_h, lp_f, rtol=0, atol=2e-3)


def test_trained_model_fp8_weights_accuracy(tmp_path):
    """The embedded trained tiny model, written as an FP8 checkpoint: weight_dtype fp8 (e4m3 weights, activations
    quantised per token and 128 channels) against the same FP8 weights dequantised (bf16 mode), greedy on text."""
    from deepinfer_core.models.loader import EMBEDDED_MODEL

    ckpt = fp8_copy(EMBEDDED_MODEL, tmp_path / "tiny-fp8")
    attn = make_llm(ckpt, weight_dtype="fp8").engine.model.layers[0].self_attn  # q_lora 128: q_a + kv_a fuse
    assert attn.w_xa.dtype == FP8 and attn.w_xa.shape[0] == 128 + 64 + 16 and attn.w_xa_scale.shape == (2, 2)
    assert torch.equal(attn.w_xa[:128].view(torch.uint8), attn.q_a_proj.view(torch.uint8))
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    runs = {}
    for mode in ("bf16", "fp8"):
        outs = make_llm(ckpt, weight_dtype=mode).generate(prompts, sp, use_tqdm=False)
        runs[mode] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                o.outputs[0].token_ids)])
                      for o in outs]
    agree, total, drift = 0, 0, []
    for (tb, lb), (tf, lf) in zip(runs["bf16"], runs["fp8"]):
        n = next((i for i, (a, b) in enumerate(zip(tb, tf)) if a != b), len(tb))  # common greedy prefix
        agree, total = agree + n, total + len(tb)
        drift += [abs(a - b) for a, b in zip(lb[:n], lf[:n])]
    # measured on CPU (float32): 72/72 tokens agree, mean |dlogprob| 0.058
    msg = (f"greedy prefix agreement {agree}/{total}, mean |dlogprob| {sum(drift) / max(1, len(drift)):.4f}, "
           f"max {max(drift):.4f}")
    assert agree / total >= 0.9, msg
    assert sum(drift) / len(drift) < 0.15 and max(drift) < 1.0, msg


def test_weight_dtype_is_validated(fp8_ckpt, tmp_path):
    with pytest.raises(ConfigError, match=r"'weight_dtype' must be one of \('auto', 'fp8', 'bf16'\), got 'int4'"):
        make_llm(fp8_ckpt, weight_dtype="int4")
    plain, _ = write_checkpoint(tmp_path / "plain", "v3", seed=1)
    with pytest.raises(ConfigError, match="'weight_dtype' is 'fp8' but .* is not an FP8 checkpoint"):
        make_llm(plain, weight_dtype="fp8")


def _scale_of_first_fp8(t: dict) -> str:
    return next(n for n, v in t.items() if v.dtype == torch.float8_e4m3fn) + "_scale_inv"


def _set_first_scale(value: float):
    return lambda t: t[_scale_of_first_fp8(t)].__setitem__((0, 0), value)


def _e5m2_weight(t: dict) -> None:
    name = _scale_of_first_fp8(t).removesuffix("_scale_inv")
    t[name] = t[name].float().to(torch.float8_e5m2)


def _quant(key, value):
    return lambda cfg: cfg["quantization_config"].__setitem__(key, value)


BAD_FP8 = {  # what is wrong -> (edit of the tensors, edit of config.json, weight_dtype, error, message)
    "a NaN scale": (_set_first_scale(float("nan")), None, "bf16", r"weight_scale_inv' holds nan at \(0, 0\); block "
                    "scales must be finite and >= 0"),
    "an infinite scale": (_set_first_scale(float("inf")), None, "fp8", "holds inf at"),
    "a negative scale": (_set_first_scale(-1.0), None, "bf16", "holds -1.0 at"),
    "integer scales": (lambda t: t.__setitem__(_scale_of_first_fp8(t), t[_scale_of_first_fp8(t)].to(torch.int32)),
                       None, "fp8", "is torch.int32; block scales must be one of float32"),
    "e5m2 weights": (_e5m2_weight, None, "bf16", "is torch.float8_e5m2; expected float32, bfloat16 or float16, or "
                     "float8_e4m3fn with block scales"),
    "64x64 blocks": (None, _quant("weight_block_size", [64, 64]), "bf16",
                     r"quantization_config.weight_block_size is \[64, 64\]; supported: \[128, 128\]"),
    "fmt e5m2": (None, _quant("fmt", "e5m2"), "fp8", "quantization_config.fmt is 'e5m2'; supported: 'e4m3'"),
    "another method": (None, _quant("quant_method", "awq"), "bf16", "quant_method is 'awq'; supported: 'fp8'"),
    "static activations kept FP8": (None, _quant("activation_scheme", "static"), "fp8",
                                    "activation_scheme is 'static'; use weight_dtype 'bf16'"),
}


@pytest.mark.parametrize("what", list(BAD_FP8))
def test_fp8_checkpoints_that_would_load_wrong_numbers_are_refused(fp8_ckpt, tmp_path, what):
    """Each of these loaded before as other numbers than the checkpoint's (NaN or garbage outputs, a
    scale ignored, the wrong tile size), without a sign; now the error names the tensor or key."""
    edit_t, edit_cfg, weight_dtype, match = BAD_FP8[what]
    out = tmp_path / "bad"
    out.mkdir()
    for f in fp8_ckpt.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    if edit_t is not None:
        t = load_file(out / "model.safetensors")
        edit_t(t)
        save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    if edit_cfg is not None:
        cfg = json.loads((out / "config.json").read_text())
        edit_cfg(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((CheckpointError, ConfigError), match=match):
        make_llm(out, weight_dtype=weight_dtype)


def test_ue8m0_scales_and_static_activations_dequantised_load(fp8_ckpt, tmp_path):
    """Scales stored as ue8m0 load as their float values, and a static activation scheme is no matter
    when the weights are dequantised."""
    out = tmp_path / "ok"
    out.mkdir()
    for f in fp8_ckpt.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    t = load_file(out / "model.safetensors")
    for n in [n for n in t if n.endswith("_scale_inv")]:
        t[n] = torch.exp2(torch.log2(t[n]).round())  # powers of two, as ue8m0 stores them
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    want = _generate(make_llm(out, weight_dtype="bf16"))
    for n in [n for n in t if n.endswith("_scale_inv")]:
        t[n] = t[n].to(torch.float8_e8m0fnu)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (out / "config.json").write_text(json.dumps(cfg))
    got = _generate(make_llm(out, weight_dtype="bf16"))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_random_weights_quantised_for_fp8_benchmarks(fp8_ckpt):
    """load_format random + weight_dtype fp8: the random weights are quantised per 128x128 tile in place
    (FP8 shapes benchmarked without a checkpoint); other modes keep them in the model dtype."""
    fp8 = make_llm(fp8_ckpt, load_format="random", weight_dtype="fp8")
    plain = make_llm(fp8_ckpt, load_format="random")
    mf, mp = fp8.engine.model, plain.engine.model
    assert mf.layers[1].mlp.w13.dtype == FP8 and mf.layers[1].mlp.w13_scale_inv.shape == (8, 2, 2)
    assert torch.equal(dequantize_blocks(mf.layers[1].mlp.w2[3], mf.layers[1].mlp.w2_scale_inv[3], 128, 128),
                       dequantize_fp8(*quantize_fp8(mp.layers[1].mlp.w2[3])))
    assert mf.layers[0].self_attn.q_a_proj.dtype == FP8 and mp.layers[0].self_attn.q_a_proj.dtype == torch.float32
    assert mf.layers[0].self_attn.kv_b_proj.dtype == torch.float32
    assert mf.layers[0].self_attn.w_xa is None  # q_lora 192: not whole tiles, q_a and kv_a stay two FP8 GEMMs
    assert mp.layers[0].self_attn.w_xa is not None  # in bf16 they are one GEMM
    assert fp8.engine.fingerprint != plain.engine.fingerprint  # other numerics: never share KV
    toks, _ = _generate(fp8)
    assert all(len(t) == 6 for t in toks)
    # round_trip: the plain model's weights become exactly the FP8 model's, dequantised (the bf16-dequantised
    # path of examples/fp8_slice.py), in place and in their own dtype
    assert quantize_model_fp8(mp, round_trip=True) > 0
    fp8_params = [(n, p) for n, p in mf.named_parameters() if p.dtype == FP8]
    assert len(fp8_params) >= 8
    for name, p in fp8_params:
        owner, attr = mf.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        twin = mp.get_parameter(name)
        assert twin.dtype == torch.float32
        assert torch.equal(dequantize_blocks(p, getattr(owner, attr + "_scale_inv"), 128, 128), twin), name
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in mp.named_parameters()}
    quantize_model_fp8(mp, round_trip=True)  # idempotent, and in place (a built engine's graphs stay valid)
    assert all(p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) for n, p in mp.named_parameters())


# ---- why the kit compares fused_moe_fp8 norm-wise ---------------------------------------------------

def _tensor_core_fp8_linear(x, w, ws):
    """``fp8_linear`` as Hopper's e4m3 wgmma computes it: each 32-product step adds into the running
    128-block sum keeping 13 mantissa bits (truncated), promoted to float32 per 128-wide k block."""
    q, s = quantize_act_fp8(x)
    qa, wb = q.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for kb in range(x.shape[1] // 128):
        part = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
        for k0 in range(kb * 128, kb * 128 + 128, 32):
            part = part + qa[:, k0:k0 + 32] @ wb[:, k0:k0 + 32].t()
            ulp = torch.exp2(torch.floor(torch.log2(part.abs().clamp_min(1e-300))) - 13)
            part = torch.sign(part) * torch.floor(part.abs() / ulp) * ulp
        acc += part.float() * s[:, kb:kb + 1] * ws[:, kb].repeat_interleave(128)[: w.shape[0]]
    return acc.to(x.dtype)


def test_tensor_core_accumulation_flips_moe_hidden_rounding_but_stays_within_the_norm_bound():
    """With FP8 tensor-core accumulation (modelled above: 13 kept bits, the H200's measured behaviour) the
    fused FP8 MoE of the kit's 120-token case exceeds the elementwise bound (the H200 kernel measured 3.2x,
    docs/fp8.md) because hidden elements re-quantise differently, while a single GEMM stays well inside
    it; norm-wise both are far inside rtol. This is why the kit compares fused_moe_fp8 norm-wise."""
    from deepinfer_core.testing.kernel_cases import _cases_fused_moe_fp8
    from kernels_cpu.ops import grouped_experts, silu_and_mul

    case = next(c for c in _cases_fused_moe_fp8(torch.Generator().manual_seed(0), torch.bfloat16, 16)
                if c.label == "120 tokens")
    x, w13, s13, w2, s2, weights, ids = case.args
    ref = fused_moe_fp8(*case.args).double()

    def project(a, e, which):
        return _tensor_core_fp8_linear(a, w13[e], s13[e]) if which == 1 else _tensor_core_fp8_linear(a, w2[e], s2[e])

    out = grouped_experts(x, w13, w2, weights, ids, lambda h: silu_and_mul(h.float()).to(h.dtype), project).double()
    elementwise = ((out - ref).abs() / (2e-2 * (ref.abs() + ref.pow(2).mean().sqrt()))).max().item()
    assert elementwise > 1.5  # outside the elementwise bound
    assert (out - ref).norm() / ref.norm() < 1e-2  # inside the norm-wise one (rtol 2e-2) with margin
    single = _tensor_core_fp8_linear(x, w13[0], s13[0]).double()
    truth = fp8_linear(x, w13[0], s13[0]).double()
    assert ((single - truth).abs() / (2e-2 * (truth.abs() + truth.pow(2).mean().sqrt()))).max() < 0.5


def test_nvidia_supports_fp8_gemm_needs_hopper_and_the_registered_fp8_ops(monkeypatch):
    """weight_dtype "auto" keeps FP8 weights on nvidia exactly when its kernel backend registers both FP8
    weight ops and the device is sm_90 (the kernels are e4m3 wgmma + TMA)."""
    from hardware.nvidia import NvidiaPlatform
    from kernels_cuda import CudaKernels

    platform = NvidiaPlatform.__new__(NvidiaPlatform)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ops = {**CudaKernels.ops, "fp8_linear": "kernels_cuda.fp8_gemm:fp8_linear",
           "fused_moe_fp8": "kernels_cuda.fp8_gemm:fused_moe_fp8"}
    monkeypatch.setattr(CudaKernels, "ops", ops)
    for capability, want in (((9, 0), True), ((8, 9), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert platform.supports_fp8_gemm() is want, capability
    monkeypatch.setattr(CudaKernels, "ops", {k: v for k, v in ops.items() if k != "fused_moe_fp8"})
    assert platform.supports_fp8_gemm() is False
