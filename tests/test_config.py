"""Configuration: precedence of the sources, and every error naming what is wrong."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import tomllib
from stevedore import ExtensionManager
from stevedore import _cache as stevedore_cache

from deepinfer_core import config, features, plugins
from deepinfer_core.config import ConfigError, EngineConfig, compose

KNOWN = ", ".join(sorted(f.name for f in dataclasses.fields(EngineConfig) if f.name != "feature_config"))


def write(tmp_path, text: str, name: str = "deepinfer.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults():
    cfg = compose(env={})
    assert cfg == EngineConfig()
    assert (cfg.max_num_seqs, cfg.block_size, cfg.accelerator, cfg.features, cfg.feature_config) == (
        256, 16, "auto", [], {})


def test_precedence_defaults_toml_env_kwargs(tmp_path):
    path = write(tmp_path, """
        max_num_seqs = 8
        block_size = 32
        seed = 3
        dtype = "bfloat16"
    """)
    env = {"DEEPINFER_BLOCK_SIZE": "64", "DEEPINFER_SEED": "4"}
    cfg = compose(config=path, env=env, seed=5)
    assert cfg.max_num_seqs == 8  # TOML over default
    assert cfg.block_size == 64  # env over TOML
    assert cfg.seed == 5  # kwargs over env
    assert cfg.dtype == "bfloat16"
    assert cfg.max_num_batched_tokens == 4096  # default


def test_config_file_from_environment(tmp_path):
    path = write(tmp_path, "max_num_seqs = 12\n")
    assert compose(env={"DEEPINFER_CONFIG": path}).max_num_seqs == 12
    # an explicit config= wins over DEEPINFER_CONFIG
    other = write(tmp_path, "max_num_seqs = 13\n", "other.toml")
    assert compose(config=other, env={"DEEPINFER_CONFIG": path}).max_num_seqs == 13


def test_environment_values_are_parsed_by_type():
    cfg = compose(env={
        "DEEPINFER_KV_CACHE_MEMORY": "0.5", "DEEPINFER_FEATURES": "eplb, dspark",
        "DEEPINFER_MAX_MODEL_LEN": "None", "DEEPINFER_ENFORCE_EAGER": "yes",
        "DEEPINFER_ASYNC_SCHEDULING": "off", "DEEPINFER_DP": "2",
    })
    assert cfg.kv_cache_memory == 0.5 and isinstance(cfg.kv_cache_memory, float)
    assert cfg.features == ["eplb", "dspark"]
    assert cfg.max_model_len is None
    assert cfg.enforce_eager is True and cfg.async_scheduling is False and cfg.dp == 2
    assert compose(env={"DEEPINFER_KV_CACHE_MEMORY": "1073741824"}).kv_cache_memory == 1 << 30


def test_tables_become_feature_sections(tmp_path):
    path = write(tmp_path, """
        features = ["eplb"]
        [eplb]
        window = 100
        [kv_store]
        name = "host"
    """)
    cfg = compose(config=path, env={}, dspark={"k": 2})
    assert cfg.feature_config == {"eplb": {"window": 100}, "dspark": {"k": 2}}
    assert cfg.kv_store == {"name": "host"}
    assert cfg.section("eplb") == {"window": 100} and cfg.section("missing") == {}


def test_malformed_toml(tmp_path):
    path = write(tmp_path, "max_num_seqs = = 3\n")
    with pytest.raises(ConfigError, match=r"^config file '.*deepinfer\.toml' is not valid TOML: ") as info:
        compose(config=path, env={})
    assert isinstance(info.value.__cause__, tomllib.TOMLDecodeError)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as info:
        compose(config=path, env={})
    assert str(info.value) == f"config file {path!r} does not exist"


def test_unknown_key_in_file_and_in_kwargs(tmp_path):
    path = write(tmp_path, "max_num_seq = 3\n")
    with pytest.raises(ConfigError) as info:
        compose(config=path, env={})
    assert str(info.value) == f"unknown config key 'max_num_seq' in file {path}; known keys: {KNOWN}"
    with pytest.raises(ConfigError) as info:
        compose(env={}, max_num_seq=3)
    assert str(info.value) == f"unknown config key 'max_num_seq' (keyword argument); known keys: {KNOWN}"


@pytest.mark.parametrize("key,value,expected", [
    ("max_num_seqs", "64", "int, got str '64'"),
    ("max_num_seqs", True, "int, got bool True"),
    ("enable_prefix_caching", 1, "bool, got int 1"),
    ("kv_cache_memory", "lots", "int or float or None, got str 'lots'"),
    ("features", "eplb", "list, got str 'eplb'"),
])
def test_wrong_value_type(key, value, expected):
    with pytest.raises(ConfigError) as info:
        compose(config={key: value}, env={})
    assert str(info.value) == f"config key {key!r} (config dict) expects {expected}"
    with pytest.raises(ConfigError) as info:
        compose(env={}, **{key: value})
    assert str(info.value) == f"config key {key!r} (keyword argument) expects {expected}"


def test_wrong_type_in_file_names_the_file(tmp_path):
    path = write(tmp_path, 'block_size = "16"\n')
    with pytest.raises(ConfigError) as info:
        compose(config=path, env={})
    assert str(info.value) == f"config key 'block_size' (file {path}) expects int, got str '16'"


@pytest.mark.parametrize("var,raw", [
    ("MAX_NUM_SEQS", "lots"), ("ENFORCE_EAGER", "maybe"), ("KV_STORE", "host"),
])
def test_bad_environment_value(var, raw):
    with pytest.raises(ConfigError) as info:
        compose(env={f"DEEPINFER_{var}": raw})
    assert str(info.value) == (f"environment variable DEEPINFER_{var}={raw!r} is not a valid value for "
                               f"{var.lower()!r}")


@pytest.mark.parametrize("kwargs,message", [
    ({"dtype": "fp8"},
     "config key 'dtype' must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'fp8'"),
    ({"max_num_seqs": 0}, "config key 'max_num_seqs' must be >= 1, got 0"),
    ({"kv_cache_memory": -1}, "config key 'kv_cache_memory' must be positive, got -1"),
    ({"features": ["eplb", 3]}, "config key 'features' must be a list of feature names, got ['eplb', 3]"),
])
def test_invalid_values(kwargs, message):
    with pytest.raises(ConfigError) as info:
        compose(env={}, **kwargs)
    assert str(info.value) == message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert "DEEPINFER_CONFIG" in config.OTHER_ENV


@pytest.mark.parametrize("raw,want", [(None, True), ("", True), ("0", False), (" Off ", False), ("no", False),
                                     ("FALSE", False), ("1", True), ("on", True), ("Yes", True)])
def test_env_flag_words(monkeypatch, raw, want):
    """The kernels' and features' on/off switches (``config.env_flag``): "false" is off (it used to turn a
    ``DEEPINFER_UV_FUSION`` style switch on: only "" and "0" were off)."""
    if raw is None:
        monkeypatch.delenv("DEEPINFER_UV_FUSION", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_UV_FUSION", raw)
    assert config.env_flag("DEEPINFER_UV_FUSION", True) is want


def test_env_flag_refuses_other_words(monkeypatch):
    monkeypatch.setenv("DEEPINFER_UV_FUSION", "maybe")
    with pytest.raises(ConfigError, match=r"DEEPINFER_UV_FUSION='maybe': expected one of 1, true, yes, on, 0, false"):
        config.env_flag("DEEPINFER_UV_FUSION", True)


def test_every_environment_variable_the_code_reads_is_known():
    """A DEEPINFER_* name quoted in the shipped sources is a config field or in ``OTHER_ENV``: otherwise setting
    it draws the unknown-variable warning (as DEEPINFER_UV_FUSION and DEEPINFER_FP8_MOE_UP did)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    known = {f"DEEPINFER_{f.name.upper()}" for f in dataclasses.fields(EngineConfig)} | config.OTHER_ENV
    quoted = {(m, str(p.relative_to(root)))
              for d in ("deepinfer_core", "kernels_cuda", "kernels_cpu", "kernels_ascend", "hardware", "plugins")
              for p in (root / d).rglob("*.py")
              for m in re.findall(r'"(DEEPINFER_[A-Z0-9_]+)"', p.read_text(encoding="utf-8"))}
    assert {(name, path) for name, path in quoted if name not in known} == set()


