"""The precisions an engine runs at, from its config, the checkpoint and the platform: whether an FP8
checkpoint's weights stay FP8, and which KV cache dtype the model stores and the kernels read."""

from __future__ import annotations

import logging
from pathlib import Path

from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.models.config import ModelConfig
from deepinfer_core.models.loader import check_quantization_config, read_config
from deepinfer_core.platform import Platform

logger = logging.getLogger("deepinfer.engine")


def keep_fp8_weights(cfg: EngineConfig, model_dir: Path, model_cls: type, mc: ModelConfig, platform: Platform) -> bool:
    """Whether an FP8 checkpoint's weights stay FP8 in memory (config ``weight_dtype``): ``fp8`` always
    (an error for a checkpoint without FP8 weights or an architecture that cannot), ``auto`` where the
    platform has block-scaled FP8 GEMMs, ``bf16`` never (dequantised to ``dtype`` at load). With
    ``load_format = "random"``, ``fp8`` quantises the random weights per 128x128 tile (benchmarks).
    A ``quantization_config`` that is not DeepSeek's FP8 is refused either way."""
    mode = cfg.weight_dtype
    config = read_config(model_dir)
    check_quantization_config(model_dir, config)
    quant = config.get("quantization_config") or {}
    random_fp8 = cfg.load_format == "random" and mode == "fp8"
    is_fp8 = quant.get("quant_method") == "fp8" and cfg.load_format != "random" or random_fp8
    if mode == "bf16" or (mode == "auto" and not (is_fp8 and platform.supports_fp8_gemm())):
        return False
    if not is_fp8:
        raise ConfigError(f"config key 'weight_dtype' is 'fp8' but {str(model_dir)!r} is not an FP8 "
                          "checkpoint (config.json has no quantization_config with quant_method 'fp8'); "
                          "use weight_dtype 'auto' or 'bf16'")
    if not getattr(model_cls, "fp8_weights", False):
        raise ConfigError(f"config key 'weight_dtype' is 'fp8' but architecture {mc.architecture!r} cannot keep "
                          "FP8 weights; use 'auto' or 'bf16'")
    if cfg.ep > 1:
        raise ConfigError("config key 'weight_dtype' is 'fp8' with ep > 1: expert parallelism runs bf16 "
                          "experts only; use weight_dtype 'bf16'")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"config key 'weight_dtype' keeps FP8 weights, whose GEMMs quantise activations on the "
                          f"fly, but the checkpoint's activation_scheme is {quant['activation_scheme']!r}; "
                          "use weight_dtype 'bf16'")
    if not platform.supports_fp8_gemm():
        logger.warning("weight_dtype 'fp8' on %s: its kernels have no block-scaled FP8 GEMM, the reference "
                       "fp8 ops run (correct, slow)", platform.name)
    return True


def check_kv_cache_dtype(cfg: EngineConfig, model_cls: type, mc: ModelConfig, platform: Platform) -> None:
    """Config ``kv_cache_dtype`` must be one the model can declare and the platform's kernels read."""
    want = cfg.kv_cache_dtype
    if want not in model_cls.kv_cache_dtypes:
        raise ConfigError(f"config key 'kv_cache_dtype' is {want!r} but architecture {mc.architecture!r} stores "
                          f"only {model_cls.kv_cache_dtypes}")
    if want not in platform.kv_cache_dtypes():
        raise ConfigError(f"config key 'kv_cache_dtype' is {want!r} but platform {platform.name!r} reads only "
                          f"{platform.kv_cache_dtypes()} KV caches")
