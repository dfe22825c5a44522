"""The README's TOML configuration example runs as written: ``deepinfer generate --config`` on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_config_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Configuration\n"):]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


def test_readme_toml_example_runs_as_written(tmp_path):
    example = readme_config_example()
    assert "[kv_store]" in example and "features" in example  # the example it documents, not another block
    (tmp_path / "deepinfer.toml").write_text(example)
    home = tmp_path / "home"  # "~" in the example: the KV tier writes here, not in the real home
    cache = os.environ.get("DEEPINFER_CACHE_DIR") or str(Path.home() / ".cache" / "deepinfer")  # curves reused
    env = {**os.environ, "HOME": str(home), "DEEPINFER_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "generate", "--config", "deepinfer.toml",
                        "--prompt", "import os", "--max-tokens", "4"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()  # generated text
    assert (home / ".cache" / "deepinfer" / "kv").is_dir()  # the [kv_store] section took effect
