"""A third-party accelerator, pip-installed for real from examples/third_party_accelerator.

The example is built offline (``--no-build-isolation`` with the venv's setuptools) and installed
into a temporary ``--target`` directory, which the subprocesses below put on PYTHONPATH: the venv
itself is left untouched (with toyaccel installed, auto-detection would prefer it to the CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.kernels import OP_NAMES

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "third_party_accelerator"
OVERRIDES = ["rms_norm", "silu_and_mul"]


def _pip_usable() -> str | None:
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed in this environment (needed by --no-build-isolation)"
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"pip is not usable: {proc.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    reason = _pip_usable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("toyaccel")
    src, site = root / "src", root / "site"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-input", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300, cwd=root,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "deepinfer_toyaccel" / "ops.py").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "TOYACCEL_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])),
               XDG_CACHE_HOME=str(root / "cache"))
    return root, src, site, env


def run(code_or_args, env, cwd, **extra_env):
    args = [sys.executable, *(["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, cwd=cwd,
                          env={**env, **extra_env})
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


SELECT = """
import json
from deepinfer_core import cli, plugins
from deepinfer_core.kernels import Kernels
from deepinfer_core.selection import select_platform
from kernels_cpu import ReferenceKernels

platform = select_platform()
backend = plugins.load("deepinfer.kernels", platform.kernel_backend, what="kernel backend")
k = Kernels(backend, ReferenceKernels)
print(json.dumps({"platform": platform.name, "type": type(platform).__module__,
                  "auto": select_platform("auto").name, "fallbacks": k.fallbacks,
                  "rms_norm": k.rms_norm.__module__, "linear": k.linear.__module__}))
cli.main(["plugins", "--json"])
"""


def test_selected_by_env_and_listed(installed):
    root, _, site, env = installed
    first, _, listing = run(SELECT, env, root, DEEPINFER_ACCELERATOR="toyaccel").partition("\n")
    facts = json.loads(first)
    assert facts["platform"] == "toyaccel" and facts["type"] == "deepinfer_toyaccel.platform"
    assert facts["fallbacks"] == [n for n in OP_NAMES if n not in OVERRIDES]
    assert (facts["rms_norm"], facts["linear"]) == ("deepinfer_toyaccel.ops", "kernels_cpu.ops")
    if not torch.cuda.is_available():
        assert facts["auto"] == "toyaccel"  # priority 100: before the cpu

    doc = json.loads(listing)
    assert (doc["accelerator_setting"], doc["selected_accelerator"]) == ("toyaccel", "toyaccel")
    hw = {row["name"]: row for row in doc["groups"]["deepinfer.hardware"]}
    assert {"cpu", "nvidia", "ascend", "toyaccel"} <= set(hw)
    toy = hw["toyaccel"]
    assert (toy["distribution"], toy["version"], toy["target"]) == (
        "deepinfer-toyaccel", "0.1.0", "deepinfer_toyaccel.platform:ToyAccelPlatform")
    assert (toy["loads"], toy["available"], toy["reason"], toy["core_api_version"]) == (True, True, "", "1.0")
    assert (toy["kernel_backend"], toy["probe_priority"]) == ("toyaccel", 100)
    assert toy["kernel_fallbacks"] == facts["fallbacks"]
    kernels = {row["name"]: row for row in doc["groups"]["deepinfer.kernels"]}
    assert kernels["toyaccel"]["overrides"] == OVERRIDES
    assert kernels["toyaccel"]["distribution"] == "deepinfer-toyaccel"


def test_unavailable_toyaccel_is_an_error_with_its_reason(installed):
    root, _, _, env = installed
    out = run(["-m", "deepinfer_core.cli", "plugins"], env, root, DEEPINFER_ACCELERATOR="toyaccel",
              TOYACCEL_DISABLE="1")
    lines = out.splitlines()
    assert lines[1].startswith("accelerator (toyaccel): none: accelerator 'toyaccel' is not available: "
                               "TOYACCEL_DISABLE is set. Installed accelerators: ")
    start = lines.index("  toyaccel     deepinfer-toyaccel 0.1.0  "
                        "(deepinfer_toyaccel.platform:ToyAccelPlatform)")
    assert lines[start + 1 : start + 4] == [
        "      loads: yes",
        "      available: no: TOYACCEL_DISABLE is set",
        "      kernels: toyaccel; reference fallback for: "
        + ", ".join(n for n in OP_NAMES if n not in OVERRIDES),
    ]


def test_example_conformance_tests_pass(installed):
    root, src, site, env = installed
    out = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(src / "tests")], env, root)
    assert out.splitlines()[-1].startswith("6 passed"), out  # 2 ops x 2 dtypes, the whole backend, selection
