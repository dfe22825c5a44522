"""DeepSeek V2 / V2-Lite / V3 for inference: MLA attention over a paged latent cache, and MoE.

Shapes: T tokens in the step, C hidden size, H heads, L kv_lora_rank, R qk_rope_head_dim,
N qk_nope_head_dim, V v_head_dim, E local experts, I expert width.

Every numerical op goes through ``self.k`` (the platform's resolved kernels), so a backend
speeds the model up without touching this file.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.kernels import Kernels
from deepinfer_core.kv_cache_spec import CacheLayout, KVCacheSpec, cache_planes
from deepinfer_core.models.config import ModelConfig
from deepinfer_core.models.interface import CausalLM, KVCaches, RouteHook
from deepinfer_core.models.metadata import AttentionMetadata
from deepinfer_core.models.rope import rope_cache
from kernels_cpu import kv_fp8


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _fp8_scales(module: nn.Module, *names: str) -> None:
    """Declare ``<name>_scale_inv`` (None) for each GEMM weight: the loader fills it when the weight
    stays block-scaled FP8 (config ``weight_dtype``); None means the weight is in the model dtype."""
    for name in names:
        module.register_buffer(name + "_scale_inv", None, persistent=False)


def linear(k: Kernels, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T: ``fp8_linear`` when ``w`` is e4m3 with its 128x128 tile scales, else ``linear``."""
    return k.linear(x, w) if scale is None else k.fp8_linear(x, w, scale)


