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


def _start(args: tuple[str, ...], env: dict | None):
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve", "--port", str(port), *args]
    log = open(os.devnull, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.PIPE,
                            text=True)
    return proc, log, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, base: str, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError("server did not become healthy")
        time.sleep(0.3)


def _stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@contextlib.contextmanager
def servers(*specs: tuple[tuple[str, ...], dict | None], timeout: float = 300.0):
    """Several ``deepinfer serve`` processes, each spec (args, env) on a free port, started together and then waited
    for (their start-ups overlap); yields their base URLs in order. All are stopped on exit, or when one fails."""
    started = []
    try:
        for args, env in specs:
            started.append(_start(args, env))
        deadline = time.time() + timeout
        for proc, _, base in started:
            _wait_healthy(proc, base, deadline)
        yield [base for _, _, base in started]
    finally:
        for proc, log, _ in started:
            _stop(proc, log)


@contextlib.contextmanager
def server(*args: str, timeout: float = 300.0, env: dict | None = None):
    """Start ``deepinfer serve ARGS`` on a free port; yields its base URL (``http://127.0.0.1:P``)."""
    with servers((args, env), timeout=timeout) as (base,):
        yield base


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
