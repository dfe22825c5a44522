"""The engine against transformers' own DeepseekV2/DeepseekV3 (float32, random tiny checkpoints).

For each config variant: greedy tokens identical to HF ``generate``; prompt logprobs and the
generated tokens' logprobs within 1e-3 of HF's log_softmax. Prompts include one of 300+ tokens;
several requests run batched together, once with prefill split into 64-token chunks (chunks mixed
with other requests' decodes, prefix read back from the paged cache) and once unchunked.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, check_against_hf, write_checkpoint

from deepinfer_core import LLM, SamplingParams

YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
YARN_V2 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

VARIANTS = {
    # V3: sigmoid + e_score_correction_bias, 4 groups keep 2, renormalised, scaled by 2.5;
    # dense first layer, one shared expert, q_lora, v_head_dim 12 != qk_nope_head_dim 8.
    "v3_noaux_tc_groups": ("v3", dict(
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # V3 with half-split rope (rope_interleave false), YaRN (mscale != mscale_all_dim), tied
    # embeddings, every layer MoE, no shared expert, no renormalisation.
    "v3_yarn_tied_no_interleave": ("v3", dict(
        rope_interleave=False, rope_parameters=YARN_V3, tie_word_embeddings=True, first_k_dense_replace=0,
        n_shared_experts=0, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5)),
    # V2: softmax, group_limited_greedy (max per group; top-3 so the group limit matters), no
    # renormalisation, 2 shared experts, YaRN.
    "v2_group_limited_yarn": ("v2", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
        norm_topk_prob=False, routed_scaling_factor=2.0, n_shared_experts=2, rope_parameters=YARN_V2)),
    # V2 greedy: top-3 of 8, all layers MoE, no shared expert, v_head_dim == qk_nope_head_dim, 3 layers.
    "v2_greedy": ("v2", dict(
        topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=0, n_shared_experts=0,
        v_head_dim=8, num_hidden_layers=3, routed_scaling_factor=1.0)),
    # V2-Lite: q_lora_rank None (plain q_proj), greedy, 2 shared experts, dense first layer, YaRN, tied.
    "v2_lite": ("v2", dict(
        q_lora_rank=None, topk_method="greedy", n_shared_experts=2, first_k_dense_replace=1,
        rope_parameters=YARN_V2, tie_word_embeddings=True)),
}

PROMPT_LENS = (3, 37, 130, 310)
N_NEW = 8


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path, hf = write_checkpoint(tmp_path / variant, arch, seed=7, tokenizer=False, **overrides)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    runs = {
        # 64-token chunks: the 310-token prompt takes 5+ steps, batched with the others' decodes
        "chunked": dict(block_size=4, max_num_batched_tokens=64),
        "whole": dict(block_size=16, max_num_batched_tokens=1024),
    }
    for name, kw in runs.items():
        llm = LLM(str(path), dtype="float32", max_num_seqs=8, kv_cache_memory=4 << 20, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if name == "chunked":
            assert llm.metrics()["steps"] >= PROMPT_LENS[-1] // 64 + N_NEW  # prefill really was chunked
        for p, o in zip(prompts, outs):
            assert o.error is None and o.outputs[0].finish_reason == "length"
            check_against_hf(hf, p, o, N_NEW)
        llm.engine.blocks.check_no_leaks()


def test_reference_check_detects_a_wrong_weight(tmp_path):
    """The comparison is sharp: perturbing one expert's weight in the saved checkpoint is caught."""
    from safetensors.torch import load_file, save_file

    arch, overrides = VARIANTS["v3_noaux_tc_groups"]
    path, hf = write_checkpoint(tmp_path / "m", arch, seed=7, tokenizer=False, **overrides)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_seqs=4, kv_cache_memory=1 << 20)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=0), use_tqdm=False)[0]
    with pytest.raises(AssertionError, match="logprobs differ"):
        check_against_hf(hf, prompt, out, 4)