# ---- features -----------------------------------------------------------------------------
@pytest.fixture
def fresh_entry_points(monkeypatch, tmp_path):
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    monkeypatch.setattr(stevedore_cache._c, "_dir", str(tmp_path / "entry-point-cache"))


def test_unknown_feature_name(fresh_entry_points):
    cfg = compose(env={}, features=["no_such_feature"])
    installed = plugins.installed_names(features.GROUP)
    with pytest.raises(ConfigError) as info:
        features.load_features(cfg, features.make_plugin_manager())
    assert str(info.value) == (f"unknown feature 'no_such_feature'; installed features: "
                               f"{', '.join(installed) or 'none'}")


def test_section_without_enabled_feature(fresh_entry_points):
    cfg = compose(config={"no_such_feature": {"x": 1}}, env={})
    installed = plugins.installed_names(features.GROUP)
    with pytest.raises(ConfigError) as info:
        features.load_features(cfg, features.make_plugin_manager())
    assert str(info.value) == ("config section [no_such_feature] does not match an enabled feature; "
                               f"enabled: [], installed features: {installed}")


def test_kv_store_section_is_reserved(fresh_entry_points):
    cfg = compose(config={"kv_store": {"name": "host"}}, env={})
    assert features.load_features(cfg, features.make_plugin_manager()) == []


