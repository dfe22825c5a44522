"""The ``deepinfer`` command: plugin listing (text and JSON), and the generate / calibrate hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from stevedore import ExtensionManager
from stevedore import _cache as stevedore_cache

import deepinfer_core.engine
from deepinfer_core import cli
from deepinfer_core.kernels import OP_NAMES
from hardware.ascend import AscendPlatform
from hardware.nvidia import NvidiaPlatform
from kernels_ascend import AscendKernels
from kernels_cuda import CudaKernels

ASCEND_OVERRIDES = AscendKernels.overrides()  # pinned by test_plugins
CUDA_OVERRIDES = CudaKernels.overrides()  # grows as TileLang kernels land
CUDA_FALLBACKS = [n for n in OP_NAMES if n not in CUDA_OVERRIDES]


def ops_text(names: list[str]) -> str:
    return "all ops" if len(names) == len(OP_NAMES) else ", ".join(names) or "none"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    monkeypatch.setattr(stevedore_cache._c, "_dir", str(tmp_path / "entry-point-cache"))


def entry(text: str, name: str) -> list[str]:
    """The lines of one plugin's entry in the text listing: its header and the indented details."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {name} "))
    end = start + 1
    while end < len(lines) and lines[end].startswith("      "):
        end += 1
    return lines[start:end]


def section(text: str, group: str) -> str:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{group}:"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("deepinfer.")), len(lines))
    return "\n".join(lines[start:end])


