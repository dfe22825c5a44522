"""The engine: one model replica, its KV cache, scheduler and step loop.

    step():  schedule -> prepare -> forward -> sample -> postprocess

Async scheduling (``async_scheduling``; on by default where ``Platform.supports_async_overlap()``)
pipelines the loop one step deep: schedule(N+1) -> launch(N+1) -> complete(N). The protocol
(placeholders, stops found one step late, synchronous steps, speculative steps on the device) is
described in ``engine/pipeline.py``, which launches and completes steps and decides whether the
coming step overlaps the one in flight; ``step()`` below only sequences them.

Failures never poison the engine. An exception while sampling a request or scoring its prompt
logprobs fails that request alone (``StepPipeline._sample``: rows are independent, so a failing batch is retried
row by row to find the culprit); any other exception in a step (scheduling, input preparation, the
forward, post-processing, a proposer) fails the requests the step involved, frees
their blocks and drops the step in flight (``_fail_step``); the engine keeps serving the rest.
"""

from __future__ import annotations

import gc
import logging
import math
import secrets
import time
from dataclasses import dataclass, field

import torch

from deepinfer_core import plugins
from deepinfer_core.config import ConfigError, EngineConfig, check_number
from deepinfer_core.engine.admission import EngineAdmission
from deepinfer_core.engine.cost_model import CostModel, default_path
from deepinfer_core.engine.fingerprint import model_fingerprint
from deepinfer_core.engine.idle import DeviceIdleMeter
from deepinfer_core.engine.kv_cache_manager import KVCacheManager, allocate_caches, size_pools
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.pipeline import StepPipeline, StepPlan
from deepinfer_core.engine.precision import check_kv_cache_dtype, keep_fp8_weights
from deepinfer_core.engine.sampler import Sampler, has_penalty
from deepinfer_core.engine.sequence import Sequence, Status
from deepinfer_core.engine.speculative import SpecDecoder
from deepinfer_core.engine.tokenizer import HFTokenizer
from deepinfer_core.engine.tokens import TokenAccounting
from deepinfer_core.features import hook_blame, load_features, make_plugin_manager
from deepinfer_core.kernels import Kernels, import_path
from deepinfer_core.kv_cache_spec import CacheLayout, HitRule
from deepinfer_core.models.loader import (
    SafetensorsReader,
    apply_weight_layout,
    quantize_model_fp8,
    random_init,
    read_config,
    resolve_model_dir,
)
from deepinfer_core.models.registry import parse_config
from deepinfer_core.sampling_params import SamplingParams, rng_seed
from deepinfer_core.scheduler import SchedulerBudget, SchedulerOutput
from deepinfer_core.selection import select_platform

logger = logging.getLogger("deepinfer.engine")
FEATURE_OPTIONS = ("so_args",)  # SamplingParams fields that only a feature plugin can honour
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineDrainingError(ValueError):
    """The engine is draining (``start_drain``) and takes no new requests: send them elsewhere."""


@dataclass
class EngineStats:
    steps: int = 0
    step_time: float = 0.0  # wall time inside step()
    forward_time: float = 0.0  # launching the forward + waiting for the step's results on the host
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    launched_steps: int = 0  # steps whose forward was launched by the engine
    completed_steps: int = 0  # of those, steps whose results were post-processed
    overlapped_steps: int = 0  # steps launched while the previous one was still on the device
    discarded_tokens: int = 0  # tokens sampled for requests that had stopped (async scheduling)
    extra: dict = field(default_factory=dict)

    @property
    def overhead_share(self) -> float:
        return 0.0 if self.step_time == 0 else 1.0 - self.forward_time / self.step_time


