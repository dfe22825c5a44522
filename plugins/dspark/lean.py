"""A lean decode path for a draft model: few, large ops per draft step.

The draft's generic forward builds attention metadata and runs the model's modules (~100 small ops
per step, so at batch 1 its time is mostly dispatch). Here the weights are folded once at load:

- ``q_a_proj`` and ``kv_a_proj_with_mqa`` read the same input: one GEMM;
- W_UK is folded into ``q_b_proj`` (absorbed MLA), and the softmax scale with it: one GEMM gives
  the absorbed query [latent part | rope part];
- W_UV is folded into ``o_proj``: one GEMM from the attention's latent output to the hidden state.

Every query token t attends over the context slots ``ctx_slots[t, :S]`` masked to positions
``<= positions[t]``, so catch-up spans of several tokens per request work as well as single-token
draft steps. MoE layers use the model's own MoE module. Results equal the generic forward up to
float rounding (``tests/test_dspark.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.models.deepseek import DeepseekForCausalLM


def context_slot_table(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, W] block tables -> [R, W * block_size] flat cache slot of every position."""
    R, W = block_tables.shape
    offs = torch.arange(block_size, device=block_tables.device)
    return (block_tables.long()[:, :, None] * block_size + offs).reshape(R, W * block_size)


class _LeanLayer:
    def __init__(self, layer) -> None:
        a = layer.self_attn
        cfg = a.cfg
        H, L, R, N = a.H, a.L, a.R, a.N
        self.H, self.L, self.R = H, L, R
        self.ln1, self.ln2, self.eps = layer.input_layernorm, layer.post_attention_layernorm, layer.eps
        self.q_lora = cfg.q_lora_rank
        if self.q_lora is None:
            wq, in_dim = a.q_proj, cfg.hidden_size
        else:
            wq, in_dim = a.q_b_proj, cfg.q_lora_rank
            self.q_ln = a.q_a_layernorm.weight
        wq = wq.detach().float().view(H, N + R, in_dim)
        q_lat = torch.einsum("hln,hnc->hlc", a.w_uk.float(), wq[:, :N])  # [H, L, in]
        q_pe = wq[:, N:]  # [H, R, in]
        dt = a.kv_b_proj.dtype
        self.w_q = (torch.cat((q_lat.reshape(H * L, in_dim), q_pe.reshape(H * R, in_dim))) * a.scale).to(dt)
        kv_a = a.kv_a_proj_with_mqa.detach()
        self.kv_ln = a.kv_a_layernorm.weight
        if self.q_lora is None:  # the query's input is the layer input: fold it into the same GEMM
            self.w_in = torch.cat((self.w_q, kv_a))
            self.split = [H * L, H * R, L, R]
        else:
            self.w_in = torch.cat((a.q_a_proj.detach(), kv_a))
            self.split = [self.q_lora, L, R]
        C = a.o_proj.shape[0]
        V = a.V
        self.w_o = torch.einsum("chv,hvl->chl", a.o_proj.detach().float().view(C, H, V),
                                a.w_uv.float()).reshape(C, H * L).to(dt)
        self.mlp = layer.mlp


class LeanDecoder:
    """Decode-only forward of a ``DeepseekForCausalLM`` draft over its own paged caches (or, with
    ``layers``/``cos_sin``/``eps`` given, of those decoder layers alone: an MTP layer)."""

    def __init__(self, model: DeepseekForCausalLM | None, layers=None, cos_sin: torch.Tensor | None = None,
                 eps: float | None = None) -> None:
        self.model = model
        self.k = model.k if model is not None else layers[0].k
        self.layers = [_LeanLayer(layer) for layer in (model.layers if model is not None else layers)]
        self.cos_sin = model.cos_sin if model is not None else cos_sin
        self.eps = model.cfg.rms_norm_eps if model is not None else eps

    def apply_layout(self, layout) -> None:
        """Re-lay the folded GEMM weights with a ``Platform.linear_weight_layout``."""
        for lay in self.layers:
            lay.w_in, lay.w_q, lay.w_o = layout(lay.w_in), layout(lay.w_q), layout(lay.w_o)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                ctx_slots: torch.Tensor, caches: list[torch.Tensor], masked: bool = True) -> torch.Tensor:
        """ids/positions/write_slots [T] (a slot < 0 writes nothing), ctx_slots [T, S] with
        S > max(positions): the cache slot of each of the token's context positions. ``masked=False``
        only when every token's position is S - 1. Returns the final normalised hidden states [T, C]."""
        x, residual = self.run_layers(F.embedding(ids, self.model.embed_tokens), positions, write_slots, ctx_slots,
                                      caches, masked)
        x, _ = self.k.add_rms_norm(x, residual, self.model.norm, self.eps)
        return x

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                   ctx_slots: torch.Tensor, caches: list[torch.Tensor], masked: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over inputs ``x`` [T, C] (as ``forward``); returns (x, residual) of the last."""
        k = self.k
        T, S = ctx_slots.shape
        mask = None
        if masked:
            ar = torch.arange(S, device=x.device)
            mask = torch.zeros(T, 1, S, dtype=torch.float32, device=x.device).masked_fill_(
                (ar[None, :] > positions[:, None])[:, None, :], float("-inf"))
        residual = None
        for lay, cache in zip(self.layers, caches):
            if residual is None:
                residual, h = x, k.rms_norm(x, lay.ln1, lay.eps)
            else:
                h, residual = k.add_rms_norm(x, residual, lay.ln1, lay.eps)
            H, L, R = lay.H, lay.L, lay.R
            parts = k.linear(h, lay.w_in).split(lay.split, dim=-1)
            if lay.q_lora is None:
                q_lat, q_pe, latent, k_pe = parts
            else:
                q_a, latent, k_pe = parts
                q_lat, q_pe = k.linear(k.rms_norm(q_a, lay.q_ln, 1e-6), lay.w_q).split([H * L, H * R], dim=-1)
            pe = k.rope(torch.cat((q_pe.reshape(T, H, R), k_pe[:, None]), dim=1), positions, self.cos_sin)
            entry = torch.cat((k.rms_norm(latent, lay.kv_ln, 1e-6), pe[:, H]), dim=-1)  # [T, L + R]
            k.paged_kv_write(cache, write_slots, entry)
            q = torch.cat((q_lat.reshape(T, H, L), pe[:, :H]), dim=-1).float()  # [T, H, L + R]
            kv = cache.view(-1, L + R).index_select(0, ctx_slots.reshape(-1)).view(T, S, L + R).float()
            scores = torch.bmm(q, kv.transpose(1, 2))
            if mask is not None:
                scores = scores + mask
            o = torch.bmm(scores.softmax(-1), kv[..., :L])  # [T, H, L]
            x = k.linear(o.reshape(T, H * L).to(h.dtype), lay.w_o)
            h, residual = k.add_rms_norm(x, residual, lay.ln2, lay.eps)
            x = lay.mlp(h)
        return x, residual
