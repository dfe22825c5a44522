"""DeepSeek-V4 checkpoint loading: tensor names and dequantisation.

Names (``../shared/V4.md`` §4): the official checkpoints (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``hc_head_fn``, ``mtp.0.*``, ...) and transformers' ``save_pretrained`` output (the same names under a
``model.`` prefix, with ``model.embed_tokens.weight`` and ``model.hc_head.hc_{fn,base,scale}``) are both
accepted. Quantised tensors are dequantised at load:

* FP8 e4m3 linears with a ``.scale`` (ue8m0, ``F8_E8M0``, or float32) per 128x128 block;
* FP4 e2m1 experts packed two per int8 byte (low nibble = even column) with a ue8m0 ``.scale`` per 32
  columns: weight ``[N, K/2]`` int8, scale ``[N, K/32]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from deepinfer_core.models.loader import (
    FP8_BLOCK,
    CheckpointError,
    SafetensorsReader,
    check_weight_dtype,
    checked_scale,
    dequantize_fp8,
)

FP4_GROUP = 32
#: e2m1 code -> value (bit 3 is the sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """FP4 e2m1 ``[N, K/2]`` (two codes per byte, low nibble first) times a scale per ``group`` columns."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # [N, K]
    w = E2M1_VALUES[codes]
    return w * scale.float().repeat_interleave(group, dim=-1)[..., : w.shape[-1]]


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (int8 ``[N, K/2]``, e8m0 ``[N, K/group]``): round to the nearest e2m1 value after a
    power-of-two scale per group (test checkpoints)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"quantize_fp4: {K} columns are not a multiple of the scale group {group}")
    g = w.float().view(N, K // group, group)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # largest |x| / scale <= 6
    q = (g / scale[..., None]).reshape(N, K)
    codes = (q[..., None] - E2M1_VALUES[None, None, :]).abs().argmin(-1)  # nearest value (sign included)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``[N, K]`` -> (e4m3 ``[N, K]``, e8m0 scale ``[ceil(N/128), ceil(K/128)]``) (test checkpoints)."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    pad = torch.zeros(nb * block, kb * block)
    pad[:N, :K] = w.float()
    tiles = pad.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (tiles / scale[:, None, :, None]).view(nb * block, kb * block)[:N, :K]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


class V4Names:
    """Canonical (official) tensor name -> the name this checkpoint uses."""

    def __init__(self, reader: SafetensorsReader) -> None:
        self.reader = reader
        self.used: set[str] = set()
        self.by_canonical: dict[str, str] = {}
        for name in reader.names():
            self.by_canonical.setdefault(self.canonical(name), name)

    @staticmethod
    def canonical(name: str) -> str:
        if name == "lm_head.weight":
            return "head.weight"
        if name.startswith("model."):
            name = name.removeprefix("model.")
            name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                    "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        return name

    def has(self, canonical: str) -> bool:
        return canonical in self.by_canonical

    def get(self, canonical: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor, shape-checked and dequantised to float32 (int tensors as they are)."""
        if canonical not in self.by_canonical:
            raise CheckpointError(f"checkpoint is missing tensor {canonical!r}")
        name = self.by_canonical[canonical]
        t = self.reader.get(name)
        stem = canonical.removesuffix(".weight")
        scale_name = next((s for s in (stem + ".scale", canonical + "_scale_inv") if s in self.by_canonical), None)
        self.used.add(canonical)
        if scale_name is not None:
            self.used.add(scale_name)
        if t.dtype == torch.float8_e4m3fn:
            if scale_name is None:
                raise CheckpointError(f"FP8 tensor {name!r} has no block scale ({stem}.scale)")
            self._check(name, t, shape)
            sname = self.by_canonical[scale_name]
            tiles = tuple(-(-n // FP8_BLOCK) for n in shape)
            scale = checked_scale(sname, self.reader.get(sname), tiles,
                                  f"one scale per {FP8_BLOCK}x{FP8_BLOCK} tile of {name!r}")
            return dequantize_fp8(t, scale)
        if t.dtype in (torch.int8, torch.uint8) and scale_name is not None:  # FP4 e2m1, two per byte
            self._check(name, t, (*shape[:-1], shape[-1] // 2))
            sname = self.by_canonical[scale_name]
            scale = checked_scale(sname, self.reader.get(sname), (*shape[:-1], -(-shape[-1] // FP4_GROUP)),
                                  f"one scale per {FP4_GROUP} columns of {name!r}")
            return dequantize_fp4(t, scale)
        self._check(name, t, shape)
        if t.is_floating_point():
            check_weight_dtype(name, t)
        return t if not t.is_floating_point() else t.float()

    @staticmethod
    def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _sources(model) -> Iterator[tuple[torch.Tensor, list[tuple[str, slice | None]]]]:
    """(target tensor, [(canonical checkpoint name, row slice of the target)]) for every weight."""
    def one(t, name):
        return t, [(name, None)]

    yield one(model.embed, "embed.weight")
    if model.head is not model.embed:
        yield one(model.head, "head.weight")
    yield one(model.norm, "norm.weight")
    for part in ("fn", "base", "scale"):
        yield one(getattr(model, f"hc_head_{part}"), f"hc_head_{part}")
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        yield one(layer.attn_norm, p + "attn_norm.weight")
        yield one(layer.ffn_norm, p + "ffn_norm.weight")
        for sub in ("attn", "ffn"):
            hc = getattr(layer, f"hc_{sub}")
            for part in ("fn", "base", "scale"):
                yield one(getattr(hc, part), f"{p}hc_{sub}_{part}")
        a = layer.attn
        for ours, theirs in (("wq_a", "wq_a"), ("q_norm", "q_norm"), ("wq_b", "wq_b"), ("wkv", "wkv"),
                             ("kv_norm", "norm"), ("wo_a", "wo_a"), ("wo_b", "wo_b")):
            yield one(getattr(a, ours), f"{p}attn.{theirs}.weight")
        yield one(a.attn_sink, p + "attn.attn_sink")
        comps = []
        if a.compressor is not None:
            comps.append((a.compressor, p + "attn.compressor."))
        if a.indexer is not None:
            yield one(a.indexer.wq_b, p + "attn.indexer.wq_b.weight")
            yield one(a.indexer.weights_proj, p + "attn.indexer.weights_proj.weight")
            comps.append((a.indexer.compressor, p + "attn.indexer.compressor."))
        for comp, cp in comps:
            for part in ("wkv", "wgate", "norm"):
                yield one(getattr(comp, part), f"{cp}{part}.weight")
            yield one(comp.ape, cp + "ape")
        f = layer.ffn
        yield one(f.gate, p + "ffn.gate.weight")
        if f.is_hash:
            yield one(f.tid2eid, p + "ffn.gate.tid2eid")
        else:
            yield one(f.bias, p + "ffn.gate.bias")
        I = model.cfg.moe_intermediate_size
        for j in range(f.num_local):
            e = f"{p}ffn.experts.{f.expert_start + j}."
            yield f.w13[j], [(e + "w1.weight", slice(0, I)), (e + "w3.weight", slice(I, 2 * I))]
            yield one(f.w2[j], e + "w2.weight")
        s = p + "ffn.shared_experts."
        yield f.shared_w13, [(s + "w1.weight", slice(0, I)), (s + "w3.weight", slice(I, 2 * I))]
        yield one(f.shared_w2, s + "w2.weight")


def load_v4_weights(model, reader: SafetensorsReader) -> None:
    """Fill every weight of ``model`` (a ``DeepseekV4ForCausalLM``) and its ``mtp`` store. A tensor the
    config does not account for is an error (a config that disagrees with its checkpoint)."""
    names = V4Names(reader)
    with torch.no_grad():
        for target, parts in _sources(model):
            for name, rows in parts:
                dst = target if rows is None else target[rows]
                t = names.get(name, tuple(dst.shape))
                dst.copy_(t.to(dst.dtype))
        mtp = sorted(c for c in names.by_canonical if c.startswith("mtp.") and not _is_scale(c, names))
        for c in mtp:
            raw = names.reader.get(names.by_canonical[c])
            t = names.get(c, _logical_shape(c, raw, names))
            model.mtp[c.replace(".", "/")] = torch.nn.Parameter(
                t.to(model.embed.dtype) if t.is_floating_point() else t, requires_grad=False)
    lo, hi = model.expert_range or (0, model.cfg.n_routed_experts)
    unexpected = sorted(
        names.by_canonical[c] for c in set(names.by_canonical) - names.used
        if not (_other_rank_expert(c, lo, hi) or (c == "head.weight" and model.cfg.tie_word_embeddings)))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"checkpoint has tensor(s) its config.json does not describe: "
                              f"{', '.join(unexpected[:5])}{more}")


def read_v4_expert(model, reader: SafetensorsReader, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13, w2) of routed expert ``expert`` of layer ``layer``, read and dequantised as
    :func:`load_v4_weights` reads it, in the dtype and on the device of the model's expert weights."""
    cfg = model.cfg
    if not 0 <= layer < len(model.layers) or not 0 <= expert < cfg.n_routed_experts:
        raise ValueError(f"no routed expert {expert} in layer {layer}: the model has {len(model.layers)} layers "
                         f"of {cfg.n_routed_experts} routed experts")
    names = V4Names(reader)
    I, C = cfg.moe_intermediate_size, cfg.hidden_size
    e = f"layers.{layer}.ffn.experts.{expert}."
    like = model.layers[layer].ffn.w2
    w13 = torch.cat((names.get(e + "w1.weight", (I, C)), names.get(e + "w3.weight", (I, C))))
    w2 = names.get(e + "w2.weight", (C, I))
    return w13.to(like.device, like.dtype), w2.to(like.device, like.dtype)


def _other_rank_expert(canonical: str, lo: int, hi: int) -> bool:
    if ".ffn.experts." not in canonical:
        return False
    return not lo <= int(canonical.split(".ffn.experts.")[1].split(".")[0]) < hi


def _is_scale(canonical: str, names: V4Names) -> bool:
    stem = canonical.removesuffix(".scale").removesuffix("_scale_inv")
    return stem != canonical and (names.has(stem + ".weight") or names.has(stem))


def _logical_shape(canonical: str, raw: torch.Tensor, names: V4Names) -> tuple[int, ...]:
    """The dequantised shape of an MTP tensor (FP4-packed tensors are twice as wide)."""
    stem = canonical.removesuffix(".weight")
    if raw.dtype in (torch.int8, torch.uint8) and names.has(stem + ".scale"):
        return (*raw.shape[:-1], raw.shape[-1] * 2)
    return tuple(raw.shape)
