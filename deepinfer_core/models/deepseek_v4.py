"""DeepSeek-V4 for inference (``../shared/V4.md``): one shared K=V head with a sliding window on every
layer, compressed attention (CSA: an entry per m tokens chosen by a lightning indexer; HCA: an entry per
m' tokens, all attended), attention sinks, mHC residual streams, and hash-routed / learned MoE.

Shapes: T tokens in the step, B sequences, C hidden, n mHC streams, H heads, D head dim, R rope dims
(the last R of a head), Dq q_lora_rank, HI/DI indexer heads/dim, E experts, I expert width.

Every query token reads its keys from the paged caches after this step's tokens are written, so
prefill chunks and decode tokens take one path; nothing before the step is recomputed. Cache groups
(:meth:`DeepseekV4ForCausalLM.cache_layout`):

* ``swa``: every layer, per token the normed, roped K=V [D]; window W.
* ``csa``: CSA layers, one entry per m tokens: [compressed K=V D | indexer key DI].
* ``hca``: HCA layers, one entry per m' tokens: compressed K=V [D].
* ``csa_state`` / ``hca_state``: the raw per-token compressor inputs (float32) a closing window pools:
  CSA [kv 2D | gate 2D | index kv 2DI | index gate 2DI] over a window of 2m tokens (overlapped
  windows), HCA [kv D | gate D] over m' tokens. Chunk boundaries, preemption and prefix hits need no
  per-request state beyond these blocks.

An entry is written by the token that closes its window (the engine gives the group's slot mapping
only to those tokens, -1 elsewhere). Every write is addressed by token position, so rejected
speculative tokens need no rollback: feeding the right token at a position again redoes its writes
before anything reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.kernels import Kernels
from deepinfer_core.kv_cache_spec import CacheLayout, KVCacheSpec
from deepinfer_core.models.config_v4 import CSA, HASH_MOE, HCA, SWA, V4Config
from deepinfer_core.models.interface import CausalLM, KVCaches
from deepinfer_core.models.metadata import AttentionMetadata
from deepinfer_core.models.rope import _yarn_inv_freq


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _f32(*shape: int) -> nn.Parameter:
    """Kept in float32 whatever the model dtype (norms, mHC, sinks, gates, compressor inputs), as the
    reference does."""
    return _param(*shape, dtype=torch.float32)


def rope_table(dim: int, theta: float, max_positions: int, rope: dict | None = None) -> torch.Tensor:
    """[max_positions, dim] ``[cos | sin]``; YaRN frequencies when ``rope`` says so, never scaled."""
    if rope and rope.get("rope_type") == "yarn":
        inv_freq, _ = _yarn_inv_freq(dim, theta, rope)
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


#: new tokens per sequence up to which a prefill-free step takes the host-synchronisation-free decode path
DECODE_MAX_Q = 16


@dataclass
class Step:
    """Per-step views shared by every layer."""

    positions: torch.Tensor  # [T] int64
    seq_idx: torch.Tensor  # [T] int64: the token's row in the block tables
    meta: AttentionMetadata

    @property
    def decode(self) -> bool:
        """A decode step (no prompt chunk, at most :data:`DECODE_MAX_Q` tokens per sequence: speculative
        verification included): few tokens, and its path must not synchronise with the host (decode
        steps are captured as device graphs)."""
        d = self.meta.decode
        return self.meta.prefill is None and (d is None or d.max_q_len <= DECODE_MAX_Q)

    def tables(self, group: str) -> torch.Tensor:
        return self.meta.groups[group].block_tables

    def slots(self, group: str) -> torch.Tensor:
        return self.meta.groups[group].slot_mapping


def _rope_tail(k: Kernels, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rope the last R channels of x[T, N, Dx]."""
    R = cos_sin.shape[-1]
    rot = (k.rope_inverse if inverse else k.rope)(x[..., -R:], positions, cos_sin)
    return torch.cat((x[..., :-R], rot), dim=-1)


