"""What a feature plugin may read of the engine: :class:`EngineView`.

Every hook (``deepinfer_core.hookspecs``) receives the engine as an ``EngineView``. The engine
(``LLMEngine``, and a dp/ep rank's ``RankEngine``) satisfies it; anything else on the engine is
private and may change without notice. Requests are passed to hooks as ``Sequence`` objects: a
hook reads them (``request_id``, ``params``, ``token_ids``, ``num_tokens``, ``num_computed_tokens``,
``block_table``, ``metrics``) and keeps its own per-request state in ``request.feature_state[name]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from deepinfer_core.communicator import Communicator
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.kv_cache_manager import KVCacheManager
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.engine.tokenizer import HFTokenizer
    from deepinfer_core.kernels import Kernels
    from deepinfer_core.kv_cache_spec import CacheLayout
    from deepinfer_core.models.interface import ArchConfig, CausalLM
    from deepinfer_core.parallel.expert_parallel import ExpertParallel
    from deepinfer_core.platform import Platform
    from deepinfer_core.scheduler import SchedulerOutput


@runtime_checkable
class EngineView(Protocol):
    """The engine as hooks see it (read these, call the methods below; never assign)."""

    #: the deployment's configuration (read only)
    cfg: EngineConfig
    #: the model's parsed ``config.json`` (``vocab_size``, ``hidden_size``, ...; the rest is the model's)
    model_config: ArchConfig
    #: the checkpoint directory
    model_dir: Path
    #: the target model (draft models may share its embedding and head; do not run it yourself)
    model: CausalLM
    #: compute dtype, torch device and the platform (ask it, never branch on a device name)
    dtype: torch.dtype
    device: torch.device
    platform: Platform
    kernels: Kernels
    tokenizer: HFTokenizer
    #: tokens per KV block, and the longest request (prompt + output) the engine accepts
    block_size: int
    max_model_len: int
    #: steps are pipelined one deep (config ``async_scheduling``, else the platform's default)
    async_scheduling: bool
    #: stable id of the weights (``engine.model_fingerprint``)
    fingerprint: str
    #: the KV cache groups (the model's and the features' ``cache_groups``), and their tensors
    cache_layout: CacheLayout
    kv_caches: dict[str, list[torch.Tensor]]
    #: block-manager queries: ``table(request, group)``, ``tables(request)``, ``num_free``,
    #: ``num_blocks``, ``pool_of``, ``primary``, ``external_hits``, ``read_block``/``write_block``
    blocks: KVCacheManager
    #: with dp/ep > 1: this rank's communicator, expert dispatcher and node count; None / 1 otherwise
    comm: Communicator | None
    expert_parallel: ExpertParallel | None
    num_nodes: int

    def get_request(self, request_id: str) -> Sequence | None:
        """The unfinished request with this id, or None."""

    def abort(self, request_id: str, reason: str = "abort", error: BaseException | None = None) -> None:
        """Finish a request now (``finish_reason`` = ``reason``; ``error`` for ``"error"``)."""

    def probe_forward(self, out: SchedulerOutput, draft_tokens: dict[str, list[int]] | None = None,
                      prepare_only: bool = False) -> None:
        """Time-measurement forward: prepare (unless ``prepare_only``, also run) the target over the
        scheduled requests ``out`` (synthetic ones whose KV blocks the caller allocated through
        ``blocks`` and gives back) with ``draft_tokens`` per request id as lookahead tokens, then
        wait for the device. Nothing is sampled, recorded or sent to hooks. With dp/ep > 1 the
        forward meets the other ranks in the MoE all-to-alls: every rank calls it as often."""

    def load_stats(self) -> dict:
        """Gauges: ``running`` and ``waiting`` requests, ``max_running`` (the most that run at once),
        ``kv_usage`` (0..1)."""
