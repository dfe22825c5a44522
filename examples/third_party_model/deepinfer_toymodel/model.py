"""A tiny causal LM with sliding-window and full attention layers, over DeepInfer's paged caches.

Shapes: T tokens in the step, C hidden, H heads, D head dim, I MLP width, W sliding window.
Per layer: x += attn(rms(x)); x += mlp(rms(x)). Positions are a learned table added to the
embedding. A layer's cache entry per token is [k | v] (2·H·D values).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from deepinfer_core.kv_cache_spec import CacheLayout, KVCacheSpec
from deepinfer_core.models.config import ModelConfigError
from deepinfer_core.models.interface import CausalLM, KVCaches
from deepinfer_core.models.loader import CheckpointError
from deepinfer_core.models.metadata import AttentionMetadata

ARCH = "ToySlidingForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class ToyConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    layer_types: list[str]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class ToySlidingForCausalLM(CausalLM):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        C, HD, I = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size
        L = cfg.num_hidden_layers

        def p(*shape):
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.embed = p(cfg.vocab_size, C)
        self.pos_embed = p(cfg.max_position_embeddings, C)
        self.attn_norm, self.wqkv, self.wo = (nn.ParameterList(p(*s) for _ in range(L)) for s in ((C,), (3 * HD, C),
                                                                                                   (C, HD)))
        self.mlp_norm, self.w1, self.w3, self.w2 = (nn.ParameterList(p(*s) for _ in range(L))
                                                    for s in ((C,), (I, C), (I, C), (C, I)))
        self.norm = p(C)
        self.lm_head = p(cfg.vocab_size, C)

    # ---- CausalLM ------------------------------------------------------------------------
    @classmethod
    def parse_config(cls, raw: dict) -> ToyConfig:
        need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "intermediate_size", "sliding_window", "layer_types", "max_position_embeddings")
        missing = [k for k in need if k not in raw]
        if missing:
            raise ModelConfigError(f"config.json: {ARCH} needs {missing}")
        bad = [t for t in raw["layer_types"] if t not in LAYER_TYPES]
        if bad or len(raw["layer_types"]) != raw["num_hidden_layers"]:
            raise ModelConfigError(f"config.json: layer_types must be num_hidden_layers entries of {LAYER_TYPES}")
        eos = raw.get("eos_token_id")
        return ToyConfig(ARCH, raw["vocab_size"], raw["hidden_size"], raw["num_hidden_layers"],
                         raw["num_attention_heads"], raw["head_dim"], raw["intermediate_size"], raw["sliding_window"],
                         list(raw["layer_types"]), raw["max_position_embeddings"], raw.get("rms_norm_eps", 1e-6),
                         raw.get("bos_token_id"), [] if eos is None else ([eos] if isinstance(eos, int) else eos), raw)

    @classmethod
    def create(cls, kernels, cfg: ToyConfig, dtype, device, max_positions, expert_range=None):
        with torch.device(device):
            return cls(cfg).to(dtype)

    def load_weights(self, reader) -> None:
        names = reader.names()
        for name, param in self.named_parameters():
            if name not in names:
                raise CheckpointError(f"checkpoint is missing tensor {name!r}")
            t = reader.get(name)
            if tuple(t.shape) != tuple(param.shape):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(t)

    def cache_layout(self) -> CacheLayout:
        cfg = self.cfg
        dim = 2 * cfg.num_attention_heads * cfg.head_dim
        swa = tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
        full = tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        groups = []
        if swa:
            groups.append(KVCacheSpec("swa", swa, dim, window=cfg.sliding_window))
        if full:
            groups.append(KVCacheSpec("full", full, dim))
        return CacheLayout(tuple(groups))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed[input_ids] + self.pos_embed[positions]
        where = {layer: (g.name, j) for g in self.cache_layout().groups for j, layer in enumerate(g.layers)}
        for i in range(cfg.num_hidden_layers):
            name, j = where[i]
            window = cfg.sliding_window if name == "swa" else None
            h = _rms(x, self.attn_norm[i], cfg.rms_norm_eps)
            q, k, v = (h @ self.wqkv[i].T).chunk(3, dim=-1)
            x = x + self._paged_attention(q, k, v, positions, meta, name, kv_caches[name][j], window) @ self.wo[i].T
            h = _rms(x, self.mlp_norm[i], cfg.rms_norm_eps)
            x = x + (torch.nn.functional.silu(h @ self.w1[i].T) * (h @ self.w3[i].T)) @ self.w2[i].T
        return _rms(x, self.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()

    # ---- attention over the paged cache ---------------------------------------------------------
    def _paged_attention(self, q, k, v, positions, meta, group: str, cache: torch.Tensor, window: int | None):
        """Write this step's [k | v] entries, then attend each query over its (windowed) causal context,
        read back from the cache through the group's block table."""
        H, D = self.cfg.num_attention_heads, self.cfg.head_dim
        gm = meta.groups[group]
        flat = cache.view(-1, cache.shape[-1])
        keep = gm.slot_mapping >= 0
        flat[gm.slot_mapping[keep]] = torch.cat((k, v), -1)[keep].to(cache.dtype)
        bs = cache.shape[1]
        out = torch.empty_like(q)
        cu, lens = meta.cu_q_lens.tolist(), meta.seq_lens.tolist()
        for b in range(len(lens)):
            rows = slice(cu[b], cu[b + 1])
            first, last = lens[b] - (cu[b + 1] - cu[b]), lens[b]
            lo = 0 if window is None else max(0, first - window + 1)
            pos = torch.arange(lo, last)
            blocks = gm.block_tables[b, pos // bs].long()
            if bool((blocks < 0).any()):
                raise RuntimeError(f"group {group!r}: read a freed block (positions {lo}..{last - 1})")
            kv = flat[blocks * bs + pos % bs].float()  # [S, 2HD]
            keys, vals = kv.view(-1, 2, H, D).unbind(1)
            qp = positions[rows, None]
            mask = pos[None, :] <= qp
            if window is not None:
                mask &= pos[None, :] > qp - window
            scores = torch.einsum("thd,shd->hts", q[rows].float().view(-1, H, D), keys) * D**-0.5
            probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
            out[rows] = torch.einsum("hts,shd->thd", probs, vals).reshape(-1, H * D).to(q.dtype)
        return out

    # ---- the reference: the same model over one whole sequence, no cache -----------------------
    @torch.no_grad()
    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32 logits of one sequence from scratch."""
        cfg = self.cfg
        H, D, T = cfg.num_attention_heads, cfg.head_dim, len(ids)
        t = torch.tensor(ids)
        pos = torch.arange(T)
        x = self.embed[t] + self.pos_embed[pos]
        causal = pos[None, :] <= pos[:, None]
        for i, kind in enumerate(cfg.layer_types):
            mask = causal
            if kind == "sliding_attention":
                mask = causal & (pos[None, :] > pos[:, None] - cfg.sliding_window)
            h = _rms(x, self.attn_norm[i], cfg.rms_norm_eps)
            q, k, v = (h @ self.wqkv[i].T).view(T, 3, H, D).unbind(1)
            scores = torch.einsum("thd,shd->hts", q, k) * D**-0.5
            a = torch.einsum("hts,shd->thd", scores.masked_fill(~mask[None], float("-inf")).softmax(-1), v)
            x = x + a.reshape(T, H * D) @ self.wo[i].T
            h = _rms(x, self.mlp_norm[i], cfg.rms_norm_eps)
            x = x + (torch.nn.functional.silu(h @ self.w1[i].T) * (h @ self.w3[i].T)) @ self.w2[i].T
        return self.logits(_rms(x, self.norm, cfg.rms_norm_eps))


def write_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """A random checkpoint (config.json + model.safetensors) of this architecture; no tokenizer."""
    from safetensors.torch import save_file

    raw = dict(architectures=[ARCH], vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
               head_dim=8, intermediate_size=48, sliding_window=8, max_position_embeddings=512,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"], bos_token_id=0,
               eos_token_id=1)
    raw.update(overrides)
    model = ToySlidingForCausalLM(ToySlidingForCausalLM.parse_config(raw))
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.data = noise * 0.3 if p.dim() > 1 else 1.0 + noise * 0.1
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: p.data.contiguous() for n, p in model.named_parameters()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path
