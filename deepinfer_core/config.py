"""Engine configuration, composed from defaults, a TOML file, environment and keyword arguments.

Precedence, lowest to highest:
  1. built-in defaults (some filled in later from the platform, e.g. ``dtype="auto"``);
  2. the TOML file named by ``config=`` or ``DEEPINFER_CONFIG``;
  3. environment variables ``DEEPINFER_<FIELD>`` (e.g. ``DEEPINFER_MAX_NUM_SEQS=64``);
  4. keyword arguments to ``LLM(...)``.

Top-level TOML keys are the fields of :class:`EngineConfig`. A table (``[eplb]``, ``[dspark]``,
``[kv_store]``...) configures the feature or store of that name; the feature validates it itself.
Unknown keys, unknown features and badly typed values are :class:`ConfigError`s naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import tomllib

logger = logging.getLogger("deepinfer.config")


class ConfigError(ValueError):
    """A configuration value is unknown or malformed."""


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = $DEEPINFER_HF_MODEL_DIR or the embedded model
    dtype: str = "auto"  # auto|float32|bfloat16|float16
    # FP8 checkpoints: fp8 keeps the GEMM weights e4m3 with their 128x128 scales (fp8_* ops); bf16
    # dequantises them to ``dtype`` at load; auto = fp8 where Platform.supports_fp8_gemm(), else bf16
    weight_dtype: str = "auto"
    #: the MLA latent KV cache: auto = the model dtype; bf16 = bfloat16; fp8 = FlashMLA's FP8 row (e4m3 latent,
    #: a power-of-two scale per 128 values, bf16 rope: 656 bytes per token and layer for V3, kernels_cpu/kv_fp8.py).
    #: The model declares which it can store (CausalLM.kv_cache_dtypes), the platform which its kernels read.
    kv_cache_dtype: str = "auto"
    accelerator: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | float | None = None  # bytes (int) or fraction of free device memory (float)
    enable_prefix_caching: bool = True
    #: prefix hits on models with window cache groups (DeepSeek-V4's sliding window), when the window KV
    #: of the hit's last block is not cached (engine/window_prefix.py): "retain" (exact: only hits whose
    #: window KV is on the device or in a host snapshot), "bounded_replay" (recompute one window with the
    #: window clipped at its start: constant cost, approximate), "recompute" (layers x window tokens, exact)
    swa_prefix_policy: str = "retain"
    spec_lookback: int | None = None  # tokens kept out of a hit past the window; None: draft length + 1
    #: window KV snapshots (engine/window_cache.py): MXFP8 copies in host memory that feed "retain" hits
    #: after the device blocks are gone (approximate: MXFP8 rounding); they share the [kv_store] host
    #: tier when there is one, else use window_snapshot_memory bytes
    window_snapshots: bool = False
    window_snapshot_memory: int = 256 << 20
    compute_quota_limit: float | None = None  # seconds of prefill compute per step (cost model)
    cost_model: str | None = None  # path of a fitted cost model (default: per platform and model)
    scheduler: str = "fcfs"
    features: list = field(default_factory=list)
    kv_store: dict | None = None
    kv_role: str = "both"  # both | prefill (compute prompts, hand their KV off) | decode (engine/handoff.py)
    kv_transfer: dict | None = None  # the hand-off transport: {backend = "shm" | "3fs" | "p2p", ...}
    drain_grace_s: float = 60.0  # start_drain(): seconds before unfinished requests are forwarded with their KV
    speculative: dict | None = None  # {proposer = "<deepinfer.proposers name>", k = 4, ...} (proposer.py)
    seed: int = 0
    dp: int = 1
    ep: int = 1
    enforce_eager: bool = False  # True: never replay device graphs (every step runs eagerly)
    decode_fusion: bool = True  # False: the model's unfused ops (CausalLM.set_decode_fusion), to check the fused
    graph_batch_sizes: list | None = None  # decode batch sizes captured as graphs; None: the default set
    #: speculative verify steps get graphs for (batch size, rows per request 2..k+1) with
    #: size x rows <= this many token rows (engine/graph_buckets.py); 0: verify steps run eagerly
    verify_graph_tokens: int = 256
    async_scheduling: bool | None = None  # None: on where the platform supports overlap (engine.py docstring)
    #: with async scheduling, speculative steps of a proposer that drafts on the device overlap too
    #: (engine/spec_async.py); False: they run synchronously (plain steps still overlap)
    async_speculation: bool = True
    measure_device_idle: bool = False  # engine.metrics() reports the device idle time between steps
    batch_invariant: bool = False
    log_level: str | None = None  # None: leave the "deepinfer" logger as the application set it
    worker_timeout_s: float = 120.0  # dp/ep > 1: a rank silent this long in a step is declared hung
    elastic_ep: bool = False  # dp/ep > 1: a dead rank re-forms the group with the survivors (parallel/elastic.py)
    load_format: str = "auto"  # auto: read the safetensors; random: seeded random weights (benchmarks)
    feature_config: dict = field(default_factory=dict)  # {feature name: its TOML table}

    def section(self, name: str) -> dict:
        return dict(self.feature_config.get(name, {}))


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "feature_config"}


def _kinds(annotation) -> tuple[type, ...]:
    """The types a field's annotation allows (``int | None`` -> (int, NoneType)); an int is a valid float."""
    kinds = typing.get_args(annotation) or (annotation,)
    if float in kinds and int not in kinds:
        i = kinds.index(float)
        kinds = (*kinds[:i], int, *kinds[i:])
    return kinds


