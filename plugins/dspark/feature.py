"""The ``dspark`` feature: confidence-scheduled speculative decoding.

Enable with ``features=["dspark"]``; configure in its ``[dspark]`` section (validated here):

    draft                   str, "auto"   "auto": the shipped MTP layer (else draft model) of the
                                          embedded model, else the checkpoint's MTP layer; "mtp"; an
                                          HF-format draft dir (a small DeepSeek model sharing the
                                          target's tokenizer); or a dir holding ``mtp.safetensors``
    k                       int, 5        most draft tokens per request and step (1..16)
    budget_policy           str           "throughput" (default: confidence-scheduled variable
                                          length), "budget" (the step verifies verify_share of the
                                          offered draft slots: the global top-k of the batch's
                                          drafts by cumulative confidence, the ``draft_lengths``
                                          kernel op), "threshold" (the drafts whose cumulative
                                          confidence reaches min_confidence, best first under the
                                          budget: the same op) or "fixed" (always k, as far as
                                          memory allows)
    verify_share            float, 0.75   the "budget" policy's verify budget per step, as a share
                                          of the draft slots offered (0..1)
    calibration             str, "auto"   the per-depth calibration beside the confidence head:
                                          "auto" (read by the "budget" and "threshold" policies,
                                          not by "throughput"), "on" or "off"
    min_confidence          float, 0.2    the "threshold" policy's cut (0..1)
    confidence_temperature  float, 1.0    calibration temperature of the confidence head
    verify_budget           int, 0        most draft tokens verified per step over the batch
                                          (0: what the step's token budget leaves)
    host_steps_below        int, 8        with async scheduling on a platform that runs the forward
                                          inline (no async overlap, e.g. a CPU): while fewer requests
                                          run, speculative steps run synchronously (``step_needs_sync``)
                                          with the host's draft loop and lengths; 0: never
    lookup_drafts           bool, true    where a request's text repeats, its drafts follow the tokens
                                          after the latest earlier occurrence of its last 4 tokens
                                          (``plugins.dspark.lookup``) instead of the draft's argmax,
                                          for as long as that run goes (greedy requests on the host
                                          path; every request on the device path, whose drafts are
                                          point masses); only with a confidence head that reads the
                                          lookup features (fitted on such drafts)

``DEEPINFER_ENABLE_MTP_VARLEN=0`` turns variable length off (fixed k). A calibration file beside the
confidence head (``confidence_calibration.json``, ``plugins.dspark.calibration``) maps the head's
output to calibrated per-depth acceptance probabilities. The throughput policy does not read it by
default: with it, concurrency 1 measured 2-5% slower in a same-load A/B (its objective and margins
were tuned on the raw head, and a calibration fitted on fixed-k verifications is not exact for the
positions its own steps start at).

DSpark is the engine's draft proposer (``deepinfer_core.proposer``, given through the
``speculative_proposer`` hook); the engine schedules its drafts as lookahead tokens, verifies them
in the step's one forward and rolls back the rejected ones (``deepinfer_core.engine.speculative``).
After each step (``propose``) the draft catches up on the tokens the target computed (prefill
chunks, accepted tokens) and proposes up to k drafts per request, with a confidence per draft;
under the throughput policy it stops drafting when one more draft step no longer pays for itself,
and cuts each request's drafts to the lengths the policy chooses (``plugins.dspark.policy``) from
their confidences and this platform's measured step-time curve (with async scheduling it proposes
on the device instead: ``plugins.dspark.device``). A draft model's decode steps run
on a lean path (``plugins.dspark.lean``); the curve is corrected by every step's measured times
(``policy.LiveCost``); ``verified`` takes the engine's accept counts back.

Requests with penalties or ``so_args`` get drafts too: the engine applies penalties and grammar masks
per verified row.

Metrics: per request ``metrics.extra`` ``accept_rate``, ``mean_accepted_len`` (accepted draft
tokens per decode step), ``verified_per_step`` (draft tokens verified per decode step); overall
(``collect_metrics``) the same with a ``dspark_`` prefix plus draft/verify/schedule seconds.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

import deepinfer_core
from deepinfer_core.config import ConfigError, env_flag
from deepinfer_core.engine.fingerprint import model_fingerprint
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.features import Feature
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv_cache_spec import KVCacheSpec
from deepinfer_core.models.loader import EMBEDDED_MODEL, load_model_config
from deepinfer_core.proposer import MAX_K, Draft, Proposer
from deepinfer_core.scheduler import SchedulerOutput
from plugins.dspark import calibration as calib_mod
from plugins.dspark import confidence as conf_mod
from plugins.dspark import metrics
from plugins.dspark.calibrate import load_or_measure_cost
from plugins.dspark.calibration import Calibration
from plugins.dspark.device import EXPLORE_VERIFY_EVERY, DeviceDrafter
from plugins.dspark.draft import CACHE_GROUP, DraftModel, MTPDraft, has_mtp, is_mtp_dir
from plugins.dspark.drafter import MEASURED_MIN_ROWS, Drafter
from plugins.dspark.policy import (
    LiveCost,
    MeasuredRates,
    StepCost,
    choose_lengths,
    drafting_can_pay,
    fixed_lengths,
)
from plugins.dspark.state import KEY, _Rows, _State  # noqa: F401 (_Rows: tests, tools)

logger = logging.getLogger("deepinfer.dspark")
DEFAULTS = {"draft": "auto", "k": 5, "budget_policy": "throughput", "confidence_temperature": 1.0,
            "verify_budget": 0, "min_confidence": 0.2, "verify_share": 0.75, "calibration": "auto",
            "host_steps_below": 8, "lookup_drafts": True}
DEFAULT_DRAFT = Path(deepinfer_core.__file__).resolve().parent / "assets" / "default_draft"
DEFAULT_MTP = Path(deepinfer_core.__file__).resolve().parent / "assets" / "default_mtp"  # preferred when present
POLICIES = ("throughput", "budget", "threshold", "fixed")
# while dormant: no exploratory step when drafts accepted this often would still not pay at this batch size
OPTIMISTIC_CONF = 0.9


def varlen_enabled() -> bool:
    return env_flag("DEEPINFER_ENABLE_MTP_VARLEN", True)


class DSpark(Drafter, DeviceDrafter, Feature, Proposer):
    name = "dspark"
    core_api_version = "1.0"
    writes_draft_kv = True  # the draft's cache group is written at the drafts' positions
    paces_itself = True  # its step-time curve and accept rates decide when drafting pays

    def __init__(self, section: dict) -> None:
        o = self.check_keys(self.name, section, DEFAULTS)
        if isinstance(o["k"], bool) or not 1 <= o["k"] <= MAX_K:
            raise ConfigError(f"[dspark] k must be an int in 1..{MAX_K}, got {o['k']!r}")
        if o["budget_policy"] not in POLICIES:
            raise ConfigError(f"[dspark] budget_policy must be one of {', '.join(map(repr, POLICIES))}, got "
                              f"{o['budget_policy']!r}")
        mc = o["min_confidence"]
        if isinstance(mc, bool) or not (isinstance(mc, (int, float)) and 0 <= mc <= 1):
            raise ConfigError(f"[dspark] min_confidence must be a number in 0..1, got {mc!r}")
        vs = o["verify_share"]
        if isinstance(vs, bool) or not (isinstance(vs, (int, float)) and 0 <= vs <= 1):
            raise ConfigError(f"[dspark] verify_share must be a number in 0..1, got {vs!r}")
        if o["calibration"] not in ("auto", "on", "off"):
            raise ConfigError(f"[dspark] calibration must be 'auto', 'on' or 'off', got {o['calibration']!r}")
        t = o["confidence_temperature"]
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ConfigError(f"[dspark] confidence_temperature must be a positive number, got {t!r}")
        hb = o["host_steps_below"]
        if isinstance(hb, bool) or not isinstance(hb, int) or hb < 0:
            raise ConfigError(f"[dspark] host_steps_below must be an int >= 0 (0: never), got {hb!r}")
        if isinstance(o["verify_budget"], bool) or o["verify_budget"] < 0:
            raise ConfigError(f"[dspark] verify_budget must be an int >= 0 (0: no limit), got {o['verify_budget']!r}")
        if not o["draft"]:
            raise ConfigError("[dspark] draft must be 'auto', 'mtp' or a draft checkpoint directory")
        self.opts = o
        self.k = o["k"]
        self.varlen = o["budget_policy"] != "fixed" and varlen_enabled()
        self.threshold = o["budget_policy"] == "threshold"
        self.budgeted = o["budget_policy"] == "budget"  # always drafts k deep; verifies a share of the slots
        self.lookup_drafts = False  # ``lookup_drafts`` where the head reads the lookup features (engine_started)
        self.engine = None
        self._host_below = 0  # host_steps_below where it applies (``step_needs_sync``), else 0; set at start
        self._source_plan: tuple | None = None  # (kind, path) of the draft, decided in cache_groups
        self.source = None
        self.head = None
        self.calib: Calibration | None = None  # per-depth calibration of the head's output, when shipped
        self.cost: StepCost | None = None  # the start-up measurement
        self.live: LiveCost | None = None  # it, corrected by each step's measured times (what the policy uses)
        self._pending: tuple | None = None  # the last decode step's times, until the next step starts
        self._drafted = (0, 0, 0.0)  # (rows, draft steps after the first token, their seconds) this step
        self._caught = 0  # rows of this step's draft catch-up forward
        self._room: dict[str, int] = {}  # request id -> drafts whose KV slots the engine reserved
        self.outcome_log: list | None = None  # set to a list to log (features, accepted) per verified draft
        self.last_depth = 0
        # the coming steps draft on the host (without async speculation always, set in ``engine_started``;
        # with it, as ``step_needs_sync`` finds each step): whose running accept rate the forecast reads
        self._host_path = False
        self.mean_conf = 0.6  # start value of each path's running accept rate (``observe_accepts``)
        self._depth_acc: list[float] = []  # the same per depth (``level_probs``)
        self._depth_dec: list[float] = []
        self.skipped = 0  # consecutive steps without drafting
        self.explore_every = 64  # skipped steps between exploratory drafts (doubles while they do not pay)
        self.exploring = False
        self.resumed = False  # drafting runs since an exploratory step (a short run counts as a loss)
        self.drafting_run = 0  # drafting decisions in a row
        self.rates = MeasuredRates()  # tokens/s measured drafting and not, per batch size: a veto on the forecast
        self.resume_after: int | None = None  # a plain-rate probe: dormant steps before looking again
        self.trial_left = 0  # drafting steps of a trial (the measured veto is off while they refresh the rate)
        self._regime: bool | None = None  # whether the step now running is a speculative one (from active())
        self._prev_regime: bool | None = None  # the same of the last step
        self._last_stats: tuple[float, int] | None = None  # the engine's (step_time, decode_tokens) at the last step
        self.launched_steps = 0  # the engine's launched steps, as of the last step_finished
        self.n = dict(verified=0, accepted=0, decode_steps=0, spec_steps=0, proposals=0, depth=0, skipped_steps=0,
                      plans=0, blocked_explorations=0, measured_vetoes=0, plain_probes=0, trials=0, budgets=0,
                      async_vetoes=0)
        self.t = dict(draft=0.0, verify=0.0, schedule=0.0)

    # ---- start-up -------------------------------------------------------------------------
    @hookimpl
    def engine_started(self, engine) -> None:
        self.engine = engine
        self.source = self._resolve_source(engine)
        head_path = getattr(self.source, "path", None)
        temp = float(self.opts["confidence_temperature"])
        if head_path is not None and (Path(head_path) / conf_mod.FILENAME).is_file():
            self.head = conf_mod.ConfidenceHead.load(Path(head_path) / conf_mod.FILENAME, self.source.hidden_size,
                                                     temp, engine.device)
        else:
            self.head = conf_mod.ConfidenceHead.fallback(temp)
        # drafts follow the lookup runs only for a head fitted on such drafts (one that reads the lookup
        # features, among them where a run token replaced the argmax): another head reads an overridden
        # draft's low q(d) as a likely rejection
        self.lookup_drafts = self.opts["lookup_drafts"] and self.head.uses_lookup
        if head_path is not None and (Path(head_path) / calib_mod.FILENAME).is_file():
            try:  # checked whenever it is there, read by the policies that rank drafts by probability
                calib = Calibration.load(Path(head_path) / calib_mod.FILENAME)
            except ValueError as exc:
                raise ConfigError(f"[dspark] the draft's confidence calibration is unusable: {exc}") from None
            mode = self.opts["calibration"]
            if mode == "on" or (mode == "auto" and self.varlen and (self.budgeted or self.threshold)):
                self.calib = calib
        if self.head.uses_target and not self.source.needs_hidden:
            raise ConfigError(f"[dspark] the confidence head {head_path}/{conf_mod.FILENAME} reads the target's "
                              "features, which only an MTP draft is fed")
        self._check_trained_for(engine)
        cfg = engine.cfg
        self._host_path = not (engine.async_scheduling and cfg.async_speculation)
        inline = engine.async_scheduling and not engine.platform.supports_async_overlap()  # (step_needs_sync)
        self._host_below = self.opts["host_steps_below"] if inline else 0
        self.cost = load_or_measure_cost(engine, self)
        self.live = LiveCost(self.cost)
        logger.info("dspark: draft %s, k=%d, %s length, confidence head %s%s", self.source.kind, self.k,
                    "variable" if self.varlen else "fixed", "trained" if self.head.trained else "q(d)",
                    ", calibrated per depth" if self.calib is not None else "")

    def _check_trained_for(self, engine) -> None:
        """A draft whose training report names another target still works (verification keeps the
        output exact), but accepts less: say so."""
        report = Path(getattr(self.source, "path", "")) / "training_report.json"
        if not report.is_file():
            return
        try:
            trained_for = json.loads(report.read_text()).get("target_fingerprint")
        except (OSError, ValueError):
            return
        if trained_for and trained_for != model_fingerprint(engine.model_dir, torch.float32):
            logger.warning("dspark: draft %s was trained for another version of the target (fingerprint %s); "
                           "it still works but accepts less - retrain it with examples/train_dspark_draft.py",
                           self.source.path, trained_for)

    def _plan_source(self, engine) -> tuple[str, Path | None]:
        """(kind "mtp" | "model", path or None for the target's own MTP layer) of the draft."""
        draft = self.opts["draft"]
        mc = engine.model_config
        if draft == "auto":
            embedded = Path(engine.model_dir).resolve() == EMBEDDED_MODEL.resolve()
            if embedded and is_mtp_dir(DEFAULT_MTP):
                return "mtp", DEFAULT_MTP
            if embedded and (DEFAULT_DRAFT / "config.json").is_file():
                return "model", DEFAULT_DRAFT
            if has_mtp(engine.model_dir, mc.num_hidden_layers):
                return "mtp", None
            raise ConfigError(
                f"[dspark] draft = 'auto' but checkpoint {str(engine.model_dir)!r} has no MTP layer "
                f"(model.layers.{mc.num_hidden_layers}.*) and is not the embedded model; set [dspark] draft "
                "to a draft model directory")
        if draft == "mtp":
            return "mtp", None
        path = Path(draft).expanduser()
        if not path.is_dir():
            raise ConfigError(f"[dspark] draft {draft!r} is not 'auto', 'mtp' or an existing directory")
        return ("mtp", path) if is_mtp_dir(path) else ("model", path)

    @hookimpl
    def cache_groups(self, engine, layout):
        """The draft's KV: one FULL group beside the target's, inside the KV budget. It shares the
        target's block pool, so the draft reads and writes at the target's slots."""
        kind, path = self._source_plan = self._plan_source(engine)
        target = engine.model_config
        if not hasattr(target, "kv_entry_dim"):
            raise ConfigError(f"[dspark] drafts for a {target.architecture} target are not supported "
                              "(DeepSeek V2/V3 targets only)")
        if kind == "mtp":
            layers, dim = 1, target.kv_entry_dim
        else:
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"[dspark] draft {str(path)!r} is not an HF checkpoint directory (no config.json)")
            cfg = load_model_config(Path(path))
            layers, dim = cfg.num_hidden_layers, cfg.kv_entry_dim
        return [KVCacheSpec(CACHE_GROUP, tuple(range(layers)), dim)]

    def _resolve_source(self, engine):
        if engine.blocks.pool_of.get(CACHE_GROUP) != engine.blocks.primary.name:
            raise ConfigError("[dspark] the draft cache must share the target's first cache pool")
        kind, path = self._source_plan
        if kind == "mtp":
            return MTPDraft(engine, path)
        return DraftModel(engine, path)

    # ---- the proposer ----------------------------------------------------------------------
    @hookimpl
    def speculative_proposer(self, engine):
        return self if self.source is not None else None

    def active(self, engine) -> bool:
        """Dormant (plain async steps) while drafting does not pay; a speculative step again after
        ``explore_gap`` skipped steps, where ``_worth_speculating`` decides anew (and explores),
        unless the step-time curve says that at the present batch size even drafts accepted with
        probability ``OPTIMISTIC_CONF`` would not pay: then it stays dormant, with no exploratory step
        (the "never slower than plain decoding" floor at high concurrency)."""
        self._regime = True
        if self.skipped == 0:
            return True
        running = engine.load_stats()["running"]
        if self._host_below and running < min(self._host_below, MEASURED_MIN_ROWS):
            # host steps (the forward runs inline, so nothing overlaps and a dormant step saves nothing):
            # the host path decides every step (``_worth_speculating``), where each request's last
            # confidence drifts back to the mean while it does not draft. Dormant here, one unlucky first
            # draft kept a request of 64 tokens from drafting for the rest of it (the exploration gap)
            return True
        self.skipped += 1
        self.n["skipped_steps"] += 1
        if self.resume_after is not None and self.skipped > self.resume_after:  # a plain-rate probe ends
            self.resume_after = None
            return True
        if self.resume_after is None:
            if self.skipped > self.explore_gap(running):
                if self._may_explore(running):
                    return True
                self.skipped = 1
        self._regime = False
        self._pending = None  # the step-time observations resume with contiguous speculative steps
        return False

    @hookimpl
    def step_needs_sync(self, engine) -> bool:
        """With async scheduling, where the platform runs the forward inline (``supports_async_overlap``
        False) nothing overlaps, so at a few requests (``host_steps_below``) a speculative step runs
        synchronously: the host's draft loop stops when one more draft no longer pays and cuts each
        request's lengths by its confidences and the measured curve, where the device path must draft
        ``min(k, budget)`` deep blind and verify the rows the host laid out before the drafts existed
        (at concurrency 1 on the CPU: 1.29-1.40x plain against 1.27x, ``examples/dspark_bench.py``).
        From that many requests on the device path's cheap dormancy and one-step explorations win.
        A step with no request running yet only prefills: it is counted by the requests it admits, so a
        wave that starts large takes the device path from its first step, as plain decoding's does (a
        synchronous prefill left DSpark one forward behind plain decoding's pipeline), and a request
        that runs alone is prefilled on the host, whose draft then reads the prompt's hidden states."""
        load = engine.load_stats()
        coming = load["running"] or min(load["waiting"], load["max_running"])
        host = self._host_below > 0 and self.source is not None and coming < self._host_below
        self._host_path = host or not engine.cfg.async_speculation
        return host

    @hookimpl
    def step_finished(self, engine, step_stats) -> None:
        """Each step's own time and decode tokens (the engine's counters: work outside the engine's
        steps, e.g. another engine in the process, is not counted) feed the measured rate of its
        regime, drafting or not (tokens verified in a step may be counted one step late, which a
        run of steps of one regime evens out; the first step of a run is left out)."""
        self.launched_steps = step_stats.launched_steps  # (the device drafts' catch-up bounds)
        now = (step_stats.step_time, step_stats.decode_tokens)
        drafting = self._regime if self._regime is not None else self.skipped == 0  # no async: no active()
        if self._last_stats is not None and drafting == self._prev_regime:
            self.rates.observe(drafting, engine.load_stats()["running"], now[1] - self._last_stats[1],
                               now[0] - self._last_stats[0])
        self._regime, self._prev_regime, self._last_stats = None, drafting, now

    def _may_explore(self, rows: int) -> bool:
        """Whether an exploratory draft can find drafting paying at ``rows`` decoding requests: by the
        step-time curve, drafts accepted with probability ``OPTIMISTIC_CONF`` (or a little above the
        running mean, if higher) would pay; from ``MEASURED_MIN_ROWS`` requests on, where async steps were
        measured at this batch size, also by their measured curve against the measured plain rate, at a
        little above the running mean (``async_verdict``). Counts ``blocked_explorations`` when not."""
        hope = min(self.mean_conf + 0.1, 0.99)
        if drafting_can_pay(rows, self.live, self.k, max(OPTIMISTIC_CONF, hope)) and \
                (rows < MEASURED_MIN_ROWS or self.async_verdict(rows, hope) is not False):
            return True
        self.n["blocked_explorations"] += 1
        return False

    @property
    def needs_hidden(self) -> bool:
        return self.source is not None and self.source.needs_hidden

    def propose(self, engine, requests: list[Sequence], max_drafts: list[int], batch) -> list[Draft | None]:
        """After a step: catch the draft up on what the target computed and draft for the next step;
        the lengths are cut by the policy (``_choose``)."""
        t0 = time.perf_counter()
        self._room = dict(zip((r.request_id for r in requests), max_drafts))  # slots the engine reserved
        if self._pending is not None:  # the previous decode step's times, with its whole cycle
            *obs, start, contiguous, caught = self._pending
            # its cycle: from its start to this step's (not to this propose, which would count this
            # step's forward as the previous step's overhead: about a whole forward too much)
            self.live.observe(*obs, cycle_s=batch.started - start if contiguous else None, catchup_rows=caught)
            self._pending = None
        scheduled = SchedulerOutput(prefills=batch.scheduled[: batch.num_prefills],
                                    decodes=batch.scheduled[batch.num_prefills :])
        for s in scheduled.decodes:
            st = s.seq.feature_state.get(KEY)
            if st:
                st.decode_steps += 1
                self.n["decode_steps"] += 1
        rowmap = {s.seq.request_id: (r, c) for s, r, c in zip(batch.scheduled, batch.row_starts,
                                                               batch.computed_before)}
        self._drafted, self._caught = (0, 0, 0.0), 0
        with torch.inference_mode():
            self._propose(engine, scheduled, batch, rowmap if self.source.needs_hidden else None)
        engine.platform.synchronize()
        dd = time.perf_counter() - t0
        self.t["draft"] += dd
        self.t["verify"] += batch.forward_s
        if not scheduled.prefills and scheduled.decodes:
            live = sum(1 for s in scheduled.decodes if not s.seq.is_finished)
            rows, steps, steps_s = self._drafted
            self._pending = (batch.input_ids.shape[0], batch.forward_s, rows, steps, steps_s,
                             dd - steps_s if rows else 0.0, len(scheduled.decodes), batch.started, live > 0,
                             self._caught)
        t1 = time.perf_counter()
        out = self._choose(engine, requests, max_drafts)
        self.t["schedule"] += time.perf_counter() - t1
        return out

    def _choose(self, engine, requests: list[Sequence], max_drafts: list[int]) -> list[Draft | None]:
        """The drafts to verify next step: cut to the lengths the policy picks from their
        confidences and the step-time curve (variable length), or as many as fit (fixed)."""
        cands, caps, idx = [], [], []
        for i, (seq, m) in enumerate(zip(requests, max_drafts)):
            st = seq.feature_state.get(KEY)
            if st and st.drafts and st.base_len == seq.num_tokens and st.epoch == seq.metrics.num_preemptions:
                cap = min(len(st.drafts), m, len(seq.block_table) * engine.block_size - seq.num_tokens)
                if cap > 0:
                    cands.append((seq, st))
                    caps.append(cap)
                    idx.append(i)
        out: list[Draft | None] = [None] * len(requests)
        if not cands:
            return out
        n_tokens = len(requests)  # the next step's query tokens (one per decode)
        budget = engine.cfg.max_num_batched_tokens - n_tokens
        if self.opts["verify_budget"]:
            budget = min(budget, self.opts["verify_budget"])
        if self.varlen and self.budgeted:  # the global top-k by cumulative confidence under the step's budget
            slots = [min(m, len(seq.block_table) * engine.block_size - seq.num_tokens)
                     for (seq, _), m in zip(cands, (max_drafts[i] for i in idx))]
            budget = min(budget, self.share_budget(sum(slots)))
            lengths = self._threshold_lengths(engine, [st.conf[:c] for (_, st), c in zip(cands, caps)], budget, 0.0)
            self.n["plans"] += 1
        elif self.varlen and self.threshold:
            lengths = self._threshold_lengths(engine, [st.conf[:c] for (_, st), c in zip(cands, caps)], budget)
        elif self.varlen:
            fixed = self.live.overhead(len(requests)) + self.live.drafting(len(cands), self.last_depth)
            lengths = choose_lengths([st.cum[:c] for (_, st), c in zip(cands, caps)], n_tokens, budget,
                                     self.live, fixed)
            self.n["plans"] += 1
            if self.n["plans"] % EXPLORE_VERIFY_EVERY == 0 and sum(lengths) < budget:
                # one draft more than chosen, on the request whose next draft is likeliest: the live
                # cost model then sees the step time of the next verify size too
                more = [(st.cum[m], i) for i, ((_, st), c, m) in enumerate(zip(cands, caps, lengths)) if m < c]
                if more:
                    lengths[max(more)[1]] += 1
        else:
            lengths = fixed_lengths(caps, budget)
        for i, (_, st), m in zip(idx, cands, lengths):
            if m > 0:
                out[i] = Draft(st.drafts[:m], None if st.q is None else st.q[:m], st.conf[:m])
            else:
                st.drafts, st.q, st.feats = [], None, None
        return out

    def share_budget(self, slots: int) -> int:
        """The "budget" policy's verify budget for a step offered ``slots`` draft slots."""
        return max(0, math.floor(float(self.opts["verify_share"]) * slots + 0.5))

    def verify_budget(self, engine, num_requests: int, num_slots: int) -> int | None:
        """Async steps (``Proposer.verify_budget``): the "budget" policy fixes the step's verify
        rows on the host as its share of the offered slots; the other policies as their device drafts
        need (``DeviceDrafter.device_budget``)."""
        if self.varlen and self.budgeted:
            return self.share_budget(num_slots)
        return self.device_budget(engine, num_requests, num_slots)

    def _threshold_lengths(self, engine, conf: list[list[float]], budget: int,
                           min_conf: float | None = None) -> list[int]:
        """Lengths through the ``draft_lengths`` kernel op (a TileLang kernel on nvidia): per
        request, its drafts whose cumulative confidence reaches ``min_conf`` (default: the
        ``min_confidence`` setting), the likeliest over the whole batch first while the verify
        budget lasts."""
        K = max(len(c) for c in conf)
        mat = torch.zeros(len(conf), K, dtype=torch.float32)
        for i, c in enumerate(conf):
            mat[i, : len(c)] = torch.tensor(c, dtype=torch.float32)
        caps = torch.tensor([len(c) for c in conf], dtype=torch.int64)
        cut = float(self.opts["min_confidence"]) if min_conf is None else float(min_conf)
        out = engine.kernels.draft_lengths(mat.to(engine.device), caps.to(engine.device), budget, cut)
        return out.tolist()

    def _state(self, seq: Sequence) -> _State | None:
        st = seq.feature_state.get(KEY)
        if st is None:
            st = seq.feature_state[KEY] = _State(seq.metrics.num_preemptions)
        elif st is False:
            return None
        elif st.epoch != seq.metrics.num_preemptions:  # preempted: its blocks (and draft KV) are gone
            st.epoch, st.done, st.drafts, st.q = seq.metrics.num_preemptions, 0, [], None
            st.dev_launch, st.dev_pending = -2, False
            st.kept_hidden, st.kept_rows = [], 0
        return st

    def verified(self, engine, requests: list[Sequence], num_drafts: list[int], num_accepted: list[int]) -> None:
        for seq, m, a in zip(requests, num_drafts, num_accepted):
            st = seq.feature_state.get(KEY)
            if not st:
                continue
            if st.dev_pending:  # drafted on the device (async): the catch-up keeps its own bounds
                self.device_verified(st, m, a)
            else:
                if m > 0:
                    self.observe_accepts(m, a, host=True)
                if self.source.needs_hidden:
                    st.done = min(st.done, seq.num_computed_tokens)
                else:  # draft KV is valid up to the last token, plus the accepted drafts it wrote
                    st.done = seq.num_computed_tokens - a + min(a, st.fed)
            st.verified += m
            st.accepted += a
            self.n["verified"] += m
            self.n["accepted"] += a
            self.n["spec_steps"] += 1
            if m > 0:
                st.prev_frac = a / m
            if self.outcome_log is not None and st.feats is not None:
                h, lq, ent, lq2, tf, lk = st.feats
                n_log = min(a + 1, m)
                # (hidden, log q, entropy of all verified positions, greedy, confidences and outcomes of
                #  the positions the target decided, the last token then the draft tokens, P_1..P_m, accepted
                #  count, log q of the top-2 token per verified position, the target's confidence features
                #  at the last verified position (MTP, else None), the lookup features per verified position)
                first = seq.num_computed_tokens - a  # index of d_1
                self.outcome_log.append((h[:m], lq[:m], ent[:m], seq.params.temperature <= 0,
                                         st.conf[:n_log], [1.0] * min(a, n_log) + [0.0] * (n_log - min(a, n_log)),
                                         seq.token_ids[first - 1 : first] + st.drafts[:m], st.cum[:m], a, lq2[:m], tf,
                                         lk[:m]))
            st.drafts, st.q, st.feats = [], None, None
            self._request_metrics(seq, st)

    @staticmethod
    def _request_metrics(seq: Sequence, st: _State) -> None:
        steps = max(st.decode_steps, 1)
        seq.metrics.extra.update({
            "accept_rate": st.accepted / st.verified if st.verified else 0.0,
            "mean_accepted_len": st.accepted / steps,
            "verified_per_step": st.verified / steps,
        })

    # ---- metrics and teardown -------------------------------------------------------------
    @hookimpl
    def request_finished(self, engine, request) -> None:
        st = request.feature_state.get(KEY)
        if st:
            self._request_metrics(request, st)
            st.q = st.feats = None
            st.drafts = []

    @hookimpl
    def collect_metrics(self, engine) -> dict | None:
        return None if self.source is None else metrics.collect(self)

    @hookimpl
    def merge_metrics(self, per_rank: list[dict]) -> dict | None:
        return metrics.merge(per_rank)

    def reset_metrics(self) -> None:
        for key in self.n:
            self.n[key] = 0
        for key in self.t:
            self.t[key] = 0.0
