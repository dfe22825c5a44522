"""DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM`` in float32 on tiny random configs
covering every variant, driven through its declared cache groups by ``v4_harness`` (chunked prefill
with chunk boundaries inside compressor windows, mixed prefill + decode steps, step-by-step decode)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import rand_ids
from tiny_v4 import CSA, HCA, MIN_MARGIN, SWA, VARIANTS, build_separated, min_margins, save_checkpoint, to_official
from v4_harness import Harness

from deepinfer_core.kernels import Kernels
from deepinfer_core.models.config import ModelConfigError
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.models.loader import CheckpointError, SafetensorsReader
from kernels_cpu import ReferenceKernels

TOL = 1e-3
N_NEW = 8
PROMPT_LENS = (45, 61, 37)  # several sliding windows (8), CSA windows (4) and HCA windows (16)


def kernels() -> Kernels:
    return Kernels(ReferenceKernels, ReferenceKernels)


def load(path, max_positions: int = 256) -> DeepseekV4ForCausalLM:
    raw = json.loads((path / "config.json").read_text())
    cfg = DeepseekV4ForCausalLM.parse_config(raw)
    model = DeepseekV4ForCausalLM.create(kernels(), cfg, torch.float32, torch.device("cpu"), max_positions)
    model.load_weights(SafetensorsReader(path))
    return model


@torch.no_grad()
def hf_greedy_full(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full (stateless) forwards: the reference without transformers' cache."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    """(variant, checkpoint dir, hf model, prompts, HF greedy continuations), re-drawn until every
    router / indexer top-k margin over prompt + continuation and every greedy choice is well separated."""
    variant = request.param
    prompts = [rand_ids(n, 100 + i) for i, n in enumerate(PROMPT_LENS)]
    seed = 0
    for _ in range(10):
        hf, seed = build_separated(variant, prompts, seed=seed)
        conts = [hf_greedy_full(hf, p, N_NEW) for p in prompts]
        full = [p + c for p, c in zip(prompts, conts, strict=True)]
        top2 = [hf_logprobs(hf, s)[len(p) - 1:-1].topk(2, -1).values for s, p in zip(full, prompts, strict=True)]
        greedy_gap = min(float((t[:, 0] - t[:, 1]).min()) for t in top2)
        if min(min_margins(hf, full).values()) >= MIN_MARGIN and greedy_gap > 1e-4:
            path = save_checkpoint(hf, tmp_path_factory.mktemp(f"tiny_v4_{variant}"))
            return variant, path, hf, prompts, conts
        seed += 1
    raise RuntimeError(f"no well-separated tiny V4 {variant}")


def _check_prompt(hf, prompt: list[int], cont: list[int], logprobs: torch.Tensor) -> None:
    ref = hf_logprobs(hf, prompt + cont)[: len(prompt)]
    err = (logprobs - ref).abs().max().item()
    assert err < TOL, f"prompt logprobs differ from transformers by {err:.2e}"


def test_chunked_prefill_and_decode_match_transformers(reference):
    """Three requests: chunked prefill with boundaries inside compressor windows, a step that mixes
    prefill chunks with another request's decode, then batched step-by-step greedy decode."""
    variant, path, hf, prompts, conts = reference
    model = load(path)
    h = Harness(model, block_size=16, max_len=96, max_requests=3)
    p0, p1, p2 = prompts
    hidden: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def run(pieces):
        out = h.step(pieces)
        start = 0
        for rid, new in pieces:
            hidden[rid].append(out[start:start + len(new)])
            start += len(new)

    run([(0, p0[:7]), (1, p1[:21])])  # 7: inside a CSA window and the first HCA window
    run([(0, p0[7:30]), (1, p1[21:]), (2, p2[:5])])
    generated = {0: [], 1: [], 2: []}

    def greedy(rid):
        tok = int(model.logits(hidden[rid][-1][-1:]).argmax())
        generated[rid].append(tok)
        return tok

    run([(0, p0[30:]), (2, p2[5:]), (1, [greedy(1)])])  # request 1 decodes beside two prefill chunks
    for rid in (0, 1, 2):
        lp = torch.log_softmax(model.logits(torch.cat(hidden[rid][: 3 if rid == 1 else None])), -1)
        _check_prompt(hf, prompts[rid], conts[rid], lp[: len(prompts[rid])])
    while any(len(generated[r]) < N_NEW for r in generated):
        run([(rid, [greedy(rid)]) for rid in (0, 1, 2) if len(generated[rid]) < N_NEW])
    for rid in (0, 1, 2):
        assert generated[rid] == conts[rid], f"{variant}: request {rid} greedy tokens differ from transformers"
        # decode-path logprobs of the generated tokens
        P = len(prompts[rid])
        mine = torch.log_softmax(model.logits(torch.cat(hidden[rid])), -1)[P - 1: P - 1 + N_NEW]
        ref = hf_logprobs(hf, prompts[rid] + conts[rid])[P - 1: P - 1 + N_NEW]
        err = (mine - ref).abs().max().item()
        assert err < TOL, f"{variant}: request {rid} decode logprobs differ by {err:.2e}"
    # nothing read an unwritten (NaN) cache slot
    assert all(torch.isfinite(torch.cat(v)).all() for v in hidden.values())