_HINTS = typing.get_type_hints(EngineConfig)
_TYPES: dict[str, tuple[type, ...]] = {name: _kinds(_HINTS[name]) for name in _FIELDS}
#: Range of each numeric key: (lowest, highest, whether the lowest is excluded); None: unbounded.
#: kv_cache_memory has its own rule (bytes, or a fraction in (0, 1]); graph_batch_sizes is a list.
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "max_num_seqs": (1, None, False), "max_num_batched_tokens": (1, None, False),
    "max_model_len": (1, None, False), "block_size": (1, None, False), "dp": (1, None, False),
    "ep": (1, None, False), "seed": (-(2**63), 2**64 - 1, False),  # what torch.manual_seed takes
    "compute_quota_limit": (0, None, True), "worker_timeout_s": (0, None, True), "drain_grace_s": (0, None, False),
    "spec_lookback": (0, None, False), "window_snapshot_memory": (0, None, False),
    "verify_graph_tokens": (0, None, False),
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
SWA_PREFIX_POLICIES = ("retain", "bounded_replay", "recompute")  # engine/window_prefix.py
WEIGHT_DTYPES = ("auto", "fp8", "bf16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_INT_LISTS = {"graph_batch_sizes"}  # list keys whose items are integers (parsed as such from the environment)
# Environment variables read elsewhere (features, tools): with DEEPINFER_<FIELD> the only known
# DEEPINFER_* names; any other draws a warning naming the closest known one (a typo is never silent).
OTHER_ENV = {"DEEPINFER_CONFIG", "DEEPINFER_HF_MODEL_DIR", "DEEPINFER_ENABLE_MTP_VARLEN",
             "DEEPINFER_SO_BUILDER_CPUS", "DEEPINFER_CACHE_DIR",
             # structured_output (plugins/structured_output/__init__.py documents them)
             "DEEPINFER_SO_COMPILE_TIMEOUT_S", "DEEPINFER_XGRAMMAR_CACHE_SIZE",
             "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", "DEEPINFER_SO_ANY_WHITESPACE", "DEEPINFER_SO_OVERLAP",
             # batch-invariant kernels (kernels_cpu/batch_invariant.py)
             "DEEPINFER_BI_ROW_TILE", "DEEPINFER_BI_KV_SPLIT",
             # TileLang kernels (kernels_cuda/_tl.py)
             "DEEPINFER_CUDA_ARCH", "DEEPINFER_TL_DRYRUN", "DEEPINFER_PDL",
             # decode-fusion kernels off for a benchmark's before (kernels_cuda/norm_gemv.py, gemv_rows.py,
             # mla_decode_uv.py, fp8_gemm.py)
             "DEEPINFER_NORM_GEMV", "DEEPINFER_KV_FUSION", "DEEPINFER_UV_FUSION", "DEEPINFER_FP8_GEMV",
             # the weight-streaming MoE's kernels (kernels_cuda/moe_gemv.py, moe_gemv_fp8.py)
             "DEEPINFER_MOE_DOWN", "DEEPINFER_FP8_MOE_UP",
             # on by default; 0 brings the before back (kernels_cuda/moe_stream_fp8.py, gemv_rows.py)
             "DEEPINFER_FP8_MOE_STREAM", "DEEPINFER_NO_CAST_LAUNCHES",
             # dp/ep under torchrun (deepinfer_core/parallel/README.md)
             "DEEPINFER_DRIVER_ADDR", "DEEPINFER_DRIVER_BIND", "DEEPINFER_DRIVER_PORT"}


def check_number(what: str, value, low: float | None = None, high: float | None = None,
                 low_open: bool = False):
    """``value`` if it is a finite number within [low, high] ((low, high] with ``low_open``), else a
    ConfigError naming ``what`` (e.g. "config key 'block_size'", "[kv_store] flush_timeout")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(f"{what} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(f"{what} must be <= {high}, got {value}")
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable (the kernels' and features' switches): 1/true/yes/on or 0/false/no/off, any
    case; unset or empty: ``default``. Anything else is a :class:`ConfigError` naming the variable."""
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ConfigError(f"environment variable {name}={os.environ[name]!r}: expected one of "
                      f"{', '.join(_TRUE + _FALSE)}")


def warn_unknown_env(env) -> None:
    """Warn about each ``DEEPINFER_*`` variable that no part of DeepInfer reads (likely a typo)."""
    known = {f"DEEPINFER_{key.upper()}" for key in _FIELDS} | OTHER_ENV
    for name in sorted(n for n in env if n.startswith("DEEPINFER_") and n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("environment variable %s is not a DeepInfer setting and is ignored%s", name, hint)


def _check_type(key: str, value: Any, source: str) -> Any:
    expected = _TYPES[key]
    if isinstance(value, bool) and bool not in expected:
        ok = False
    else:
        ok = isinstance(value, expected)
    if not ok:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in expected)
        raise ConfigError(f"config key {key!r} ({source}) expects {names}, got {type(value).__name__} {value!r}")
    return value


def _parse_env(key: str, raw: str) -> Any:
    expected = _TYPES[key]
    text = raw.strip()
    if text.lower() in ("none", "") and type(None) in expected:
        return None
    if bool in expected:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    if int in expected:
        try:
            return int(text)
        except ValueError:
            pass
    if float in expected:
        try:
            return float(text)
        except ValueError:
            pass
    if list in expected:
        items = [p.strip() for p in text.split(",") if p.strip()]
        if key in _INT_LISTS:
            try:
                return [int(p) for p in items]
            except ValueError:
                raise ConfigError(f"environment variable DEEPINFER_{key.upper()}={raw!r} is not a comma-separated "
                                  f"list of integers for {key!r}") from None
        return items
    if str in expected:
        return text
    raise ConfigError(f"environment variable DEEPINFER_{key.upper()}={raw!r} is not a valid value for {key!r}")


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from exc


def compose(config: str | dict | None = None, env: dict | None = None, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from the sources above. ``config`` may be a path or an already-parsed dict."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sections: dict[str, dict] = {}

    path = config if isinstance(config, str) else env.get("DEEPINFER_CONFIG") if config is None else None
    table = load_toml(path) if path else dict(config or {})
    source = f"file {path}" if path else "config dict"
    for key, value in table.items():
        if isinstance(value, dict) and key not in ("kv_store", "kv_transfer", "speculative"):
            sections[key] = value
        elif key in _FIELDS:
            values[key] = _check_type(key, value, source)
        else:
            raise ConfigError(f"unknown config key {key!r} in {source}; known keys: {', '.join(sorted(_FIELDS))}")

    warn_unknown_env(env)
    for key in _FIELDS:
        raw = env.get(f"DEEPINFER_{key.upper()}")
        if raw is not None:
            values[key] = _check_type(key, _parse_env(key, raw), f"env DEEPINFER_{key.upper()}")

    for key, value in kwargs.items():
        if key in _FIELDS:
            values[key] = _check_type(key, value, "keyword argument")
        elif isinstance(value, dict):
            sections[key] = value  # a feature's section passed as a keyword, e.g. dspark={...}
        else:
            raise ConfigError(
                f"unknown config key {key!r} (keyword argument); known keys: {', '.join(sorted(_FIELDS))}"
            )

    cfg = EngineConfig(**values, feature_config=sections)
    _validate(cfg)
    return cfg


def _validate(cfg: EngineConfig) -> None:
    if cfg.load_format not in ("auto", "random"):
        raise ConfigError(f"config key 'load_format' must be 'auto' or 'random', got {cfg.load_format!r}")
    if cfg.kv_role not in ("both", "prefill", "decode"):
        raise ConfigError(f"config key 'kv_role' must be 'both', 'prefill' or 'decode', got {cfg.kv_role!r}")
    if cfg.kv_role != "both" and not cfg.kv_transfer:
        raise ConfigError(f"kv_role={cfg.kv_role!r} needs a [kv_transfer] table naming the transport "
                          "(backend = 'shm', '3fs' or 'p2p')")
    if cfg.swa_prefix_policy not in SWA_PREFIX_POLICIES:
        raise ConfigError(f"config key 'swa_prefix_policy' must be one of {SWA_PREFIX_POLICIES}, "
                          f"got {cfg.swa_prefix_policy!r}")
    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"config key 'dtype' must be one of {_DTYPES}, got {cfg.dtype!r}")
    if cfg.weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"config key 'weight_dtype' must be one of {WEIGHT_DTYPES}, got {cfg.weight_dtype!r}")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"config key 'kv_cache_dtype' must be one of {KV_CACHE_DTYPES}, got {cfg.kv_cache_dtype!r}")
    if cfg.log_level is not None and cfg.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError(f"config key 'log_level' must be one of {', '.join(_LOG_LEVELS)} (any case), "
                          f"got {cfg.log_level!r}")
    for key, (low, high, low_open) in _RANGES.items():
        if getattr(cfg, key) is not None:
            check_number(f"config key {key!r}", getattr(cfg, key), low, high, low_open)
    if not all(isinstance(f, str) for f in cfg.features):
        raise ConfigError(f"config key 'features' must be a list of feature names, got {cfg.features!r}")
    _validate_kv_cache_memory(cfg.kv_cache_memory)
    _validate_graph_batch_sizes(cfg)


def _validate_kv_cache_memory(value: int | float | None) -> None:
    if value is None:
        return
    what = "config key 'kv_cache_memory'"
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what} must be positive, got {value}")
        return
    check_number(what, value)
    if not 0 < value <= 1:
        raise ConfigError(f"{what} as a float is a fraction of the free device memory and must be in (0, 1], "
                          f"got {value}; give a byte count as an integer")


def _validate_graph_batch_sizes(cfg: EngineConfig) -> None:
    sizes = cfg.graph_batch_sizes
    if sizes is None:
        return
    if not sizes:
        raise ConfigError("config key 'graph_batch_sizes' is an empty list; leave it unset for the default sizes, "
                          "or set enforce_eager = true to run every step eagerly")
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
        raise ConfigError(f"config key 'graph_batch_sizes' must be a list of integers >= 1, got {sizes!r} "
                          f"(bad: {bad!r})")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"config key 'graph_batch_sizes' lists a size more than once: {sizes!r}")
    over = [s for s in sizes if s > cfg.max_num_seqs]
    if over:
        raise ConfigError(f"config key 'graph_batch_sizes' has sizes {over} above max_num_seqs={cfg.max_num_seqs} "
                          "(a decode batch never holds more sequences); remove them or raise max_num_seqs")
