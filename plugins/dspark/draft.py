"""Draft sources: a small DeepSeek model with its own paged cache, or the checkpoint's MTP layer.

Both keep their KV in the cache group "dspark" that the feature declares (``DSpark.cache_groups``):
tensors of their own inside the engine's KV budget, in the target's block pool, so indexed by the
*target's* block tables and slots. A draft needs no block management: a request's blocks hold the
target's KV in the target's cache and the draft's KV at the same slots of the draft's cache.

A source runs one forward over a flat batch laid out like the target's (prefill items first, then
decode items, ``AttentionMetadata``) and returns ``(carry, normed)``: the hidden state a next draft
step continues from (MTP) and the normalised hidden state its LM head reads.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from deepinfer_core.config import ConfigError
from deepinfer_core.engine.fingerprint import model_fingerprint
from deepinfer_core.models.deepseek import DecoderLayer
from deepinfer_core.models.loader import (
    SafetensorsReader,
    apply_weight_layout,
    assign_weights,
    construct,
    dequantize_fp8,
    iter_checkpoint,
    load_model,
    load_model_config,
)
from deepinfer_core.models.metadata import AttentionMetadata
from plugins.dspark.lean import LeanDecoder

logger = logging.getLogger("deepinfer.dspark")


CACHE_GROUP = "dspark"


def _alloc_caches(engine, num_layers: int, entry_dim: int, caches: list[torch.Tensor] | None = None
                  ) -> list[torch.Tensor]:
    """The draft's cache tensors: ``caches`` if given, else the "dspark" group the feature declared."""
    caches = engine.kv_caches.get(CACHE_GROUP) if caches is None else caches
    if caches is None or len(caches) != num_layers or caches[0].shape[-1] != entry_dim:
        got = None if caches is None else (len(caches), caches[0].shape[-1])
        raise ConfigError(f"[dspark] the draft needs {num_layers} cache layers of {entry_dim} values in cache group "
                          f"{CACHE_GROUP!r}, the engine has {got}")
    return caches


