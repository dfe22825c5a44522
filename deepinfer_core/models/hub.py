"""Models by Hugging Face id (``LLM(model="org/name")``, ``deepinfer serve org/name``).

The id resolves through ``huggingface_hub``'s cache (``HF_HOME`` / ``HF_HUB_CACHE``): a snapshot
already there is used as is, without network access. Otherwise the checkpoint's files are
downloaded, unless ``HF_HUB_OFFLINE=1``. Only the files an engine reads are fetched (config,
tokenizer, safetensors and their index, generation config); never pickled ``*.bin`` weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "~"))


def resolve_repo_id(repo_id: str) -> Path:
    """The local snapshot directory of ``repo_id`` (CheckpointError, one line, if unavailable)."""
    from deepinfer_core.models.loader import CheckpointError

    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(f"model {repo_id!r} is not a directory; loading models by Hugging Face id needs "
                              "huggingface_hub (pip install 'deepinfer[serve]')") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = huggingface_hub.snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=offline)
    except Exception as exc:  # the hub's errors (offline miss, 404, no network, gated repo) differ by version
        from huggingface_hub.constants import HF_HUB_CACHE

        if offline:
            raise CheckpointError(f"model {repo_id!r} is not a directory and has no snapshot in the Hugging Face "
                                  f"cache {HF_HUB_CACHE} (HF_HUB_OFFLINE=1: nothing is downloaded)") from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"model {repo_id!r} is not a directory, not in the Hugging Face cache {HF_HUB_CACHE}, "
                              f"and could not be downloaded: {reason}") from None
    p = Path(path)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"model {repo_id!r} (snapshot {p}) has no config.json")
    return p
