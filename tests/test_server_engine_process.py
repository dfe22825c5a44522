"""``deepinfer serve`` runs its engine in a separate process: killing that process fails the requests
in flight with a clear error, /health answers 503 and new requests get 503 (no hang); a bad config
stays one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
try:
    import httpx
except ImportError:
    import httpx2 as httpx

from server_helpers import ROOT, server, wait_for  # noqa: E402


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _server_pid(port: int) -> int:
    return next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and f"--port\0{port}\0".encode() in (p / "cmdline").read_bytes())


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped
    except OSError:
        return True


def test_killed_engine_process_gives_503_and_failing_health():
    with server("--max-num-seqs", "4") as base:
        port = int(base.rsplit(":", 1)[1])
        server_pid = _server_pid(port)
        (engine_pid,) = _children(server_pid)
        assert b"deepinfer_core.serving.engine_core" in Path(f"/proc/{engine_pid}/cmdline").read_bytes()

        body = {"prompt": "while True:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            os.kill(engine_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]  # ends: the stream does not hang
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"], error

        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and "engine process exited unexpectedly" in health.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        wait_for(lambda: _gone(engine_pid), what="the engine process gone")


def test_engine_process_exits_with_the_api_process():
    with server("--max-num-seqs", "4") as base:
        port = int(base.rsplit(":", 1)[1])
        server_pid = _server_pid(port)
        (engine_pid,) = _children(server_pid)
        os.kill(server_pid, signal.SIGKILL)  # no shutdown message: the engine reads EOF and stops
        wait_for(lambda: _gone(engine_pid), timeout=60, what="the orphaned engine process exiting")


def test_serve_config_errors_are_one_line():
    r = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "serve", "-o", "max_num_seqs=zero"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "max_num_seqs" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "serve", "-o", "kv_cache_memory=5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