def test_one_token_at_a_time_equals_one_shot(reference):
    """Every chunk boundary (down to single tokens) gives the one-shot prefill's logits."""
    _, path, hf, prompts, _ = reference
    model = load(path)
    prompt = prompts[2]
    one = Harness(model, 16, 64, 1).step([(0, prompt)])
    h = Harness(model, 32, 64, 1)
    steps = torch.cat([h.step([(0, [t])]) for t in prompt])
    assert (model.logits(one) - model.logits(steps)).abs().max().item() < 1e-4


def test_prefix_hit_needs_only_prefix_cacheable_blocks(reference):
    """A request that reuses another's blocks below a block boundary (FULL groups, the SWA window and
    the CSA state; the HCA state not at all) and prefills only its tail gets the one-shot logits."""
    _, path, _, prompts, _ = reference
    model = load(path)
    prompt = prompts[1]  # 61 tokens
    one = model.logits(Harness(model, 16, 96, 1).step([(0, prompt)]))
    h = Harness(model, 16, 96, 2)
    h.step([(0, prompt[:40])])  # the source request: 2.5 blocks
    h.fork(0, 1, 32)  # a hit on its first 2 blocks
    tail = model.logits(h.step([(1, prompt[32:])]))
    assert (tail - one[32:]).abs().max().item() < 1e-4


