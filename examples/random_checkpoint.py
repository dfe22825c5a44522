"""Write a random DeepSeek checkpoint in HF format (config.json + safetensors + tokenizer) for
benchmarks and tests, using the loader's own list of expected tensors.

``--fp8`` writes it as DeepSeek-V3's FP8 checkpoints are: every linear weight but the router's in e4m3
with a float32 ``<name>_scale_inv`` per 128x128 tile, and ``quantization_config`` in config.json.

    python examples/random_checkpoint.py --shape v3-slice --fp8 --out /tmp/v3slice-fp8
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer_core.models.config import ModelConfig
from deepinfer_core.models.loader import EMBEDDED_MODEL, FP8_BLOCK, expected_tensors, quantize_fp8

#: config.json's entry of DeepSeek-V3's FP8 checkpoints
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def is_fp8_weight(name: str) -> bool:
    """The tensors V3's FP8 checkpoints store in e4m3: the linear layers (not embeddings, head, router, norms)."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")

SHAPES = {
    # the engine issue's CPU benchmark shape
    "v3-tiny": dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=4096),
    "v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                    num_attention_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                    first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, topk_method="greedy",
                    n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax"),
    "v3-slice": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
                     num_attention_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                     n_group=8, topk_group=4, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
                     routed_scaling_factor=2.5),
}
BASE = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", topk_method="noaux_tc",
            scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=16384,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
            num_key_value_heads=None, torch_dtype="float32")


def shape_config(shape: str) -> dict:
    cfg = {**BASE, **SHAPES[shape]}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def write_config(out: Path, config: dict) -> Path:
    """Write ``config`` as config.json to ``out``, and the embedded tokenizer when its vocabulary fits
    (enough for an engine with ``load_format="random"``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = EMBEDDED_MODEL / "tokenizer.json"
    if tok.is_file() and json.loads(tok.read_text())["model"].get("vocab") is not None:
        if len(json.loads(tok.read_text())["model"]["vocab"]) <= config["vocab_size"]:
            shutil.copy(tok, out / "tokenizer.json")
            shutil.copy(EMBEDDED_MODEL / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def make_random_checkpoint(out: Path, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32,
                           std: float = 0.05, fp8: bool = False) -> Path:
    """Write ``config`` (``write_config``) and seeded random weights to ``out``; ``fp8``: the linear weights
    quantised per 128x128 tile (V3 naming: ``weight_scale_inv``)."""
    if fp8:
        config = {**config, "quantization_config": FP8_QUANTIZATION}
    write_config(out, config)
    cfg = ModelConfig.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(cfg).items():
        if len(shape) == 1:
            t = torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * std
        if fp8 and is_fp8_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t)
        else:
            tensors[name] = t.to(dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def fp8_copy(src: Path, out: Path) -> Path:
    """Write checkpoint ``src`` to ``out`` in V3's FP8 format (its linear weights quantised per 128x128 tile,
    ``quantization_config`` added); tokenizer and other files are copied."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            if is_fp8_weight(name):
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t)
            else:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QUANTIZATION}, indent=2))
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fp8", action="store_true", help="e4m3 linear weights with 128x128 weight_scale_inv")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make_random_checkpoint(args.out, shape_config(args.shape), args.seed, getattr(torch, args.dtype), fp8=args.fp8)
    print(args.out)


if __name__ == "__main__":
    main()
