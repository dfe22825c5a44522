"""The engine's extension points, as pluggy hook specifications.

A feature plugin (``deepinfer.features`` entry point) is a :class:`deepinfer_core.features.Feature`
subclass whose instance is registered with pluggy. It implements any of the hooks below by defining
a method of the same name decorated with ``@hookimpl``; it may take fewer arguments than the spec.
Hooks are called in the engine process and receive the engine as an
:class:`~deepinfer_core.engine_view.EngineView` (what a plugin may read). With ``dp``/``ep`` > 1
every rank's engine runs in its own worker process with its own feature instances, and every rank
calls ``step_finished`` once per (lock-step) step; the driver instantiates features to validate
their config sections and to merge their metrics (``merge_metrics``).

Order within a step (fixed): ``request_ready`` / ``match_external_prefix`` / ``load_external_blocks``
while scheduling; ``process_logits`` before sampling; then, per completed step, ``tokens_sampled``
for every token placed (the last one of a request included), then ``request_finished`` for the
requests that stopped on those tokens, then ``step_finished``. A request aborted or failed outside
post-processing gets ``request_finished`` at once.

A hook that raises during a step fails that step's requests (``finish_reason == "error"``), with an error
naming the plugin and the hook (``engine step failed in plugin 'name' (hook tokens_sampled): ...``); the
other requests keep running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from deepinfer_core.engine.engine import EngineStats
    from deepinfer_core.engine.model_runner import StepBatch
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.engine_view import EngineView
    from deepinfer_core.kv_cache_spec import CacheLayout, KVCacheSpec
    from deepinfer_core.models.interface import RouteHook
    from deepinfer_core.proposer import Proposer

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- start-up and shutdown ----------------------------------------------------------------------
@hookspec
def cache_groups(engine: EngineView, layout: CacheLayout) -> list[KVCacheSpec] | None:
    """Extra KV cache groups this feature keeps beside the model's own (e.g. a draft model's KV).

    :param engine: the engine being built: model loaded, no KV cache yet (``model_config``,
        ``model_dir`` and ``cfg`` are set; ``blocks`` and ``kv_caches`` are not).
    :param layout: the model's cache layout.
    :return: specs with names unused by ``layout``, or None. The groups are sized from the same KV
        memory budget and paged like the model's; a group with the window and prefix-cacheability of
        a model group shares that group's block pool, so its block ids and slots are the model's
        (``engine.blocks.table(request, group)``). After start-up its tensors are
        ``engine.kv_caches[name]``, one per entry of ``layers``.
    """


@hookspec
def engine_started(engine: EngineView) -> None:
    """The engine is built (model loaded, KV cache allocated). Attach draft models, stores, maps.

    :param engine: the engine.
    """


@hookspec(firstresult=True)
def moe_route_hook(engine: EngineView) -> RouteHook | None:
    """A function the engine installs on every MoE layer the model declares
    (``CausalLM.moe_layers``), called after ``engine_started``: ``(layer_idx, weights [T, k],
    expert ids [T, k]) -> (weights, ids)`` (e.g. EPLB's logical-to-replica map and load counts).
    At most one feature may route; steps then run without decode graphs.

    :param engine: the engine (started).
    :return: the hook, or None.
    """


@hookspec
def engine_shutdown(engine: EngineView) -> None:
    """The engine is closing: stop threads, flush files.

    :param engine: the engine.
    """


# ---- requests ------------------------------------------------------------------------------------
@hookspec
def request_options() -> list[str] | None:
    """Names of the feature-owned SamplingParams fields this feature handles (e.g. ``so_args``).
    A request setting such a field when no enabled feature claims it is rejected.

    :return: field names, or None.
    """


@hookspec
def request_added(engine: EngineView, request: Sequence) -> None:
    """A request passed core validation. Check feature-specific options, start async work
    (e.g. grammar compilation). Raise ValueError to fail this request alone.

    :param engine: the engine.
    :param request: the new request (not yet queued).
    """


@hookspec(firstresult=True)
def request_ready(engine: EngineView, request: Sequence) -> bool | None:
    """May a waiting request be scheduled now? Raise to fail it alone.

    :param engine: the engine.
    :param request: a waiting request the scheduler is about to admit.
    :return: False to hold it (a grammar still compiling, KV blocks still being fetched), else None.
    """


@hookspec(firstresult=True)
def match_external_prefix(engine: EngineView, request: Sequence, block_hashes: list[int],
                          num_device_blocks: int) -> int | None:
    """How many leading full blocks another KV tier can supply (metadata only; the tier then
    fetches them off the step loop).

    :param engine: the engine.
    :param request: the request being admitted.
    :param block_hashes: the prefix hash chain of its prompt's full blocks.
    :param num_device_blocks: how many of them the device cache already holds.
    :return: a count >= ``num_device_blocks``, or None.
    """


@hookspec(firstresult=True)
def load_request_state(engine: EngineView, request: Sequence) -> int | None:
    """A request handed over by another engine (prefill, or a draining decode engine) is being
    admitted: allocate its blocks (``engine.blocks.allocate``), fill them from the transferred state,
    set its number of computed tokens.

    :param engine: the engine.
    :param request: the request being admitted.
    :return: its computed tokens, or None: nothing to load (normal admission follows).
    """


@hookspec
def load_external_blocks(engine: EngineView, request: Sequence, block_ids: list[int],
                         block_hashes: list[int]) -> None:
    """Copy the fetched blocks into device blocks before the request's first forward.

    :param engine: the engine.
    :param request: the request being admitted.
    :param block_ids: device block ids (of ``engine.blocks.record_pool``), one per hash.
    :param block_hashes: the hashes of the blocks to copy, in order.
    """


@hookspec
def blocks_evicted(engine: EngineView, block_hashes: list[int], block_ids: list[int]) -> None:
    """Full device blocks are about to be reused: a lower tier may copy them out first.

    :param engine: the engine.
    :param block_hashes: the evicted blocks' hashes.
    :param block_ids: their device block ids (still holding the data during the call).
    """


@hookspec
def request_finishing(engine: EngineView, request: Sequence) -> None:
    """A request is finishing and still holds its KV blocks (``engine.blocks.tables(request)`` is
    valid, the tokens are on the host): read them now (a prefill engine hands its KV off here).

    :param engine: the engine.
    :param request: the request; ``finish_reason`` is set.
    """


@hookspec
def request_finished(engine: EngineView, request: Sequence) -> None:
    """A request finished or failed (offload its KV, free its matcher). Comes after
    ``tokens_sampled`` for its last token.

    :param engine: the engine.
    :param request: the request; ``finish_reason`` is set, its blocks are released after the call
        returns only when it failed before its first step.
    """


# ---- the step ------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def speculative_proposer(engine: EngineView) -> Proposer | None:
    """The draft proposer this feature provides for speculative decoding (a feature that also
    owns cache groups or config, e.g. DSpark; a plain proposer is an entry point in
    ``deepinfer.proposers`` named by the ``[speculative]`` table instead). Called once, after
    ``engine_started``; at most one proposer runs.

    :param engine: the engine (started).
    :return: the proposer (its ``k``: the most drafts per request and step), or None.
    """


# With ``async_scheduling`` on, the engine launches step N+1 before it post-processes step N: while
# step N+1 is scheduled, prepared and its ``process_logits`` runs, the token each request sampled in
# step N is still on the device (a placeholder in ``request.token_ids``; ``request.output_token_ids``
# holds the known tokens only), and ``tokens_sampled`` for step N runs after step N+1 was launched.
# A feature that needs the last token on the host before the next step (a grammar mask built from
# it, penalties over the output) says so through the two hooks below; the engine then runs those
# steps synchronously (it first post-processes the step in flight). The rule is the same for every
# feature and never depends on its name. Speculative steps run synchronously too.


@hookspec
def request_needs_sync(engine: EngineView, request: Sequence) -> bool | None:
    """Whether this request's steps need its previous token on the host before they are prepared;
    while it is unfinished every step then runs synchronously. Called once, after ``request_added``.

    :param engine: the engine.
    :param request: the new request.
    :return: True if so.
    """


@hookspec
def step_needs_sync(engine: EngineView) -> bool | None:
    """Whether the coming step must run synchronously (called before it is scheduled, every step,
    only with async scheduling on; keep it cheap).

    :param engine: the engine.
    :return: True to run it synchronously.
    """


@hookspec
def process_logits(engine: EngineView, batch: StepBatch, logits: torch.Tensor) -> None:
    """Edit next-token logits in place before sampling (e.g. grammar masks). Called in inference
    mode on a tensor the hook owns for the call: in-place edits are allowed and are what is sampled.

    :param engine: the engine.
    :param batch: the step; ``batch.sample_seqs[i]`` is the request of ``logits[i]`` (with
        speculative decoding a request verifying drafts appears once per verified position, in
        order: its row after its last token, then after each draft).
    :param logits: float32 ``[len(batch.sample_seqs), vocab]``. With async scheduling this runs
        when the step is launched, before ``tokens_sampled`` of the previous step (see
        ``request_needs_sync``).
    """


@hookspec
def tokens_sampled(engine: EngineView, batch: StepBatch, token_ids: list[int]) -> None:
    """Tokens were placed in requests (advance grammar matchers, count accepts). Runs before
    ``request_finished`` of the requests that stopped on these tokens.

    :param engine: the engine.
    :param batch: the step; ``batch.sample_seqs[i]`` received ``token_ids[i]`` (a request appears
        once per token it received). With async scheduling this runs after the next step was
        launched; requests that had already stopped are left out (their extra token is discarded).
    :param token_ids: the tokens, in ``batch.sample_seqs`` order.
    """


@hookspec
def step_finished(engine: EngineView, step_stats: EngineStats) -> None:
    """A step ended (a safe point to move expert weights or rebalance).

    :param engine: the engine.
    :param step_stats: the engine's running counters (read only).
    """


# ---- metrics -------------------------------------------------------------------------------------
@hookspec
def collect_metrics(engine: EngineView) -> dict | None:
    """Metrics to merge into ``engine.metrics()``.

    :param engine: the engine.
    :return: a flat dict (keys prefixed with the feature's name), or None.
    """


@hookspec
def merge_metrics(per_rank: list[dict]) -> dict | None:
    """With dp/ep > 1, called on the driver's feature instances: merge this feature's
    ``collect_metrics`` keys over the ranks (sum counters, recompute rates). Keys no feature merges
    keep rank 0's value.

    :param per_rank: every rank's ``metrics()``, in rank order.
    :return: the merged values of this feature's keys, or None.
    """


# ---- elastic expert parallelism ------------------------------------------------------------------
@hookspec(firstresult=True)
def ep_group_resized(engine: EngineView, old_placement: dict[int, list[int]],
                     load_expert: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> bool | None:
    """The expert-parallel group was re-formed with fewer ranks (elastic EP: a rank died). Every
    rank calls it together, so it may use collectives.

    :param engine: the rank's engine; ``comm`` and ``expert_parallel`` already span the new group.
    :param old_placement: per MoE layer, the physical→logical list over the *new* ranks, each
        keeping its old slots (the dead rank's are gone).
    :param load_expert: ``(layer, logical expert) -> (w13, w2)``, an expert no survivor holds, read
        from the checkpoint.
    :return: True once a placement where every logical expert has a slot is installed
        (``ExpertParallel.set_placement``); None if this feature does not place experts.
    """