class RMSNorm(nn.Module):
    def __init__(self, k: Kernels, dim: int, eps: float) -> None:
        super().__init__()
        self.k, self.eps, self.weight = k, eps, _param(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.rms_norm(x, self.weight, self.eps)


def _fp8_rows(cache) -> bool:
    """Whether a layer's latent cache holds FP8 rows (``kv_cache_dtype = "fp8"``: uint8, kernels_cpu/kv_fp8.py)."""
    return isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8


class MLA(nn.Module):
    """Multi-head latent attention. The cache holds [normed latent L | rotated rope key R] per token, as
    values (``kv_cache_dtype`` auto/bf16) or as FP8 rows that the ops quantise and read (fp8)."""

    def __init__(self, k: Kernels, cfg: ModelConfig) -> None:
        super().__init__()
        self.k, self.cfg = k, cfg
        H, C, L, R, N, V = (cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                            cfg.qk_nope_head_dim, cfg.v_head_dim)
        self.H, self.L, self.R, self.N, self.V = H, L, R, N, V
        if cfg.q_lora_rank is None:
            self.q_proj = _param(H * (N + R), C)
        else:
            self.q_a_proj = _param(cfg.q_lora_rank, C)
            self.q_a_layernorm = RMSNorm(k, cfg.q_lora_rank, 1e-6)
            self.q_b_proj = _param(H * (N + R), cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = _param(L + R, C)
        self.kv_a_layernorm = RMSNorm(k, L, 1e-6)
        self.kv_b_proj = _param(H * (N + V), L)
        self.o_proj = _param(C, H * V)
        _fp8_scales(self, "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
        self.scale = cfg.softmax_scale
        self.w_uk: torch.Tensor | None = None  # [H, L, N] (W_UK transposed), derived from kv_b_proj
        self.w_uv: torch.Tensor | None = None  # [H, V, L]
        # [q_a_proj | q_proj ; kv_a_proj_with_mqa]: both read the layer input, so one GEMM (post_load)
        self.w_xa: torch.Tensor | None = None
        self.w_xa_scale: torch.Tensor | None = None
        # mla_kv_write and mla_q_absorb, and mla_decode_uv (set_decode_fusion(False): rms_norm + rope +
        # paged_kv_write, head_linear + rope + cat for the decode query, mla_decode + head_linear after it)
        self.fuse_kv_write = True

    def post_load(self) -> None:
        kv_b = self.kv_b_proj.view(self.H, self.N + self.V, self.L)
        self.w_uk = kv_b[:, : self.N].transpose(1, 2).contiguous()
        self.w_uv = kv_b[:, self.N :].contiguous()
        self._fuse_input_projections()

    def _fuse_input_projections(self) -> None:
        """Concatenate the query's first projection and kv_a into ``w_xa`` (one GEMM per layer instead of two);
        the parameters become views of it (no extra memory). FP8 weights fuse when the query part fills whole
        128-row tiles (their scales concatenate too); otherwise the two GEMMs stay separate."""
        name = "q_proj" if self.cfg.q_lora_rank is None else "q_a_proj"
        wq, wkv = getattr(self, name), self.kv_a_proj_with_mqa
        sq, skv = getattr(self, name + "_scale_inv"), self.kv_a_proj_with_mqa_scale_inv
        if wq.dtype != wkv.dtype or (sq is None) != (skv is None) or (sq is not None and wq.shape[0] % 128):
            self.w_xa = self.w_xa_scale = None
            return
        fused = torch.cat((wq.data, wkv.data))
        n = wq.shape[0]
        wq.data, wkv.data = fused[:n], fused[n:]
        self.w_xa = fused
        self.w_xa_scale = None if sq is None else torch.cat((sq, skv))

    def fuses_input_norm(self) -> bool:
        """Whether the layer's input norm runs in the prologue of the fused input projection
        (``add_rms_norm_linear``, decode fusion): one model-dtype weight ``w_xa`` and a backend that runs the op."""
        return self.fuse_kv_write and self.w_xa is not None and self.w_xa_scale is None and \
            self.k.implements("add_rms_norm_linear")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                meta: AttentionMetadata, cache: torch.Tensor, xa: torch.Tensor | None = None) -> torch.Tensor:
        """``xa``: ``x @ w_xa.T`` already computed (by ``add_rms_norm_linear``; ``x`` is then that same tensor)."""
        k, T = self.k, x.shape[0]
        if xa is not None or self.w_xa is not None:
            if xa is None:
                xa = linear(k, x, self.w_xa, self.w_xa_scale)
            x_q, kv_a = xa.split([self.w_xa.shape[0] - self.L - self.R, self.L + self.R], dim=-1)
        else:
            x_q = linear(k, x, *((self.q_proj, self.q_proj_scale_inv) if self.cfg.q_lora_rank is None
                                 else (self.q_a_proj, self.q_a_proj_scale_inv)))
            kv_a = linear(k, x, self.kv_a_proj_with_mqa, self.kv_a_proj_with_mqa_scale_inv)
        if self.cfg.q_lora_rank is None:
            q = x_q
        else:
            q = linear(k, self.q_a_layernorm(x_q), self.q_b_proj, self.q_b_proj_scale_inv)
        q = q.view(T, self.H, self.N + self.R)
        q_nope, q_pe = q.split([self.N, self.R], dim=-1)  # [T, H, N], [T, H, R]
        P = meta.num_prefill_tokens
        # fused: the decode rows' rope happens inside mla_q_absorb, so only prefill rows are rotated here
        absorb = self.fuse_kv_write and meta.decode is not None and k.implements("mla_q_absorb")
        if not absorb:
            q_pe = k.rope(q_pe, positions, cos_sin)
        elif P:
            q_pe = k.rope(q_pe[:P], positions[:P], cos_sin)

        one_cache = self.fuse_kv_write and isinstance(cache, torch.Tensor) and cache.dtype == kv_a.dtype
        # a decode-only step: the cache write inside mla_q_absorb's launch (the entry is not needed)
        kv_in_query = absorb and one_cache and meta.prefill is None and k.implements("mla_q_absorb_kv_write")
        if kv_in_query:
            entry = None
        elif one_cache:
            entry = k.mla_kv_write(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, positions, cos_sin,
                                   cache, meta.slot_mapping)
        else:  # cache planes or a quantised cache: the platform's own write
            latent, k_pe = kv_a.split([self.L, self.R], dim=-1)
            entry = torch.cat((self.kv_a_layernorm(latent), k.rope(k_pe[:, None], positions, cos_sin)[:, 0]), -1)
            k.paged_kv_write(cache, meta.slot_mapping, entry)  # entry: [T, L + R]

        if meta.prefill is None and meta.decode is None:  # no tokens (an idle expert-parallel rank)
            out = x.new_empty(T, self.H, self.V)
        elif meta.decode is None:
            out = self._prefill(q_nope, q_pe, entry, meta, cache)
        elif meta.prefill is None:
            out = self._decode(q, None if absorb else q_pe, positions, cos_sin, meta, cache,
                               kv_a if kv_in_query else None)
        else:  # a mixed step: prefill chunks' rows first
            out = x.new_empty(T, self.H, self.V)
            out[:P] = self._prefill(q_nope[:P], q_pe[:P], entry[:P], meta, cache)
            out[P:] = self._decode(q[P:], None if absorb else q_pe[P:], positions[P:], cos_sin, meta, cache)
        return linear(k, out.reshape(T, self.H * self.V), self.o_proj, self.o_proj_scale_inv)

    def _prefill(self, q_nope, q_pe, entry, meta: AttentionMetadata, cache) -> torch.Tensor:
        """Expanded form: K/V for the whole context from kv_b_proj, causal attention per sequence. With
        FP8 rows (or a cache of another dtype than the model's) the context is always read back from the
        cache, so a prompt attends over the same keys whether it is computed at once, in chunks or after
        a prefix hit."""
        pm = meta.prefill
        if _fp8_rows(cache):
            rows = self.k.paged_kv_gather(cache, pm.block_tables, pm.seq_lens)
            entry = self.k.latent_kv_dequant(rows, self.L + self.R, q_nope.dtype)
        elif pm.has_prefix or cache_planes(cache)[0].dtype != q_nope.dtype:  # a chunk, a prefix hit, a bf16 cache:
            entry = self.k.paged_kv_gather(cache, pm.block_tables, pm.seq_lens).to(q_nope.dtype)  # read it back
        S = entry.shape[0]
        kv = self.k.linear(entry[:, : self.L], self.kv_b_proj).view(S, self.H, self.N + self.V)
        k_nope, v = kv.split([self.N, self.V], dim=-1)
        key = torch.cat((k_nope, entry[:, None, self.L :].expand(S, self.H, self.R)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        return self.k.mla_prefill(query, key, v.contiguous(), pm.cu_q_lens, pm.cu_k_lens, self.scale)

    def _decode(self, q, q_pe, positions, cos_sin, meta: AttentionMetadata, cache,
                kv_a: torch.Tensor | None = None) -> torch.Tensor:
        """Absorbed form: fold W_UK into q, attend over latents, then apply W_UV. ``q_pe`` None: q's rope part
        is not rotated yet, and ``mla_q_absorb`` does both in one op (decode fusion); ``kv_a`` given: the cache
        entry is not written yet, and ``mla_q_absorb_kv_write`` writes it in the same op. Under decode fusion the
        attention and W_UV are one op too (``mla_decode_uv``) where the backend implements it."""
        dm = meta.decode
        if kv_a is not None:
            norm = self.kv_a_layernorm
            q_abs = self.k.mla_q_absorb_kv_write(q, self.w_uk, positions, cos_sin, kv_a, norm.weight, norm.eps, cache,
                                                 meta.slot_mapping)
        elif q_pe is None:
            q_abs = self.k.mla_q_absorb(q, self.w_uk, positions, cos_sin)  # [T, H, L + R]
        else:
            q_lat = self.k.head_linear(q[..., : self.N], self.w_uk)  # [T, H, L]
            q_abs = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, L + R]
        if self.fuse_kv_write and self.k.implements("mla_decode_uv"):  # the attention and W_UV in one op
            return self.k.mla_decode_uv(q_abs, cache, dm.block_tables, dm.cu_q_lens, dm.seq_lens, self.scale, self.L,
                                        self.w_uv)  # [T, H, V]
        o_lat = self.k.mla_decode(q_abs, cache, dm.block_tables, dm.cu_q_lens, dm.seq_lens, self.scale, self.L)
        return self.k.head_linear(o_lat, self.w_uv)  # [T, H, V]


class MLP(nn.Module):
    """SiLU-gated MLP with gate and up fused: w13 = [gate; up]."""

    def __init__(self, k: Kernels, hidden: int, inter: int) -> None:
        super().__init__()
        self.k, self.w13, self.w2 = k, _param(2 * inter, hidden), _param(hidden, inter)
        _fp8_scales(self, "w13", "w2")

    def forward(self, x: torch.Tensor, h13: torch.Tensor | None = None) -> torch.Tensor:
        """``h13``: ``x @ w13.T`` already computed (``add_rms_norm_linear``)."""
        if h13 is None:
            h13 = linear(self.k, x, self.w13, self.w13_scale_inv)
        return linear(self.k, self.k.silu_and_mul(h13), self.w2, self.w2_scale_inv)


class MoE(nn.Module):
    """Routed experts (this rank holds experts [expert_start, expert_start + E)) plus shared experts."""

    def __init__(self, k: Kernels, cfg: ModelConfig, layer_idx: int, expert_start: int = 0,
                 num_local: int | None = None) -> None:
        super().__init__()
        self.k, self.cfg, self.layer_idx = k, cfg, layer_idx
        E = cfg.n_routed_experts if num_local is None else num_local
        self.expert_start, self.num_local = expert_start, E
        C, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = _param(cfg.n_routed_experts, C)
        self.e_score_correction_bias = _param(cfg.n_routed_experts) if cfg.topk_method == "noaux_tc" else None
        self.w13 = _param(E, 2 * I, C)
        self.w2 = _param(E, C, I)
        _fp8_scales(self, "w13", "w2")
        self.shared = MLP(k, C, I * cfg.n_shared_experts) if cfg.n_shared_experts else None
        v3 = cfg.topk_method == "noaux_tc"
        self.renormalize = cfg.norm_topk_prob and (v3 or cfg.num_experts_per_tok > 1)
        # V2 scales only when it does not renormalise; V3 always scales.
        self.scale = cfg.routed_scaling_factor if (v3 or not self.renormalize) else 1.0
        grouped = cfg.topk_method in ("group_limited_greedy", "noaux_tc")
        self.n_group = cfg.n_group if grouped else 1
        self.group_score = "top2sum" if v3 else "max"
        # Set by the engine (ModelRunner.set_route_hook: EPLB's replica map), and EP's dispatcher.
        self.route_hook: RouteHook | None = None
        self.expert_parallel = None
        # the shared experts as always-selected experts E.. of one fused_moe (post_load; set_decode_fusion)
        self.fold_shared = True
        self.w13_all: torch.Tensor | None = None
        self.w2_all: torch.Tensor | None = None
        self.s13_all: torch.Tensor | None = None  # FP8 experts: the stacked 128x128 tile scales
        self.s2_all: torch.Tensor | None = None

    def post_load(self) -> None:
        self._fold_shared_experts()

    def _fold_shared_experts(self) -> None:
        """Stack the shared experts behind the routed ones: ``w13_all`` [E + S, 2I, C] and ``w2_all`` [E + S, C, I]
        with the shared MLP of width S * I split into S experts of width I (its gate/up rows and down columns
        per block of I; the MLP is a sum over its intermediate channels, so this is the same function). The
        routed parameters become views of the stacked tensors (no extra memory); the shared MLP's too when
        S == 1 (V3), while for S > 1 (V2) its stacked copy costs its size once more. Only for model-dtype
        weights on a rank that holds every routed expert (expert parallelism moves experts between ranks), or for
        FP8 experts and shared MLP alike whose width I fills whole 128-channel tiles (their scales stack the same
        way, per tile)."""
        self.w13_all = self.w2_all = self.s13_all = self.s2_all = None
        sh, cfg = self.shared, self.cfg
        fp8 = self.w13_scale_inv is not None
        if (sh is None or fp8 != (sh.w13_scale_inv is not None)
                or self.expert_parallel is not None or self.expert_start or self.num_local != cfg.n_routed_experts):
            return
        E, I, C = self.num_local, cfg.moe_intermediate_size, self.w13.shape[-1]
        S = sh.w2.shape[1] // I
        if S * I != sh.w2.shape[1] or (fp8 and I % 128):
            return
        if fp8:
            self._stack_scales(E, S, I // 128)
        w13 = self.w13.new_empty(E + S, 2 * I, C)
        w2 = self.w2.new_empty(E + S, C, I)
        w13[:E].copy_(self.w13.data)
        w2[:E].copy_(self.w2.data)
        w13[E:, :I].copy_(sh.w13.data[: S * I].view(S, I, C))
        w13[E:, I:].copy_(sh.w13.data[S * I :].view(S, I, C))
        w2[E:].copy_(sh.w2.data.view(C, S, I).permute(1, 0, 2))
        self._install_stacked(w13, w2)
        self.shared_ids = torch.arange(E, E + S, device=w13.device).view(1, S)
        self.shared_weights = torch.ones(1, S, dtype=w13.dtype, device=w13.device)

    def _stack_scales(self, E: int, S: int, Ib: int) -> None:
        """The FP8 tile scales of the routed experts and of the shared MLP split into S experts of Ib tiles,
        stacked as ``_fold_shared_experts`` stacks the weights; the routed (and a single shared expert's) scale
        buffers become views of them."""
        sh = self.shared
        s13 = self.w13_scale_inv.new_empty(E + S, 2 * Ib, self.w13_scale_inv.shape[-1])
        s2 = self.w2_scale_inv.new_empty(E + S, self.w2_scale_inv.shape[-2], Ib)
        s13[:E].copy_(self.w13_scale_inv)
        s2[:E].copy_(self.w2_scale_inv)
        s13[E:, :Ib].copy_(sh.w13_scale_inv[: S * Ib].reshape(S, Ib, -1))
        s13[E:, Ib:].copy_(sh.w13_scale_inv[S * Ib :].reshape(S, Ib, -1))
        s2[E:].copy_(sh.w2_scale_inv.reshape(-1, S, Ib).permute(1, 0, 2))
        self.s13_all, self.s2_all = s13, s2
        self.w13_scale_inv, self.w2_scale_inv = s13[:E], s2[:E]
        if S == 1:
            sh.w13_scale_inv, sh.w2_scale_inv = s13[E], s2[E]

    def _stacked_moe(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.s13_all is None:
            return self.k.fused_moe(x, self.w13_all, self.w2_all, weights, ids)
        return self.k.fused_moe_fp8(x, self.w13_all, self.s13_all, self.w2_all, self.s2_all, weights, ids)

    def _install_stacked(self, w13: torch.Tensor, w2: torch.Tensor) -> list[nn.Parameter]:
        """Make the routed parameters (and a single shared expert's) views of the stacked tensors; returns them."""
        E, sh = self.num_local, self.shared
        self.w13.data, self.w2.data = w13[:E], w2[:E]
        self.w13_all, self.w2_all = w13, w2
        views = [self.w13, self.w2]
        if w13.shape[0] == E + 1:
            sh.w13.data, sh.w2.data = w13[E], w2[E]
            views += [sh.w13, sh.w2]
        return views

    def apply_weight_layout(self, layout) -> list[nn.Parameter]:
        """Re-lay the stacked tensors with a ``Platform.linear_weight_layout`` (the views follow them); returns
        the parameters laid out with them, which ``loader.apply_weight_layout`` then leaves alone."""
        if not self._folded():
            return []
        return self._install_stacked(layout(self.w13_all), layout(self.w2_all))

    def _folded(self) -> bool:
        """The stacked tensors are in use: folding on, and the routed weights still the views made at post_load
        (a placement or layout change since replaces them; then the shared MLP runs on its own)."""
        return (self.fold_shared and self.w13_all is not None and self.expert_parallel is None
                and self.w13.data_ptr() == self.w13_all.data_ptr() and self.w2.data_ptr() == self.w2_all.data_ptr()
                and (self.s13_all is None or (self.w13_scale_inv.data_ptr() == self.s13_all.data_ptr()
                                              and self.w2_scale_inv.data_ptr() == self.s2_all.data_ptr())))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = self.k.linear_f32(x, self.gate)  # router logits in float32, as the references
        weights, ids = self.k.moe_route(logits, self.e_score_correction_bias, cfg.num_experts_per_tok,
                                        cfg.scoring_func, self.n_group, cfg.topk_group, self.group_score,
                                        self.renormalize, self.scale)
        if self.route_hook is not None:
            weights, ids = self.route_hook(self.layer_idx, weights, ids)
        return weights, ids

    def fused_gate(self) -> bool:
        """Whether the router and the shared experts' slots are one ``moe_gate`` (decode fusion, folded experts)."""
        return self._folded() and self.route_hook is None and self.k.implements("moe_gate")

    def gate_args(self) -> tuple:
        """``moe_gate``'s arguments after the activations, up to (not including) the weights' dtype."""
        cfg = self.cfg
        return (self.gate, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.scoring_func, self.n_group,
                cfg.topk_group, self.group_score, self.renormalize, self.scale, self.shared_ids.shape[1])

    def forward(self, x: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``routed``: (weights, ids) of ``moe_gate`` already computed (``add_rms_norm_moe_gate``)."""
        if routed is not None or self.fused_gate():  # router + shared slots
            weights, ids = routed if routed is not None else self.k.moe_gate(x, *self.gate_args(), x.dtype)
            return self._stacked_moe(x, weights, ids)
        weights, ids = self.route(x)
        if self._folded():
            T, S = x.shape[0], self.shared_ids.shape[1]
            ids = torch.cat((ids, self.shared_ids.expand(T, S)), 1)
            # (the shared slots' weight 1 is kept in the experts' dtype, FP8 for FP8 experts: cast, [1, S])
            weights = torch.cat((weights.to(x.dtype), self.shared_weights.to(x.dtype).expand(T, S)), 1)
            return self._stacked_moe(x, weights, ids)
        if self.expert_parallel is not None:
            out = self.expert_parallel.run(self, x, weights, ids)
        else:
            local = ids - self.expert_start if self.expert_start else ids
            if self.w13_scale_inv is None:
                out = self.k.fused_moe(x, self.w13, self.w2, weights.to(x.dtype), local)
            else:
                out = self.k.fused_moe_fp8(x, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv,
                                           weights.to(x.dtype), local)
        return out if self.shared is None else out + self.shared(x)


class DecoderLayer(nn.Module):
    def __init__(self, k: Kernels, cfg: ModelConfig, i: int, **moe_kw) -> None:
        super().__init__()
        self.k, self.eps = k, cfg.rms_norm_eps
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        self.self_attn = MLA(k, cfg)
        self.mlp = MoE(k, cfg, i, **moe_kw) if cfg.is_moe_layer(i) else MLP(k, cfg.hidden_size,
                                                                            cfg.intermediate_size)

    def forward(self, x, residual, positions, cos_sin, meta, cache):
        attn = self.self_attn
        if attn.fuses_input_norm():  # the input norm inside the q + kv_a projection (decode fusion)
            xa, residual = self.k.add_rms_norm_linear(x, residual, self.input_layernorm, self.eps, attn.w_xa)
            x = attn(xa, positions, cos_sin, meta, cache, xa=xa)
        else:
            if residual is None:
                residual, x = x, self.k.rms_norm(x, self.input_layernorm, self.eps)
            else:
                x, residual = self.k.add_rms_norm(x, residual, self.input_layernorm, self.eps)
            x = attn(x, positions, cos_sin, meta, cache)
        mlp = self.mlp
        if isinstance(mlp, MLP) and attn.fuse_kv_write and mlp.w13_scale_inv is None and \
                self.k.implements("add_rms_norm_linear"):  # a dense layer: the norm inside the w13 GEMV
            h13, residual = self.k.add_rms_norm_linear(x, residual, self.post_attention_layernorm, self.eps, mlp.w13)
            return mlp(h13, h13=h13), residual
        if isinstance(mlp, MoE) and mlp.fused_gate() and self.k.implements("add_rms_norm_moe_gate"):
            # the post-attention norm inside the router's launch (decode fusion)
            x, residual, weights, ids = self.k.add_rms_norm_moe_gate(
                x, residual, self.post_attention_layernorm, self.eps, *mlp.gate_args(), x.dtype)
            return mlp(x, routed=(weights, ids)), residual
        x, residual = self.k.add_rms_norm(x, residual, self.post_attention_layernorm, self.eps)
        return mlp(x), residual


class DeepseekForCausalLM(CausalLM):
    """The whole model. ``forward`` returns final hidden states; ``logits`` projects chosen rows.

    Its cache is one FULL group, "latent": per layer and token the normalised latent and the rope
    key (``kv_lora_rank + qk_rope_head_dim`` values)."""

    CACHE_GROUP = "latent"
    kv_cache_dtypes = ("auto", "bf16", "fp8")

    def __init__(self, k: Kernels, cfg: ModelConfig, max_positions: int | None = None, **moe_kw) -> None:
        super().__init__()
        self.k, self.cfg = k, cfg
        self.expert_range: tuple[int, int] | None = None
        if moe_kw:
            start = moe_kw.get("expert_start", 0)
            self.expert_range = (start, start + moe_kw.get("num_local", cfg.n_routed_experts))
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(k, cfg, i, **moe_kw) for i in range(cfg.num_hidden_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("cos_sin", rope_cache(cfg, max_positions or cfg.max_position_embeddings),
                             persistent=False)

    # ---- CausalLM ------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.from_dict(raw)

    @classmethod
    def create(cls, kernels: Kernels, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, expert_range: tuple[int, int] | None = None) -> DeepseekForCausalLM:
        from deepinfer_core.models.loader import build_model

        moe_kw = {} if expert_range is None else {"expert_start": expert_range[0],
                                                   "num_local": expert_range[1] - expert_range[0]}
        return build_model(kernels, cfg, dtype, device, max_positions, **moe_kw)

    fp8_weights = True  # load_weights(keep_fp8=True) keeps an FP8 checkpoint's GEMM weights in e4m3

    def load_weights(self, reader, keep_fp8: bool = False) -> None:
        from deepinfer_core.models.loader import assign_weights, iter_checkpoint

        assign_weights(self, iter_checkpoint(reader, self.cfg, self.embed_tokens.dtype, self.expert_range,
                                             keep_fp8=keep_fp8))

    def read_expert(self, reader, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed expert ``expert`` of MoE layer ``layer`` from the checkpoint, as one slot of the
        fused (w13, w2) parameters (elastic EP reloads the experts a dead rank held)."""
        from deepinfer_core.models.loader import iter_checkpoint

        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        parts = dict(iter_checkpoint(reader, self.cfg, self.embed_tokens.dtype, (expert, expert + 1), prefix))
        w13 = torch.cat((parts[prefix + "gate_proj.weight"], parts[prefix + "up_proj.weight"]))
        return w13.to(self.embed_tokens.device), parts[prefix + "down_proj.weight"].to(self.embed_tokens.device)

    def cache_layout(self) -> CacheLayout:
        """One FULL group "latent". ``kv_cache_dtype`` auto: ``kv_lora_rank + qk_rope_head_dim`` values of the
        model dtype (bf16: bfloat16), whose two parts a platform may store as two planes (FIA's MLA mode);
        fp8: one row of bytes per token, FlashMLA's FP8 layout (kernels_cpu/kv_fp8.py; 656 bytes for V3)."""
        cfg = self.cfg
        layers, L, R = tuple(range(cfg.num_hidden_layers)), cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if self.kv_cache_dtype == "fp8":
            if L % 16:
                raise ValueError(f"kv_cache_dtype 'fp8' needs kv_lora_rank to be a multiple of 16, got {L}")
            spec = KVCacheSpec(self.CACHE_GROUP, layers, kv_fp8.row_bytes(L, R), dtype=torch.uint8,
                               encoding=kv_fp8.ENCODING)
        else:
            dtype = torch.bfloat16 if self.kv_cache_dtype == "bf16" else None
            spec = KVCacheSpec(self.CACHE_GROUP, layers, cfg.kv_entry_dim, dtype=dtype, parts=(L, R))
        return CacheLayout((spec,))

    def moe_layers(self) -> dict[int, nn.Module]:
        return {layer.mlp.layer_idx: layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)}

    def post_load(self) -> None:
        for layer in self.layers:
            layer.self_attn.post_load()
            if isinstance(layer.mlp, MoE):
                layer.mlp.post_load()

    def set_decode_fusion(self, enabled: bool) -> None:
        """Decode fusion on (the default) or off: the router and shared experts by ``moe_gate`` and one routed
        ``fused_moe``, MLA's cache entry by ``mla_kv_write``, its decode query by ``mla_q_absorb`` and its
        attention with W_UV by ``mla_decode_uv``; or the unfused ops (to check one against the other). Graphs
        captured before keep the path they captured."""
        for layer in self.layers:
            layer.self_attn.fuse_kv_write = enabled
            if isinstance(layer.mlp, MoE):
                layer.mlp.fold_shared = enabled

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches) -> torch.Tensor:
        x = self.embed_tokens[input_ids]  # [T, C]
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches[self.CACHE_GROUP])):
            if meta.layer_ready is not None:
                for event in meta.layer_ready[i]:
                    event.wait()  # this layer's swapped-in KV blocks have landed
            x, residual = layer(x, residual, positions, self.cos_sin, meta, cache)
        x, _ = self.k.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, C] -> [R, vocab] float32."""
        return self.k.linear(hidden, self.lm_head).float()
