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
import os
from dataclasses import dataclass, field
from typing import Any

import tomllib


class ConfigError(ValueError):
    """A configuration value is unknown or malformed."""


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = $DEEPINFER_HF_MODEL_DIR or the embedded model
    dtype: str = "auto"  # auto|float32|bfloat16|float16
    accelerator: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | float | None = None  # bytes (int) or fraction of free device memory (float)
    enable_prefix_caching: bool = True
    compute_quota_limit: float | None = None  # seconds of prefill compute per step (cost model)
    cost_model: str | None = None  # path of a fitted cost model (default: per platform and model)
    scheduler: str = "fcfs"
    features: list = field(default_factory=list)
    kv_store: dict | None = None
    seed: int = 0
    dp: int = 1
    ep: int = 1
    enforce_eager: bool = False  # True: never replay device graphs (every step runs eagerly)
    graph_batch_sizes: list | None = None  # decode batch sizes captured as graphs; None: the default set
    async_scheduling: bool | None = None  # None: on where the platform supports overlap (engine.py docstring)
    measure_device_idle: bool = False  # engine.metrics() reports the device idle time between steps
    batch_invariant: bool = False
    log_level: str | None = None  # None: leave the "deepinfer" logger as the application set it
    worker_timeout_s: float = 120.0  # dp/ep > 1: a rank silent this long in a step is declared hung
    load_format: str = "auto"  # auto: read the safetensors; random: seeded random weights (benchmarks)
    feature_config: dict = field(default_factory=dict)  # {feature name: its TOML table}

    def section(self, name: str) -> dict:
        return dict(self.feature_config.get(name, {}))


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig) if f.name != "feature_config"}
_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str, type(None)), "dtype": (str,), "accelerator": (str,), "max_num_seqs": (int,),
    "max_num_batched_tokens": (int,), "max_model_len": (int, type(None)), "block_size": (int,),
    "kv_cache_memory": (int, float, type(None)), "enable_prefix_caching": (bool,),
    "compute_quota_limit": (int, float, type(None)), "cost_model": (str, type(None)), "scheduler": (str,),
    "features": (list,), "kv_store": (dict, type(None)), "seed": (int,), "dp": (int,), "ep": (int,),
    "enforce_eager": (bool,), "graph_batch_sizes": (list, type(None)), "async_scheduling": (bool, type(None)),
    "measure_device_idle": (bool,), "batch_invariant": (bool,),
    "log_level": (str, type(None)), "worker_timeout_s": (int, float), "load_format": (str,),
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_INT_LISTS = {"graph_batch_sizes"}  # list keys whose items are integers (parsed as such from the environment)
# Environment variables read elsewhere (features, tools); known so that typos can be flagged.
OTHER_ENV = {"DEEPINFER_CONFIG", "DEEPINFER_HF_MODEL_DIR", "DEEPINFER_ENABLE_MTP_VARLEN",
             "DEEPINFER_SO_BUILDER_CPUS", "DEEPINFER_CACHE_DIR",
             # structured_output (plugins/structured_output/__init__.py documents them)
             "DEEPINFER_SO_COMPILE_TIMEOUT_S", "DEEPINFER_XGRAMMAR_CACHE_SIZE",
             "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", "DEEPINFER_SO_ANY_WHITESPACE", "DEEPINFER_SO_OVERLAP",
             # batch-invariant kernels (kernels_cpu/batch_invariant.py)
             "DEEPINFER_BI_ROW_TILE", "DEEPINFER_BI_KV_SPLIT",
             # dp/ep under torchrun (deepinfer_core/parallel/README.md)
             "DEEPINFER_DRIVER_ADDR", "DEEPINFER_DRIVER_BIND", "DEEPINFER_DRIVER_PORT"}


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
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
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
        if isinstance(value, dict) and key != "kv_store":
            sections[key] = value
        elif key in _FIELDS:
            values[key] = _check_type(key, value, source)
        else:
            raise ConfigError(f"unknown config key {key!r} in {source}; known keys: {', '.join(sorted(_FIELDS))}")

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
    if cfg.dtype not in _DTYPES:
        raise ConfigError(f"config key 'dtype' must be one of {_DTYPES}, got {cfg.dtype!r}")
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "dp", "ep"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r} must be >= 1, got {getattr(cfg, key)}")
    if not all(isinstance(f, str) for f in cfg.features):
        raise ConfigError(f"config key 'features' must be a list of feature names, got {cfg.features!r}")
    if cfg.worker_timeout_s <= 0:
        raise ConfigError(f"config key 'worker_timeout_s' must be positive, got {cfg.worker_timeout_s}")
    if cfg.kv_cache_memory is not None and cfg.kv_cache_memory <= 0:
        raise ConfigError(f"config key 'kv_cache_memory' must be positive, got {cfg.kv_cache_memory}")
    _validate_graph_batch_sizes(cfg)


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