def tokenizer_id(model_dir: Path) -> str | None:
    """Short hash of a checkpoint's tokenizer vocabulary (None without tokenizer.json)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    h = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in sorted(vocab.items(), key=lambda x: x[1])).encode())
    return f"{len(vocab)} tokens, sha256 {h.hexdigest()[:12]}"


class DraftModel:
    """A separate small DeepSeek checkpoint (HF format) sharing the target's tokenizer."""

    needs_hidden = False
    kind = "model"

    def __init__(self, engine, path: Path, caches: list[torch.Tensor] | None = None) -> None:
        """``caches``: the draft's KV tensors (default: the engine's "dspark" cache group)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"[dspark] draft {str(path)!r} is not an HF checkpoint directory (no config.json)")
        cfg = load_model_config(path)
        tv, dv = engine.model_config.vocab_size, cfg.vocab_size
        t_tok, d_tok = tokenizer_id(engine.model_dir), tokenizer_id(path)
        if tv != dv or (t_tok is not None and d_tok is not None and t_tok != d_tok):
            raise ConfigError(
                f"[dspark] draft {str(path)!r} does not share the target's tokenizer: draft vocab_size {dv} "
                f"(tokenizer {d_tok or 'none shipped'}), target {str(engine.model_dir)!r} vocab_size {tv} "
                f"(tokenizer {t_tok or 'none shipped'})")
        self.path, self.cfg = path, cfg
        self.max_positions = engine.max_model_len + 32
        self.model = load_model(engine.kernels, path, cfg, engine.dtype, engine.device, self.max_positions)
        self.caches = _alloc_caches(engine, cfg.num_hidden_layers, cfg.kv_entry_dim, caches)
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.fingerprint = model_fingerprint(path, torch.float32)[:12]
        self.lean = LeanDecoder(self.model)  # it folds the weights, so before they are re-laid
        layout = engine.platform.linear_weight_layout
        apply_weight_layout(self.model, layout)
        self.lean.apply_layout(layout)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
               ctx_slots: torch.Tensor, masked: bool = True) -> torch.Tensor:
        """The lean decode path (``plugins.dspark.lean``): normalised hidden states of the tokens."""
        return self.lean.forward(ids, positions, write_slots, ctx_slots, self.caches, masked)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                prev_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.model(ids, positions, meta, {self.model.CACHE_GROUP: self.caches})
        return normed, normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.logits(normed)


MTP_FILENAME = "mtp.safetensors"  # an MTP layer shipped apart from its target (``MTPDraft(engine, path)``)


def has_mtp(model_dir: Path, num_hidden_layers: int) -> bool:
    try:
        names = SafetensorsReader(Path(model_dir)).names()
    except Exception:  # noqa: BLE001 - no readable checkpoint: no MTP layer
        return False
    p = f"model.layers.{num_hidden_layers}."
    return all(p + n in names for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"))


def is_mtp_dir(path: Path) -> bool:
    """A directory holding a separately trained MTP layer (``mtp.safetensors``, no ``config.json``)."""
    return (Path(path) / MTP_FILENAME).is_file() and not (Path(path) / "config.json").is_file()


class _LayerHolder(nn.Module):
    """Gives one extra decoder layer the parameter names ``layers.{N}.*`` the loader maps to."""

    def __init__(self, layer: DecoderLayer, index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Identity() for _ in range(index)] + [layer])

    def post_load(self) -> None:
        self.layers[-1].self_attn.post_load()


class MTPDraft:
    """DeepSeek-V3 multi-token prediction: ``model.layers.{num_hidden_layers}`` of the checkpoint.

        x = eh_proj([enorm(embed(token_{p+1})) ; hnorm(h_p)]);  h' = decoder_layer(x)
        logits = lm_head(shared_head.norm(h'))

    ``h_p`` is the target's final (normalised) hidden state at position p; for later draft steps it
    is the MTP's own ``h'`` before ``shared_head.norm``. The embedding and LM head are the target's.
    Applied recursively for k > 1.

    ``path``: a directory whose ``mtp.safetensors`` holds the layer (trained apart from the target,
    e.g. the embedded model's, by ``examples/train_dspark_draft.py --kind mtp``); else the target
    checkpoint's own. The layer's MLP is dense when the file holds ``mlp.gate_proj`` (MoE otherwise)."""

    needs_hidden = True
    kind = "mtp"

    def __init__(self, engine, path: Path | None = None) -> None:
        cfg = engine.model_config
        N = cfg.num_hidden_layers
        src = Path(path) if path is not None else Path(engine.model_dir)
        if path is not None and not is_mtp_dir(src):
            raise ConfigError(f"[dspark] draft {str(src)!r} holds no {MTP_FILENAME} (or is a draft model checkpoint)")
        if not has_mtp(src, N):
            raise ConfigError(f"[dspark] draft 'mtp': checkpoint {str(src)!r} has no MTP layer "
                              f"(model.layers.{N}.{{enorm,hnorm,eh_proj,shared_head.norm}}); give a draft "
                              "model path instead")
        self.target = engine.model
        k, dtype, dev = engine.kernels, engine.dtype, engine.device
        reader = SafetensorsReader(src)
        prefix = f"model.layers.{N}."
        if prefix + "mlp.gate_proj.weight" in reader.names():  # a dense MTP layer
            cfg = replace(cfg, first_k_dense_replace=N + 1)
        layer = construct(lambda: DecoderLayer(k, cfg, N), dtype, dev)
        assign_weights(_LayerHolder(layer, N), iter_checkpoint(reader, replace(cfg, num_hidden_layers=N + 1),
                                                               dtype, prefix=prefix))
        if path is not None:
            self.path = src  # its confidence head and training report lie beside it
        self.layer = layer
        self.k, self.eps = k, cfg.rms_norm_eps

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = reader.get(prefix + name)
            if t.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8(t, reader.get(prefix + name + "_scale_inv"))
            if tuple(t.shape) != shape:
                raise ConfigError(f"[dspark] MTP tensor {prefix + name!r} has shape {tuple(t.shape)}, expected "
                                  f"{shape}")
            return t.to(dtype=dtype, device=dev)

        C = cfg.hidden_size
        self.enorm = get("enorm.weight", (C,))
        self.hnorm = get("hnorm.weight", (C,))
        self.eh_proj = get("eh_proj.weight", (C, 2 * C))
        self.head_norm = get("shared_head.norm.weight", (C,))
        self.caches = _alloc_caches(engine, 1, cfg.kv_entry_dim)
        self.hidden_size = C
        self.vocab_size = cfg.vocab_size
        self.max_positions = engine.max_model_len
        self.lean = LeanDecoder(None, [layer], self.target.cos_sin, cfg.rms_norm_eps)
        layout = engine.platform.linear_weight_layout
        apply_weight_layout(layer, layout)
        self.lean.apply_layout(layout)
        self.eh_proj = layout(self.eh_proj)
        self.fingerprint = f"mtp-{engine.fingerprint}"
        if path is not None:
            h = hashlib.sha256((src / MTP_FILENAME).read_bytes()).hexdigest()[:12]
            self.fingerprint = f"mtp-{engine.fingerprint}-{h}"

    def _input(self, ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        k = self.k
        e = k.rms_norm(self.target.embed_tokens[ids], self.enorm, self.eps)
        h = k.rms_norm(prev_hidden, self.hnorm, self.eps)
        return k.linear(torch.cat((e, h), dim=-1), self.eh_proj)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
               ctx_slots: torch.Tensor, masked: bool = True, prev_hidden: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lean decode path (``plugins.dspark.lean``) at MTP positions: (carry, normed)."""
        x, residual = self.lean.run_layers(self._input(ids, prev_hidden), positions, write_slots, ctx_slots,
                                           self.caches, masked)
        carry = x + residual
        return carry, self.k.rms_norm(carry, self.head_norm, self.eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                prev_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._input(ids, prev_hidden)
        x, residual = self.layer(x, None, positions, self.target.cos_sin, meta, self.caches[0])
        carry = x + residual
        return carry, self.k.rms_norm(carry, self.head_norm, self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.target.logits(normed)
