"""Models by Hugging Face id (a local hub cache layout, HF_HUB_OFFLINE) and the CLI's error lines,
``--debug`` and ``--log-level``."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.models.loader import EMBEDDED_MODEL, CheckpointError, resolve_model_dir

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("huggingface_hub")


def hub_cache(root: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(EMBEDDED_MODEL, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = hub_cache(cache, "deepinfer-test/tiny-v3")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return snap


def test_model_id_resolves_from_the_local_cache(offline_cache):
    assert resolve_model_dir("deepinfer-test/tiny-v3") == offline_cache
    from deepinfer_core import LLM, SamplingParams

    with LLM("deepinfer-test/tiny-v3") as llm, LLM() as ref:
        sp = SamplingParams(temperature=0, max_tokens=6)
        assert (llm.generate("def f(", sp, use_tqdm=False)[0].outputs[0].token_ids
                == ref.generate("def f(", sp, use_tqdm=False)[0].outputs[0].token_ids)


def test_missing_model_id_is_one_clear_line(offline_cache):
    with pytest.raises(CheckpointError) as info:
        resolve_model_dir("deepinfer-test/absent")
    msg = str(info.value)
    assert "'deepinfer-test/absent'" in msg and "HF_HUB_OFFLINE=1" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_dir("/no/such/dir")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_cli_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    r = _cli("generate", "--prompt", "x", "--config", str(tmp_path / "absent.toml"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"deepinfer generate: error: config file '{tmp_path / 'absent.toml'}' does not exist (--debug shows the "
        "traceback)"]
    r = _cli("serve", str(tmp_path / "nowhere"), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr
    r = _cli("generate", "--prompt", "x", "-o", "max_num_seqs=zero")
    assert r.returncode == 2 and "max_num_seqs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("--debug", "generate", "--prompt", "x", "--config", str(tmp_path / "absent.toml"))
    assert r.returncode != 0 and "Traceback (most recent call last)" in r.stderr and "ConfigError" in r.stderr


def test_log_level_reaches_the_engine_and_is_not_reset():
    r = _cli("generate", "--prompt", "x", "--max-tokens", "2", "--log-level", "info")
    assert r.returncode == 0, r.stderr
    assert "INFO deepinfer.kv_cache: KV cache pool" in r.stderr
    quiet = _cli("generate", "--prompt", "x", "--max-tokens", "2")
    assert "INFO" not in quiet.stderr
    # an application's own logging setting survives building an engine (config log_level unset)
    from deepinfer_core import LLM

    logging.getLogger("deepinfer").setLevel(logging.DEBUG)
    try:
        with LLM():
            assert logging.getLogger("deepinfer").level == logging.DEBUG
        with LLM(log_level="ERROR"):
            assert logging.getLogger("deepinfer").level == logging.ERROR
    finally:
        logging.getLogger("deepinfer").setLevel(logging.NOTSET)
