"""DeepSeek-V4 configuration from an HF ``config.json``: transformers-style fields
(``layer_types``, ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor``, nested
``rope_parameters``) and the official / legacy ones (``compress_ratios``, ``compress_rate_csa/hca``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``). ``../shared/V4.md`` §1 lists them."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_core.models.config import ModelConfigError

ARCHITECTURE = "DeepseekV4ForCausalLM"
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


@dataclass
class V4Config:
    architecture: str
    vocab_size: int
    hidden_size: int  # C
    num_hidden_layers: int
    num_attention_heads: int  # H
    head_dim: int  # D (= K = V, one shared KV head)
    rope_dim: int  # R: the last R channels of each head are roped
    q_lora_rank: int
    layer_types: list[str]  # per layer: SWA | CSA | HCA
    compress_csa: int  # m
    compress_hca: int  # m'
    sliding_window: int  # W keys, the query's own included
    index_n_heads: int
    index_head_dim: int  # D_I
    index_topk: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: list[str]  # per layer: HASH_MOE | MOE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float  # main table (SWA-only layers)
    compress_rope: dict  # compress table (CSA/HCA layers): rope_type, rope_theta and YaRN fields
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    def compress_rate(self, i: int) -> int:
        """Tokens per compressed entry of layer ``i`` (0 for a SWA-only layer)."""
        return {SWA: 0, CSA: self.compress_csa, HCA: self.compress_hca}[self.layer_types[i]]

    @classmethod
    def from_dict(cls, cfg: dict) -> V4Config:
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs and cfg.get("model_type") != "deepseek_v4":
            raise ModelConfigError(f"config.json: architectures {archs!r} is not {ARCHITECTURE}")

        def need(name: str):
            if cfg.get(name) is None:
                raise ModelConfigError(f"config.json: DeepSeek-V4 needs field {name!r}")
            return cfg[name]

        def bad(name: str, value, expected: str):
            return ModelConfigError(f"config.json: unsupported {name} = {value!r}; expected {expected}")

        n = int(need("num_hidden_layers"))
        head_dim = int(need("head_dim"))
        H = int(need("num_attention_heads"))
        if cfg.get("num_key_value_heads", 1) != 1:
            raise bad("num_key_value_heads", cfg["num_key_value_heads"], "1 (one shared K=V head)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise bad("hidden_act", cfg["hidden_act"], "'silu'")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            name = "attention_bias" if cfg.get("attention_bias") else "mlp_bias"
            raise bad(name, cfg[name], "false")

        rates = dict(cfg.get("compress_rates") or {})
        m = int(cfg.get("compress_rate_csa") or rates.get(CSA, 4))
        m2 = int(cfg.get("compress_rate_hca") or rates.get(HCA, 128))
        if m < 1 or m2 < 1:
            raise bad("compress_rates", {CSA: m, HCA: m2}, "positive rates")
        if cfg.get("layer_types") is not None:
            layer_types = list(cfg["layer_types"])[:n]
            field_name = "layer_types"
        elif cfg.get("compress_ratios") is not None:
            field_name = "compress_ratios"
            by_ratio = {0: SWA, m: CSA, m2: HCA}
            try:  # the official list has one more entry (the MTP layer's); it is not a main layer
                layer_types = [by_ratio[int(r)] for r in list(cfg["compress_ratios"])[:n]]
            except KeyError as exc:
                raise bad("compress_ratios", cfg["compress_ratios"], f"entries in {sorted(by_ratio)}") from exc
        else:
            raise ModelConfigError("config.json: DeepSeek-V4 needs field 'layer_types' (or legacy 'compress_ratios')")
        if len(layer_types) != n or any(t not in (SWA, CSA, HCA) for t in layer_types):
            raise bad(field_name, cfg.get(field_name), f"{n} entries of {SWA}|{CSA}|{HCA}")

        if cfg.get("mlp_layer_types") is not None:
            mlp_types = list(cfg["mlp_layer_types"])[:n]
        else:
            n_hash = int(cfg.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        if len(mlp_types) != n or any(t not in (HASH_MOE, MOE) for t in mlp_types):
            raise bad("mlp_layer_types", cfg.get("mlp_layer_types"), f"{n} entries of {HASH_MOE}|{MOE}")

        if cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
        else:
            rope_dim = int(cfg.get("qk_rope_head_dim") or 64)
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise bad("partial_rotary_factor", cfg.get("partial_rotary_factor"), "an even rope width <= head_dim")

        rope_theta = float(cfg.get("rope_theta", 10000.0))
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            rope_theta = float(rp["main"].get("rope_theta", rope_theta))
            if rp["main"].get("rope_type", "default") != "default":
                raise bad("rope_parameters.main.rope_type", rp["main"]["rope_type"], "'default'")
            compress = dict(rp["compress"])
        else:
            compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            compress["rope_theta"] = float(cfg.get("compress_rope_theta", 160000.0))
        compress.pop("partial_rotary_factor", None)  # the rope width is rope_dim for both tables
        compress["rope_type"] = compress.get("rope_type", compress.get("type", "default")) or "default"
        if compress["rope_type"] not in ("default", "yarn"):
            raise bad("rope_parameters.compress.rope_type", compress["rope_type"], "'default' or 'yarn'")
        if compress["rope_type"] == "yarn":
            compress["attention_factor"] = 1.0  # V4 never scales cos/sin (no mscale)
            if compress.get("factor") is None:
                raise ModelConfigError("config.json: YaRN rope_parameters need field 'factor'")

        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise bad("scoring_func", scoring, " or ".join(SCORING_FUNCS))
        o_groups = int(cfg.get("o_groups", 8))
        if H % o_groups:
            raise bad("o_groups", o_groups, f"a divisor of num_attention_heads={H}")
        hc_mult = int(cfg.get("hc_mult", 4))
        if hc_mult < 1:
            raise bad("hc_mult", hc_mult, ">= 1")
        window = int(cfg.get("sliding_window", 128))
        if window < 1:
            raise bad("sliding_window", window, ">= 1")
        top_k = int(cfg.get("num_experts_per_tok", 6))
        experts = int(need("n_routed_experts"))
        if not 0 < top_k <= experts:
            raise bad("num_experts_per_tok", top_k, f"1..n_routed_experts={experts}")
        limit = cfg.get("swiglu_limit", 10.0)
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=ARCHITECTURE,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n,
            num_attention_heads=H,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(need("q_lora_rank")),
            layer_types=layer_types,
            compress_csa=m,
            compress_hca=m2,
            sliding_window=window,
            index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)),
            o_groups=o_groups,
            o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            hc_mult=hc_mult,
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            mlp_layer_types=mlp_types,
            n_routed_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or need("intermediate_size")),
            scoring_func=scoring,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            swiglu_limit=None if limit is None else float(limit),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1 << 20)),
            rope_theta=rope_theta,
            compress_rope=compress,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            raw=cfg,
        )
