"""Runs one scheduled step on the device: builds the flat batch, runs the model, samples.

Layout: prefill chunks' tokens first, then decode tokens (see ``models.metadata``). Logits are
computed only for the rows that need them: each request's last row when it samples, and every
prefill row of requests that asked for prompt logprobs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.graph_runner import DecodeGraphs, default_batch_sizes
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.transfer import Upload
from deepinfer_core.kv_cache_spec import CacheLayout
from deepinfer_core.models.interface import RouteHook
from deepinfer_core.models.metadata import AttentionMetadata, DecodeMeta, GroupMeta, PrefillMeta
from deepinfer_core.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.models.interface import KVCaches
    from deepinfer_core.platform import Platform

logger = logging.getLogger("deepinfer.runner")


@dataclass
class StepBatch:
    """A scheduled step turned into device tensors, plus the bookkeeping to read results back."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    scheduled: list[ScheduledSeq]
    logit_rows: list[int] = field(default_factory=list)  # token rows whose logits are computed
    sample_seqs: list[Sequence] = field(default_factory=list)  # requests that draw a token this step
    sample_rows: list[int] = field(default_factory=list)  # their index into logit_rows' result
    prompt_lp: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # (seq, first, count, start)
    keep_hidden: bool = False  # forward() keeps every row's final hidden state in ``hidden`` (MTP drafts)
    hidden: torch.Tensor | None = None
    logit_index: torch.Tensor | None = None  # ``logit_rows`` on the device (set by prepare)
    num_prefills: int = 0  # ``scheduled`` holds the step's prefill chunks first, then its decodes
    row_starts: list[int] = field(default_factory=list)  # per scheduled request: its first token row
    computed_before: list[int] = field(default_factory=list)  # per scheduled request: computed tokens before
    started: float = 0.0  # perf_counter() when the step was prepared
    forward_s: float = 0.0  # seconds of its forward (set where measured: speculative steps)
    # per scheduled request its first position on the device, where ``computed_before`` is only the
    # host's upper bound (async steps after a speculative one: shifted back by its rejected drafts)
    first_dev: torch.Tensor | None = None
    # (positions [len(sample_seqs)] on the device, {id(seq): index}): the position each sampling row
    # draws at where the host's lengths over-count (async steps after a speculative one); None: the host's
    sample_pos: tuple[torch.Tensor, dict[int, int]] | None = None


def _table_rows(tables: list[list[int]], pad: int) -> list[list[int]]:
    """Block tables padded to the widest with ``pad`` (a [B, max width] tensor's rows)."""
    width = max(len(t) for t in tables)
    return [t + [pad] * (width - len(t)) for t in tables]


