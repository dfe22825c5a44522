#!/usr/bin/env python
"""Write a tiny *random* DeepSeek-V3 checkpoint in HF layout, for tests and examples.

It has the architecture of the embedded default model (``examples/train_tiny.py``: MLA, one dense
layer, then sigmoid/noaux_tc MoE layers with a shared expert) and its byte-level BPE tokenizer when
``deepinfer_core/assets/default_model/tokenizer.json`` exists; otherwise a small byte-level BPE is
trained with ``tokenizers`` on a few Python sources. The weights are random, so the text is noise,
but every engine path (prefill, chunked prefill, decode, MoE, sampling, grammars) runs for real.

Usage::

    python examples/tiny_random_model.py --out /tmp/tiny_model [--vocab-size 4100] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

EMBEDDED = Path(__file__).resolve().parent.parent / "deepinfer_core" / "assets" / "default_model"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def model_fields(vocab_size: int, layers: int = 4, max_positions: int = 1024) -> dict:
    """config.json of the default model's architecture (DeepSeek-V3 field names)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": layers,
        "first_k_dense_replace": 1, "intermediate_size": 768, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 256, "n_group": 2,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_attention_heads": 4,
        "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "num_nextn_predict_layers": 0, "hidden_act": "silu", "attention_bias": False,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "rope_theta": 10000.0,
        "rope_scaling": None, "torch_dtype": "bfloat16",
    }


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on this repository's Python sources (used when no tokenizer ships)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(__file__).resolve().parent.parent
    texts = [p.read_text(errors="replace") for p in sorted(root.glob("deepinfer_core/**/*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(out: Path, vocab_size: int) -> int:
    """Copy the embedded tokenizer (or train one); returns the tokenizer's vocabulary size."""
    if (EMBEDDED / "tokenizer.json").is_file():
        shutil.copy(EMBEDDED / "tokenizer.json", out / "tokenizer.json")
    else:
        _train_tokenizer(min(vocab_size, 4096)).save(str(out / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()


def write_tiny_model(out: str | Path, vocab_size: int | None = None, layers: int = 4, seed: int = 0,
                     std: float = 0.08) -> Path:
    """Write config.json, model.safetensors and the tokenizer into ``out``; returns ``out``.

    ``vocab_size`` defaults to the tokenizer's; a larger one pads the embedding (as real checkpoints do).
    """
    from deepinfer_core.models.config import ModelConfig
    from deepinfer_core.models.loader import expected_tensors

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = write_tokenizer(out, vocab_size or 4096)
    fields = model_fields(max(vocab_size or tok_vocab, tok_vocab), layers)
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(ModelConfig.from_dict(fields)).items():
        if len(shape) == 1:
            t = torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.ones(shape)
        else:
            t = torch.randn(*shape, generator=g) * std
        tensors[name] = t.to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(write_tiny_model(args.out, args.vocab_size, args.layers, args.seed))


if __name__ == "__main__":
    main()
