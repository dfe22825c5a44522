"""What the engine asks of a model architecture.

An architecture registers under the ``deepinfer.models`` entry-point group, named by the
``architectures`` string of its ``config.json`` (``DeepseekV3ForCausalLM = "pkg.mod:Class"``),
exactly as a third party's would. The class is a :class:`CausalLM`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.kv_cache_spec import CacheLayout, LayerCache
    from deepinfer_core.models.loader import SafetensorsReader
    from deepinfer_core.models.metadata import AttentionMetadata

#: group name -> one cache per layer of the group, in ``KVCacheSpec.layers`` order: a tensor, or the
#: tuple of its planes where the platform splits the entry (``kv_cache_spec``, "Planes")
KVCaches = dict[str, list["LayerCache"]]


class ArchConfig(Protocol):
    """The fields of a parsed config.json that the engine reads; the rest is the model's own."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: list[int]
    raw: dict


class CausalLM(nn.Module, ABC):
    """A decoder-only model over a paged cache that it declares (:meth:`cache_layout`)."""

    core_api_version = "1.0"  # the plugin API this class is written against (``deepinfer_core.version``)
    cfg: Any

    @classmethod
    @abstractmethod
    def parse_config(cls, raw: dict) -> ArchConfig:
        """config.json -> this architecture's config. Unsupported values raise ``ModelConfigError``
        naming the field."""

    @classmethod
    @abstractmethod
    def create(cls, kernels: Kernels, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, expert_range: tuple[int, int] | None = None) -> CausalLM:
        """The model with uninitialised weights in ``dtype`` on ``device``. ``expert_range``: the routed
        experts [lo, hi) this rank holds (expert parallelism); None for all."""

    #: True when ``load_weights`` takes ``keep_fp8=True``: an FP8 checkpoint's GEMM weights then stay e4m3
    #: with their 128x128 tile scales (config ``weight_dtype``) and run through the ``fp8_*`` ops
    fp8_weights: bool = False

    @abstractmethod
    def load_weights(self, reader: SafetensorsReader) -> None:
        """Fill every weight from the checkpoint: shape-checked, dequantised, cast. A missing or
        wrongly shaped tensor raises ``CheckpointError`` naming it."""

    #: the config ``kv_cache_dtype`` values :meth:`cache_layout` can declare ("auto": the model dtype); the
    #: engine refuses any other, and sets ``kv_cache_dtype`` (one of them) before it asks for the layout
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    kv_cache_dtype: str = "auto"

    @abstractmethod
    def cache_layout(self) -> CacheLayout:
        """The cache groups this model reads and writes (their encoding follows ``kv_cache_dtype``)."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KVCaches) -> torch.Tensor:
        """input_ids, positions: [T]. Writes this step's cache entries; returns final hidden [T, C]."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, C] -> [R, vocab] float32."""

    def moe_layers(self) -> dict[int, nn.Module]:
        """The routed-expert layers by layer index (none for a dense model). Each has ``layer_idx``,
        ``route_hook`` (a :data:`RouteHook` or None: rewrites its routing, e.g. EPLB's replica map)
        and ``expert_parallel`` (the EP dispatcher or None); the engine sets those two, never a feature."""
        return {}

    def set_decode_fusion(self, enabled: bool) -> None:
        """Fused decode ops on (the default) or off (the unfused ops they replace, for checking one against the
        other; config ``decode_fusion``). The engine calls it before capturing graphs. A model with no fused
        paths ignores it."""


#: (layer_idx, weights [T, k], expert ids [T, k]) -> (weights, ids): rewrites a MoE layer's routing
RouteHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
