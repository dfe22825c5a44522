"""Feature plugins: optional behaviour enabled per deployment by name.

A feature is a class in the ``deepinfer.features`` entry-point group:

    class MyFeature(Feature):
        name = "my_feature"
        core_api_version = "1.0"

        def __init__(self, section: dict):     # its config table; raise ConfigError on bad keys
            ...

        @hookimpl
        def engine_started(self, engine): ...

Its instance is registered with pluggy, so its ``@hookimpl`` methods run at the engine's extension
points (``deepinfer_core.hookspecs``).
"""

from __future__ import annotations

import logging

import pluggy

from deepinfer_core import hookspecs, plugins
from deepinfer_core.config import ConfigError, EngineConfig, check_number

logger = logging.getLogger("deepinfer.features")
GROUP = "deepinfer.features"


class Feature:
    """Base class of feature plugins (see the module docstring)."""

    name: str = ""
    core_api_version: str = ""

    def __init__(self, section: dict) -> None:
        if section:
            raise ConfigError(f"feature {self.name!r} takes no settings, got keys {sorted(section)}")

    @staticmethod
    def check_keys(feature: str, section: dict, allowed: dict) -> dict:
        """Merge ``section`` over ``allowed`` defaults, rejecting unknown keys, wrong types and
        non-finite floats (ranges are the feature's to check, e.g. with ``config.check_number``)."""
        unknown = sorted(set(section) - set(allowed))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {unknown} in the [{feature}] section; known keys: {sorted(allowed)}"
            )
        merged = dict(allowed)
        for key, value in section.items():
            default = allowed[key]
            if default is not None and not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)
            ):
                raise ConfigError(
                    f"[{feature}] {key} expects {type(default).__name__}, got {type(value).__name__} {value!r}"
                )
            if isinstance(value, float):
                check_number(f"[{feature}] {key}", value)  # no NaN or infinity
            merged[key] = value
        return merged


def make_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def load_features(cfg: EngineConfig, pm: pluggy.PluginManager,
                  reserved_sections=("kv_store", "kv_transfer")) -> list[Feature]:
    """Instantiate and register the features ``cfg.features`` names, each with its own section."""
    installed = plugins.installed_names(GROUP)
    for section in cfg.feature_config:
        if section not in cfg.features and section not in reserved_sections:
            raise ConfigError(
                f"config section [{section}] does not match an enabled feature; enabled: {cfg.features}, "
                f"installed features: {installed}"
            )
    loaded = []
    for name in cfg.features:
        if name not in installed:
            raise ConfigError(f"unknown feature {name!r}; installed features: {', '.join(installed) or 'none'}")
        cls = plugins.load(GROUP, name, what="feature")
        feature = cls(cfg.section(name))
        pm.register(feature, name=name)
        loaded.append(feature)
        logger.info("feature %r enabled", name)
    return loaded


def hook_blame(pm: pluggy.PluginManager, exc: BaseException) -> str | None:
    """The registered plugin whose hook implementation raised ``exc``, as ``"plugin 'name' (hook hook_name)"``,
    found in the traceback (the innermost such frame: a hook that calls another plugin's blames the latter);
    None when no hook implementation is on it."""
    owners = {}
    for name, plugin in pm.list_name_plugin():
        for caller in pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                code = getattr(impl.function, "__code__", None)
                if impl.plugin is plugin and code is not None:
                    owners[code] = f"plugin {name!r} (hook {caller.name})"
    blame, tb = None, exc.__traceback__
    while tb is not None:
        blame = owners.get(tb.tb_frame.f_code, blame)
        tb = tb.tb_next
    return blame

