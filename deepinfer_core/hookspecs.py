"""The engine's extension points, as pluggy hook specifications.

A feature plugin (``deepinfer.features`` entry point) is a :class:`deepinfer_core.features.Feature`
subclass whose instance is registered with pluggy. It implements any of the hooks below by defining
a method of the same name decorated with ``@hookimpl``; it may take fewer arguments than the spec.
Hooks are called in the engine process. With ``dp``/``ep`` > 1 every rank's engine runs in its
own worker process with its own feature instances, and every rank calls ``step_finished`` once per
(lock-step) step; the driver only instantiates features to validate their config sections.
"""

from __future__ import annotations

import pluggy

PROJECT = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def cache_groups(engine, layout) -> list | None:
    """Extra KV cache groups this feature keeps beside the model's own (e.g. a draft model's KV).

    ``engine``: the engine being built (model loaded, no KV cache yet; ``engine.model_config`` and
    ``engine.model_dir`` are set). ``layout``: the model's ``kv_cache_spec.CacheLayout``. Return a
    list of ``kv_cache_spec.KVCacheSpec`` with names unused by ``layout``, or None. The groups are
    sized from the same KV memory budget and paged like the model's; a group with the window and
    prefix-cacheability of a model group shares that group's block pool, so its block ids and slots
    are the model's (``engine.blocks.table(request, group)``). After start-up its tensors are
    ``engine.kv_caches[name]``, one per entry of ``layers``."""


@hookspec
def engine_started(engine) -> None:
    """The engine is built (model loaded, KV cache allocated). Attach draft models, stores, maps."""


@hookspec
def engine_shutdown(engine) -> None:
    """The engine is closing: stop threads, flush files."""


@hookspec
def request_options() -> list[str] | None:
    """Names of the feature-owned SamplingParams fields this feature handles (e.g. ``so_args``).
    A request setting such a field when no enabled feature claims it is rejected."""


@hookspec
def request_added(engine, request) -> None:
    """A request passed core validation. Check feature-specific options, start async work
    (e.g. grammar compilation). Raise ValueError to fail this request alone."""


@hookspec(firstresult=True)
def request_ready(engine, request) -> bool | None:
    """May a waiting request be scheduled now? Return False to hold it (e.g. grammar still
    compiling, KV blocks still being fetched). Raise to fail it alone."""


@hookspec(firstresult=True)
def match_external_prefix(engine, request, block_hashes, num_device_blocks) -> int | None:
    """Number of leading full blocks (>= num_device_blocks) another KV tier can supply for the
    request's hash chain. Metadata only; the tier then fetches them off the step loop."""


@hookspec(firstresult=True)
def load_request_state(engine, request) -> int | None:
    """A request handed over by another engine (prefill, or a draining decode engine) is being
    admitted: allocate its blocks (``engine.blocks.allocate``), fill them from the transferred state,
    set and return its number of computed tokens. None: nothing to load (normal admission follows)."""


@hookspec
def load_external_blocks(engine, request, block_ids, block_hashes) -> None:
    """Copy the fetched blocks for ``block_hashes`` into device blocks ``block_ids`` before the
    request's first forward."""


@hookspec
def blocks_evicted(engine, block_hashes, block_ids) -> None:
    """Full device blocks are about to be reused: a lower tier may copy them out first."""


@hookspec(firstresult=True)
def execute_step(engine, scheduled) -> bool | None:
    """Run the model work of a scheduled step yourself (speculative decoding): prepare, forward,
    then ``engine._postprocess`` / ``engine.append_tokens`` for the bookkeeping. Return True when
    done, or None to let the engine run the step normally. Only called on synchronous steps (see
    ``step_needs_sync``): every request's tokens are on the host and no step is in flight."""


# ---- async scheduling -------------------------------------------------------------------------
# With ``async_scheduling`` on, the engine launches step N+1 before it post-processes step N: while
# step N+1 is scheduled, prepared and its ``process_logits`` runs, the token each request sampled in
# step N is still on the device (a placeholder in ``request.token_ids``; ``request.output_token_ids``
# holds the known tokens only), and ``tokens_sampled`` for step N runs after step N+1 was launched.
# A feature that needs the last token on the host before the next step (a grammar mask built from
# it, penalties over the output) or that runs steps itself says so through the two hooks below;
# the engine then runs those steps synchronously (it first post-processes the step in flight). The
# rule is the same for every feature and never depends on its name. A feature that implements
# ``execute_step`` but not ``step_needs_sync`` is assumed to take over every step (all synchronous).


@hookspec
def request_needs_sync(engine, request) -> bool | None:
    """Return True if this request's steps need its previous token on the host before they are
    prepared (e.g. its logits mask depends on it). While it is unfinished every step runs
    synchronously. Called once per request, after ``request_added``."""


@hookspec
def step_needs_sync(engine) -> bool | None:
    """Return True to run the coming step synchronously (called before it is scheduled, every step,
    only with async scheduling on; keep it cheap). A feature implementing ``execute_step`` returns
    True for the steps it may take over."""


@hookspec
def process_logits(engine, batch, logits) -> None:
    """Edit next-token logits in place before sampling (e.g. grammar masks).
    ``logits`` is [rows, vocab]; ``batch.logit_rows`` maps rows to requests. With async scheduling
    this runs when the step is launched, before ``tokens_sampled`` of the previous step (see
    ``request_needs_sync``)."""


@hookspec
def tokens_sampled(engine, batch, token_ids) -> None:
    """Tokens were appended to requests (advance grammar matchers, count accepts). With async
    scheduling this runs after the next step was launched; requests that had already stopped are
    left out of ``batch.sample_seqs`` and ``token_ids`` (their extra token is discarded)."""


@hookspec
def step_finished(engine, step_stats) -> None:
    """A step ended (a safe point to move expert weights or rebalance)."""


@hookspec
def request_finishing(engine, request) -> None:
    """A request is finishing and still holds its KV blocks (``engine.blocks.tables(request)`` is
    valid, the tokens are on the host): read them now (a prefill engine hands its KV off here)."""


@hookspec
def request_finished(engine, request) -> None:
    """A request finished or failed (offload its KV, free its matcher)."""


@hookspec
def collect_metrics(engine) -> dict | None:
    """Return metrics to merge into ``engine.metrics()``."""


@hookspec(firstresult=True)
def max_draft_tokens(engine) -> int | None:
    """The most draft tokens this feature appends to a request in one step (speculative decoding), or
    None. Prefix hits on window models keep ``window + max_draft_tokens + 1`` tokens out of the hit
    (``spec_lookback``) unless the config sets ``spec_lookback``."""
