"""Choosing the accelerator (the ``deepinfer.hardware`` plugin) for this process.

``DEEPINFER_ACCELERATOR`` (or ``accelerator=``) names a backend. When it is unset or ``auto``,
the installed platforms are probed in ascending ``probe_priority`` (nvidia 10, ascend 20, third
parties 100 by default, cpu 1000) and the first available one wins; every rejection is logged
with its reason. A backend the user named that cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import logging
import os

from deepinfer_core import plugins
from deepinfer_core.platform import Platform

logger = logging.getLogger("deepinfer.selection")
GROUP = "deepinfer.hardware"


class AcceleratorError(RuntimeError):
    """The requested accelerator cannot be used here."""


def _installed() -> str:
    return ", ".join(plugins.installed_names(GROUP)) or "none"


def select_platform(name: str | None = None) -> Platform:
    """Return an instance of the chosen platform (see the module docstring for the rules)."""
    name = (name or os.environ.get("DEEPINFER_ACCELERATOR") or "auto").strip().lower()
    if name != "auto":
        try:
            cls = plugins.load(GROUP, name, what="accelerator")
        except plugins.PluginNotFoundError as exc:
            raise AcceleratorError(str(exc)) from None
        except Exception as exc:
            raise AcceleratorError(
                f"accelerator {name!r} cannot be loaded: {exc}. Installed accelerators: {_installed()}"
            ) from exc
        verdict = cls.probe()
        if not verdict.ok:
            raise AcceleratorError(
                f"accelerator {name!r} is not available: {verdict.reason}. "
                f"Installed accelerators: {_installed()}"
            )
        logger.info("accelerator %r selected by name", name)
        return cls()

    candidates = []
    for info in plugins.discover(GROUP):
        if info.error is not None:
            logger.warning("accelerator %r rejected: failed to load: %s", info.name, info.error)
            continue
        candidates.append(info.obj)
    for cls in sorted(candidates, key=lambda c: (c.probe_priority, c.name)):
        verdict = cls.probe()
        if verdict.ok:
            logger.info("accelerator %r selected by auto-detection", cls.name)
            return cls()
        logger.info("accelerator %r rejected: %s", cls.name, verdict.reason)
    raise AcceleratorError(f"no accelerator is available; installed: {_installed()}")