class LLMEngine(TokenAccounting):
    #: Local device index of this engine; a DP/EP rank engine sets its own before ``__init__``.
    device_index: int = 0
    #: A step that raises fails its requests and the engine keeps serving (``_fail_step``). A rank of
    #: an expert-parallel job sets False: its peers may wait in a collective, so the driver fails the job.
    recover_from_step_errors: bool = True
    #: dp/ep > 1 only (``parallel.worker.RankEngine``): the rank's communicator, expert dispatcher, nodes
    comm = None
    expert_parallel = None
    num_nodes: int = 1

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.log_level is not None:  # else the application's (or the CLI's --log-level) setting stands
            logging.getLogger("deepinfer").setLevel(cfg.log_level.upper())
        self.platform = select_platform(cfg.accelerator)
        backend = plugins.load("deepinfer.kernels", self.platform.kernel_backend, what="kernel backend")
        reference = plugins.load("deepinfer.kernels", "reference", what="kernel backend")
        self.kernels = Kernels(backend, reference)
        if cfg.batch_invariant:  # per-token results independent of the batch (kernels_cpu.batch_invariant)
            invariant = plugins.load("deepinfer.kernels", self.platform.batch_invariant_kernel_backend,
                                     what="batch-invariant kernel backend")
            for op in invariant.overrides():
                self.kernels.override(op, import_path(invariant.ops[op]))
        self.device = self.platform.device(self.device_index)
        self.pm = make_plugin_manager()
        self.features = load_features(cfg, self.pm)

        self.model_dir = resolve_model_dir(cfg.model)
        self.model_cls, self.model_config = parse_config(read_config(self.model_dir))
        mc = self.model_config
        self.dtype = _DTYPES[cfg.dtype] if cfg.dtype != "auto" else self.platform.preferred_dtypes()[0]
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.tokenizer = HFTokenizer.load(self.model_dir, mc.bos_token_id, mc.eos_token_id)
        self.fp8_weights = keep_fp8_weights(cfg, self.model_dir, self.model_cls, mc, self.platform)
        check_kv_cache_dtype(cfg, self.model_cls, mc, self.platform)
        self.fingerprint = model_fingerprint(self.model_dir, self.dtype, cfg.load_format, cfg.seed, self.fp8_weights)
        self.model = self.build_model()
        apply_weight_layout(self.model, self.platform.linear_weight_layout)
        self.model.set_decode_fusion(cfg.decode_fusion)

        self.cache_layout = self._cache_layout()
        num_blocks = self._size_kv_cache()
        self.kv_caches = allocate_caches(self.cache_layout, num_blocks, self.block_size, self.dtype, self.device,
                                        self.platform.kv_cache_planes)
        self._num_blocks = num_blocks
        self.cost_model = self._load_cost_model()
        self._new_request_state()
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_size, self.device,
                                  batch_invariant=cfg.batch_invariant, layout=self.cache_layout,
                                  pool_of=self.blocks.pool_of)
        self._pin = self.platform.supports_pinned_memory()
        self.runner.pin_memory = self._pin
        self.sampler = Sampler(self.kernels, mc.vocab_size, self.device, pin_memory=self._pin)
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.platform.supports_async_overlap())
        self.pipeline = StepPipeline(self)
        self._step_seqs: list[Sequence] | None = []  # requests the current step involves (_fail_step)
        self._sync_requests: set[str] = set()  # unfinished requests whose steps must run synchronously
        self._idle = DeviceIdleMeter(self.platform) if cfg.measure_device_idle else None
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._next_id = 0
        self.claimed_options = {o for opts in self.pm.hook.request_options() for o in (opts or [])}
        if cfg.kv_store:
            from deepinfer_core.engine.kv_tiers import TieredKVCache

            self.pm.register(TieredKVCache(self, dict(cfg.kv_store)), name="kv_tiers")
        self.handoff = None
        self._forward_at: float | None = None  # start_drain(): when unfinished requests are forwarded
        from deepinfer_core.engine.handoff import StateLoader

        self.pm.register(StateLoader(), name="kv_state_loader")
        if cfg.kv_transfer:
            from deepinfer_core.engine.handoff import KVHandoff
            from deepinfer_core.kv_transfer import load_transport

            self.handoff = KVHandoff(self, cfg.kv_role, load_transport(cfg.kv_transfer))
            self.pm.register(self.handoff, name="kv_handoff")
        self.pm.hook.engine_started(engine=self)
        self.spec = SpecDecoder.create(self)
        self.window_cache = self._window_cache()  # after spec: its look-back is the draft length + 1
        route = self.pm.hook.moe_route_hook(engine=self)
        if route is not None:
            self.runner.set_route_hook(route)
        # after the features: they may hook the model (moe_route_hook) or allocate device memory
        self.runner.setup_graphs(self.platform, cfg, self.max_model_len, spec_k=self.spec.k if self.spec else 0)
        # The model, caches and plugins live as long as the engine: keep the cyclic GC from rescanning
        # them. Otherwise the first full collection (~0.2 s for a freshly loaded engine) stalls every
        # thread at some early request, e.g. mid KV fetch. Undone in shutdown() so they can be freed.
        gc.freeze()

    # ---- construction -------------------------------------------------------------------
    def build_model(self, expert_range=None):
        """The model of ``config.json``'s architecture (``deepinfer.models``), loaded or randomly
        initialised; ``expert_range``: the routed experts [lo, hi) this rank holds."""
        model = self.model_cls.create(self.kernels, self.model_config, self.dtype, self.device, self.max_model_len,
                                      expert_range)
        model.kv_cache_dtype = self.cfg.kv_cache_dtype  # its cache_layout() declares the rows (check_kv_cache_dtype)
        if self.cfg.load_format == "random":
            random_init(model, seed=self.cfg.seed)
            if self.fp8_weights:
                quantize_model_fp8(model)
                model.post_load()  # weights derived at load (fused projections) from the FP8 ones
        elif self.fp8_weights:
            model.load_weights(SafetensorsReader(self.model_dir), keep_fp8=True)
        else:
            model.load_weights(SafetensorsReader(self.model_dir))
        return model

    def _new_request_state(self) -> None:
        """A fresh KV block manager (over the allocated caches) and scheduler, with no request."""
        cfg = self.cfg
        self.blocks = KVCacheManager(self.cache_layout, self.block_size, self._num_blocks, self.kv_caches,
                                     cfg.enable_prefix_caching)
        self.blocks.on_evict = self._on_evict
        budget = SchedulerBudget(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.compute_quota_limit,
                                 self.max_model_len)
        scheduler_cls = plugins.load("deepinfer.schedulers", cfg.scheduler, what="scheduler")
        self.scheduler = scheduler_cls(budget, self.blocks, self.cost_model, EngineAdmission(self))

    def _cache_layout(self) -> CacheLayout:
        """The model's cache groups plus those features declare (``cache_groups``); fixes block_size."""
        layout = self.model.cache_layout()
        extra = [g for groups in self.pm.hook.cache_groups(engine=self, layout=layout) for g in (groups or [])]
        if extra:
            layout = CacheLayout(layout.groups + tuple(extra), layout.block_size_multiple)
        bs, mult = self.cfg.block_size, layout.block_size_multiple
        self.block_size = bs * mult // math.gcd(bs, mult)
        if self.block_size != bs:
            logger.info("block_size %d -> %d: %s needs a multiple of %d", bs, self.block_size,
                        self.model_config.architecture, mult)
        layout.check_block_size(self.block_size)
        return layout

    def _size_kv_cache(self) -> dict[str, int]:
        """Blocks per cache pool within the KV memory budget (``kv_cache_manager.size_pools``)."""
        cfg = self.cfg
        if isinstance(cfg.kv_cache_memory, int):
            free, total = self.platform.memory_info(self.device_index)
            if cfg.kv_cache_memory > free:
                raise ConfigError(f"config key 'kv_cache_memory' asks for {cfg.kv_cache_memory} bytes of KV cache, "
                                  f"more than the device's free memory ({free} of {total} bytes); lower it, "
                                  "or give a fraction of the free memory as a float in (0, 1]")
            budget, fraction = cfg.kv_cache_memory, False
        else:
            free, _ = self.platform.memory_info(self.device_index)
            share = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else self.platform.kv_cache_memory_fraction
            budget, fraction = int(free * share), True
        return size_pools(self.cache_layout, budget, self.block_size, self.dtype, cfg.max_num_seqs,
                          self.max_model_len, cfg.max_num_batched_tokens, budget_is_share=fraction,
                          at_least_one_request=cfg.kv_cache_memory is None, setting=cfg.kv_cache_memory)

    def _window_cache(self):
        """Prefix hits and host snapshots for window cache groups (engine/window_cache.py), or None."""
        if not self.cfg.enable_prefix_caching or not any(
                g.window is not None and g.prefix_cacheable and g.hit_rule == HitRule.REQUIRED
                for g in self.cache_layout.groups):
            return None
        from deepinfer_core.engine.window_cache import WindowCache

        tiers = self.pm.get_plugin("kv_tiers")
        if not self.cfg.window_snapshots:
            store = None
        elif tiers is not None:
            store = tiers.host  # capacity and LRU shared with the host tier's blocks
        elif self.cfg.window_snapshot_memory > 0:
            from deepinfer_core.engine.host_store import HostMemoryStore

            store = HostMemoryStore(capacity_bytes=self.cfg.window_snapshot_memory, pin_memory=self._pin)
        else:
            store = None
        return WindowCache(self, store)

    def _load_cost_model(self) -> CostModel | None:
        path = self.cfg.cost_model or default_path(self.platform.name, self.fingerprint)
        try:
            return CostModel.load(path)
        except ValueError as exc:  # a corrupt file
            if self.cfg.cost_model:
                raise ConfigError(f"config key 'cost_model': {exc}") from exc
            logger.warning("%s; ignoring it (`deepinfer calibrate` writes a new one)", exc)
            return None
        except FileNotFoundError:
            if self.cfg.compute_quota_limit is not None:
                logger.warning("compute_quota_limit is set but no cost model at %s; run `deepinfer calibrate` "
                               "first. Prefill is limited by max_num_batched_tokens only.", path)
            return None
        except OSError as exc:  # unreadable (permissions, I/O)
            if self.cfg.cost_model:
                raise ConfigError(f"config key 'cost_model': cannot read {str(path)!r}: {exc}") from exc
            logger.warning("cannot read the cost model %s (%s); ignoring it", path, exc)
            return None

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | dict | list, params: SamplingParams | dict | None,
                    request_id: str | None = None, sibling: bool = False) -> Sequence:
        """Validate and queue a request. Bad input raises ValueError/TypeError naming the field.
        ``sibling``: another sample of an admitted request (``SampleGroup``), taken even while draining."""
        if self.draining and not sibling:
            raise EngineDrainingError("this engine is draining (start_drain): it takes no new requests; send them "
                                      "to another")
        if request_id is None:
            request_id, self._next_id = str(self._next_id), self._next_id + 1
        seq = self.new_sequence(prompt, params, request_id)
        self.pm.hook.request_added(engine=self, request=seq)
        if has_penalty(seq) or any(self.pm.hook.request_needs_sync(engine=self, request=seq)):
            self._sync_requests.add(request_id)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, prompt, params: SamplingParams | dict | None, request_id: str) -> Sequence:
        """A validated, not yet queued request (also used by the DP driver, which has no model)."""
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        for option in FEATURE_OPTIONS:
            if getattr(params, option) is not None and option not in self.claimed_options:
                raise ValueError(f"SamplingParams.{option} is set but no enabled feature handles it "
                                 f"(enable the feature that provides {option!r}, e.g. features=[...])")
        text, ids = LLMEngine._prompt_ids(self, prompt)  # explicit: the DP driver borrows this method
        seed = rng_seed(params.seq_seed) if params.seq_seed is not None else secrets.randbits(63)
        eos = [] if params.ignore_eos else self.tokenizer.eos_token_ids
        return Sequence(request_id, text, ids, params, seed, eos)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would raise a bare TypeError
                raise ValueError(f"prompt has an unpaired surrogate {prompt[exc.start]!r} at position {exc.start}; "
                                 "a prompt must be valid Unicode text") from None
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = None, prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("prompt_token_ids must be a list of ints")
        else:
            raise TypeError(f"prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        V = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's maximum length is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        return text, list(ids)

    def unfinished_requests(self) -> list[Sequence]:
        return [s for s in self._seqs.values() if not s.is_finished]

    def get_request(self, request_id: str) -> Sequence | None:
        """The unfinished request with this id, or None."""
        seq = self._seqs.get(request_id)
        return seq if seq is not None and not seq.is_finished else None

    def abort(self, request_id: str, reason: str = "abort", error: BaseException | None = None) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, reason, error=error)

    def kv_layout_info(self) -> dict:
        """What a router needs to look this engine's blocks up in a shared KV store by itself: the
        block size and, with a ``[kv_store]``, the layout its records are written with."""
        tiers = self.pm.get_plugin("kv_tiers")
        lay = getattr(tiers, "layout", None)
        store = None if lay is None else {
            "model_fingerprint": lay.model_fingerprint, "num_layers": lay.num_layers, "block_size": lay.block_size,
            "entry_dim": lay.entry_dim, "dtype": str(lay.dtype).removeprefix("torch."),
            "shape": list(lay.shape) if lay.shape is not None else None}
        return {"block_size": self.block_size, "fingerprint": self.fingerprint, "kv_store_layout": store}

    # ---- drain with forwarding ---------------------------------------------------------
    def start_drain(self, grace_s: float | None = None) -> None:
        """Stop admission now; after ``grace_s`` (default ``drain_grace_s``) every unfinished request
        is handed off with its KV and finishes here with ``finish_reason == "forwarded"`` and
        ``kv_transfer_params`` naming the hand-off, which another engine continues from (as a
        decode engine continues a prefill engine's request). Thread-safe (a signal handler or a
        server thread may call it); the forwarding itself runs in the next step."""
        if self.handoff is None:
            raise ConfigError("drain with forwarding needs a [kv_transfer] transport to hand requests off through")
        grace = self.cfg.drain_grace_s if grace_s is None else grace_s
        check_number("drain grace_s", grace, 0)
        at = time.monotonic() + grace
        self._forward_at = at if self._forward_at is None else min(self._forward_at, at)

    @property
    def draining(self) -> bool:
        return self._forward_at is not None

    def _forward_unfinished(self) -> list[Sequence]:
        """Hand every unfinished request off (its tokens and the KV of its computed positions)."""
        t0 = time.perf_counter()
        self.pipeline.drain()  # every token on the host, no step in flight
        for seq in list(self._seqs.values()):
            if not seq.is_finished:
                seq.kv_transfer_out = self.handoff.export(self, seq)
                self._finish(seq, "forwarded")
                self.stats.extra["drain_forwarded"] = self.stats.extra.get("drain_forwarded", 0) + 1
        self.stats.extra["drain_forward_s"] = self.stats.extra.get("drain_forward_s", 0.0) + time.perf_counter() - t0
        finished = [s for s in self._seqs.values() if s.is_finished]
        self._drop(finished)
        return finished

    def load_stats(self) -> dict:
        """Cheap gauges for a serving front end: running and waiting requests, the most that run at once
        (the scheduler's ``max_num_seqs``), KV-cache usage (0..1)."""
        return {"running": self.scheduler.num_running(), "waiting": self.scheduler.num_waiting(),
                "max_running": self.scheduler.budget.max_num_seqs,
                "kv_usage": 1.0 - self.blocks.num_free / max(1, self.blocks.num_blocks)}

    def probe_forward(self, out: SchedulerOutput, draft_tokens: dict[str, list[int]] | None = None,
                      prepare_only: bool = False) -> None:
        """Prepare (unless ``prepare_only``, also run) a target forward over ``out`` and wait for
        the device; nothing is sampled or recorded (step-time measurements, see ``EngineView``)."""
        batch = self.runner.prepare(out, draft_tokens)
        if not prepare_only:
            self.runner.forward(batch)
            self.platform.synchronize()

    def has_unfinished(self) -> bool:
        """Requests wait or run, or a launched step is still to be post-processed."""
        return self.scheduler.has_work() or self.pipeline.inflight is not None

    def _on_evict(self, hashes: list[int], block_ids: list[int]) -> None:
        self.pm.hook.blocks_evicted(engine=self, block_hashes=hashes, block_ids=block_ids)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step; returns the requests that finished in it (with async scheduling, the ones
        found finished when the previous step's results were post-processed)."""
        try:
            return self._step()
        except Exception as exc:
            if not self.recover_from_step_errors:
                raise
            return self._fail_step(exc)

    def _step(self) -> list[Sequence]:
        if self._forward_at is not None and time.monotonic() >= self._forward_at:
            return self._forward_unfinished()
        t0, tokens0 = time.perf_counter(), self.stats.decode_tokens
        pipe = self.pipeline
        self._step_seqs = pipe.inflight_seqs()
        plan = pipe.plan(speculate=self.spec is not None and self.spec.active())
        out = self._schedule(plan)
        if not out and pipe.inflight is not None:  # nothing new to launch: finish the step in flight
            pipe.drain()
            out = self._schedule(plan)
        finished = [s for s in self._seqs.values() if s.is_finished]
        if not out:
            return self._idle_step(finished)
        now = time.perf_counter()
        for s in out.prefills:
            self.stats.prefill_tokens += s.num_new_tokens
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        pipe.run(out, plan)
        if self.spec is not None:  # what the step cost and gave, for speculation's floor
            self.spec.observe(plan.speculate, out, time.perf_counter() - t0, self.stats.decode_tokens - tokens0)
        finished += [s for s in self._seqs.values() if s.is_finished and s not in finished]
        self._drop(finished)
        self.stats.steps += 1
        self.stats.step_time += time.perf_counter() - t0
        if self._idle is not None and not self.has_unfinished():
            self._idle.break_chain()
        self.pm.hook.step_finished(engine=self, step_stats=self.stats)
        return finished

    def _idle_step(self, finished: list[Sequence]) -> list[Sequence]:
        """Nothing could be scheduled: drop the finished requests, fail one that can never fit."""
        self._drop(finished)
        if self.scheduler.has_work() and not finished:
            self._fail_stuck()
        if self._idle is not None:
            self._idle.break_chain()
        return finished

    def _schedule(self, plan: StepPlan) -> SchedulerOutput:
        """The pipeline's ``schedule``, noting the requests the step now involves (for ``_fail_step``)
        and its preemptions."""
        involved, self._step_seqs = self._step_seqs, None  # a failure inside: the scheduler's state is unknown
        out = self.pipeline.schedule(plan)
        self._step_seqs = involved + [s.seq for s in (*out.prefills, *out.decodes)]
        self.stats.preemptions += len(out.preempted)  # also when nothing could be scheduled after all
        return out

    # ---- failures -----------------------------------------------------------------------
    def _fail_request(self, seq: Sequence, stage: str, exc: Exception) -> None:
        """An error attributable to one request fails it alone (``finish_reason == "error"``)."""
        logger.error("request %s: %s failed: %s: %s", seq.request_id, stage, type(exc).__name__, exc,
                     exc_info=exc)
        err = RuntimeError(f"request {seq.request_id}: {stage} failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self._finish(seq, "error", error=err)

    def _fail_step(self, exc: Exception) -> list[Sequence]:
        """A step raised and no single request could be blamed: fail the requests it involved (the
        step in flight and the one being launched; every request when the scheduler itself raised,
        as its state is then unknown), free their blocks and forget the step in flight. The other
        requests keep running and the engine stays usable. Returns the requests now finished."""
        involved = self._step_seqs if self._step_seqs is not None else list(self._seqs.values())
        involved = involved + self.pipeline.drop()
        where = f" in {blame}" if (blame := hook_blame(self.pm, exc)) else ""
        logger.error("engine step failed%s (%s: %s); failing its %d request(s)", where, type(exc).__name__, exc,
                     len({id(s) for s in involved}), exc_info=exc)
        err = RuntimeError(f"engine step failed{where}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        for seq in involved:
            if not seq.is_finished:
                self._finish(seq, "error", error=err)
        finished = [s for s in self._seqs.values() if s.is_finished]
        self._drop(finished)
        return finished

    def _finish(self, seq: Sequence, reason: str, stop_reason=None, error: BaseException | None = None,
                remove_from_scheduler: bool = True) -> None:
        seq.drop_pending()  # tokens still being sampled for it are discarded
        self._sync_requests.discard(seq.request_id)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason, seq.error = reason, stop_reason, error
        seq.metrics.finished_time = time.perf_counter()
        n = seq.num_output_tokens
        if n:
            seq.metrics.decode_ppl = math.exp(-seq.sum_logprob / n)
        self.pm.hook.request_finishing(engine=self, request=seq)
        if remove_from_scheduler:
            self.scheduler.finish(seq)
        else:
            self.blocks.release(seq)
        self.pm.hook.request_finished(engine=self, request=seq)
        if self.spec is not None:
            self.spec.request_finished(seq)

    def _drop(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self._seqs.pop(seq.request_id, None)
            self.scheduler.remove_waiting(seq)

    def _fail_stuck(self) -> None:
        """Nothing could be scheduled although requests wait: a request that can never fit fails
        alone instead of hanging the engine. It must be found so in two idle steps in a row: an
        asynchronous request_ready (a KV fetch finishing) may have only just let it go."""
        waiting = [s for s in self._seqs.values() if not s.is_finished and s.status == Status.WAITING]
        ready = [s for s in waiting if self.scheduler.admission.is_ready(s)]
        if ready and self.scheduler.num_running() == 0:
            seq = ready[0]
            if getattr(self, "_stuck", None) != (seq.request_id, self.stats.steps):
                self._stuck = (seq.request_id, self.stats.steps)  # no step ran since: retry once
                return
            need = -(-seq.num_tokens // self.block_size)
            sizes = {name: pool.num_blocks for name, pool in self.blocks.pools.items()}
            self._finish(seq, "error", error=RuntimeError(
                f"request {seq.request_id} needs {need} KV blocks but the cache has "
                f"{sizes if len(sizes) > 1 else self.blocks.num_blocks}; raise kv_cache_memory"))

    # ---- metrics and shutdown -----------------------------------------------------------
    def metrics(self) -> dict:
        out = {
            "steps": self.stats.steps, "prefill_tokens": self.stats.prefill_tokens,
            "decode_tokens": self.stats.decode_tokens, "preemptions": self.stats.preemptions,
            "overhead_share": self.stats.overhead_share, "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_used": self.blocks.usage(),
            "async_scheduling": self.async_scheduling,
            "overlapped_steps": self.stats.overlapped_steps, "discarded_tokens": self.stats.discarded_tokens,
        }
        if self._idle is not None:
            out.update(self._idle.metrics())
        out.update(self.stats.extra)
        if self.spec is not None:
            out.update(self.spec.metrics())
        if self.window_cache is not None:
            out["window_prefix"] = self.window_cache.metrics()
        for extra in self.pm.hook.collect_metrics(engine=self):
            out.update(extra or {})
        return out

    def shutdown(self) -> None:
        self.pipeline.drain()
        self.pm.hook.engine_shutdown(engine=self)
        gc.unfreeze()