def run_cli(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


@NO_GPU
def test_plugins_text_lists_every_backend_with_status(capsys):
    out = run_cli(capsys, "plugins")
    assert out.splitlines()[:2] == ["deepinfer core API 1.0", "accelerator (auto): cpu"]
    hw = section(out, "deepinfer.hardware")
    assert entry(hw, "cpu") == [
        "  cpu          deepinfer 0.1.0  (hardware.cpu:CpuPlatform)  [selected]",
        "      loads: yes",
        "      available: yes",
        "      kernels: reference (all ops are the reference)",
        "      features: graph_capture=no, graph_capture_dtypes=none, pinned_memory=no, async_overlap=no, fp8_gemm=no, "
        "kv_cache_dtypes=auto+bf16+fp8",
    ]
    assert entry(hw, "nvidia") == [
        "  nvidia       deepinfer 0.1.0  (hardware.nvidia:NvidiaPlatform)",
        "      loads: yes",
        f"      available: no: {NvidiaPlatform.probe().reason}",
        f"      kernels: cuda; reference fallback for: {ops_text(CUDA_FALLBACKS)}",
        "      features: graph_capture=yes, graph_capture_dtypes=bfloat16+float16, pinned_memory=yes, "
        "async_overlap=yes, fp8_gemm=no, kv_cache_dtypes=auto+bf16+fp8",
    ]
    fallbacks = ", ".join(n for n in OP_NAMES if n not in ASCEND_OVERRIDES)
    assert entry(hw, "ascend") == [
        "  ascend       deepinfer 0.1.0  (hardware.ascend:AscendPlatform)",
        "      loads: yes",
        f"      available: no: {AscendPlatform.probe().reason}",
        f"      kernels: ascend; reference fallback for: {fallbacks}",
        "      features: graph_capture=yes, graph_capture_dtypes=bfloat16+float16, pinned_memory=yes, "
        "async_overlap=yes, fp8_gemm=no, kv_cache_dtypes=auto+bf16, mla_cache_planes=yes, fia_in_graphs=yes, "
        "verified_on_hardware=no",
    ]
    kernels = section(out, "deepinfer.kernels")
    assert entry(kernels, "ascend")[1:] == [
        "      loads: yes",
        f"      overrides: {', '.join(ASCEND_OVERRIDES)}",
        f"      reference fallback for: {fallbacks}",
    ]
    assert entry(kernels, "cuda")[1:] == ["      loads: yes", f"      overrides: {ops_text(CUDA_OVERRIDES)}",
                                          f"      reference fallback for: {ops_text(CUDA_FALLBACKS)}"]
    assert entry(kernels, "reference")[1:] == ["      loads: yes", "      overrides: all ops"]
    assert entry(section(out, "deepinfer.kv_stores"), "host")[1:] == ["      loads: yes"]


def test_plugins_json(capsys):
    doc = json.loads(run_cli(capsys, "plugins", "--json"))
    assert doc["core_api_version"] == "1.0" and doc["accelerator_setting"] == "auto"
    assert set(doc["groups"]) == {"deepinfer.hardware", "deepinfer.kernels", "deepinfer.schedulers",
                                  "deepinfer.kv_stores", "deepinfer.features", "deepinfer.models",
                                  "deepinfer.kv_transports", "deepinfer.proposers"}
    transports = {row["name"]: row["target"] for row in doc["groups"]["deepinfer.kv_transports"]}
    assert transports == {"shm": "plugins.kv_transfer_shm:ShmTransport",
                          "3fs": "plugins.kv_3fs.handoff:ThreeFSTransport",
                          "p2p": "plugins.kv_transfer_p2p:P2PTransport"}
    models = {row["name"]: row["target"] for row in doc["groups"]["deepinfer.models"]}
    assert models["DeepseekV4ForCausalLM"] == "deepinfer_core.models.deepseek_v4:DeepseekV4ForCausalLM"
    assert models["DeepseekV3ForCausalLM"] == "deepinfer_core.models.deepseek:DeepseekForCausalLM"
    hw = {row["name"]: row for row in doc["groups"]["deepinfer.hardware"]}
    assert hw["cpu"] == {
        "name": "cpu", "target": "hardware.cpu:CpuPlatform", "distribution": "deepinfer", "version": "0.1.0",
        "loads": True, "error": None, "core_api_version": "1.0", "available": True, "reason": "",
        "probe_priority": 1000, "device_type": "cpu", "dist_backend": "gloo", "kernel_backend": "reference",
        "kernel_fallbacks": [], "features": {"graph_capture": False, "graph_capture_dtypes": [],
                                             "pinned_memory": False, "async_overlap": False, "fp8_gemm": False,
                                             "kv_cache_dtypes": ["auto", "bf16", "fp8"]},
    }
    assert (hw["nvidia"]["available"], hw["nvidia"]["reason"]) == (
        NvidiaPlatform.probe().ok, NvidiaPlatform.probe().reason)
    assert (hw["ascend"]["available"], hw["ascend"]["reason"]) == (False, AscendPlatform.probe().reason)
    assert hw["ascend"]["kernel_fallbacks"] == [n for n in OP_NAMES if n not in ASCEND_OVERRIDES]
    assert hw["nvidia"]["kernel_fallbacks"] == CUDA_FALLBACKS
    kernels = {row["name"]: row for row in doc["groups"]["deepinfer.kernels"]}
    assert kernels["ascend"]["overrides"] == ASCEND_OVERRIDES
    assert kernels["cuda"]["overrides"] == CUDA_OVERRIDES and kernels["cuda"]["fallbacks"] == CUDA_FALLBACKS
    assert kernels["reference"]["overrides"] == list(OP_NAMES) and kernels["reference"]["fallbacks"] == []
    stores = {row["name"]: row for row in doc["groups"]["deepinfer.kv_stores"]}
    assert stores["host"]["loads"] is True and stores["host"]["target"].endswith(":HostMemoryStore")
    if not torch.cuda.is_available():
        assert doc["selected_accelerator"] == "cpu" and doc["selection_error"] is None


def test_plugins_shows_why_the_named_accelerator_cannot_run(capsys, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    out = run_cli(capsys, "plugins")
    assert out.splitlines()[1].startswith(
        "accelerator (ascend): none: accelerator 'ascend' is not available: "
        f"{AscendPlatform.probe().reason}. ")
    doc = json.loads(run_cli(capsys, "plugins", "--json"))
    assert doc["selected_accelerator"] is None and doc["accelerator_setting"] == "ascend"
    assert doc["selection_error"].startswith("accelerator 'ascend' is not available: ")


BROKEN = """
    raise ImportError("libtoy.so: cannot open shared object file")
"""
OLD = """
    from deepinfer_core.kernels import KernelBackend

    class OldKernels(KernelBackend):
        name = "oldk"
        core_api_version = "0.3"
        ops = {"linear": "nowhere:linear"}
"""


def test_plugins_lists_broken_and_mismatched_plugins(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "dit_cli_broken.py").write_text(textwrap.dedent(BROKEN))
    (site / "dit_cli_old.py").write_text(textwrap.dedent(OLD))
    info = site / "dit_cli-0.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dit-cli\nVersion: 0.2\n")
    (info / "entry_points.txt").write_text(
        "[deepinfer.hardware]\nbrokenhw = dit_cli_broken:Platform\n"
        "[deepinfer.kernels]\noldk = dit_cli_old:OldKernels\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        out = run_cli(capsys, "plugins")
        assert entry(section(out, "deepinfer.hardware"), "brokenhw") == [
            "  brokenhw     dit-cli 0.2  (dit_cli_broken:Platform)",
            "      loads: no: ImportError: libtoy.so: cannot open shared object file",
        ]
        assert entry(section(out, "deepinfer.kernels"), "oldk") == [
            "  oldk         dit-cli 0.2  (dit_cli_old:OldKernels)",
            "      loads: no: PluginAPIVersionError: plugin 'oldk' in deepinfer.kernels was written for core "
            "API 0.3, but this core provides 1.0 (needs the same major version and a minor version <= 0)",
        ]
        doc = json.loads(run_cli(capsys, "plugins", "--json"))
        old = next(r for r in doc["groups"]["deepinfer.kernels"] if r["name"] == "oldk")
        assert (old["loads"], old["core_api_version"], old["distribution"]) == (False, "0.3", "dit-cli")
    finally:
        sys.modules.pop("dit_cli_broken", None)
        sys.modules.pop("dit_cli_old", None)


STUBS = {"tilelang": "import sys\nsys.stderr.write('STUB tilelang imported\\n')\n",
         "torch_npu": "import sys\nsys.stderr.write('STUB torch_npu imported\\n')\n"}


def test_listing_imports_no_heavy_backend_code(tmp_path):
    """Even with TileLang and torch_npu importable, listing plugins must not import them."""
    for name, src in STUBS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(src)
    code = ("import sys, json; from deepinfer_core import cli; rc = cli.main(['plugins', '--json']); "
            "print('HEAVY=' + json.dumps(sorted(m for m in ('tilelang', 'torch_npu') if m in sys.modules)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "ASCEND_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "STUB" not in proc.stderr
    body, _, heavy = proc.stdout.rpartition("HEAVY=")
    assert json.loads(heavy) == []
    hw = {row["name"]: row for row in json.loads(body)["groups"]["deepinfer.hardware"]}
    if not os.path.isdir("/usr/local/Ascend"):  # torch_npu "installed" (the stub) but no CANN
        assert hw["ascend"]["reason"] == ("Ascend CANN toolkit not found (ASCEND_HOME_PATH unset, "
                                          "no /usr/local/Ascend)")


def test_module_entry_point(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "plugins"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("deepinfer core API 1.0\n")
    assert "\ndeepinfer.hardware:\n" in proc.stdout


# ---- generate and calibrate hooks ----------------------------------------------------------
class FakeLLM:
    calls: list = []

    def __init__(self, **kwargs):
        FakeLLM.calls.append(("init", kwargs))

    def generate(self, prompts, params):
        FakeLLM.calls.append(("generate", prompts, params.kwargs))
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text=f"<{p} done>")]) for p in prompts]


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_llm(monkeypatch):
    FakeLLM.calls = []
    monkeypatch.setitem(sys.modules, "deepinfer_core.llm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setitem(sys.modules, "deepinfer_core.sampling_params",
                        types.SimpleNamespace(SamplingParams=FakeSamplingParams))
    return FakeLLM.calls


