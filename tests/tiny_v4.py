"""Tiny random DeepSeek-V4 checkpoints written with transformers (``DeepseekV4ForCausalLM``).

Small rates (CSA 4, HCA 16, sliding window 8) make a 60-token prompt span many windows. Weights are
re-randomised far from degenerate, and re-drawn until every discrete choice is well separated
(``../shared/V4.md`` lesson 5): 16 indexer heads, wide router logits, and every router / indexer top-k
margin of the reference forward >= ``MIN_MARGIN`` on the sequences a test uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import BOS, EOS, VOCAB, save_checkpoint

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MIN_MARGIN = 1e-5

BASE = dict(
    vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, n_routed_experts=8, num_experts_per_tok=2,
    sliding_window=8, compress_rates={CSA: 4, HCA: 16}, o_groups=2, o_lora_rank=16, index_n_heads=16,
    index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", max_position_embeddings=256,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False, num_nextn_predict_layers=0,
)

#: name -> overrides of BASE; together they cover every V4 variant
VARIANTS: dict[str, dict] = {
    # SWA + CSA + HCA, two hash layers, sqrt(softplus), 4 streams, an active SwiGLU clamp
    "mixed": dict(layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                  swiglu_limit=1.0),
    # HCA first, sigmoid scoring, 2 streams, plain (non-YaRN) compress rope
    "hca_sigmoid_hc2": dict(layer_types=[HCA, CSA, SWA, HCA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                            scoring_func="sigmoid", hc_mult=2, rope_parameters=None),
    # sliding window only
    "swa_only": dict(layer_types=[SWA, SWA, SWA], num_hidden_layers=3, hc_mult=2,
                     mlp_layer_types=["hash_moe", "moe", "moe"]),
}


def hf_config(variant: str = "mixed", **overrides):
    from transformers import DeepseekV4Config

    kw = dict(BASE, **VARIANTS[variant])
    kw.update(overrides)
    if kw.get("rope_parameters") is None:
        kw.pop("rope_parameters", None)
    return DeepseekV4Config(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)

    def rand(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight",)):
                p.copy_(rand(p.shape, 1.0))  # wide router logits
            elif name.endswith(("sinks",)):
                p.copy_(rand(p.shape, 1.0))
            elif name.endswith("position_bias"):
                p.copy_(rand(p.shape, 0.5))
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale")):
                p.copy_(rand(p.shape, 0.1, 1.0))
            elif name.endswith(("attn_hc.base", "ffn_hc.base", "hc_head.hc_base")):
                p.copy_(rand(p.shape, 0.3))
            elif p.dim() > 1:
                p.copy_(rand(p.shape, 0.3))
            else:  # norm weights
                p.copy_(rand(p.shape, 0.1, 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rand(b.shape, 0.1))
            elif name.endswith("tid2eid"):
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])]))
    return model


def build_hf_model(variant: str = "mixed", seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(variant, **overrides)).float().eval()
    randomize_(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = BOS
    return model


# ---- separation of discrete choices ---------------------------------------------------------

@torch.no_grad()
def min_margins(hf, sequences: list[list[int]]) -> dict[str, float]:
    """Smallest top-k boundary gap of every learned router and every indexer over full forwards of
    ``sequences`` (the choices a cached engine makes on the same tokens are the same ones)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    gaps = {"router": float("inf"), "indexer": float("inf")}
    cfg = hf.config
    hooks = []

    def topk_gap(scores: torch.Tensor, k: int) -> float:
        s = scores.sort(-1, descending=True).values
        ok = torch.isfinite(s[..., k]) if s.shape[-1] > k else None
        if ok is None or not bool(ok.any()):
            return float("inf")
        return float((s[..., k - 1] - s[..., k])[ok].min())

    def on_router(module, args, out):
        logits = out[0]
        scores = module.score_fn(logits) + module.e_score_correction_bias
        gaps["router"] = min(gaps["router"], topk_gap(scores, module.top_k))

    def on_scorer(module, args, out):  # out [B, S, N] for positions 0..S-1
        S, N = out.shape[1], out.shape[2]
        m = cfg.compress_rates[CSA]
        visible = (torch.arange(S)[:, None] + 1) // m
        masked = out[0].masked_fill(torch.arange(N)[None, :] >= visible, float("-inf"))
        gaps["indexer"] = min(gaps["indexer"], topk_gap(masked, cfg.index_topk))

    for m in hf.modules():
        if isinstance(m, mod.DeepseekV4TopKRouter):
            hooks.append(m.register_forward_hook(on_router))
        elif isinstance(m, mod.DeepseekV4IndexerScorer):
            hooks.append(m.register_forward_hook(on_scorer))
    try:
        for ids in sequences:
            hf(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return gaps


def build_separated(variant: str, sequences: list[list[int]], seed: int = 0, tries: int = 20, **overrides):
    """``build_hf_model`` re-drawn (seed, seed+1, ...) until every top-k margin on ``sequences`` is at
    least MIN_MARGIN; returns (model, its seed)."""
    for s in range(seed, seed + tries):
        model = build_hf_model(variant, s, **overrides)
        if min(min_margins(model, sequences).values()) >= MIN_MARGIN:
            return model, s
    raise RuntimeError(f"no well-separated tiny V4 ({variant}) in {tries} draws")


# ---- checkpoints ----------------------------------------------------------------------------

def write_checkpoint(path: Path, variant: str = "mixed", seed: int = 0, tokenizer: bool = True,
                     sequences: list[list[int]] | None = None, **overrides):
    """Build (well separated on ``sequences`` when given), save and return (path, hf_model)."""
    if sequences:
        model, _ = build_separated(variant, sequences, seed, **overrides)
    else:
        model = build_hf_model(variant, seed, **overrides)
    return save_checkpoint(model, path, tokenizer), model


def to_official(path: Path, out: Path, fp8: bool = False, fp4_experts: bool = False,
                legacy_config: bool = False, mtp: bool = False) -> Path:
    """Rewrite an HF-saved checkpoint with the official tensor names (no ``model.`` prefix, ``embed``,
    ``hc_head_fn``...), optionally FP8 (e4m3 + ue8m0 128x128 ``.scale``) linears, FP4 (e2m1 packed in int8 +
    ue8m0 per-32 ``.scale``) routed experts, legacy config field names, and a fake ``mtp.0.*`` block;
    sharded in two files with an index."""
    from safetensors.torch import load_file, save_file

    from deepinfer_core.models.v4_weights import V4Names, quantize_fp4, quantize_fp8

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    official = {V4Names.canonical(n): t for n, t in tensors.items()}
    if mtp:
        official["mtp.0.e_proj.weight"] = official["layers.0.attn.wq_a.weight"].clone()
        official["mtp.0.ffn.experts.0.w1.weight"] = official["layers.0.ffn.experts.0.w1.weight"].clone()
        official["mtp.0.hc_attn_base"] = official["layers.0.hc_attn_base"].clone()
    result = {}
    for name, t in official.items():
        expert = ".experts." in name and ".shared_experts." not in name and name.endswith(".weight")
        linear = name.endswith(".weight") and t.dim() == 2 and "embed" not in name and name != "head.weight"
        if fp4_experts and expert:
            result[name], result[name.removesuffix(".weight") + ".scale"] = quantize_fp4(t)
        elif fp8 and linear and not expert and "compressor" not in name and "weights_proj" not in name \
                and ".gate." not in name:
            result[name], result[name.removesuffix(".weight") + ".scale"] = quantize_fp8(t)
        else:
            result[name] = t.contiguous()
    names = sorted(result)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: result[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((Path(path) / "config.json").read_text())
    if legacy_config:
        rates = cfg.pop("compress_rates")
        ratio = {SWA: 0, CSA: rates[CSA], HCA: rates[HCA]}
        cfg["compress_ratios"] = [ratio[t] for t in cfg.pop("layer_types")] + [0]  # + the MTP layer
        cfg["compress_rate_csa"], cfg["compress_rate_hca"] = rates[CSA], rates[HCA]
        cfg["num_hash_layers"] = cfg.pop("mlp_layer_types").count("hash_moe")
        cfg["qk_rope_head_dim"] = int(cfg["head_dim"] * cfg.pop("partial_rotary_factor"))
        rp = cfg.pop("rope_parameters")
        cfg["compress_rope_theta"] = rp["compress"]["rope_theta"]
        if rp["compress"].get("rope_type") == "yarn":
            cfg["rope_scaling"] = {k: v for k, v in rp["compress"].items()
                                   if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
        cfg["rope_theta"] = rp["main"]["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out
