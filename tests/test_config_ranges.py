"""Every numeric config value is range- and finite-checked with an error naming the key (issue 14,
item 2): engine keys from every source, feature sections, the KV cache size against the device;
``log_level`` names the valid levels; a misspelled ``DEEPINFER_*`` variable is not ignored silently."""

from __future__ import annotations

import dataclasses
import logging
import math
import typing

import pytest

from deepinfer_core import LLM, config
from deepinfer_core.config import ConfigError, EngineConfig, compose
from plugins.structured_output.feature import StructuredOutput

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("key,value,words", [
    ("max_model_len", 0, ["'max_model_len'", ">= 1", "got 0"]),
    ("max_model_len", -5, ["'max_model_len'", ">= 1", "got -5"]),
    ("block_size", 0, ["'block_size'", ">= 1"]),
    ("max_num_batched_tokens", -1, ["'max_num_batched_tokens'", ">= 1"]),
    ("dp", 0, ["'dp'", ">= 1"]),
    ("seed", 2**64, ["'seed'", "<= 18446744073709551615"]),
    ("kv_cache_memory", 1.5, ["'kv_cache_memory'", "(0, 1]", "got 1.5", "integer"]),
    ("kv_cache_memory", 0.0, ["'kv_cache_memory'", "(0, 1]"]),
    ("kv_cache_memory", NAN, ["'kv_cache_memory'", "finite", "nan"]),
    ("kv_cache_memory", INF, ["'kv_cache_memory'", "finite", "inf"]),
    ("kv_cache_memory", 0, ["'kv_cache_memory'", "positive"]),
    ("worker_timeout_s", NAN, ["'worker_timeout_s'", "finite"]),
    ("worker_timeout_s", INF, ["'worker_timeout_s'", "finite"]),
    ("worker_timeout_s", 0, ["'worker_timeout_s'", "> 0"]),
    ("compute_quota_limit", NAN, ["'compute_quota_limit'", "finite"]),
    ("compute_quota_limit", -1.0, ["'compute_quota_limit'", "> 0"]),
])
def test_numeric_keys_are_range_and_finite_checked(tmp_path, key, value, words):
    for source in ("kwargs", "dict"):
        with pytest.raises(ConfigError) as info:
            compose(env={}, **{key: value}) if source == "kwargs" else compose(config={key: value}, env={})
        for w in words:
            assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("var,raw,key", [
    ("DEEPINFER_WORKER_TIMEOUT_S", "nan", "worker_timeout_s"),
    ("DEEPINFER_KV_CACHE_MEMORY", "inf", "kv_cache_memory"),
    ("DEEPINFER_MAX_MODEL_LEN", "0", "max_model_len"),
])
def test_environment_values_are_range_checked(var, raw, key):
    with pytest.raises(ConfigError, match=repr(key)):
        compose(env={var: raw})


def test_the_type_table_comes_from_the_dataclass():
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "feature_config":
            continue
        kinds = config._TYPES[f.name]
        assert set(typing.get_args(hints[f.name]) or (hints[f.name],)) <= set(kinds)
        # every numeric key has a range (kv_cache_memory has its own rule)
        if {int, float} & set(kinds) and f.name != "kv_cache_memory":
            assert f.name in config._RANGES, f"{f.name} has no range in config._RANGES"


def test_valid_edge_values_are_accepted():
    cfg = compose(env={}, kv_cache_memory=1.0, max_model_len=1, worker_timeout_s=0.5, seed=2**64 - 1,
                  compute_quota_limit=1, log_level="debug")
    assert (cfg.kv_cache_memory, cfg.max_model_len, cfg.seed) == (1.0, 1, 2**64 - 1)


def test_log_level_names_the_valid_levels():
    with pytest.raises(ConfigError) as info:
        compose(env={}, log_level="LOUD")
    msg = str(info.value)
    assert "'log_level'" in msg and "'LOUD'" in msg
    assert all(level in msg for level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))


def test_misspelled_environment_variable_is_warned_about(caplog):
    env = {"DEEPINFER_MAX_NUM_SEQ": "8", "DEEPINFER_HF_MODEL_DIR": "/x", "DEEPINFER_SO_OVERLAP": "0",
           "DEEPINFER_BLOCK_SIZE": "8", "DEEPINFER_TL_DRYRUN": "1", "PATH": "/bin"}
    with caplog.at_level(logging.WARNING, logger="deepinfer.config"):
        cfg = compose(env=env)
    assert cfg.block_size == 8
    warned = [r.getMessage() for r in caplog.records if r.name == "deepinfer.config"]
    assert len(warned) == 1, warned  # the legitimate variables are known
    assert "DEEPINFER_MAX_NUM_SEQ is not" in warned[0] and "did you mean DEEPINFER_MAX_NUM_SEQS?" in warned[0]


@pytest.mark.parametrize("section,env,words", [
    ({"compile_timeout_s": NAN}, {}, ["[structured_output] compile_timeout_s", "finite"]),
    ({"compile_timeout_s": INF}, {}, ["[structured_output] compile_timeout_s", "finite"]),
    ({}, {"DEEPINFER_SO_COMPILE_TIMEOUT_S": "nan"}, ["[structured_output] compile_timeout_s", "finite"]),
    ({"compile_timeout_s": 0.0}, {}, ["[structured_output] compile_timeout_s", "> 0"]),
])
def test_structured_output_section_numbers(section, env, words):
    with pytest.raises(ConfigError) as info:
        StructuredOutput(section, env=env)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("key,value", [("flush_timeout", NAN), ("flush_timeout", INF), ("flush_timeout", -1),
                                       ("gc_interval", NAN)])
def test_kv_store_section_numbers(tiny_v3_path, tmp_path, key, value):
    section = {"backend": "3fs", "path": str(tmp_path / "store"), key: value}
    with pytest.raises(ConfigError) as info:
        LLM(tiny_v3_path, dtype="float32", block_size=4, kv_cache_memory=1 << 20, kv_store=section)
    assert f"[kv_store] {key}" in str(info.value)


def test_kv_cache_bytes_above_the_device_memory_is_a_clear_error(tiny_v3_path):
    from deepinfer_core.selection import select_platform

    free, total = select_platform("auto").memory_info(0)
    with pytest.raises(ConfigError) as info:
        LLM(tiny_v3_path, dtype="float32", block_size=4, kv_cache_memory=total * 4)
    msg = str(info.value)
    assert "'kv_cache_memory'" in msg and "free memory" in msg and str(total * 4) in msg
    assert math.isfinite(free)