class Compressor(nn.Module):
    """Gated pooling of ``rate`` tokens into one entry of ``dim``; overlapped (CSA) windows use 2·dim
    wide projections: [:dim] feeds the next window (Ca), [dim:] the current one (Cb)."""

    def __init__(self, k: Kernels, cfg: V4Config, dim: int, rate: int, overlap: bool) -> None:
        super().__init__()
        self.k, self.dim, self.rate = k, dim, rate
        width = 2 * dim if overlap else dim
        self.wkv, self.wgate = _f32(width, cfg.hidden_size), _f32(width, cfg.hidden_size)
        self.ape = _f32(rate, width)
        self.norm = _f32(dim)
        self.state_dim = 2 * width  # [kv | gate] per token

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x[T, C] -> raw per-token [kv | gate] [T, state_dim] float32 (float32 x: no conversion launch)."""
        xf = x.float()
        return torch.cat((self.k.linear(xf, self.wkv), self.k.linear(xf, self.wgate)), dim=-1)

    def compress(self, state: torch.Tensor, step: Step, group: str, close: torch.Tensor | None, col: int,
                 eps: float, cos_sin: torch.Tensor) -> torch.Tensor:
        """Entries [N, dim] for the closing tokens ``close`` [N] (indices into the step); None: every token
        of the step (rows of tokens that close nothing are garbage, and never stored)."""
        seq_idx, pos = (step.seq_idx, step.positions) if close is None else (step.seq_idx[close], step.positions[close])
        return self.k.v4_compress(state, step.tables(group), seq_idx, pos, self.ape, self.norm, eps, cos_sin, col)


class Attention(nn.Module):
    def __init__(self, k: Kernels, cfg: V4Config, i: int) -> None:
        super().__init__()
        self.k, self.cfg, self.kind = k, cfg, cfg.layer_types[i]
        C, H, D, Dq = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
        g, dg = cfg.o_groups, cfg.o_lora_rank
        self.H, self.D, self.g = H, D, g
        self.wq_a, self.q_norm, self.wq_b = _param(Dq, C), _f32(Dq), _param(H * D, Dq)
        self.wkv, self.kv_norm = _param(D, C), _f32(D)
        self.wo_a = _param(g * dg, H * D // g)  # grouped: group j maps its H*D/g channels to dg
        self.wo_b = _param(C, g * dg)
        self.attn_sink = _f32(H)
        self.register_buffer("ones", torch.ones(D), persistent=False)  # per-head unweighted q norm
        self.compressor = self.indexer = None
        if self.kind == CSA:
            self.compressor = Compressor(k, cfg, D, cfg.compress_csa, overlap=True)
            self.indexer = Indexer(k, cfg)
        elif self.kind == HCA:
            self.compressor = Compressor(k, cfg, D, cfg.compress_hca, overlap=False)

    def forward(self, x: torch.Tensor, step: Step, cos_sin: torch.Tensor, caches: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        k, cfg, T, H, D, eps = self.k, self.cfg, x.shape[0], self.H, self.D, self.cfg.rms_norm_eps
        pos = step.positions
        qr = k.rms_norm(k.linear(x, self.wq_a), self.q_norm, eps)  # [T, Dq], also the indexer's input
        q = k.rms_norm(k.linear(qr, self.wq_b).view(T * H, D), self.ones, eps).view(T, H, D)
        q = _rope_tail(k, q, pos, cos_sin)  # [T, H, D]
        kv = k.rms_norm(k.linear(x, self.wkv), self.kv_norm, eps)
        kv = _rope_tail(k, kv[:, None], pos, cos_sin)[:, 0]  # [T, D], K == V
        k.paged_kv_write(caches["swa"], step.slots("swa"), kv)

        comp_cache = comp_tables = comp_ids = None
        if self.kind != SWA:
            comp_cache, comp_tables, comp_ids = self._compressed_keys(x, qr, step, cos_sin, caches)
        o = k.v4_sparse_attention(q, caches["swa"], step.tables("swa"), comp_cache, comp_tables, comp_ids,
                                  step.seq_idx, pos, cfg.sliding_window, self.attn_sink, D**-0.5)  # [T, H, D]
        o = _rope_tail(k, o, pos, cos_sin, inverse=True)  # undo the rope V carried
        o = k.head_linear(o.reshape(T, self.g, H * D // self.g), self.wo_a.view(self.g, -1, H * D // self.g))
        return k.linear(o.reshape(T, self.wo_b.shape[1]), self.wo_b)  # [T, C]

    def _compressed_keys(self, x: torch.Tensor, qr: torch.Tensor, step: Step, cos_sin: torch.Tensor,
                         caches: dict[str, torch.Tensor]):
        """Store this step's compressor inputs, write the entries its tokens close, and choose each
        token's entries: (cache [NB, EPB, D(+DI)], block tables, ids [T, K], -1 = none)."""
        k, cfg, D, T, pos = self.k, self.cfg, self.D, x.shape[0], step.positions
        group = "csa" if self.kind == CSA else "hca"
        state_group, comp_cache, comp_tables = group + "_state", caches[group], step.tables(group)
        state = caches[state_group]
        xf = x.float()  # once: the compressors and the indexer's head weights all read float32 x
        inputs = self.compressor.inputs(xf)
        if self.indexer is not None:
            inputs = torch.cat((inputs, self.indexer.compressor.inputs(xf)), dim=-1)
        k.paged_kv_write(state, step.slots(state_group), inputs)  # [T, state row]
        close_slots = step.slots(group)
        # decode steps (a few tokens) compress every token and never ask the host which close a window:
        # no synchronisation, so they can be captured in a device graph; prefill chunks pick the closers
        close = None if step.decode else (close_slots >= 0).nonzero().flatten()
        if close is None or close.numel():
            eps = cfg.rms_norm_eps
            entry = self.compressor.compress(state, step, state_group, close, 0, eps, cos_sin)
            if self.indexer is not None:
                ikey = self.indexer.compressor.compress(state, step, state_group, close, self.compressor.state_dim,
                                                        eps, cos_sin)
                entry = torch.cat((entry, ikey), dim=-1)  # [N, D + DI]
            k.paged_kv_write(comp_cache, close_slots if close is None else close_slots[close], entry)
        if self.indexer is not None:  # CSA: the indexer's top-k
            comp_ids = self.indexer(xf, qr, step, comp_cache[..., D:], comp_tables, cos_sin)
        else:  # HCA: every closed entry (decode: up to the block tables' capacity, a shape-only bound)
            visible = (pos + 1) // cfg.compress_hca
            n = comp_tables.shape[1] * comp_cache.shape[1] if step.decode else (int(visible.max()) if T else 0)
            ids = torch.arange(n, device=x.device).expand(T, -1)
            comp_ids = torch.where(ids < visible[:, None], ids, torch.full_like(ids, -1))
        return comp_cache, comp_tables, comp_ids


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own overlapped compressor at DI, scored per query head."""

    def __init__(self, k: Kernels, cfg: V4Config) -> None:
        super().__init__()
        self.k, self.cfg = k, cfg
        HI, DI = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = _param(HI * DI, cfg.q_lora_rank)
        self.weights_proj = _f32(HI, cfg.hidden_size)
        self.compressor = Compressor(k, cfg, DI, cfg.compress_csa, overlap=True)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, step: Step, keys: torch.Tensor, tables: torch.Tensor,
                cos_sin: torch.Tensor) -> torch.Tensor:
        k, cfg, T = self.k, self.cfg, x.shape[0]
        HI, DI = cfg.index_n_heads, cfg.index_head_dim
        q = _rope_tail(k, k.linear(qr, self.wq_b).view(T, HI, DI), step.positions, cos_sin)  # [T, HI, DI]
        w = k.linear(x.float(), self.weights_proj) * HI**-0.5  # [T, HI] (x arrives in float32)
        return k.v4_indexer_topk(q, w, keys, tables, step.seq_idx, step.positions, cfg.compress_csa,
                                 cfg.index_topk, DI**-0.5)  # [T, index_topk]


class MoE(nn.Module):
    """Routed experts [expert_start, expert_start + E) of this rank plus the one shared expert."""

    def __init__(self, k: Kernels, cfg: V4Config, i: int, expert_range: tuple[int, int] | None) -> None:
        super().__init__()
        self.k, self.cfg, self.layer_idx = k, cfg, i
        lo, hi = expert_range or (0, cfg.n_routed_experts)
        self.expert_start, self.num_local = lo, hi - lo
        C, I, E = cfg.hidden_size, cfg.moe_intermediate_size, hi - lo
        self.is_hash = cfg.mlp_layer_types[i] == HASH_MOE
        self.gate = _f32(cfg.n_routed_experts, C)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = _f32(cfg.n_routed_experts)  # e_score_correction_bias: selection only
        self.w13 = _param(E, 2 * I, C)  # [w1 (gate); w3 (up)]
        self.w2 = _param(E, C, I)
        self.shared_w13, self.shared_w2 = _param(2 * I, C), _param(C, I)
        self.route_hook = None  # set by the engine (ModelRunner.set_route_hook), as on the V2/V3 MoE
        self.expert_parallel = None  # set by the expert-parallel worker (parallel.ExpertParallel)

    def local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over this rank's experts (others skipped)."""
        local = ids - self.expert_start if self.expert_start else ids
        return self.k.fused_moe_clamped(x, self.w13, self.w2, weights, local, self.cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        k, cfg = self.k, self.cfg
        logits = k.linear(x.float(), self.gate)  # [T, E] float32
        hash_ids = self.tid2eid[input_ids] if self.is_hash else None
        weights, ids = k.moe_route_v4(logits, self.bias, hash_ids, cfg.num_experts_per_tok, cfg.scoring_func,
                                      cfg.routed_scaling_factor)
        if self.route_hook is not None:  # EPLB: logical -> physical experts, load counts
            weights, ids = self.route_hook(self.layer_idx, weights, ids)
        if self.expert_parallel is not None:
            out = self.expert_parallel.run(self, x, weights, ids)
        elif self.num_local != cfg.n_routed_experts:
            raise RuntimeError(f"MoE layer {self.layer_idx} holds experts [{self.expert_start}, "
                               f"{self.expert_start + self.num_local}) of {cfg.n_routed_experts} but has no "
                               "expert-parallel dispatch")
        else:
            out = self.local_experts(x, weights.to(x.dtype), ids)
        shared = k.linear(k.silu_and_mul_clamped(k.linear(x, self.shared_w13), cfg.swiglu_limit), self.shared_w2)
        return out + shared


class HyperConnection(nn.Module):
    """mHC weights of one sub-block: fn [(2+n)n, nC], base [(2+n)n], scale [3]."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.fn, self.base, self.scale = _f32((2 + n) * n, n * cfg.hidden_size), _f32((2 + n) * n), _f32(3)


class Block(nn.Module):
    def __init__(self, k: Kernels, cfg: V4Config, i: int, expert_range: tuple[int, int] | None) -> None:
        super().__init__()
        self.k, self.cfg = k, cfg
        self.attn_norm, self.ffn_norm = _f32(cfg.hidden_size), _f32(cfg.hidden_size)
        self.hc_attn, self.hc_ffn = HyperConnection(cfg), HyperConnection(cfg)
        self.attn = Attention(k, cfg, i)
        self.ffn = MoE(k, cfg, i, expert_range)
        self.rope = "main" if cfg.layer_types[i] == SWA else "compress"

    def _pre(self, h: torch.Tensor, hc: HyperConnection):
        c = self.cfg
        return self.k.mhc_pre(h, hc.fn, hc.base, hc.scale, c.hc_sinkhorn_iters, c.rms_norm_eps, c.hc_eps)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, step: Step, cos_sin: torch.Tensor,
                caches: dict[str, torch.Tensor]) -> torch.Tensor:
        k, eps = self.k, self.cfg.rms_norm_eps
        x, post, comb = self._pre(h, self.hc_attn)  # h [T, n, C] -> x [T, C]
        h = k.mhc_post(self.attn(k.rms_norm(x, self.attn_norm, eps), step, cos_sin, caches), h, post, comb)
        x, post, comb = self._pre(h, self.hc_ffn)
        return k.mhc_post(self.ffn(k.rms_norm(x, self.ffn_norm, eps), input_ids), h, post, comb)


def cache_layout(cfg: V4Config) -> CacheLayout:
    """The cache groups of a V4 model of this config (module docstring); no weights needed."""
    D, DI, m, m2 = cfg.head_dim, cfg.index_head_dim, cfg.compress_csa, cfg.compress_hca
    csa, hca = cfg.layers_of(CSA), cfg.layers_of(HCA)
    groups = [KVCacheSpec("swa", tuple(range(cfg.num_hidden_layers)), D, window=cfg.sliding_window)]
    multiple = 1
    if csa:
        groups.append(KVCacheSpec("csa", csa, D + DI, tokens_per_entry=m))
        # a resume at a block boundary needs the last m tokens' Ca inputs: cacheable
        groups.append(KVCacheSpec("csa_state", csa, 4 * D + 4 * DI, window=2 * m, dtype=torch.float32))
        multiple = math.lcm(multiple, m)
    if hca:
        groups.append(KVCacheSpec("hca", hca, D, tokens_per_entry=m2))
        # block boundaries close every HCA window, so a resume never reads earlier state
        groups.append(KVCacheSpec("hca_state", hca, 2 * D, window=m2, dtype=torch.float32, prefix_cacheable=False))
        multiple = math.lcm(multiple, m2)
    return CacheLayout(tuple(groups), block_size_multiple=multiple)


class DeepseekV4ForCausalLM(CausalLM):
    """The whole model. ``forward`` returns final hidden states; ``logits`` projects chosen rows.
    ``mtp`` holds the checkpoint's ``mtp.0.*`` tensors (for DSpark drafting; not run here)."""

    def __init__(self, k: Kernels, cfg: V4Config, max_positions: int | None = None,
                 expert_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.k, self.cfg = k, cfg
        C, n = cfg.hidden_size, cfg.hc_mult
        self.expert_range = expert_range
        self.embed = _param(cfg.vocab_size, C)
        self.layers = nn.ModuleList(Block(k, cfg, i, expert_range) for i in range(cfg.num_hidden_layers))
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _f32(n, n * C), _f32(n), _f32(1)
        self.norm = _f32(C)
        self.head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, C)
        self.mtp = nn.ParameterDict()  # checkpoint name with '.' -> '/' : tensor
        P = max_positions or cfg.max_position_embeddings
        c = cfg.compress_rope
        self.register_buffer("cos_sin_main", rope_table(cfg.rope_dim, cfg.rope_theta, P), persistent=False)
        self.register_buffer("cos_sin_compress", rope_table(cfg.rope_dim, c["rope_theta"], P, c), persistent=False)
        # group name -> {layer index: position in the group's cache list}
        self._group_index = {g.name: {layer: j for j, layer in enumerate(g.layers)} for g in self.cache_layout().groups}

    # ---- CausalLM -------------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, raw: dict) -> V4Config:
        return V4Config.from_dict(raw)

    @classmethod
    def create(cls, kernels: Kernels, cfg: V4Config, dtype: torch.dtype, device: torch.device,
               max_positions: int, expert_range: tuple[int, int] | None = None) -> DeepseekV4ForCausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return cls(kernels, cfg, max_positions, expert_range)
        finally:
            torch.set_default_dtype(previous)

    def load_weights(self, reader) -> None:
        from deepinfer_core.models.v4_weights import load_v4_weights

        load_v4_weights(self, reader)

    def read_expert(self, reader, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed expert ``expert`` of layer ``layer`` from the checkpoint (FP4/FP8 dequantised), as one
        slot of the fused (w13, w2) parameters (elastic EP reloads the experts a dead rank held)."""
        from deepinfer_core.models.v4_weights import read_v4_expert

        return read_v4_expert(self, reader, layer, expert)

    def cache_layout(self) -> CacheLayout:
        return cache_layout(self.cfg)

    def moe_layers(self) -> dict[int, nn.Module]:
        return {layer.ffn.layer_idx: layer.ffn for layer in self.layers}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches) -> torch.Tensor:
        if meta.groups is None or meta.cu_q_lens is None:
            raise ValueError("DeepSeek-V4 needs per-group attention metadata (AttentionMetadata.groups, cu_q_lens)")
        for name, idx in self._group_index.items():
            if name not in meta.groups or len(kv_caches.get(name, ())) != len(idx):
                raise ValueError(f"DeepSeek-V4 cache group {name!r}: expected metadata and {len(idx)} cache "
                                 f"tensor(s), got {name in meta.groups} and {len(kv_caches.get(name, ()))}")
        T, cfg = input_ids.shape[0], self.cfg
        q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
        seq_idx = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=input_ids.device), q_lens,
                                          output_size=T)
        step = Step(positions=positions, seq_idx=seq_idx, meta=meta)
        h = self.embed[input_ids][:, None, :].expand(T, cfg.hc_mult, cfg.hidden_size).contiguous()  # [T, n, C]
        for i, layer in enumerate(self.layers):
            if meta.layer_ready is not None:
                for event in meta.layer_ready[i]:
                    event.wait()
            caches = {g: kv_caches[g][idx[i]] for g, idx in self._group_index.items() if i in idx}
            cos_sin = self.cos_sin_main if layer.rope == "main" else self.cos_sin_compress
            h = layer(h, input_ids, step, cos_sin, caches)
        x = self.k.mhc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.rms_norm_eps, cfg.hc_eps)
        return self.k.rms_norm(x, self.norm, cfg.rms_norm_eps)  # [T, C]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.k.linear(hidden, self.head).float()
