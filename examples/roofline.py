"""Roofline figures of the benchmark: what a decode step must read and what a prefill must compute.

Decode (memory-bound): the bytes one step must read at ``batch`` sequences of ``context`` cached tokens,

    routed experts    sum over MoE layers of (distinct experts hit in the step) x 3 C I x w
    shared experts    MoE layers x n_shared x 3 C I x w
    router            MoE layers x E C x 4 (float32 gate; + E x 4 for V3's correction bias)
    dense MLPs        dense layers x 3 C I_dense x w
    attention         layers x (q | q_a + q_a_norm + q_b, kv_a, kv_a_norm, kv_b, o) x w
                      (the absorbed decode reads kv_b once, as its W_UK and W_UV halves)
    norms             layers x 2 C x w + the final norm C x w
    LM head           vocab x C x w
    embedding rows    batch x C x w
    KV cache          batch x context x (KV bytes per token over all layers): by default (kv_lora + rope)
                      x w x layers; the engine's declared cache spec gives it otherwise (``kv_bytes_per_token``:
                      656 x layers for the FP8 latent rows of kv_cache_dtype "fp8")

(w: bytes per weight; activations are ignored). With FP8 weights (``fp8_matrices``) the GEMM matrices that an
FP8 checkpoint stores as e4m3 (q / q_a / q_b, kv_a, o, the experts, the dense MLPs) count 1 byte plus a float32
scale per 128x128 tile; kv_b (dequantised at load for the absorbed decode), norms, router, head and
embedding keep w. The bound is bytes / (measured read bandwidth), so
the roofline tokens/s is batch / bound and the fraction is measured tok/s over it. With uniform random
routing the expected number of distinct experts hit by ``batch`` tokens is E (1 - (1 - k/E)^batch);
the benchmark uses the router's own count where it can observe it.

Prefill (compute-bound): FLOPs of ``num_prompts`` prompts of ``prompt_len`` tokens, no cached prefix,

    linear            2 x (matmul parameters one token passes through) x tokens: attention projections
                      (the expanded prefill applies kv_b to every token), router, dense MLP, and k routed
                      + n_shared experts per MoE layer
    attention         layers x num_prompts x 2 H (qk_head_dim + v_head_dim) x S (S + 1) / 2  (causal)
    LM head           2 x vocab x C x num_prompts (only each prompt's last row is projected)

The bound is FLOPs / (measured bf16 matmul peak); the fraction is measured tok/s over tokens / bound.
"""

from __future__ import annotations

from deepinfer_core.models.config import ModelConfig


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts hit by ``tokens`` tokens routed uniformly at random to ``top_k`` of ``n_experts``."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


FP8_WBYTES = 1 + 4 / (128 * 128)  # e4m3 weight + its share of the tile's float32 scale


