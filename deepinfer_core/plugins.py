"""Plugin discovery and loading, through stevedore, one entry-point group per interface.

Groups:
  deepinfer.hardware   Platform subclasses (cpu, nvidia, ascend, third parties)
  deepinfer.kernels    KernelBackend subclasses (reference, cuda, ascend, ...)
  deepinfer.schedulers Scheduler subclasses (fcfs, ...)
  deepinfer.kv_stores  KVStore subclasses (host, 3fs, ...)
  deepinfer.features   Feature subclasses (eplb, dspark, structured_output, ...)
  deepinfer.proposers  Proposer subclasses (speculative decoding drafts; third parties)

A plugin that fails to import is "installed but broken", never "not installed": the error names
the plugin and chains the original exception.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass

from stevedore import ExtensionManager, NamedExtensionManager

from deepinfer_core.version import check_api_version

logger = logging.getLogger("deepinfer.plugins")

GROUPS = ("deepinfer.hardware", "deepinfer.kernels", "deepinfer.schedulers", "deepinfer.kv_stores",
          "deepinfer.features", "deepinfer.models", "deepinfer.kv_transports", "deepinfer.proposers")


class PluginError(RuntimeError):
    """A plugin could not be found or loaded."""


class PluginNotFoundError(PluginError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass
class PluginInfo:
    group: str
    name: str
    target: str  # "module:attr"
    distribution: str
    version: str
    obj: object | None = None
    error: BaseException | None = None


def _dist(ep) -> tuple[str, str]:
    """(distribution, version) that registered ``ep`` (stevedore's cache does not keep it)."""
    for candidate in importlib.metadata.entry_points(group=ep.group, name=ep.name):
        if candidate.value == ep.value and candidate.dist is not None:
            return candidate.dist.metadata["Name"], candidate.dist.version
    return "unknown", "unknown"


def installed_names(group: str) -> list[str]:
    """Names registered in ``group``, without importing anything."""
    mgr = ExtensionManager.__new__(ExtensionManager)
    mgr.namespace = group
    return sorted({ep.name for ep in mgr.list_entry_points()})


def discover(group: str) -> list[PluginInfo]:
    """Load every plugin of ``group``; broken ones are returned with their error, not raised."""
    failures: dict[str, PluginInfo] = {}

    def on_fail(_mgr, ep, exc):
        failures[ep.name] = PluginInfo(group, ep.name, ep.value, *_dist(ep), error=exc)

    mgr = ExtensionManager(group, on_load_failure_callback=on_fail)
    found = [PluginInfo(group, e.name, e.entry_point.value, *_dist(e.entry_point), obj=e.plugin) for e in mgr]
    for info in found:
        try:
            check_api_version(info.obj, f"plugin {info.name!r} in {group}")
        except Exception as exc:  # reported, not raised, by listings
            info.error = exc
    return sorted(found + list(failures.values()), key=lambda p: p.name)


def load(group: str, name: str, what: str = "plugin") -> object:
    """Load one plugin by name, checking its core API version.

    Raises PluginNotFoundError (listing what is installed) or PluginError (chaining the import error).
    """
    names = installed_names(group)
    if name not in names:
        raise PluginNotFoundError(
            f"unknown {what} {name!r}: no entry point named {name!r} in group {group!r}; "
            f"installed: {', '.join(names) or 'none'}"
        )
    errors: list[BaseException] = []
    mgr = NamedExtensionManager(
        group, names=[name], on_load_failure_callback=lambda _m, _ep, exc: errors.append(exc),
        on_missing_entrypoints_callback=lambda missing: None,
    )
    if errors or name not in mgr.names():
        cause = errors[0] if errors else None
        raise PluginError(
            f"{what} {name!r} (group {group!r}) is installed but failed to import: "
            f"{type(cause).__name__}: {cause}"
        ) from cause
    obj = mgr[name].plugin
    check_api_version(obj, f"{what} {name!r}")
    return obj