def test_rejected_speculative_tokens_need_no_rollback(reference):
    """A verify step of 5 draft tokens that close a CSA and an HCA window, 3 of them rejected: feeding
    the right tokens at those positions again gives the one-shot logits (every cache write is addressed
    by position, so nothing needs a snapshot)."""
    _, path, _, prompts, _ = reference
    model = load(path)
    seq = prompts[1]  # 61 tokens
    one = model.logits(Harness(model, 16, 96, 1).step([(0, seq)]))
    h = Harness(model, 16, 96, 1)
    h.step([(0, seq[:44])])
    drafts = [(t * 7 + 3) % 120 + 4 for t in seq[44:49]]  # positions 44..48: 47 closes CSA and HCA windows
    h.step([(0, seq[44:46] + drafts[2:])])  # the first two are right, the last three wrong
    h.truncate(0, 46)
    tail = torch.cat([model.logits(h.step([(0, seq[46:50])])), model.logits(h.step([(0, seq[50:])]))])
    assert (tail - one[46:]).abs().max().item() < 1e-4


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(reference):
    """In bfloat16 (float32 kept where the reference keeps it), our logprobs stray from the float32
    reference no more than transformers' own bfloat16 run does."""
    from transformers import DeepseekV4ForCausalLM as HF

    _, path, hf, prompts, _ = reference
    cfg = DeepseekV4ForCausalLM.parse_config(json.loads((path / "config.json").read_text()))
    m16 = DeepseekV4ForCausalLM.create(kernels(), cfg, torch.bfloat16, torch.device("cpu"), 256)
    m16.load_weights(SafetensorsReader(path))
    assert m16.layers[0].hc_attn.fn.dtype == torch.float32 and m16.embed.dtype == torch.bfloat16
    ids = prompts[0]
    ours = torch.log_softmax(m16.logits(Harness(m16, 16, 64, 1, dtype=torch.bfloat16).step([(0, ids)])), -1)
    with torch.no_grad():
        theirs = torch.log_softmax(HF.from_pretrained(path, dtype=torch.bfloat16).eval()(
            torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
    ref = hf_logprobs(hf, ids)
    ours_err, their_err = (ours - ref).abs().mean().item(), (theirs - ref).abs().mean().item()
    assert ours_err < 1.5 * their_err, f"bf16 mean logprob error {ours_err:.3f}, transformers' {their_err:.3f}"


def test_a_step_without_tokens(reference):
    """An idle rank's step (no sequences) runs and returns no rows."""
    from deepinfer_core.models.metadata import AttentionMetadata, GroupMeta

    _, path, *_ = reference
    model = load(path)
    h = Harness(model, 16, 32, 1)
    e = torch.zeros(0, dtype=torch.int64)
    groups = {g.name: GroupMeta(e, torch.zeros(0, 2, dtype=torch.int32)) for g in model.cache_layout().groups}
    meta = AttentionMetadata(0, e, None, None, groups=groups, cu_q_lens=torch.zeros(1, dtype=torch.int64), seq_lens=e)
    with torch.no_grad():
        assert model(e, e, meta, h.caches).shape == (0, model.cfg.hidden_size)


def test_missing_group_metadata_is_an_error(reference):
    _, path, _, prompts, _ = reference
    model = load(path)
    h = Harness(model, 16, 64, 1)
    del h.caches["swa"]
    with pytest.raises(ValueError, match="cache group 'swa': expected metadata and"):
        h.step([(0, prompts[0][:5])])


def test_cache_layout_groups(reference):
    variant, path, *_ = reference
    model = load(path)
    cfg = model.cfg
    layout = model.cache_layout()
    names = [g.name for g in layout.groups]
    csa, hca = cfg.layers_of(CSA), cfg.layers_of(HCA)
    expected = ["swa"] + (["csa", "csa_state"] if csa else []) + (["hca", "hca_state"] if hca else [])
    assert names == expected
    D, DI = cfg.head_dim, cfg.index_head_dim
    assert layout.group("swa").layers == tuple(range(cfg.num_hidden_layers))
    assert layout.group("swa").window == cfg.sliding_window and layout.group("swa").entry_dim == D
    if csa:
        g = layout.group("csa")
        assert (g.layers, g.entry_dim, g.tokens_per_entry, g.window) == (csa, D + DI, 4, None)
        s = layout.group("csa_state")
        assert (s.entry_dim, s.window, s.dtype) == (4 * D + 4 * DI, 8, torch.float32)
    if hca:
        g = layout.group("hca")
        assert (g.layers, g.entry_dim, g.tokens_per_entry) == (hca, D, 16)
        assert layout.group("hca_state").window == 16 and not layout.group("hca_state").prefix_cacheable
    assert layout.block_size_multiple == (16 if hca else 4 if csa else 1)
    if hca:
        with pytest.raises(ValueError, match="multiple of 16"):
            layout.check_block_size(8)


def test_official_names_legacy_config_and_mtp(reference, tmp_path):
    """The official layout (no ``model.`` prefix, ``embed``/``hc_head_fn`` names, legacy config fields,
    sharded, an ``mtp.0.*`` block) loads to the same weights and logits."""
    variant, path, hf, prompts, _ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    official = to_official(path, tmp_path / "official", legacy_config=True, mtp=True)
    raw = json.loads((official / "config.json").read_text())
    assert "layer_types" not in raw and raw["compress_ratios"][-1] == 0
    a, b = load(path), load(official)
    assert a.cfg.layer_types == b.cfg.layer_types and a.cfg.mlp_layer_types == b.cfg.mlp_layer_types
    assert a.cfg.rope_dim == b.cfg.rope_dim and a.cfg.compress_rope == b.cfg.compress_rope
    sb = b.state_dict()
    for name, t in a.state_dict().items():
        assert torch.equal(t, sb[name]), name
    assert sorted(b.mtp) == ["mtp/0/e_proj/weight", "mtp/0/ffn/experts/0/w1/weight", "mtp/0/hc_attn_base"]
    assert torch.equal(b.mtp["mtp/0/e_proj/weight"], b.layers[0].attn.wq_a)
    ids = prompts[0]
    ha, hb = Harness(a, 16, 64, 1).step([(0, ids)]), Harness(b, 16, 64, 1).step([(0, ids)])
    assert torch.equal(a.logits(ha), b.logits(hb))


def test_fp8_fp4_checkpoint_dequantises(reference, tmp_path):
    """FP8 e4m3 linears (ue8m0 128x128 scales) and FP4 e2m1 experts (int8-packed, ue8m0 per 32) load as
    their dequantised values, and those are close to the originals."""
    from deepinfer_core.models.v4_weights import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

    variant, path, hf, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    q = to_official(path, tmp_path / "quant", fp8=True, fp4_experts=True)
    reader = SafetensorsReader(q)
    assert reader.get("layers.0.attn.wq_b.weight").dtype == torch.float8_e4m3fn
    assert reader.get("layers.0.attn.wq_b.scale").dtype == torch.float8_e8m0fnu
    assert reader.get("layers.1.ffn.experts.3.w2.weight").dtype == torch.int8
    full, model = load(path), load(q)
    w = full.layers[0].attn.wq_b
    assert torch.equal(model.layers[0].attn.wq_b, dequantize_fp8(*quantize_fp8(w)))
    assert (model.layers[0].attn.wq_b - w).abs().max() <= w.abs().max() / 16  # e4m3: 3 mantissa bits
    w2 = full.layers[1].ffn.w2[3]
    assert torch.equal(model.layers[1].ffn.w2[3], dequantize_fp4(*quantize_fp4(w2)))
    assert (model.layers[1].ffn.w2[3] - w2).abs().max() <= w2.abs().max() / 4  # e2m1 per-32 power-of-2 scale
    # the e2m1 grid round-trips exactly
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    grid = torch.tensor([values * 4, [-v for v in values] * 4])
    assert torch.equal(dequantize_fp4(*quantize_fp4(grid)), grid)
    assert torch.equal(model.layers[0].ffn.gate, full.layers[0].ffn.gate)  # routers stay unquantised


def test_bad_block_scales_are_named(reference, tmp_path):
    """A NaN ue8m0 scale, an FP4 scale of the wrong shape, an FP8 weight in e5m2: errors naming the
    tensor (they loaded as NaN weights, a garbled repeat, or raw values)."""
    from safetensors.torch import load_file, save_file

    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    q = to_official(path, tmp_path / "quant", fp8=True, fp4_experts=True)
    shard = next(f for f in sorted(q.glob("*.safetensors")) if "layers.0.attn.wq_b.scale" in load_file(f))
    good = load_file(shard)
    edits = {
        "nan": ("layers.0.attn.wq_b.scale", lambda t: torch.full_like(t.float(), float("nan")).to(t.dtype),
                r"'layers.0.attn.wq_b.scale' holds nan at \(0, 0\); block scales must be finite"),
        "e5m2": ("layers.0.attn.wq_b.weight", lambda t: t.float().to(torch.float8_e5m2),
                 r"'layers.0.attn.wq_b.weight' is torch.float8_e5m2"),
    }
    for name, edit, match in edits.values():
        save_file({**good, name: edit(good[name])}, str(shard))
        with pytest.raises(CheckpointError, match=match):
            load(q)
    save_file(good, str(shard))
    shard = next(f for f in sorted(q.glob("*.safetensors")) if "layers.1.ffn.experts.3.w2.scale" in load_file(f))
    good = load_file(shard)
    save_file({**good, "layers.1.ffn.experts.3.w2.scale": good["layers.1.ffn.experts.3.w2.scale"][:1]}, str(shard))
    with pytest.raises(CheckpointError, match=r"'layers.1.ffn.experts.3.w2.scale' has shape .* \(one scale per 32 "
                                              "columns"):
        load(q)


def test_read_expert_equals_the_loaded_expert(reference, tmp_path):
    """Elastic EP re-reads a lost expert (``read_expert``): it equals what loading put in that slot, for
    plain and FP4-packed experts, and an expert that does not exist is an error naming it."""
    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    q = to_official(path, tmp_path / "quant", fp8=True, fp4_experts=True)
    for ckpt in (path, q):
        model = load(ckpt)
        reader = SafetensorsReader(ckpt)
        for layer in (0, len(model.layers) - 1):
            for e in (0, model.cfg.n_routed_experts - 1):
                w13, w2 = model.read_expert(reader, layer, e)
                assert torch.equal(w13, model.layers[layer].ffn.w13[e])
                assert torch.equal(w2, model.layers[layer].ffn.w2[e])
        with pytest.raises(ValueError, match=f"no routed expert {model.cfg.n_routed_experts} in layer 0"):
            model.read_expert(reader, 0, model.cfg.n_routed_experts)


def test_unexpected_tensor_is_an_error(reference, tmp_path):
    """A config that disagrees with its checkpoint (a layer the checkpoint has as CSA declared SWA)."""
    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((path / "config.json").read_text())
    raw["layer_types"][1] = SWA
    (bad / "config.json").write_text(json.dumps(raw))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not describe: model.layers.1.attn.compressor"):
        load(bad)


def test_checkpoint_errors(reference, tmp_path):
    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(path / "model.safetensors")
    (bad / "config.json").write_text((path / "config.json").read_text())
    del tensors["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.attn.indexer.wq_b.weight'"):
        load(bad)
    tensors["model.layers.1.attn.indexer.wq_b.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.attn.indexer.wq_b.weight' has shape \(3, 3\)"):
        load(bad)


# ---- config ------------------------------------------------------------------------------------
def _raw(**kw):
    from tiny_v4 import hf_config

    raw = hf_config("mixed").to_dict()
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    raw.update(kw)
    return raw


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 2, "num_key_value_heads = 2"),
    ("scoring_func", "softmax", "scoring_func = 'softmax'"),
    ("layer_types", [SWA, "full_attention", CSA, CSA], "layer_types"),
    ("mlp_layer_types", ["moe"], "mlp_layer_types"),
    ("o_groups", 3, "o_groups = 3"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("rope_parameters", {"main": {"rope_type": "default", "rope_theta": 1e4},
                         "compress": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_type"),
])
def test_config_rejects_unsupported_values(field, value, match):
    with pytest.raises(ModelConfigError, match=match):
        DeepseekV4ForCausalLM.parse_config(_raw(**{field: value}))


def test_config_legacy_fields():
    raw = _raw()
    for k in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor"):
        raw.pop(k)
    raw.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, qk_rope_head_dim=16)
    cfg = DeepseekV4ForCausalLM.parse_config(raw)
    assert cfg.layer_types == [SWA, CSA, HCA, CSA] and (cfg.compress_csa, cfg.compress_hca) == (4, 128)
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"] and cfg.rope_dim == 16
    with pytest.raises(ModelConfigError, match="compress_ratios"):
        DeepseekV4ForCausalLM.parse_config(dict(raw, compress_ratios=[0, 4, 7, 4]))


def test_entry_point_maps_the_architecture():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="deepinfer.models") if e.name == "DeepseekV4ForCausalLM"]
    assert ep.load() is DeepseekV4ForCausalLM


