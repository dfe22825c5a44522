"""Default sampling parameters from a checkpoint's ``generation_config.json`` (as vLLM applies them).

The keys a model's authors tune (temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens) become the defaults of requests that do not set them. Other keys (bos/eos ids, ...)
are read elsewhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("deepinfer.loader")
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: Path) -> dict:
    """SamplingParams field -> value from ``model_dir/generation_config.json`` ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        logger.warning("%s is not valid JSON (%s); no sampling defaults taken from it", path, exc)
        return {}
    out = {field: raw[key] for key, field in _KEYS.items() if raw.get(key) is not None}
    if out:
        logger.info("sampling defaults from %s: %s", path, out)
    return out
