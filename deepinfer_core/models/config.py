"""The model configuration read from an HF ``config.json`` (DeepSeek V2 and V3 families)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes something this engine cannot run."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # MoE
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str  # softmax | sigmoid
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # rope
    rope_theta: float
    rope: dict = field(default_factory=dict)  # rope_scaling / rope_parameters table
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Values cached per token per layer: the normalised latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type", self.rope.get("type", "default")) or "default"

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts is not None and i >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_type != "default" and self.rope.get("mscale_all_dim"):
            m = yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"])
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        v3 = arch == "DeepseekV3ForCausalLM"
        topk_method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
        if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ModelConfigError(f"config.json: unsupported topk_method {topk_method!r}")
        scoring = cfg.get("scoring_func", "sigmoid" if topk_method == "noaux_tc" else "softmax")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        n_heads = cfg["num_attention_heads"]
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ModelConfigError("config.json: only moe_layer_freq = 1 is supported")
        if cfg.get("attention_bias", False):
            raise ModelConfigError("config.json: attention_bias = true is not supported")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            kv_lora_rank=cfg["kv_lora_rank"],
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            n_routed_experts=cfg.get("n_routed_experts"),
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 1,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            topk_method=topk_method,
            scoring_func=scoring,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            rope_theta=float(theta),
            rope=rope,
            rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            raw=cfg,
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