FEATURE_SRC = """
    from deepinfer_core.features import Feature
    from deepinfer_core.hookspecs import hookimpl

    class Counter(Feature):
        name = "dit_counter"
        core_api_version = "1.0"

        def __init__(self, section):
            self.settings = self.check_keys(self.name, section, {"every": 1, "scale": 1.0, "label": "x"})
            self.steps = 0

        @hookimpl
        def step_finished(self, engine, step_stats):
            self.steps += self.settings["every"]

        @hookimpl
        def collect_metrics(self, engine):
            return {"dit_counter_steps": self.steps}
"""


@pytest.fixture
def counter_feature(tmp_path, monkeypatch, fresh_entry_points):
    site = tmp_path / "site"
    site.mkdir()
    (site / "dit_feature.py").write_text(textwrap.dedent(FEATURE_SRC))
    info = site / "dit_feature-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dit-feature\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[deepinfer.features]\ndit_counter = dit_feature:Counter\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("dit_feature", None)


def test_feature_plugin_gets_its_section_and_hooks(counter_feature):
    cfg = compose(config={"features": ["dit_counter"], "dit_counter": {"every": 2, "scale": 3}}, env={})
    pm = features.make_plugin_manager()
    (feature,) = features.load_features(cfg, pm)
    assert feature.settings == {"every": 2, "scale": 3, "label": "x"}
    pm.hook.step_finished(engine=None, step_stats=None)
    assert pm.hook.collect_metrics(engine=None) == [{"dit_counter_steps": 2}]


@pytest.mark.parametrize("section,message", [
    ({"evry": 2},
     "unknown key(s) ['evry'] in the [dit_counter] section; known keys: ['every', 'label', 'scale']"),
    ({"every": "2"}, "[dit_counter] every expects int, got str '2'"),
    ({"label": 5}, "[dit_counter] label expects str, got int 5"),
])
def test_feature_section_errors(counter_feature, section, message):
    cfg = compose(config={"features": ["dit_counter"], "dit_counter": section}, env={})
    with pytest.raises(ConfigError) as info:
        features.load_features(cfg, features.make_plugin_manager())
    assert str(info.value) == message


def test_feature_without_settings_rejects_a_section():
    class Plain(features.Feature):
        name = "plain"

    with pytest.raises(ConfigError) as info:
        Plain({"x": 1})
    assert str(info.value) == "feature 'plain' takes no settings, got keys ['x']"