def _attention_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(matmul parameters, norm parameters, kv_b's parameters among the matmul ones) of one layer's attention."""
    C, H, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        q, q_norm = H * cfg.qk_head_dim * C, 0
    else:
        q, q_norm = cfg.q_lora_rank * C + H * cfg.qk_head_dim * cfg.q_lora_rank, cfg.q_lora_rank
    kv_a = (L + R) * C
    kv_b = H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * L
    o = C * H * cfg.v_head_dim
    return q + kv_a + kv_b + o, q_norm + L, kv_b


def _layers(cfg: ModelConfig) -> tuple[int, int]:
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return moe, cfg.num_hidden_layers - moe


def decode_step_bytes(cfg: ModelConfig, batch: int, context: float, experts_hit: float | list[float],
                      wbytes: int = 2, kv_bytes_per_token: float | None = None,
                      fp8_matrices: bool = False) -> dict[str, float]:
    """Bytes one decode step must read, by component (module docstring); ``experts_hit``: distinct
    routed experts per MoE layer in one step (one number for all layers, or one per MoE layer);
    ``kv_bytes_per_token``: cached bytes per token over all layers (``KVCacheSpec.bytes_per_token``);
    ``fp8_matrices``: the GEMM weights are e4m3 with 128x128 scales (the FP8 roofline)."""
    C, I = cfg.hidden_size, cfg.moe_intermediate_size
    n_moe, n_dense = _layers(cfg)
    hits = [experts_hit] * n_moe if isinstance(experts_hit, (int, float)) else list(experts_hit)
    if len(hits) != n_moe:
        raise ValueError(f"experts_hit has {len(hits)} entries, the model has {n_moe} MoE layers")
    attn, attn_norm, kv_b = _attention_params(cfg)
    mb = FP8_WBYTES if fp8_matrices else wbytes
    E = cfg.n_routed_experts or 0
    router = E * C * 4 + (E * 4 if cfg.topk_method == "noaux_tc" else 0)
    out = {
        "routed_experts": sum(hits) * 3 * C * I * mb,
        "shared_experts": n_moe * cfg.n_shared_experts * 3 * C * I * mb,
        "router": n_moe * router,
        "dense_mlp": n_dense * 3 * C * cfg.intermediate_size * mb,
        "attention": cfg.num_hidden_layers * ((attn - kv_b) * mb + (kv_b + attn_norm) * wbytes),
        "norms": (cfg.num_hidden_layers * 2 * C + C) * wbytes,
        "lm_head": cfg.vocab_size * C * wbytes,
        "embedding": batch * C * wbytes,
        "kv_cache": batch * context * (cfg.kv_entry_dim * wbytes * cfg.num_hidden_layers
                                       if kv_bytes_per_token is None else kv_bytes_per_token),
    }
    out["total"] = sum(out.values())
    return out


def prefill_flops(cfg: ModelConfig, prompt_len: int, num_prompts: int = 1) -> dict[str, float]:
    """FLOPs of prefilling ``num_prompts`` prompts of ``prompt_len`` tokens, by component (module docstring)."""
    C, S = cfg.hidden_size, prompt_len
    n_moe, n_dense = _layers(cfg)
    attn = _attention_params(cfg)[0]
    E = cfg.n_routed_experts or 0
    per_token = (cfg.num_hidden_layers * attn + n_dense * 3 * C * cfg.intermediate_size
                 + n_moe * (E * C + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * C
                            * cfg.moe_intermediate_size))
    heads = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    out = {
        "linear": 2.0 * per_token * S * num_prompts,
        "attention": cfg.num_hidden_layers * num_prompts * 2.0 * heads * S * (S + 1) / 2,
        "lm_head": 2.0 * cfg.vocab_size * C * num_prompts,
    }
    out["total"] = sum(out.values())
    return out


def decode_roofline(cfg: ModelConfig, batch: int, context: float, tok_s: float, read_GBps: float,
                    experts_hit: float | list[float], wbytes: int = 2,
                    kv_bytes_per_token: float | None = None, fp8_matrices: bool = False) -> dict[str, float]:
    """Measured decode tok/s against its bandwidth roofline: bytes per step / measured read bandwidth."""
    step = decode_step_bytes(cfg, batch, context, experts_hit, wbytes, kv_bytes_per_token, fp8_matrices)
    bound_s = step["total"] / (read_GBps * 1e9)
    roof = batch / bound_s
    return {"bytes_per_step": step["total"], "roofline_tok_s": roof, "fraction": tok_s / roof,
            "bytes_by_part": step}


def prefill_roofline(cfg: ModelConfig, prompt_len: int, num_prompts: int, tok_s: float,
                     matmul_TFLOPs: float) -> dict[str, float]:
    """Measured prefill tok/s against its compute roofline: FLOPs / measured matmul peak."""
    flops = prefill_flops(cfg, prompt_len, num_prompts)
    bound_s = flops["total"] / (matmul_TFLOPs * 1e12)
    roof = prompt_len * num_prompts / bound_s
    return {"flops": flops["total"], "roofline_tok_s": roof, "fraction": tok_s / roof,
            "achieved_TFLOPs": flops["total"] / (prompt_len * num_prompts / tok_s) / 1e12}
