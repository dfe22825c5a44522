"""Model architectures by name, from the ``deepinfer.models`` entry-point group.

``config.json``'s ``architectures`` names the class: the first entry registered in the group wins.
The built-in DeepSeek models register there exactly as a third party's package would.
"""

from __future__ import annotations

from deepinfer_core import plugins
from deepinfer_core.models.config import ModelConfigError
from deepinfer_core.models.interface import ArchConfig, CausalLM

GROUP = "deepinfer.models"


def model_class(raw: dict) -> type[CausalLM]:
    """The :class:`CausalLM` registered for ``raw["architectures"]``. An architecture no package
    registers raises ``ModelConfigError`` listing the registered ones."""
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    registered = plugins.installed_names(GROUP)
    arch = next((a for a in archs if a in registered), None)
    if arch is None:
        raise ModelConfigError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in config.json; registered "
            f"(entry-point group {GROUP!r}): {', '.join(registered) or 'none'}")
    cls = plugins.load(GROUP, arch, what="model architecture")
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise plugins.PluginError(f"model architecture {arch!r} ({GROUP}) is {cls!r}, not a CausalLM subclass")
    return cls


def parse_config(raw: dict) -> tuple[type[CausalLM], ArchConfig]:
    """(model class, its parsed config) for a config.json dict."""
    cls = model_class(raw)
    return cls, cls.parse_config(raw)
