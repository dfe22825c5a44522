"""The ``structured_output`` feature plugin: the engine hooks around the grammar compiler and the
per-request :class:`GrammarState` (see the package docstring for usage and configuration)."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from deepinfer_core.config import ConfigError, check_number
from deepinfer_core.features import Feature
from deepinfer_core.hookspecs import hookimpl
from plugins.structured_output.bitmask import apply_bitmask, apply_cpu_masks
from plugins.structured_output.grammar import GrammarCompiler, GrammarError, GrammarSpec, parse_so_args, tokenizer_info
from plugins.structured_output.matcher import GrammarState, schedule_fills

logger = logging.getLogger("deepinfer.structured_output")
NAME = "structured_output"

#: config key -> (environment variable, default)
SETTINGS: dict[str, tuple[str, object]] = {
    "builder_threads": ("DEEPINFER_SO_BUILDER_CPUS", 2),
    "compile_timeout_s": ("DEEPINFER_SO_COMPILE_TIMEOUT_S", 30.0),
    "cache_size": ("DEEPINFER_XGRAMMAR_CACHE_SIZE", 512),
    "cache_limit_bytes": ("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", 256 * 1024 * 1024),
    "any_whitespace": ("DEEPINFER_SO_ANY_WHITESPACE", False),
    "overlap": ("DEEPINFER_SO_OVERLAP", True),
}
ENV_VARS = tuple(env for env, _ in SETTINGS.values())
IDLE_WAIT_S = 0.02  # with nothing else to run, wait this long for a compile instead of spinning


def _from_env(key: str, env: dict) -> object:
    name, default = SETTINGS[key]
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip().lower()
    try:
        if isinstance(default, bool):
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return type(default)(text)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {type(default).__name__} "
                          f"for [{NAME}] {key}") from None


class _Pending:
    """A request whose grammar is compiling."""

    def __init__(self, spec: GrammarSpec, future, eos: list[int]) -> None:
        self.spec, self.future, self.eos = spec, future, eos
        self.submitted = time.perf_counter()


class StructuredOutput(Feature):
    name = NAME
    core_api_version = "1.0"

    def __init__(self, section: dict, env: dict | None = None) -> None:
        env = os.environ if env is None else env
        defaults = {key: _from_env(key, env) for key in SETTINGS}
        cfg = self.check_keys(NAME, section, defaults)
        for key in ("builder_threads", "cache_size", "cache_limit_bytes"):
            if cfg[key] < 1:
                raise ConfigError(f"[{NAME}] {key} must be >= 1, got {cfg[key]}")
        check_number(f"[{NAME}] compile_timeout_s", cfg["compile_timeout_s"], 0, low_open=True)
        self.cfg = cfg
        self.compiler: GrammarCompiler | None = None
        self.vocab_size = 0
        self.no_tokenizer_reason: str | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self.cpu_masks = False  # CPU logits: the mask worker also prepares each mask (bitmask.CpuMask)
        self.stats = {"requests": 0, "failed": 0, "masked_rows": 0, "mask_wait_s": 0.0, "apply_s": 0.0,
                      "fill_s": 0.0, "fills": 0}

    # ---- lifecycle --------------------------------------------------------------------------------
    @hookimpl
    def request_options(self) -> list[str]:
        return ["so_args"]

    @hookimpl
    def engine_started(self, engine) -> None:
        self.vocab_size = engine.model_config.vocab_size
        self.cpu_masks = engine.device.type == "cpu"
        tk = getattr(engine.tokenizer, "tk", None)
        if tk is None:
            self.no_tokenizer_reason = (f"structured output needs the model's tokenizer.json, which "
                                        f"{str(engine.model_dir)!r} does not have")
            return
        info = tokenizer_info(tk, self.vocab_size, engine.tokenizer.eos_token_ids)
        self.compiler = GrammarCompiler(info, self.cfg["builder_threads"], self.cfg["cache_size"],
                                        self.cfg["cache_limit_bytes"], self.cfg["any_whitespace"])
        if self.cfg["overlap"]:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="so-mask")

    @hookimpl
    def engine_shutdown(self, engine) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)

    # ---- requests ---------------------------------------------------------------------------------
    @hookimpl
    def request_added(self, engine, request) -> None:
        so_args = request.params.so_args
        if so_args is None:
            return
        spec = parse_so_args(so_args, self.vocab_size)
        if self.compiler is None:
            raise GrammarError(self.no_tokenizer_reason or "structured output is not initialised")
        eos = request.eos_token_ids or engine.tokenizer.eos_token_ids
        request.feature_state[NAME] = _Pending(spec, self.compiler.submit(spec.key), list(eos))
        self.stats["requests"] += 1

    @hookimpl
    def request_needs_sync(self, engine, request) -> bool | None:
        """The next mask depends on the last token: with async scheduling, its steps run synchronously."""
        return True if request.params.so_args is not None else None

    @hookimpl
    def request_ready(self, engine, request):
        """False while the grammar compiles; raises if it failed or timed out; None (no opinion,
        so other features decide) once compiled."""
        pending = request.feature_state.get(NAME)
        if not isinstance(pending, _Pending):
            return None
        fut, timeout = pending.future, self.cfg["compile_timeout_s"]
        left = timeout - (time.perf_counter() - pending.submitted)
        if not fut.done() and left > 0 and engine.load_stats()["running"] == 0:
            try:  # nothing else to run: block briefly rather than spin the step loop
                fut.result(timeout=min(left, IDLE_WAIT_S))
            except Exception:
                pass
        if not fut.done():
            if time.perf_counter() - pending.submitted >= timeout:
                self.stats["failed"] += 1
                raise TimeoutError(f"structured output: the {pending.spec.schema_type} grammar did not compile "
                                   f"within compile_timeout_s={timeout:g} s")
            return False
        exc = fut.exception()
        if exc is not None:
            self.stats["failed"] += 1
            raise exc
        state = GrammarState(fut.result(), pending.spec, pending.eos, self.vocab_size, self.cpu_masks)
        for tok in request.output_token_ids:  # resumed with output already generated
            if not state.accept_token(tok):
                raise GrammarError(f"structured output: existing output token {tok} violates the grammar")
        request.feature_state[NAME] = state
        return None

    @hookimpl
    def request_finished(self, engine, request) -> None:
        state = request.feature_state.pop(NAME, None)
        if isinstance(state, GrammarState):
            state.sync()
            self.stats["fill_s"] += state.fill_seconds
            self.stats["fills"] += state.fills

    def state(self, request) -> GrammarState | None:
        """The request's grammar state (for speculative decoding), or None."""
        st = request.feature_state.get(NAME)
        return st if isinstance(st, GrammarState) else None

    # ---- each step --------------------------------------------------------------------------------
    @hookimpl
    def process_logits(self, engine, batch, logits: torch.Tensor) -> None:
        rows: list[int] = []
        states: list[GrammarState] = []
        drafted: list[tuple[int, GrammarState, list[int]]] = []
        seqs = batch.sample_seqs
        i = 0
        while i < len(seqs):
            seq, n = seqs[i], 1
            while i + n < len(seqs) and seqs[i + n] is seq:  # speculative verification: one row per draft
                n += 1
            st = self.state(seq)
            if st is not None and n > 1:
                drafted.append((i, st, seq.spec_tokens[: n - 1]))
            elif st is not None and st.active:
                rows.append(i)
                states.append(st)
            i += n
        if drafted:
            self._mask_drafts(logits, drafted)
        if not rows:
            return
        t0 = time.perf_counter()
        if self.cpu_masks and logits.device.type == "cpu" and logits.dtype == torch.float32:
            masks = [st.next_cpu_mask() for st in states]  # usually ready: filled during the forward
            t1 = time.perf_counter()
            apply_cpu_masks(logits, rows, masks)
        else:
            masks = [st.next_mask() for st in states]
            t1 = time.perf_counter()
            apply_bitmask(logits, masks[0] if len(masks) == 1 else torch.cat(masks),
                          None if len(rows) == logits.shape[0] else rows)
        self.stats["mask_wait_s"] += t1 - t0
        self.stats["apply_s"] += time.perf_counter() - t1
        self.stats["masked_rows"] += len(rows)

    def _mask_drafts(self, logits: torch.Tensor, drafted: list) -> None:
        """Masks of a request's verify rows: row j allows what the grammar allows after its drafts
        d_1..d_j (``fill_draft_bitmasks``: advanced and rolled back, the state is unchanged). Rows
        after a draft the grammar rejects stay unmasked: that draft's own row masks it out, so the
        verification never keeps it or anything after it."""
        t0 = time.perf_counter()
        for first, st, toks in drafted:
            bitmask = xgr.allocate_token_bitmask(len(toks) + 1, self.vocab_size)
            filled = st.fill_draft_bitmasks(toks, bitmask)
            apply_bitmask(logits, bitmask[:filled], list(range(first, first + filled)))
            self.stats["masked_rows"] += filled
        self.stats["apply_s"] += time.perf_counter() - t0

    @hookimpl
    def tokens_sampled(self, engine, batch, token_ids: list[int]) -> None:
        refill: list[GrammarState] = []
        for seq, tok in zip(batch.sample_seqs, token_ids):
            st = self.state(seq)
            if st is None or seq.is_finished:
                continue
            if not st.accept_token(tok):
                engine.abort(seq.request_id, "error", GrammarError(
                    f"structured output: sampled token {tok} is not allowed by the grammar"))
                continue
            if st.is_finished:  # the grammar took its EOS; with ignore_eos the engine would go on unconstrained
                engine.abort(seq.request_id, "stop")
                continue
            if st.active and st not in refill:
                refill.append(st)
        refill = [st for st in refill if st.active]  # a later token of the same request may end its span
        if self._mask_pool is not None:  # next step's masks, while its forward runs
            schedule_fills(self._mask_pool, refill)

    @hookimpl
    def merge_metrics(self, per_rank: list[dict]) -> dict | None:
        """Every ``so_*`` metric is a count or a sum of seconds: summed over the ranks."""
        keys = {k for m in per_rank for k in m if k.startswith("so_")}
        return {k: sum(m.get(k, 0) for m in per_rank) for k in keys} or None

    @hookimpl
    def collect_metrics(self, engine) -> dict:
        s = self.stats
        c = self.compiler
        out = {"so_requests": s["requests"], "so_failed": s["failed"], "so_masked_rows": s["masked_rows"],
               "so_mask_wait_s": s["mask_wait_s"], "so_mask_apply_s": s["apply_s"]}
        if c is not None:
            out.update(so_cache_hits=c.hits, so_cache_misses=c.misses, so_compile_errors=c.errors,
                       so_cache_entries=c.num_cached, so_compile_s=c.compile_time)
        return out