def test_flash_cache_layout_bytes():
    """The V4-Flash shape (``examples/kv_bytes.py``): 6,880 B/token of long-range KV in bf16 against V3's
    70,272, a 5.4 MiB bf16 window per request, blocks a multiple of 128."""
    import importlib.util
    from pathlib import Path

    from deepinfer_core.models.config_v4 import V4Config
    from deepinfer_core.models.deepseek_v4 import cache_layout

    spec = importlib.util.spec_from_file_location(
        "kv_bytes", Path(__file__).resolve().parent.parent / "examples" / "kv_bytes.py")
    kv_bytes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv_bytes)
    cfg = V4Config.from_dict(kv_bytes.FLASH)
    assert (len(cfg.layers_of(SWA)), len(cfg.layers_of(CSA)), len(cfg.layers_of(HCA))) == (2, 21, 20)
    layout = cache_layout(cfg)
    per_token = {g.name: g.bytes_per_token(torch.bfloat16) for g in layout.groups}
    assert per_token == {"swa": 44032, "csa": 6720, "csa_state": 215040, "hca": 160, "hca_state": 81920}
    assert per_token["csa"] + per_token["hca"] == 6880
    assert per_token["swa"] * 128 == 43 * 128 * 1024  # 5.375 MiB per request
    assert layout.block_size_multiple == 128