def _slots(table: list[int], lo: int, hi: int, block_size: int, m: int) -> list[int]:
    """Flat slot of the entry each position in [lo, hi) writes, for a group of ``m`` tokens per entry:
    only a position that closes an entry writes (``(p + 1) % m == 0``), the rest get -1."""
    if m == 1:
        return [table[p // block_size] * block_size + p % block_size for p in range(lo, hi)]
    per = block_size // m
    return [table[p // block_size] * per + (p % block_size) // m if (p + 1) % m == 0 else -1 for p in range(lo, hi)]


def empty_metadata(layout: CacheLayout, device) -> AttentionMetadata:
    """Metadata of a forward over zero tokens (an idle expert-parallel rank keeping collectives in step)."""
    empty = torch.empty(0, dtype=torch.long, device=device)
    tables = torch.empty(0, 0, dtype=torch.int32, device=device)
    groups = {g.name: GroupMeta(empty, tables) for g in layout.groups}
    return AttentionMetadata(0, empty, None, None, groups=groups, cu_q_lens=torch.zeros(1, dtype=torch.long,
                                                                                       device=device), seq_lens=empty)


def _cumsum(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


class ModelRunner:
    def __init__(self, model, kv_caches: KVCaches, block_size: int, device: torch.device,
                 batch_invariant: bool = False, layout: CacheLayout | None = None,
                 pool_of: dict[str, str] | None = None) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.layout = layout if layout is not None else model.cache_layout()
        #: cache group -> its block pool (the key of its table in ``Sequence.block_tables``)
        self.pool_of = pool_of or {g.name: g.name for g in self.layout.groups}
        first = self.layout.groups[0]
        #: (pool, tokens per entry) -> the groups whose slot mappings are equal
        self._slot_keys: dict[tuple[str, int], list[str]] = {}
        for g in self.layout.groups:
            self._slot_keys.setdefault((self.pool_of[g.name], g.tokens_per_entry), []).append(g.name)
        self._first_key = (self.pool_of[first.name], first.tokens_per_entry)
        #: pools of full-history groups: a replayed token (``Sequence.replay_until``) writes none of them
        self._full_pools = {self.pool_of[g.name] for g in self.layout.groups if g.window is None}
        self.num_layers = model.cfg.num_hidden_layers
        #: Batch-invariant mode: prefill chunks go through the decode (absorbed MLA) path too, so a
        #: token's result does not depend on how its prompt was chunked.
        self.batch_invariant = batch_invariant
        #: prepare() builds its host tensors in pinned memory (set by the engine from the platform).
        self.pin_memory = False
        #: Pure-decode steps replay device graphs through these (set by :meth:`setup_graphs`).
        self.graphs: DecodeGraphs | None = None
        #: Why every step runs eagerly, while ``graphs`` is None.
        self.graphs_off_reason = "setup_graphs() was not called"
        #: Per layer, events of KV swap-ins the next prepared step must wait for (see swap_in_events).
        self.layer_ready: list[list] | None = None
        #: The route hook installed on every MoE layer (``set_route_hook``), or None.
        self.route_hook: RouteHook | None = None

    def set_route_hook(self, hook: RouteHook) -> None:
        """Install ``hook`` on every routed-expert layer the model declares (``CausalLM.moe_layers``):
        it rewrites each layer's (weights, expert ids) before the experts run. The engine installs a
        feature's hook before setting up graphs, so steps then run eagerly (a hook may keep host-side
        state); one installed later (a benchmark's counter) runs in eager steps only."""
        layers = self.model.moe_layers()
        if not layers:
            raise ValueError(f"{type(self.model).__name__} declares no MoE layers (moe_layers()); nothing to route")
        for moe in layers.values():
            moe.route_hook = hook
        self.route_hook = hook

    def swap_in_events(self, events: list) -> None:
        """KV blocks are being copied into the cache on a side stream, ``events[i]`` recorded after
        layer i's copies: the next prepared step's layer i waits for them, so the copies of later
        layers overlap the compute of earlier ones."""
        if self.layer_ready is None:
            self.layer_ready = [[] for _ in range(self.num_layers)]
        for ready, event in zip(self.layer_ready, events):
            ready.append(event)

    def graphs_unavailable(self, platform: Platform, cfg: EngineConfig) -> str | None:
        """Why decode steps cannot be captured as graphs here, or None when they can."""
        dtype = next(self.model.parameters()).dtype
        if cfg.enforce_eager:
            return "enforce_eager is set"
        if not platform.supports_graph_capture():
            return f"platform {platform.name!r} does not support graph capture"
        if dtype not in platform.graph_capture_dtypes():
            return (f"platform {platform.name!r} captures graphs for "
                    f"{[str(d) for d in platform.graph_capture_dtypes()]} only, not {dtype}")
        if self.batch_invariant:
            return "batch_invariant kernels read sequence lengths on the host"
        if any(m.expert_parallel is not None for m in self.model.moe_layers().values()):
            return "expert-parallel MoE layers exchange host-sized all-to-alls"
        if self.route_hook is not None:
            return "a feature hooks MoE routing (moe_route_hook)"
        return None

    def setup_graphs(self, platform: Platform, cfg: EngineConfig, max_model_len: int, *,
                     capture: bool = True, spec_k: int = 0) -> None:
        """Capture the pure-decode graphs (after the KV cache exists and features are set up).

        ``spec_k`` (the speculative draft length; 0: none): verify steps of up to ``spec_k + 1``
        rows per request get graphs too, for batch sizes with ``n * rows <= cfg.verify_graph_tokens``,
        where the platform captures them (``Platform.supports_verify_graphs``).
        ``capture=False`` (tests) sets up the same padded static buffers on any platform, run eagerly."""
        if capture:
            reason = self.graphs_unavailable(platform, cfg)
            if reason is not None:
                self.graphs_off_reason = reason
                logger.info("decode graphs off: %s; every step runs eagerly", reason)
                return
        sizes = cfg.graph_batch_sizes or default_batch_sizes(cfg.max_num_seqs)
        # +1: a speculative request may hold a block for draft slots past max_model_len
        max_blocks = math.ceil(max_model_len / self.block_size) + 1
        rows = spec_k + 1 if spec_k > 0 and (not capture or platform.supports_verify_graphs()) else 1
        graphs = DecodeGraphs(self.model, self.kv_caches, sizes, max_blocks, self.device, platform, capture,
                              layout=self.layout, pool_of=self.pool_of, block_size=self.block_size,
                              verify_rows=rows, verify_tokens=cfg.verify_graph_tokens)
        seconds = graphs.capture()
        self.graphs, self.graphs_off_reason = graphs, ""
        if capture:
            logger.info("captured decode graphs for batch sizes %s and verify graphs for %s in %.2f s",
                        graphs.sizes, {f"{R} rows": ns for R, ns in graphs.verify_sizes.items()}, seconds)

    def prepare(self, out: SchedulerOutput, draft_tokens: dict[str, list[int]] | None = None,
                keep_hidden: bool = False, prev_tokens: torch.Tensor | None = None,
                upload: Upload | None = None) -> StepBatch:
        """``draft_tokens`` (speculative decoding): tokens appended after a decode request's query
        token, verified in the same forward. Their KV slots must be allocated; the request's logit
        rows are then its query row and every draft row, consecutive from its sample row.

        ``prev_tokens`` (async scheduling): the previous step's sampled tokens, still on the device.
        A placeholder id ``-(i + 1)`` in a request's tokens is resolved to ``prev_tokens[i]`` here,
        on the device. No host copy in here waits for queued device work: every host-built tensor
        goes in one :class:`Upload` (``upload``: the caller's, which may hold parts of its own, sent here)."""
        bs, dev, pin = self.block_size, self.device, self.pin_memory
        drafts = draft_tokens or {s.seq.request_id: s.spec_tokens for s in out.decodes if s.spec_tokens}
        ids: list[int] = []
        pos: list[int] = []
        slots: dict[tuple[str, int], list[int]] = {key: [] for key in self._slot_keys}
        first_pool, first_slots = self._first_key[0], slots[self._first_key]
        one_key = len(slots) == 1 and self._first_key[1] == 1
        q_all: list[int] = []  # new tokens (with drafts) per sequence, batch order
        logit_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_lp = []
        ph_rows: list[int] = []  # rows holding a placeholder, and the prev_tokens index of each
        ph_src: list[int] = []
        started = time.perf_counter()
        row_starts: list[int] = []
        computed_before: list[int] = []
        for i, s in enumerate(out.prefills + out.decodes):
            seq, n = s.seq, s.num_new_tokens
            c = seq.num_computed_tokens
            row0 = len(ids)
            row_starts.append(row0)
            computed_before.append(c)
            ids.extend(seq.token_ids[c : c + n])
            if seq.num_pending_tokens and c + n > seq.num_known_tokens:  # trailing placeholders -(i + 1)
                for k in range(max(c, seq.num_known_tokens), c + n):
                    ph_rows.append(row0 + k - c)
                    ph_src.append(-seq.token_ids[k] - 1)
            extra = drafts.get(seq.request_id, ()) if drafts and i >= len(out.prefills) else ()
            ids.extend(extra)
            hi = c + n + len(extra)
            pos.extend(range(c, hi))
            q_all.append(hi - c)
            if one_key:  # a single slot mapping (DeepSeek V2/V3's latent group): the common path inline
                bt = seq.block_tables[first_pool]
                first_slots.extend(bt[p // bs] * bs + p % bs for p in range(c, hi))
            else:
                replay = max(0, min(seq.replay_until, hi) - c)
                for (pool, m), out_slots in slots.items():
                    got = _slots(seq.block_tables[pool], c, hi, bs, m)
                    if replay and pool in self._full_pools:  # the cached blocks hold these entries
                        got[:replay] = [-1] * replay
                    out_slots.extend(got)
            done_lp = len(seq.prompt_logprobs) - 1  # prompt positions already scored (kept on recompute)
            if seq.params.prompt_logprobs is not None and max(c, done_lp) < seq.num_prompt_tokens - 1:
                first = max(c, done_lp)
                count = min(c + n, seq.num_prompt_tokens - 1) - first
                if count > 0:
                    prompt_lp.append((seq, first, count, len(logit_rows)))
                    logit_rows.extend(range(row0 + first - c, row0 + first - c + count))
            if c + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(len(logit_rows))
                logit_rows.extend(range(row0 + n - 1, row0 + n + len(extra)))

        prefills, decodes = out.prefills, out.decodes
        if self.batch_invariant:  # same token layout; every sequence in the decode metadata
            prefills, decodes = [], out.prefills + out.decodes
        up = upload if upload is not None else Upload(dev, pin)  # the step's host-built tensors, sent at once
        h_ids, h_pos = up.add(ids), up.add(pos)
        h_logits = up.add(logit_rows) if logit_rows else None
        h_ph = (up.add(ph_rows), up.add(ph_src)) if ph_rows else None
        if prefills:
            q_lens = [s.num_new_tokens for s in prefills]
            k_lens = [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills]
            h_pre = (up.add(_cumsum(q_lens)), up.add(_cumsum(k_lens)), up.add(k_lens),
                     up.add(_table_rows([s.seq.block_table for s in prefills], 0), torch.int32))
        if decodes:
            q_dec = [s.num_new_tokens + len(drafts.get(s.seq.request_id, ())) for s in decodes]
            lens = [s.seq.num_computed_tokens + q for s, q in zip(decodes, q_dec)]
            h_dec = (up.add(_cumsum(q_dec)), up.add(lens),
                     up.add(_table_rows([s.seq.block_table for s in decodes], 0), torch.int32))
        scheduled = out.prefills + out.decodes
        only = (not prefills) != (not decodes)  # a step of only prefills or only decodes
        h_groups = self._group_parts(up, scheduled, slots, q_all, only) if scheduled else None
        t = up.send()
        prefill = decode = None
        if prefills:
            cu_q, cu_k, k_t, tables = (t[h] for h in h_pre)
            prefill = PrefillMeta(cu_q_lens=cu_q, cu_k_lens=cu_k, seq_lens=k_t, block_tables=tables,
                                  has_prefix=any(s.seq.num_computed_tokens > 0 for s in prefills))
        if decodes:
            cu_q, lens_t, tables = (t[h] for h in h_dec)
            decode = DecodeMeta(cu_q_lens=cu_q, seq_lens=lens_t, block_tables=tables, max_q_len=max(q_dec),
                                host_seq_lens=lens)
        num_prefill_tokens = sum(s.num_new_tokens for s in prefills)
        meta = AttentionMetadata(num_prefill_tokens, None, prefill, decode, layer_ready=self.layer_ready)
        if scheduled:
            self._group_meta(meta, t, h_groups)
        else:
            meta.slot_mapping = torch.empty(0, dtype=torch.long, device=dev)
        self.layer_ready = None
        input_ids = t[h_ids]
        if h_ph is not None:  # one or two launches: a gather, and a scatter unless every row is a placeholder
            if prev_tokens is None:
                raise RuntimeError("prepare: a request holds a placeholder token but prev_tokens was not given")
            if max(ph_src) >= prev_tokens.shape[0]:  # checked here: on a GPU the gather would assert on the device
                raise RuntimeError(f"prepare: placeholder -{max(ph_src) + 1} points past the previous step's "
                                   f"{prev_tokens.shape[0]} sampled tokens")
            # a fresh tensor, not a view of prev_tokens: input_ids may be edited in place later
            sampled = prev_tokens.index_select(0, t[h_ph[1]]).to(input_ids.dtype)
            if len(ph_rows) == len(ids):
                input_ids = sampled
            else:
                input_ids.index_copy_(0, t[h_ph[0]], sampled)
        return StepBatch(input_ids, t[h_pos], meta, out.prefills + out.decodes,
                         logit_rows, sample_seqs, sample_rows, prompt_lp, keep_hidden,
                         logit_index=t[h_logits] if h_logits is not None else None,
                         num_prefills=len(out.prefills), row_starts=row_starts, computed_before=computed_before,
                         started=started)

    def _group_parts(self, up: Upload, scheduled: list[ScheduledSeq], slots: dict[tuple[str, int], list[int]],
                     q_all: list[int], only: bool) -> dict:
        """Queue the per-group slot mappings, the block tables of pools other than the step's own
        and (for a mixed step) the step-wide lengths; handles for :meth:`_group_meta`."""
        tables = {}
        for pool in dict.fromkeys(p for p, _ in slots):
            if not (only and pool == self._first_key[0]):  # else the prefill's or decode's own table
                tables[pool] = up.add(_table_rows([s.seq.block_tables[pool] for s in scheduled], -1), torch.int32)
        lens = None
        if not only:
            c_all = [s.seq.num_computed_tokens for s in scheduled]
            lens = (up.add(_cumsum(q_all)), up.add([c + q for c, q in zip(c_all, q_all)]))
        return {"slots": {key: up.add(v) for key, v in slots.items()}, "tables": tables, "lens": lens}

    def _group_meta(self, meta: AttentionMetadata, t: list[torch.Tensor], h: dict) -> None:
        """Fill ``meta``'s per-group slot mappings and block tables and its step-wide lengths. A step of
        only prefills or only decodes reuses their tensors for the first pool and the lengths."""
        slot_t = {key: t[i] for key, i in h["slots"].items()}
        meta.slot_mapping = slot_t[self._first_key]
        only = meta.decode if meta.prefill is None else meta.prefill if meta.decode is None else None
        tables = {pool: t[i] for pool, i in h["tables"].items()}
        if only is not None:
            tables[self._first_key[0]] = only.block_tables  # the same rows, padded with 0 instead of -1
        meta.groups = {g: GroupMeta(slot_t[key], tables[key[0]]) for key, names in self._slot_keys.items()
                       for g in names}
        if only is not None:
            meta.cu_q_lens, meta.seq_lens = only.cu_q_lens, only.seq_lens
        else:
            meta.cu_q_lens, meta.seq_lens = t[h["lens"][0]], t[h["lens"][1]]

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] float32. Pure-decode and verify steps of a captured
        key replay a graph (``DecodeGraphs.key``); every other step runs eagerly."""
        if self.graphs is not None and self.graphs.accepts(batch):
            for event in (e for ready in batch.meta.layer_ready or [] for e in ready):
                event.wait()
            return self.graphs.run(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches)
        if batch.keep_hidden:
            batch.hidden = hidden
        if not batch.logit_rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        rows = batch.logit_index
        if rows is None:  # a batch built by hand
            rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden[rows])
