"""Version of the public plugin API.

Every plugin class declares ``core_api_version = "MAJOR.MINOR"``. A plugin loads when its major
version equals the core's and its minor version is not newer than the core's. Anything else is a
clear error at load time (see :func:`check_api_version`).
"""

from __future__ import annotations

CORE_API_VERSION = "1.0"


class PluginAPIVersionError(RuntimeError):
    """A plugin was written for a core API this core does not provide."""


def _parse(version: str, who: str) -> tuple[int, int]:
    try:
        major, minor = (int(p) for p in str(version).split("."))
    except ValueError as exc:
        raise PluginAPIVersionError(f"{who}: core_api_version {version!r} is not 'MAJOR.MINOR'") from exc
    return major, minor


def check_api_version(obj: object, who: str) -> None:
    """Raise PluginAPIVersionError unless ``obj.core_api_version`` is compatible with this core."""
    declared = getattr(obj, "core_api_version", None)
    if declared is None:
        raise PluginAPIVersionError(
            f"{who} does not declare core_api_version; this core provides {CORE_API_VERSION}"
        )
    major, minor = _parse(declared, who)
    core_major, core_minor = _parse(CORE_API_VERSION, "deepinfer_core")
    if major != core_major or minor > core_minor:
        raise PluginAPIVersionError(
            f"{who} was written for core API {declared}, but this core provides {CORE_API_VERSION} "
            f"(needs the same major version and a minor version <= {core_minor})"
        )