def test_expert_range_loads_only_local_experts(reference):
    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    cfg = DeepseekV4ForCausalLM.parse_config(json.loads((path / "config.json").read_text()))
    full = load(path)
    half = DeepseekV4ForCausalLM.create(kernels(), cfg, torch.float32, torch.device("cpu"), 256, expert_range=(4, 8))
    half.load_weights(SafetensorsReader(path))
    assert half.layers[2].ffn.w13.shape[0] == 4
    assert torch.equal(half.layers[2].ffn.w2[1], full.layers[2].ffn.w2[5])
    x, ids = torch.randn(3, cfg.hidden_size), torch.tensor([5, 6, 7])
    with pytest.raises(RuntimeError, match=r"MoE layer 0 holds experts \[4, 8\) of 8 but has no expert-parallel"):
        half.layers[0].ffn(x, ids)


def test_expert_parallel_two_ranks(reference):
    """dp = ep = 2 at the MoE: each gloo rank holds half the experts; ExpertParallel's dispatch/combine
    through the V4 MoE (clamped experts, hash and learned routing) equals the single-process MoE."""
    import socket

    import torch.multiprocessing as mp
    from v4_ep_check import ep_rank

    variant, path, *_ = reference
    if variant != "mixed":
        pytest.skip("one variant is enough")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(ep_rank, args=(2, port, str(path)), nprocs=2, join=True, start_method="spawn")
