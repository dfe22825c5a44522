"""A real ``deepinfer serve`` process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deepinfer_core.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def server(*args: str, timeout: float = 300.0, env: dict | None = None):
    """Start ``deepinfer serve ARGS`` on a free port; yields its base URL (``http://127.0.0.1:P``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve", "--port", str(port), *args]
    log = open(os.devnull, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not become healthy")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def metric_samples(base: str) -> dict[tuple[str, tuple], float]:
    """/metrics parsed with prometheus_client's own parser: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def wait_for(pred, timeout: float = 60.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout} s")
