"""The ``dspark`` feature: confidence-scheduled speculative decoding.

Enable with ``features=["dspark"]``; configure in its ``[dspark]`` section (validated here):

    draft                   str, "auto"   "auto": the shipped MTP layer (else draft model) of the
                                          embedded model, else the checkpoint's MTP layer; "mtp"; an
                                          HF-format draft dir (a small DeepSeek model sharing the
                                          target's tokenizer); or a dir holding ``mtp.safetensors``
    k                       int, 5        most draft tokens per request and step (1..16)
    budget_policy           str           "throughput" (default: confidence-scheduled variable
                                          length) or "fixed" (always k, as far as memory allows)
    confidence_temperature  float, 1.0    calibration temperature of the confidence head
    verify_budget           int, 0        most draft tokens verified per step over the batch
                                          (0: what the step's token budget leaves)

``DEEPINFER_ENABLE_MTP_VARLEN=0`` turns variable length off (fixed k).

A step (``execute_step``): the drafts proposed at the end of the previous step are cut to the
lengths the policy chooses (``plugins.dspark.policy``) from their confidences and this platform's
measured step-time curve; every decode request then gets the query tokens [last token, d_1..d_m]
and ONE target forward runs over prefill chunks and decodes together. Requests without drafts go
through the engine's normal post-processing; drafted ones through rejection sampling
(``plugins.dspark.rejection``), ``engine.append_tokens``, and a KV roll-back of rejected tokens.
Finally the draft catches up on the tokens the target computed (prefill chunks, accepted tokens)
and proposes up to k drafts per request for the next step, with a confidence per draft; under
the throughput policy it stops drafting when one more draft step no longer pays for itself. A draft
model's decode steps run on a lean path (``plugins.dspark.lean``); the policy's step-time curve is
corrected by every step's measured times (``policy.LiveCost``).

Requests using penalties or feature-owned options (``so_args``) are decoded without drafts.

Metrics: per request ``metrics.extra`` ``accept_rate``, ``mean_accepted_len`` (accepted draft
tokens per decode step), ``verified_per_step`` (draft tokens verified per decode step); overall
(``collect_metrics``) the same with a ``dspark_`` prefix plus draft/verify/schedule seconds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

import deepinfer_core
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.cost_model import cache_dir
from deepinfer_core.engine.engine import model_fingerprint
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.features import Feature
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv_cache_spec import KVCacheSpec
from deepinfer_core.models.loader import EMBEDDED_MODEL, load_model_config
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, PrefillMeta
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput
from plugins.dspark import confidence as conf_mod
from plugins.dspark.draft import CACHE_GROUP, DraftModel, MTPDraft, has_mtp, is_mtp_dir
from plugins.dspark.lean import context_slot_table
from plugins.dspark.policy import LiveCost, StepCost, choose_lengths, fixed_lengths, worth_drafting
from plugins.dspark.rejection import STREAM_DRAFT, SamplingRows, draw, filtered_probs, stream, verify

logger = logging.getLogger("deepinfer.dspark")
KEY = "dspark"
MAX_K = 16
DEFAULTS = {"draft": "auto", "k": 5, "budget_policy": "throughput", "confidence_temperature": 1.0,
            "verify_budget": 0}
DEFAULT_DRAFT = Path(deepinfer_core.__file__).resolve().parent / "assets" / "default_draft"
DEFAULT_MTP = Path(deepinfer_core.__file__).resolve().parent / "assets" / "default_mtp"  # preferred when present
DECODE_SPAN = MAX_K + 1  # catch-up spans up to this long use the decode (absorbed) attention path
EXPLORE_ROWS = 4  # requests drafting in an exploratory step while drafting does not pay
MAX_KEPT = 512  # most positions of target hidden states an MTP request keeps while not drafting
# A request's last first-draft confidence predicts its next one only weakly (lag-1 autocorrelation 0.16
# on held-out prompts), so whether to draft at all is forecast this far from the running mean towards it.
SKIP_FORECAST_BLEND = 0.5
EXPLORE_VERIFY_EVERY = 16  # varlen steps between verifying one draft more than chosen (measures that size)


def varlen_enabled() -> bool:
    return os.environ.get("DEEPINFER_ENABLE_MTP_VARLEN", "1").strip().lower() not in ("0", "false", "no", "off")


class _State:
    """Per-request draft state (``seq.feature_state['dspark']``)."""

    __slots__ = ("epoch", "done", "drafts", "cum", "conf", "q", "base_len", "fed", "feats",
                 "verified", "accepted", "decode_steps", "recent_conf", "kept_hidden", "kept_rows")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.done = 0  # positions whose draft KV is valid
        self.drafts: list[int] = []  # proposed tokens for token indices base_len, base_len + 1, ...
        self.cum: list[float] = []  # P(d_1..d_j all accepted)
        self.conf: list[float] = []
        self.q: torch.Tensor | None = None  # draft distributions [n, V] (sampled requests)
        self.base_len = -1
        self.fed = 0  # drafts whose draft KV was written (valid when accepted)
        self.feats = None  # (hidden, logq, entropy) when outcomes are logged
        self.verified = self.accepted = self.decode_steps = 0
        self.recent_conf: float | None = None  # its last first-draft confidence (is its text predictable now?)
        # MTP: the target's hidden states of positions done, done + 1, ... computed in steps without
        # drafting, kept for the catch-up when drafting resumes
        self.kept_hidden: list[torch.Tensor] = []
        self.kept_rows = 0


class _Rows:
    """The requests drafting this step, as tensors for the autoregressive draft loop."""

    def __init__(self, seqs: list[Sequence], caps: list[int], block_size: int, device) -> None:
        self.seqs, self.caps = seqs, caps
        R = len(seqs)
        width = max(len(s.block_table) for s in seqs)
        self.block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                         dtype=torch.int32, device=device)
        self.bt_long = self.block_tables.long()
        self.base = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long, device=device)
        self.cap_t = torch.tensor(caps, dtype=torch.long, device=device)
        self.cu = torch.arange(R + 1, dtype=torch.long, device=device)
        self.greedy_list = [s.params.temperature <= 0 for s in seqs]
        self.all_greedy = all(self.greedy_list)
        self.greedy = torch.tensor(self.greedy_list, dtype=torch.bool, device=device)
        self.seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=device)
        self.params = None if self.all_greedy else SamplingRows.from_params([s.params for s in seqs], device)
        self.block_size = block_size
        self.row_idx = torch.arange(R, device=device)
        self.base_max = max(s.num_tokens for s in seqs)
        self.head_rows: tuple | None = None  # the confidence head's per-row coefficients, once computed
        self._ctx: torch.Tensor | None = None

    @property
    def ctx(self) -> torch.Tensor:
        """[R, W * block_size] cache slot of every position of each row (the lean draft path)."""
        if self._ctx is None:
            self._ctx = context_slot_table(self.block_tables, self.block_size)
        return self._ctx


class DSpark(Feature):
    name = "dspark"
    core_api_version = "1.0"

    def __init__(self, section: dict) -> None:
        o = self.check_keys(self.name, section, DEFAULTS)
        if isinstance(o["k"], bool) or not 1 <= o["k"] <= MAX_K:
            raise ConfigError(f"[dspark] k must be an int in 1..{MAX_K}, got {o['k']!r}")
        if o["budget_policy"] not in ("throughput", "fixed"):
            raise ConfigError(f"[dspark] budget_policy must be 'throughput' or 'fixed', got {o['budget_policy']!r}")
        t = o["confidence_temperature"]
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ConfigError(f"[dspark] confidence_temperature must be a positive number, got {t!r}")
        if isinstance(o["verify_budget"], bool) or o["verify_budget"] < 0:
            raise ConfigError(f"[dspark] verify_budget must be an int >= 0 (0: no limit), got {o['verify_budget']!r}")
        if not o["draft"]:
            raise ConfigError("[dspark] draft must be 'auto', 'mtp' or a draft checkpoint directory")
        self.opts = o
        self.k = o["k"]
        self.varlen = o["budget_policy"] == "throughput" and varlen_enabled()
        self.engine = None
        self._source_plan: tuple | None = None  # (kind, path) of the draft, decided in cache_groups
        self.source = None
        self.head = None
        self.cost: StepCost | None = None  # the start-up measurement
        self.live: LiveCost | None = None  # it, corrected by each step's measured times (what the policy uses)
        self._pending: tuple | None = None  # the last decode step's times, until the next step starts
        self._drafted = (0, 0, 0.0)  # (rows, draft steps after the first token, their seconds) this step
        self._caught = 0  # rows of this step's draft catch-up forward
        self.outcome_log: list | None = None  # set to a list to log (features, accepted) per verified draft
        self.last_depth = 0
        self.mean_conf = 0.6  # running mean of the drafts' confidences (decides whether to draft at all)
        self.skipped = 0  # consecutive steps without drafting
        self.explore_every = 64  # skipped steps between exploratory drafts (doubles while they do not pay)
        self.exploring = False
        self.n = dict(verified=0, accepted=0, decode_steps=0, spec_steps=0, proposals=0, depth=0, skipped_steps=0,
                      plans=0)
        self.t = dict(draft=0.0, verify=0.0, schedule=0.0)

    # ---- start-up -------------------------------------------------------------------------
    @hookimpl
    def max_draft_tokens(self, engine) -> int:
        return self.k

    @hookimpl
    def engine_started(self, engine) -> None:
        if engine.cfg.ep > 1:
            raise ConfigError("[dspark] speculative decoding does not support expert parallelism (ep > 1) yet")
        self.engine = engine
        self.source = self._resolve_source(engine)
        head_path = getattr(self.source, "path", None)
        temp = float(self.opts["confidence_temperature"])
        if head_path is not None and (Path(head_path) / conf_mod.FILENAME).is_file():
            self.head = conf_mod.ConfidenceHead.load(Path(head_path) / conf_mod.FILENAME, self.source.hidden_size,
                                                     temp, engine.device)
        else:
            self.head = conf_mod.ConfidenceHead.fallback(temp)
        self._check_trained_for(engine)
        self.cost = self._load_or_measure_cost(engine)
        self.live = LiveCost(self.cost)
        logger.info("dspark: draft %s, k=%d, %s length, confidence head %s", self.source.kind, self.k,
                    "variable" if self.varlen else "fixed", "trained" if self.head.trained else "q(d)")

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

    # ---- the step -------------------------------------------------------------------------
    @hookimpl
    def execute_step(self, engine, scheduled: SchedulerOutput):
        if self.source is None:
            return None
        with torch.inference_mode():
            self._step(engine, scheduled)
        return True

    def _step(self, engine, scheduled: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        if self._pending is not None:  # the previous decode step's times, with its whole cycle
            *obs, start, contiguous, caught = self._pending
            self.live.observe(*obs, cycle_s=t0 - start if contiguous else None, catchup_rows=caught)
            self._pending = None
        plan, drafted = self._plan(engine, scheduled)
        t1 = time.perf_counter()
        self.t["schedule"] += t1 - t0
        rowmap = self._row_map(scheduled, plan) if self.source.needs_hidden else None
        batch = engine.runner.prepare(scheduled, plan or None, keep_hidden=self.source.needs_hidden)
        tf = time.perf_counter()
        logits = engine.runner.forward(batch)
        engine.platform.synchronize()
        dt = time.perf_counter() - tf
        engine.stats.forward_time += dt
        self.t["verify"] += dt
        if drafted:
            ids = set(plan)
            keep = [i for i, s in enumerate(batch.sample_seqs) if s.request_id not in ids]
            normal = replace(batch, scheduled=[s for s in batch.scheduled if s.seq.request_id not in ids],
                             sample_seqs=[batch.sample_seqs[i] for i in keep],
                             sample_rows=[batch.sample_rows[i] for i in keep])
            engine._postprocess(normal, scheduled, logits)
            self._verify(engine, batch, logits, drafted)
        else:
            engine._postprocess(batch, scheduled, logits)
        td = time.perf_counter()
        self._drafted, self._caught = (0, 0, 0.0), 0
        self._propose(engine, scheduled, batch, rowmap)
        engine.platform.synchronize()
        dd = time.perf_counter() - td
        engine.stats.forward_time += dd
        self.t["draft"] += dd
        if not scheduled.prefills and scheduled.decodes:
            live = sum(1 for s in scheduled.decodes if not s.seq.is_finished)
            rows, steps, steps_s = self._drafted
            self._pending = (batch.input_ids.shape[0], dt, rows, steps, steps_s, dd - steps_s if rows else 0.0,
                             len(scheduled.decodes), t0, live > 0, self._caught)

    def _state(self, seq: Sequence) -> _State | None:
        st = seq.feature_state.get(KEY)
        if st is None:
            p = seq.params
            if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    or p.so_args is not None):
                seq.feature_state[KEY] = False
                return None
            st = seq.feature_state[KEY] = _State(seq.metrics.num_preemptions)
        elif st is False:
            return None
        elif st.epoch != seq.metrics.num_preemptions:  # preempted: its blocks (and draft KV) are gone
            st.epoch, st.done, st.drafts, st.q = seq.metrics.num_preemptions, 0, [], None
            st.kept_hidden, st.kept_rows = [], 0
        return st

    def _plan(self, engine, scheduled: SchedulerOutput):
        """Drafts to verify this step: {request_id: tokens} and [(seq, state, m)]."""
        cands, caps = [], []
        bs = engine.block_size
        for s in scheduled.decodes:
            seq = s.seq
            st = seq.feature_state.get(KEY)
            if not st:
                continue
            st.decode_steps += 1
            self.n["decode_steps"] += 1
            if not st.drafts:
                continue
            if (st.base_len != seq.num_tokens or st.epoch != seq.metrics.num_preemptions
                    or seq.num_computed_tokens != seq.num_tokens - 1):
                st.drafts, st.q = [], None
                continue
            cap = min(len(st.drafts), len(seq.block_table) * bs - seq.num_tokens)
            if cap > 0:
                cands.append((seq, st))
                caps.append(cap)
        if not cands:
            return {}, []
        budget = engine.cfg.max_num_batched_tokens - scheduled.num_tokens
        if self.opts["verify_budget"]:
            budget = min(budget, self.opts["verify_budget"])
        if self.varlen:
            fixed = self.live.overhead(len(scheduled.decodes)) + self.live.drafting(len(cands), self.last_depth)
            lengths = choose_lengths([st.cum[:c] for (_, st), c in zip(cands, caps)], scheduled.num_tokens,
                                     budget, self.live, fixed)
            self.n["plans"] += 1
            if self.n["plans"] % EXPLORE_VERIFY_EVERY == 0 and sum(lengths) < budget:
                # one draft more than chosen, on the request whose next draft is likeliest: the live
                # cost model then sees the step time of the next verify size too
                more = [(st.cum[m], i) for i, ((_, st), c, m) in enumerate(zip(cands, caps, lengths)) if m < c]
                if more:
                    lengths[max(more)[1]] += 1
        else:
            lengths = fixed_lengths(caps, budget)
        plan, drafted = {}, []
        for (seq, st), m in zip(cands, lengths):
            if m > 0:
                plan[seq.request_id] = st.drafts[:m]
                drafted.append((seq, st, m))
        return plan, drafted

    @staticmethod
    def _row_map(scheduled: SchedulerOutput, plan: dict) -> dict:
        """request_id -> (first row in the flat batch, its position), before the step advances them."""
        out, row = {}, 0
        for s in scheduled.prefills + scheduled.decodes:
            out[s.seq.request_id] = (row, s.seq.num_computed_tokens)
            row += s.num_new_tokens + len(plan.get(s.seq.request_id, ()))
        return out

    # ---- verification ---------------------------------------------------------------------
    def _verify(self, engine, batch, logits: torch.Tensor, drafted: list) -> None:
        dev = logits.device
        where = {id(s): i for i, s in enumerate(batch.sample_seqs)}
        rows, row_seqs, starts = [], [], []
        for seq, _, m in drafted:
            r0 = batch.sample_rows[where[id(seq)]]
            starts.append(len(rows))
            rows.extend(range(r0, r0 + m + 1))
            row_seqs.extend([seq] * (m + 1))
        spec = logits[torch.tensor(rows, device=dev)]
        view = replace(batch, scheduled=[], sample_seqs=row_seqs, sample_rows=list(range(len(rows))))
        engine.pm.hook.process_logits(engine=engine, batch=view, logits=spec)
        seqs = [d[0] for d in drafted]
        greedy = [s.params.temperature <= 0 for s in seqs]
        draft_tokens = [st.drafts[:m] for _, st, m in drafted]
        first_pos = [s.num_tokens for s in seqs]
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.long, device=dev)
        if all(greedy):
            probs, q, argmax = None, None, spec.argmax(-1).tolist()
        else:
            probs = filtered_probs(spec, SamplingRows.from_params([s.params for s in row_seqs], dev))
            V = spec.shape[-1]
            q = torch.cat([st.q[:m] if st.q is not None else spec.new_zeros(m, V) for _, st, m in drafted])
            argmax = None
        tokens, accepted = verify(probs, q, draft_tokens, seeds, first_pos, greedy, argmax)

        # logprobs of the emitted tokens under the target rows
        emit_rows = [starts[i] + j for i, toks in enumerate(tokens) for j in range(len(toks))]
        emit_toks = [t for toks in tokens for t in toks]
        er = torch.tensor(emit_rows, device=dev)
        lse = torch.logsumexp(spec[er], dim=-1)
        lp_flat = (spec[er, torch.tensor(emit_toks, device=dev)] - lse).tolist()
        logprobs, tops, k = [], [], 0
        for i, toks in enumerate(tokens):
            logprobs.append(lp_flat[k : k + len(toks)])
            n = seqs[i].params.logprobs
            if n:
                vals, idx = spec[er[k : k + len(toks)]].topk(n, dim=-1)
                vals = vals - lse[k : k + len(toks), None]
                tops.append([list(zip(a, b)) for a, b in zip(idx.tolist(), vals.tolist())])
            else:
                tops.append([None] * len(toks))
            k += len(toks)

        for (seq, st, m), a in zip(drafted, accepted):
            seq.num_computed_tokens += 1 + a  # the query token and the accepted drafts have KV now
            if self.source.needs_hidden:
                st.done = min(st.done, seq.num_computed_tokens)
            else:
                st.done = seq.num_tokens + min(a, st.fed)
            st.verified += m
            st.accepted += a
            self.n["verified"] += m
            self.n["accepted"] += a
            self.n["spec_steps"] += 1
            if self.outcome_log is not None and st.feats is not None:
                h, lq, ent = st.feats
                n_log = min(a + 1, m)
                # (hidden, log q, entropy of all verified positions, greedy, confidences and outcomes of
                #  the positions the target decided, the last token then the draft tokens, P_1..P_m, accepted count)
                self.outcome_log.append((h[:m], lq[:m], ent[:m], seq.params.temperature <= 0,
                                         st.conf[:n_log], [1.0] * min(a, n_log) + [0.0] * (n_log - min(a, n_log)),
                                         seq.token_ids[-1:] + st.drafts[:m], st.cum[:m], a))
            st.drafts, st.q, st.feats = [], None, None
        engine.append_tokens(seqs, tokens, logprobs, tops)
        for seq, st, _ in drafted:
            if not seq.is_finished:
                engine.blocks.truncate(seq, seq.num_tokens)  # roll back the rejected drafts' KV
                engine.blocks.register_full_blocks(seq)
            self._request_metrics(seq, st)
        flat_seqs = [s for s, toks in zip(seqs, tokens) for _ in toks]
        view = replace(batch, scheduled=[], sample_seqs=flat_seqs, sample_rows=list(range(len(flat_seqs))))
        engine.pm.hook.tokens_sampled(engine=engine, batch=view, token_ids=emit_toks)

    @staticmethod
    def _request_metrics(seq: Sequence, st: _State) -> None:
        steps = max(st.decode_steps, 1)
        seq.metrics.extra.update({
            "accept_rate": st.accepted / st.verified if st.verified else 0.0,
            "mean_accepted_len": st.accepted / steps,
            "verified_per_step": st.verified / steps,
        })

    # ---- drafting -------------------------------------------------------------------------
    def _propose(self, engine, scheduled: SchedulerOutput, batch, rowmap: dict | None) -> None:
        """Catch the draft up on what the target computed this step and propose the next drafts."""
        bs, src = engine.block_size, self.source
        mtp = src.needs_hidden
        items = []  # (seq, st, lo, hi, cap)
        n_live = sum(1 for s in scheduled.prefills + scheduled.decodes if not s.seq.is_finished)
        allowed = self._worth_speculating(scheduled, n_live) if self.varlen else True
        kept = {}  # request_id -> kept hidden states of positions lo..c0-1 (MTP)
        for s in scheduled.prefills + scheduled.decodes:
            seq = s.seq
            if seq.is_finished:
                continue
            if allowed is False or (allowed is not True and seq.request_id not in allowed):
                if mtp and (st := self._state(seq)) is not None:
                    self._defer(st, seq.num_computed_tokens, *rowmap[seq.request_id], batch.hidden)
                continue  # the draft catches up when this request drafts again
            st = self._state(seq)
            if st is None:
                continue
            C, L = seq.num_computed_tokens, seq.num_tokens
            ready = C == L - 1
            if mtp:
                row0, c0 = rowmap[seq.request_id]
                if st.kept_rows and st.done + st.kept_rows == c0:
                    lo, kept[seq.request_id] = st.done, torch.cat(st.kept_hidden)
                else:
                    lo = max(st.done, c0)
                st.kept_hidden, st.kept_rows = [], 0
                hi = C
            else:
                lo, hi = st.done, (L if ready else C)
            cap = 0
            if ready:
                cap = min(self.k, engine.max_model_len - L, src.max_positions - L)
                if seq.params.max_tokens is not None:
                    cap = min(cap, seq.params.max_tokens - seq.num_output_tokens - 1)
                cap = self._reserve(engine, seq, L, max(cap, 0), n_live)
                if cap < 0:  # not even the last token's slot: sync what fits, no drafts
                    hi = min(hi, len(seq.block_table) * bs)
                    cap = 0
            if hi > lo or cap > 0:
                items.append((seq, st, lo, hi, cap))
            else:
                st.drafts = []
        if not items:
            return
        # 1. one forward over every catch-up span; the last row of each drafting request proposes d_1
        pre = [it for it in items if it[2] == 0 or it[3] - it[2] > DECODE_SPAN]
        dec = [it for it in items if not (it[2] == 0 or it[3] - it[2] > DECODE_SPAN)]
        ids, pos, slots, hid_parts, last_rows = [], [], [], [], []
        for seq, _, lo, hi, cap in pre + dec:
            bt = seq.block_table
            if mtp:
                ids.extend(seq.token_ids[lo + 1 : hi + 1])
                row0, c0 = rowmap[seq.request_id]
                if seq.request_id in kept:
                    hid_parts.append(kept[seq.request_id])
                hid_parts.append(batch.hidden[row0 + max(lo, c0) - c0 : row0 + hi - c0])
            else:
                ids.extend(seq.token_ids[lo:hi])
            pos.extend(range(lo, hi))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(lo, hi))
            if cap > 0:
                last_rows.append(len(pos) - 1)
        dev = engine.device
        self._caught = len(ids)
        ids_t, pos_t = torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev)
        if not pre and ids and hasattr(src, "decode"):  # lean path: short catch-up spans only
            table = context_slot_table(self._meta_tables(dec, dev), bs)
            which = torch.tensor([i for i, it in enumerate(dec) for _ in range(it[3] - it[2])], device=dev)
            S = max(it[3] for it in dec)
            args = (ids_t, pos_t, torch.tensor(slots, dtype=torch.long, device=dev), table[which, :S])
            if mtp:
                carry, normed = src.decode(*args, masked=len(ids) > 1, prev_hidden=torch.cat(hid_parts))
            else:
                carry = normed = src.decode(*args, masked=len(ids) > 1)
        else:
            meta = self._meta(pre, dec, slots, dev)
            prev = torch.cat(hid_parts) if mtp else None
            carry, normed = src.forward(ids_t, pos_t, meta, prev)
        for _, st, _, hi, _ in items:
            st.done = hi
            st.drafts, st.q, st.feats = [], None, None
        drafting = [it for it in pre + dec if it[4] > 0]
        if not drafting:
            return
        lr = torch.tensor(last_rows, device=dev)
        self._draft_loop(_Rows([it[0] for it in drafting], [it[4] for it in drafting], bs, dev),
                         [it[1] for it in drafting], carry[lr], normed[lr], n_live)

    @staticmethod
    def _defer(st: _State, computed: int, row0: int, c0: int, hidden: torch.Tensor) -> None:
        """An MTP request that does not draft this step keeps the target's hidden states of the
        positions computed now (c0..computed-1), so that its catch-up can write their draft KV when it
        drafts again. After a gap, or past ``MAX_KEPT`` rows, the older positions are given up (their
        draft KV stays stale: fewer drafts are accepted, outputs stay exact)."""
        rows = computed - c0
        if rows <= 0:
            return
        if st.done + st.kept_rows != c0 or st.kept_rows + rows > MAX_KEPT:
            st.kept_hidden, st.kept_rows, st.done = [], 0, max(st.done, c0)
            if st.done != c0 or rows > MAX_KEPT:
                return
        st.kept_hidden.append(hidden[row0 : row0 + rows].clone())
        st.kept_rows += rows

    def _worth_speculating(self, scheduled: SchedulerOutput, n_live: int) -> bool | set[str]:
        """Whether drafting for the next step can pay at this batch size at all, given the drafts'
        running mean confidence and each request's latest first-draft confidence. After 64 skipped
        steps it drafts once anyway to refresh them, waiting twice as long after each such try that
        does not make drafting pay. Such a try drafts for the ``EXPLORE_ROWS`` requests with the
        least draft catch-up (their ids are returned): a sample refreshes the estimates, and the
        draft does not have to catch up on every request's skipped tokens."""
        ready = [s.seq for s in scheduled.prefills + scheduled.decodes
                 if not s.seq.is_finished and s.seq.num_computed_tokens == s.seq.num_tokens - 1
                 and s.seq.feature_state.get(KEY) is not False]
        if not ready:
            return False
        R = len(ready)
        states = [seq.feature_state.get(KEY) for seq in ready]
        mean = self.mean_conf
        conf = [mean + SKIP_FORECAST_BLEND * (st.recent_conf - mean) if st and st.recent_conf is not None else mean
                for st in states]
        worth = worth_drafting([1.0] * R, conf, R, n_live, R, self.live, self.live.overhead(n_live), self.k,
                               start_s=self.live.catchup(R) - self.live.draft(R))
        if worth:
            self.skipped, self.exploring, self.explore_every = 0, False, 64
            return True
        if self.exploring:  # the last exploratory draft did not make drafting pay: wait longer
            self.exploring, self.explore_every = False, min(self.explore_every * 2, 4096)
        if self.skipped >= self.explore_every:
            self.skipped, self.exploring = 0, True
            order = sorted(range(R), key=lambda i: ready[i].num_tokens - (states[i].done if states[i] else 0))
            chosen = {ready[i].request_id for i in order[:EXPLORE_ROWS]}
            for seq, st in zip(ready, states):
                if st and seq.request_id not in chosen:
                    st.drafts, st.q, st.feats = [], None, None
            return chosen
        self.skipped += 1
        for st in states:
            if st:
                st.drafts, st.q, st.feats = [], None, None
                if st.recent_conf is not None:  # drift back to the mean while not drafting
                    st.recent_conf = 0.8 * st.recent_conf + 0.2 * self.mean_conf
        self.n["skipped_steps"] += 1
        return False

    def _reserve(self, engine, seq: Sequence, L: int, cap: int, n_live: int) -> int:
        """Allocate blocks for the last token and ``cap`` drafts (fewer when memory is short, keeping
        a block of headroom per live request); -1 when even the last token's slot cannot be had."""
        blocks = engine.blocks
        if not blocks.can_allocate(seq, L):
            return -1
        blocks.allocate(seq, L)
        while cap > 0:
            extra = blocks.blocks_needed(seq, L + cap)
            if extra == 0 or (blocks.can_allocate(seq, L + cap) and blocks.num_free - extra >= n_live):
                blocks.allocate(seq, L + cap)
                break
            cap -= 1
        return cap

    @staticmethod
    def _meta_tables(its: list, dev) -> torch.Tensor:
        width = max(len(it[0].block_table) for it in its)
        return torch.tensor([it[0].block_table + [0] * (width - len(it[0].block_table)) for it in its],
                            dtype=torch.int32, device=dev)

    @classmethod
    def _meta(cls, pre: list, dec: list, slots: list[int], dev) -> AttentionMetadata:
        def cumsum(lens):
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.long, device=dev)

        def tables(its):
            return cls._meta_tables(its, dev)

        prefill = decode = None
        if pre:
            q = [hi - lo for _, _, lo, hi, _ in pre]
            kl = [hi for _, _, _, hi, _ in pre]
            prefill = PrefillMeta(cu_q_lens=cumsum(q), cu_k_lens=cumsum(kl),
                                  seq_lens=torch.tensor(kl, dtype=torch.long, device=dev), block_tables=tables(pre),
                                  has_prefix=any(lo > 0 for _, _, lo, _, _ in pre))
        if dec:
            q = [hi - lo for _, _, lo, hi, _ in dec]
            decode = DecodeMeta(cu_q_lens=cumsum(q),
                                seq_lens=torch.tensor([hi for _, _, _, hi, _ in dec], dtype=torch.long, device=dev),
                                block_tables=tables(dec), max_q_len=max(q))
        num_pre = sum(hi - lo for _, _, lo, hi, _ in pre)
        return AttentionMetadata(num_pre, torch.tensor(slots, dtype=torch.long, device=dev), prefill, decode)

    def _pick(self, rows: _Rows, logits: torch.Tensor, normed: torch.Tensor, depth: int):
        """Draft token, draft distribution (sampled rows), confidence and features at one depth."""
        if rows.head_rows is None:
            rows.head_rows = (self.head.per_row(rows.greedy),)
        greedy_tok = logits.argmax(-1)
        if rows.all_greedy:  # log q(d) and entropy from one log-softmax
            logp = torch.log_softmax(logits.float(), dim=-1)
            logq = logp.gather(1, greedy_tok[:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            return greedy_tok, None, self.head.fast(normed, logq, ent, rows.greedy, rows.head_rows[0]), (logq, ent)
        q = filtered_probs(logits, rows.params)
        sampled = draw(q, stream(rows.seeds, STREAM_DRAFT), rows.base + (depth - 1))
        tok = torch.where(rows.greedy, greedy_tok, sampled)
        logq, ent = conf_mod.ConfidenceHead.features(logits, tok)
        c = self.head.fast(normed, logq, ent, rows.greedy, rows.head_rows[0])
        return tok, q, c, (logq, ent)

    def _ar_step(self, rows: _Rows, prev_tok: torch.Tensor, prev_carry: torch.Tensor | None, depth: int):
        """Feed d_{depth-1}; returns (carry, normed) of the rows."""
        bs = rows.block_size
        if hasattr(self.source, "decode"):  # lean path: one query token per row
            ctx = rows.ctx
            off = 1 if self.source.needs_hidden else 0  # an MTP layer sits one position before the token
            S = min(rows.base_max + depth - 1 - off, ctx.shape[1], self.source.max_positions)
            pos = (rows.base + (depth - 2 - off)).clamp(max=S - 1)
            slot = torch.where(rows.cap_t >= depth, ctx.gather(1, pos[:, None])[:, 0], torch.full_like(pos, -1))
            if self.source.needs_hidden:
                return self.source.decode(prev_tok, pos, slot, ctx[:, :S], masked=len(rows.seqs) > 1,
                                          prev_hidden=prev_carry)
            normed = self.source.decode(prev_tok, pos, slot, ctx[:, :S], masked=len(rows.seqs) > 1)
            return normed, normed
        tok_index = rows.base + (depth - 2)  # token index of d_{depth-1}
        pos = tok_index - 1 if self.source.needs_hidden else tok_index
        pos = pos.clamp(max=self.source.max_positions - 1)
        blk = rows.bt_long.gather(1, (pos // bs).clamp(max=rows.bt_long.shape[1] - 1)[:, None])[:, 0]
        slot = torch.where(rows.cap_t >= depth, blk * bs + pos % bs, torch.full_like(pos, -1))
        meta = AttentionMetadata(0, slot, None, DecodeMeta(cu_q_lens=rows.cu, seq_lens=pos + 1,
                                                           block_tables=rows.block_tables, max_q_len=1))
        return self.source.forward(prev_tok, pos, meta, prev_carry)

    def _draft_loop(self, rows: _Rows, states: list[_State], carry: torch.Tensor, normed: torch.Tensor,
                    n_live: int) -> None:
        src, cost = self.source, self.live
        R = len(states)
        K = max(rows.caps)
        logits = src.logits(normed)
        tok, q, c, feats = self._pick(rows, logits, normed, 1)
        toks, qs, confs, hs, lqs, ents = [tok], [q], [c], [normed], [feats[0]], [feats[1]]
        cum = c.tolist()
        cum_hist = [cum]
        expected = R + sum(cum)
        depth = 1
        t_loop = time.perf_counter()
        while depth < K:
            if self.varlen:
                live = [i for i in range(R) if rows.caps[i] > depth]
                c_last = confs[-1].tolist()
                fixed = cost.overhead(n_live) + cost.drafting(R, depth)
                if not worth_drafting([cum[i] for i in live], [c_last[i] for i in live], R,
                                      n_live + depth * R, expected, cost, fixed, K - depth):
                    break
            depth += 1
            carry, normed = self._ar_step(rows, tok, carry if src.needs_hidden else None, depth)
            logits = src.logits(normed)
            tok, q, c, feats = self._pick(rows, logits, normed, depth)
            toks.append(tok)
            qs.append(q)
            confs.append(c)
            if self.outcome_log is not None:
                hs.append(normed)
                lqs.append(feats[0])
                ents.append(feats[1])
            c_list = c.tolist()
            cum = [a * b if depth <= rows.caps[i] else 0.0 for i, (a, b) in enumerate(zip(cum, c_list))]
            cum_hist.append(cum)
            expected += sum(cum)
        self.last_depth = depth
        self.engine.platform.synchronize()
        self._drafted = (R, depth - 1, time.perf_counter() - t_loop)
        self.n["proposals"] += 1
        self.n["depth"] += depth
        tok_m = torch.stack(toks, dim=1).tolist()
        conf_m = torch.stack(confs, dim=1).tolist()
        produced = [v for i, row in enumerate(conf_m) for v in row[: min(depth, rows.caps[i])]]
        if produced:
            self.mean_conf = 0.9 * self.mean_conf + 0.1 * (sum(produced) / len(produced))
        q_m = None if rows.all_greedy else torch.stack(qs, dim=1)  # [R, depth, V]
        log = self.outcome_log is not None
        if log:
            h_m, lq_m, ent_m = torch.stack(hs, 1), torch.stack(lqs, 1), torch.stack(ents, 1)
        for i, (seq, st) in enumerate(zip(rows.seqs, states)):
            n = min(depth, rows.caps[i])
            st.drafts = tok_m[i][:n]
            st.conf = conf_m[i][:n]
            st.cum = [cum_hist[j][i] for j in range(n)]
            st.q = None if rows.greedy_list[i] or q_m is None else q_m[i, :n]
            st.base_len = seq.num_tokens
            st.fed = n - 1
            st.recent_conf = conf_m[i][0]
            if log:
                st.feats = (h_m[i, :n].float().cpu(), lq_m[i, :n].cpu(), ent_m[i, :n].cpu())
            if n < rows.caps[i]:
                self.engine.blocks.truncate(seq, seq.num_tokens + n)  # blocks for drafts not made

    # ---- step-time curve ------------------------------------------------------------------
    def _cost_path(self, engine) -> Path:
        # the batch sizes a curve covers depend on max_num_seqs and the KV pool: one curve per pool shape
        name = (f"{engine.platform.name}-{engine.fingerprint}-{self.source.fingerprint}-bs{engine.block_size}"
                f"-th{torch.get_num_threads()}-k{self.k}-seqs{engine.cfg.max_num_seqs}-blocks{engine.blocks.num_free}"
                ".json")
        return cache_dir() / "dspark" / name

    def _load_or_measure_cost(self, engine) -> StepCost:
        path = self._cost_path(engine)
        try:
            return StepCost.load(path)
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("dspark: the step-time curve %s is unreadable (%s); measuring it again", path, exc)
        cost = measure_step_cost(engine, self)
        try:
            cost.save(path)
        except OSError as exc:
            logger.warning("dspark: could not save the step-time curve to %s: %s", path, exc)
        return cost

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
        if self.source is None:
            return None
        n = self.n
        steps = max(n["decode_steps"], 1)
        return {
            "dspark_draft": self.source.kind, "dspark_varlen": self.varlen, "dspark_k": self.k,
            "dspark_accept_rate": n["accepted"] / n["verified"] if n["verified"] else 0.0,
            "dspark_mean_accepted_len": n["accepted"] / steps,
            "dspark_verified_per_step": n["verified"] / steps,
            "dspark_tokens_per_step": (n["accepted"] + n["decode_steps"]) / steps,
            "dspark_decode_steps": n["decode_steps"], "dspark_verified": n["verified"],
            "dspark_accepted": n["accepted"],
            "dspark_mean_draft_depth": n["depth"] / n["proposals"] if n["proposals"] else 0.0,
            "dspark_steps_without_drafts": n["skipped_steps"],
            "dspark_draft_time": self.t["draft"], "dspark_verify_time": self.t["verify"],
            "dspark_schedule_time": self.t["schedule"],
            "dspark_cost_verify_scale": self.live.verify_scale, "dspark_cost_draft_scale": self.live.draft_scale,
            "dspark_cost_extra_overhead": self.live.extra_overhead_s,
        }

    def reset_metrics(self) -> None:
        for key in self.n:
            self.n[key] = 0
        for key in self.t:
            self.t[key] = 0.0


def _time_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure_step_cost(engine, feature: DSpark, ctx: int = 128, sweeps: int = 3) -> StepCost:
    """Time target forwards over decode batches with drafts, and draft steps, on synthetic requests
    whose blocks are taken from the pool and given back. Their tokens are seeded random ids, so that
    MoE layers route them to as many experts as real text does. Every point is timed in ``sweeps``
    interleaved sweeps and the fastest time kept, so a burst of other load on a shared machine
    does not bend the curve."""
    blocks, runner = engine.blocks, engine.runner
    q = feature.k + 1
    ctx = max(1, min(ctx, engine.max_model_len - q - 1))
    V = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs: list[Sequence] = []

    def rand(n: int) -> list[int]:
        return torch.randint(2, V, (n,), generator=gen).tolist() if V > 2 else [0] * n

    def make(n: int) -> list[Sequence]:
        while len(seqs) < n:
            s = Sequence(f"__dspark_calibrate_{len(seqs)}", None, rand(ctx + 1), SamplingParams(max_tokens=1),
                         0, [])
            if not blocks.can_allocate(s, ctx + q):
                break
            blocks.allocate(s, ctx + q)
            s.num_computed_tokens = ctx
            seqs.append(s)
        return seqs[:n]

    points: list[tuple[str, int, object]] = []  # (kind, x, fn)
    src = feature.source
    try:
        with torch.inference_mode():
            # every verify length of one request (conc 1), then whole batches of k + 1 tokens each
            for T in [*range(1, q + 1), *(q * b for b in (2, 4, 8, 16, 32, 64) if q * b <= 384)]:
                per = min(T, q)
                B = -(-T // per)
                group = make(B)
                if len(group) < B or ctx + per >= engine.max_model_len:
                    break
                out = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in group])
                plan = {s.request_id: rand(per - 1) for s in group} if per > 1 else None

                def fwd(out=out, plan=plan):
                    runner.forward(runner.prepare(out, plan))
                    engine.platform.synchronize()

                points.append(("verify", B * per, fwd))
            for B in (1, 64):
                group = make(B)
                if len(group) == B:
                    out = SchedulerOutput(decodes=[ScheduledSeq(s, 1) for s in group])
                    points.append(("prepare", B, lambda out=out: runner.prepare(out)))
            for B in (1, 8, 32, 64):
                group = make(B)
                if len(group) < B:
                    break
                rows = _Rows(group, [q - 1] * B, engine.block_size, engine.device)
                tok = torch.tensor(rand(B), dtype=torch.long, device=engine.device)
                carry = torch.zeros(B, src.hidden_size, dtype=engine.dtype, device=engine.device)

                def dstep(rows=rows, tok=tok, carry=carry):
                    c, n = feature._ar_step(rows, tok, carry if src.needs_hidden else None, 2)
                    feature._pick(rows, src.logits(n), n, 2)
                    engine.platform.synchronize()

                points.append(("draft", B, dstep))
            best = [math.inf] * len(points)
            for _, _, fn in points:
                fn()  # warm-up
            for _ in range(sweeps):
                for i, (_, _, fn) in enumerate(points):
                    best[i] = min(best[i], _time_once(fn), _time_once(fn))
    finally:
        for s in seqs:
            blocks.release(s)
    curve = {"verify": ([], []), "draft": ([], []), "prepare": ([], [])}
    for (kind, x, _), t in zip(points, best):
        curve[kind][0].append(x)
        curve[kind][1].append(t)
    # engine bookkeeping per step outside forwards, estimated as twice the input preparation
    px, pt = curve["prepare"]
    p1 = pt[0] if pt else 0.0
    per_req = max(pt[-1] - p1, 0.0) / max(px[-1] - 1, 1) if len(pt) > 1 else 0.0
    cost = StepCost(*curve["verify"], *curve["draft"], overhead_s=2 * p1, overhead_per_req_s=2 * per_req,
                    platform=engine.platform.name, key=f"{engine.fingerprint}-{feature.source.fingerprint}")
    logger.info("dspark step-time curve: verify %s, draft %s", list(zip(*curve["verify"])), list(zip(*curve["draft"])))
    return cost
