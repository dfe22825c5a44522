"""Tiny random DeepSeek V2/V3 checkpoints written with transformers, plus a tiny tokenizer.

Weights are re-randomised (matrices ~ N(0, 0.3), norm weights ~ 1 + N(0, 0.1), a random
``e_score_correction_bias``) so that routing, attention and logits are far from degenerate and a
wrong formula shows up as a large difference, not a rounding error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 128
BOS, EOS, END_OF_TEXT, UNK = 0, 1, 2, 3
SPECIALS = ["<bos>", "<eos>", "<|end_of_text|>", "<unk>"]
_CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII, ids 4..98
_BIGRAMS = ["th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed",
            "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io"]  # ids 99..127
TOKENS = SPECIALS + _CHARS + _BIGRAMS
assert len(TOKENS) == VOCAB

#: Shared shape of every tiny model (variants override some keys).
BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS,
    tie_word_embeddings=False,
)


def hf_config(arch: str = "v3", **overrides):
    """A transformers DeepseekV2Config / DeepseekV3Config from BASE plus ``overrides``."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    kw = dict(BASE, **overrides)
    kw["num_key_value_heads"] = kw["num_attention_heads"]
    if arch == "v3":
        kw.setdefault("n_group", 1)
        kw.setdefault("topk_group", 1)
        kw.setdefault("num_nextn_predict_layers", 0)
        return DeepseekV3Config(**kw)
    if arch == "v2":
        return DeepseekV2Config(**kw)
    raise ValueError(arch)


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def build_hf_model(arch: str = "v3", seed: int = 0, **overrides):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    cfg = hf_config(arch, **overrides)
    cls = DeepseekV3ForCausalLM if arch == "v3" else DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Reference greedy decoding must not stop at (or be steered away from) EOS.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = BOS
    return model


def write_tokenizer(path: Path, add_bos: bool = True) -> None:
    """A character-level BPE tokenizer over the whole vocabulary (every id decodes to text)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "add_bos_token": add_bos}))


def save_checkpoint(model, path: Path, tokenizer: bool = True) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        write_tokenizer(path)
    return path


def write_checkpoint(path: Path, arch: str = "v3", seed: int = 0, tokenizer: bool = True, **overrides):
    """Build, save and return (path, hf_model)."""
    model = build_hf_model(arch, seed, **overrides)
    return save_checkpoint(model, path, tokenizer), model


def kv_bytes_per_block(path: Path, block_size: int, itemsize: int = 4) -> int:
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg["num_hidden_layers"] * block_size * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize


# ---- reference comparisons -------------------------------------------------------------------

@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits for every position of ``ids``: [len(ids), vocab]."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def check_against_hf(hf, prompt: list[int], out, n_new: int, tol: float = 1e-3,
                     tie_gap: float = 1e-4) -> None:
    """``out`` (a RequestOutput of greedy decoding with prompt_logprobs=0 and logprobs=0) matches HF:
    the same greedy tokens as ``generate`` (a divergence is only tolerated at an exact near-tie of
    HF's own logits), prompt and generated-token logprobs within ``tol``."""
    ours = out.outputs[0].token_ids
    assert len(ours) == n_new, (len(ours), n_new)
    lp = hf_logprobs(hf, prompt + ours)
    P = len(prompt)
    # prompt logprobs: entry i scores prompt[i] given prompt[:i]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == P
    assert out.prompt_logprobs[0] is None
    mine = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, P)])
    ref = lp[: P - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    err = (mine - ref).abs().max().item()
    assert err < tol, f"prompt logprobs differ from HF by {err:.2e} (prompt length {P})"
    # generated tokens' logprobs (decode path), teacher-forced on our tokens
    mine = torch.tensor([out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(ours)])
    ref = lp[P - 1 : P - 1 + n_new].gather(1, torch.tensor(ours)[:, None])[:, 0]
    err = (mine - ref).abs().max().item()
    assert err < tol, f"generated-token logprobs differ from HF by {err:.2e} (prompt length {P})"
    # greedy tokens vs HF generate
    theirs = hf_greedy(hf, prompt, n_new)
    if ours != theirs:
        j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        row = lp[P - 1 + j]
        gap = (row.max() - row[ours[j]]).item()
        assert gap < tie_gap, (f"greedy tokens differ from HF generate at step {j} (gap {gap:.2e}, prompt "
                               f"length {P}): ours {ours}, HF {theirs}")


def rand_ids(n: int, seed: int) -> list[int]:
    """``n`` seeded random token ids of the tiny vocabulary, above the special tokens."""
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def preemption_workload() -> tuple[list[list[int]], list]:
    """8 prompts of 10-31 tokens, 12 output tokens each: odd ones seeded sampling with top-2 logprobs,
    even ones greedy with prompt logprobs; too many blocks for a 24-block cache at once."""
    from deepinfer_core import SamplingParams

    prompts = [rand_ids(10 + 3 * i, 10 + i) for i in range(8)]
    params = [SamplingParams(temperature=1.0, seq_seed=100 + i, max_tokens=12, ignore_eos=True, logprobs=2) if i % 2
              else SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
              for i in range(8)]
    return prompts, params