def test_generate_builds_llm_and_sampling_params(fake_llm, capsys):
    out = run_cli(capsys, "generate", "--model", "/ckpt", "--prompt", "Hi", "--max-tokens", "7",
                  "--temperature", "0.5", "--seed", "42", "--accelerator", "cpu", "--config", "c.toml")
    assert fake_llm == [("init", {"model": "/ckpt", "accelerator": "cpu", "config": "c.toml"}),
                        ("generate", ["Hi"], {"max_tokens": 7, "temperature": 0.5, "seed": 42})]
    assert out == "<Hi done>\n"


def test_generate_defaults_and_several_prompts(fake_llm, capsys):
    out = run_cli(capsys, "generate", "--prompt", "a", "--prompt", "b")
    assert fake_llm == [("init", {"model": None}), ("generate", ["a", "b"], {})]
    assert out == "--- [0] 'a'\n<a done>\n--- [1] 'b'\n<b done>\n"


def test_calibrate_passes_its_arguments_through(monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 3)
    monkeypatch.setitem(sys.modules, "deepinfer_core.engine.calibrate", fake)
    monkeypatch.setattr(deepinfer_core.engine, "calibrate", fake, raising=False)
    assert cli.main(["calibrate", "--model", "m", "--help", "extra"]) == 3
    assert seen == [["--model", "m", "--help", "extra"]]
    fake.main = lambda argv: None
    assert cli.main(["calibrate"]) == 0


@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: COMMAND"),
    (["plugins", "--jsn"], "unrecognized arguments: --jsn"),
    (["generate"], "the following arguments are required: --prompt"),
    (["serve", "--bogus"], "unrecognized arguments: --bogus"),
    (["--log-level", "LOUD", "plugins"], "invalid choice: 'LOUD'"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
